"""Arrow schemas derived from the record declarations (never written by hand).

A record becomes one flat row: a nested group's field `client_ns.first_token` is the
column `client_ns.first_token`. Types follow the annotations (`int` -> int64, `float`
-> float64, `str` -> string, `bool` -> bool); every column is nullable because "no data"
is null. Each table's schema name and version travel in the Arrow metadata, so a reader
can refuse a newer one.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa

from calculet_load.schema.records import (
    REQUEST_SCHEMA,
    TOKEN_EVENT_SCHEMA,
    RequestRecord,
    TokenEvent,
    check_schema,
    record_from_dict,
)

SELFWATCH_SCHEMA = "calculet-selfwatch/v1"


@dataclasses.dataclass(frozen=True, slots=True)
class SelfWatchRow:
    """One sample of the client's own health (the self-watch of the measurement core)."""

    worker: str
    mono_ns: int
    wall_ns: int
    loop_lag_ms: float  # how late a timer on the event loop fired
    cpu_percent: float | None  # this process, percent of one core over the interval
    rss_bytes: int | None
    in_flight: int | None
    token_events_per_s: float | None
    # True for the samples of the client's start-up (before its prompts, tokenization and
    # connections were ready and its first request went out): not judged for saturation
    warmup: bool | None = None


# Columns added to `calculet-selfwatch/v1` after its first release (null in older parts).
ADDED_SELFWATCH_COLUMNS = ("warmup",)


_SCALARS: dict[Any, pa.DataType] = {
    int: pa.int64(),
    float: pa.float64(),
    str: pa.string(),
    bool: pa.bool_(),
}


def _scalar(annotation: Any) -> Any:
    """`int | None` -> int; a dataclass group is returned as is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {annotation!r}")
        return args[0]
    return annotation


def leaf_fields(cls: type) -> list[tuple[str, tuple[str, ...], Any]]:
    """(column name, attribute path, python type) for every leaf field, in order."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, tuple[str, ...], Any]] = []
    for field in _field_names(cls):
        kind = _scalar(hints[field])
        if dataclasses.is_dataclass(kind):
            for name, path, leaf in leaf_fields(kind):  # type: ignore[arg-type]
                out.append((f"{field}.{name}", (field, *path), leaf))
        else:
            out.append((field, (field,), kind))
    return out


