"""The request record: §3 shape (against the source document), Arrow columns, round trips."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any

import pyarrow as pa
import pytest

from calculet_load.schema.arrow import (
    CONVERT_CHUNK_ROWS,
    SelfWatchRow,
    check_table_schema,
    leaf_fields,
    records_from_table,
    records_table,
    request_schema,
    selfwatch_schema,
    token_event_schema,
    token_events_table,
)
from calculet_load.schema.records import (
    REQUEST_SCHEMA,
    ClientNs,
    Ext,
    RequestRecord,
    Result,
    SchemaVersionError,
    TokenEvent,
    Workload,
    check_schema,
    record_from_dict,
    record_to_dict,
    request_json_schema,
)
from tests.conftest import REPO


def source_example() -> dict[str, Any]:
    """The JSON example of §3 of the specification (docs/spec.md, the source's own)."""
    text = (REPO / "docs" / "spec.md").read_text(encoding="utf-8")
    section = text[text.index("## §3 ") : text.index("## §4 ")]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block is not None
    obj: dict[str, Any] = json.loads(block.group(1))
    return obj


def full_record() -> RequestRecord:
    """A record with every field set to a non-default value."""
    values: dict[Any, Any] = {int: 7, float: 1.5, str: "x", bool: True}

    def fill(cls: Any) -> Any:
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            kinds = [k for k in typing.get_args(hints[f.name]) if k is not type(None)]
            kind = kinds[0] if kinds else hints[f.name]
            kwargs[f.name] = fill(kind) if dataclasses.is_dataclass(kind) else values[kind]
        return cls(**kwargs)

    rec: RequestRecord = fill(RequestRecord)
    return dataclasses.replace(rec, schema=REQUEST_SCHEMA)


_GROUP_NAMES: dict[str, type] = {
    f.name: type(getattr(RequestRecord("r", "q"), f.name))
    for f in dataclasses.fields(RequestRecord)
    if dataclasses.is_dataclass(getattr(RequestRecord("r", "q"), f.name))
}


def test_strict_export_has_exactly_the_source_keys_in_the_source_order() -> None:
    example = source_example()
    exported = record_to_dict(RequestRecord("run", "req"), strict=True)
    assert list(exported) == list(example)
    for key, value in example.items():
        if isinstance(value, dict):
            assert list(exported[key]) == list(value), key


def test_strict_export_drops_only_ext() -> None:
    full = record_to_dict(full_record())
    strict = record_to_dict(full_record(), strict=True)
    assert set(full) - set(strict) == {"ext"}


def test_every_leaf_field_is_exactly_one_arrow_column() -> None:
    schema = request_schema()
    leaves = [name for name, _, _ in leaf_fields(RequestRecord)]
    assert schema.names == leaves
    assert len(set(schema.names)) == len(schema.names)
    groups = _GROUP_NAMES
    expected = sum(len(dataclasses.fields(g)) for g in groups.values()) + sum(
        1 for f in dataclasses.fields(RequestRecord) if f.name not in groups
    )
    assert len(schema) == expected


def test_arrow_types_follow_the_annotations() -> None:
    schema = request_schema()
    assert schema.field("client_ns.first_token").type == pa.int64()
    assert schema.field("durations_ms.tpot").type == pa.float64()
    assert schema.field("result.token_hash").type == pa.string()
    assert schema.field("quality.warmup").type == pa.bool_()
    assert all(f.nullable for f in schema)
    assert schema.metadata == {b"schema": REQUEST_SCHEMA.encode()}
    assert token_event_schema().names == [
        "request_id",
        "event_index",
        "arrival_ns",
        "tokens",
        "server_cumulative",
    ]
    assert "loop_lag_ms" in selfwatch_schema().names


def test_record_round_trips_through_arrow_and_json() -> None:
    rec = full_record()
    table = records_table([rec, RequestRecord("run", "empty")])
    back = list(records_from_table(table))
    assert back[0] == rec
    assert back[1] == RequestRecord("run", "empty")
    assert record_from_dict(json.loads(json.dumps(record_to_dict(rec)))) == rec


def test_no_data_stays_null_not_zero() -> None:
    rec = RequestRecord("run", "r", client_ns=ClientNs(request_start=5))
    row = records_table([rec]).to_pylist()[0]
    assert row["client_ns.request_start"] == 5
    assert row["client_ns.first_token"] is None
    assert row["durations_ms.tpot"] is None


def test_token_events_table() -> None:
    events = [TokenEvent("r", 1, 100, 3, 3), TokenEvent("r", 2, 200, 2, None)]
    table = token_events_table(events)
    assert table.column("tokens").to_pylist() == [3, 2]
    assert table.column("server_cumulative").to_pylist() == [3, None]


def test_a_long_conversion_comes_in_record_batches_with_every_row_in_order() -> None:
    """A sink part of hundreds of thousands of token events is converted a chunk at a
    time (the interpreter lock changes hands between chunks): the rows, their order and
    the schema are as one piece would give them."""
    n = 2 * CONVERT_CHUNK_ROWS + 7
    events = [TokenEvent(f"r{i % 3}", i, 10 * i, i % 5, None if i % 4 else i) for i in range(n)]
    table = token_events_table(events)
    assert table.num_rows == n and table.schema == token_event_schema()
    assert table.column("event_index").num_chunks == 3
    assert table.column("arrival_ns").to_pylist() == [10 * i for i in range(n)]
    assert table.column("server_cumulative").to_pylist() == [None if i % 4 else i for i in range(n)]
    assert table.column("request_id").to_pylist()[-2:] == [f"r{(n - 2) % 3}", f"r{(n - 1) % 3}"]
    assert token_events_table([]).num_rows == 0
    n = CONVERT_CHUNK_ROWS + 1
    records = [RequestRecord("run", f"q{i}", ext=Ext(events=i)) for i in range(n)]
    assert records_table(records).column("ext.events").to_pylist() == list(range(len(records)))


def test_newer_schema_is_refused_with_a_clear_message() -> None:
    with pytest.raises(SchemaVersionError, match="newer than this calculet-load reads"):
        check_schema("calculet-perf-request/v2", REQUEST_SCHEMA)
    with pytest.raises(SchemaVersionError, match="expected calculet-perf-request/v1"):
        check_schema("something-else/v1", REQUEST_SCHEMA)
    check_schema("calculet-perf-request/v1", REQUEST_SCHEMA)
    newer = request_schema().with_metadata({"schema": "calculet-perf-request/v9"})
    with pytest.raises(SchemaVersionError):
        check_table_schema(newer, REQUEST_SCHEMA)
    with pytest.raises(SchemaVersionError):
        record_from_dict({"schema": "calculet-perf-request/v3", "run_id": "a", "request_id": "b"})


def test_json_schema_validates_an_export() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    rec = RequestRecord(
        "run",
        "r",
        workload=Workload(prompt_tokens=3),
        result=Result(http_status=200),
        ext=Ext(worker="w"),
    )
    jsonschema.validate(record_to_dict(rec), request_json_schema())
    bad = record_to_dict(rec)
    bad["workload"]["prompt_tokens"] = "three"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, request_json_schema())


def test_selfwatch_row_fields_match_its_schema() -> None:
    assert [f.name for f in dataclasses.fields(SelfWatchRow)] == selfwatch_schema().names