def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's fields, or a msgspec Struct's (schema.records.TokenEvent)."""
    struct_fields: tuple[str, ...] | None = getattr(cls, "__struct_fields__", None)
    if struct_fields is not None:
        return struct_fields
    return tuple(f.name for f in dataclasses.fields(cls))


@functools.cache
def arrow_schema(cls: type, schema_name: str) -> pa.Schema:
    fields = []
    for name, _, kind in leaf_fields(cls):
        if kind not in _SCALARS:
            raise TypeError(f"{cls.__name__}.{name}: no Arrow type for {kind!r}")
        fields.append(pa.field(name, _SCALARS[kind], nullable=True))
    return pa.schema(fields, metadata={"schema": schema_name})


def _column_type(cls: type, name: str, annotation: Any, nested: Sequence[str]) -> pa.DataType:
    """The Arrow type of one field of a trace row: a scalar, a string enum or literal,
    or a list of a dataclass (`nested`: the struct's fields, all of them if empty)."""
    kind = _scalar(annotation)
    if kind in _SCALARS:
        return _SCALARS[kind]
    if isinstance(kind, type) and issubclass(kind, str):  # a StrEnum
        return pa.string()
    if typing.get_origin(kind) is typing.Literal:
        return pa.string()
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if dataclasses.is_dataclass(item):
            return pa.list_(pa.struct(trace_columns(item, nested)))  # type: ignore[arg-type]
    raise TypeError(f"{cls.__name__}.{name}: no Arrow type for {annotation!r}")


@functools.cache
def trace_columns(
    cls: type, names: Sequence[str] = (), nested: tuple[tuple[str, Sequence[str]], ...] = ()
) -> pa.Schema:
    """The Arrow schema of the columns `names` (all if empty, in the declared order) of a
    trace row type (calculet_load.schema.traces), derived from its declaration; a list of
    rows (a device sample's chips) becomes a list of structs of the fields `nested`
    gives for it. A name the row does not declare is a TypeError."""
    hints = typing.get_type_hints(cls)
    declared = [f.name for f in dataclasses.fields(cls)]
    unknown = [n for n in names if n not in declared]
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {unknown[0]!r}")
    inner = dict(nested)
    return pa.schema(
        pa.field(n, _column_type(cls, n, hints[n], inner.get(n, ())), nullable=True)
        for n in (names or declared)
    )


def request_schema() -> pa.Schema:
    return arrow_schema(RequestRecord, REQUEST_SCHEMA)


def token_event_schema() -> pa.Schema:
    return arrow_schema(TokenEvent, TOKEN_EVENT_SCHEMA)


def selfwatch_schema() -> pa.Schema:
    return arrow_schema(SelfWatchRow, SELFWATCH_SCHEMA)


# Rows converted by one call into C. Such a call holds the interpreter lock from start to
# end: a sink writer converting a 10-s part of 320 req/s (205,000 token events) in one
# piece held it for tens of ms, and the I/O engine's sends and reads waited (send lag P99
# 27 ms, one stall of 56 ms; docs/measurement.md, "Pauses that hold the engine"). Between
# two chunks the lock goes to a thread that asks for it; a chunk holds it under 1 ms.
CONVERT_CHUNK_ROWS = 4096


def to_table(rows: Sequence[Any], cls: type, schema: pa.Schema) -> pa.Table:
    """Column-wise conversion of dataclass rows to a table of `schema`, in record
    batches of CONVERT_CHUNK_ROWS rows. Each column's values are fetched in C
    (`operator.attrgetter` mapped over the rows, a dotted path for a nested field): 0.41
    µs a token event against 0.62 with a Python lambda a value."""
    getters = [operator.attrgetter(".".join(path)) for _, path, _ in leaf_fields(cls)]
    if len(getters) != len(schema):
        raise ValueError(f"{cls.__name__}: {len(getters)} fields against {len(schema)} columns")
    batches = []
    for start in range(0, len(rows), CONVERT_CHUNK_ROWS):
        chunk = rows[start : start + CONVERT_CHUNK_ROWS]
        columns = [
            pa.array(list(map(get, chunk)), type=field.type)
            for get, field in zip(getters, schema, strict=True)
        ]
        batches.append(pa.RecordBatch.from_arrays(columns, schema=schema))
    return pa.Table.from_batches(batches, schema=schema)


def records_table(records: Sequence[RequestRecord]) -> pa.Table:
    return to_table(records, RequestRecord, request_schema())


def token_events_table(events: Sequence[TokenEvent]) -> pa.Table:
    return to_table(events, TokenEvent, token_event_schema())


def selfwatch_table(rows: Sequence[SelfWatchRow]) -> pa.Table:
    return to_table(rows, SelfWatchRow, selfwatch_schema())


def check_table_schema(table_schema: pa.Schema, expected: str) -> None:
    """Refuse a table written under a newer (or a different) schema."""
    meta = table_schema.metadata or {}
    found = meta.get(b"schema")
    check_schema(found.decode() if found is not None else None, expected)


def nest(row: dict[str, Any]) -> dict[str, Any]:
    """A flat row (`group.field` keys) back to the nested JSON shape."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        group, dot, field = key.partition(".")
        if dot:
            out.setdefault(group, {})[field] = value
        else:
            out[key] = value
    return out


def records_from_table(table: pa.Table) -> Iterable[RequestRecord]:
    check_table_schema(table.schema, REQUEST_SCHEMA)
    for row in table.to_pylist():
        yield record_from_dict(nest(row))
