"""Reading a run folder back: the closed parts of every worker, and the §3 JSONL export.

Layout (DESIGN §3.4): `<run>/client/<worker>/part-NNNNN.<table>.parquet`. Temporary
files of a part being written (`.part-*.tmp`) are never read: a part exists completely or
not at all. A part written under a newer schema is refused with a clear message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from calculet_load.schema.arrow import (
    SELFWATCH_SCHEMA,
    check_table_schema,
    records_from_table,
    request_schema,
    selfwatch_schema,
    token_event_schema,
)
from calculet_load.schema.fs import resolve_fs
from calculet_load.schema.records import (
    REQUEST_SCHEMA,
    TOKEN_EVENT_SCHEMA,
    RequestRecord,
    SchemaVersionError,
    record_to_dict,
)

_TABLES: dict[str, tuple[str, Any]] = {
    "requests": (REQUEST_SCHEMA, request_schema),
    "tokens": (TOKEN_EVENT_SCHEMA, token_event_schema),
    "selfwatch": (SELFWATCH_SCHEMA, selfwatch_schema),
}


def part_files(run_dir: str, table: str) -> list[str]:
    """Every closed part of `table` under `run_dir/client/`, workers and parts in order."""
    if table not in _TABLES:
        raise ValueError(f"table: unknown {table!r}; one of {sorted(_TABLES)}")
    fs, root = resolve_fs(run_dir)
    selector = pafs.FileSelector(f"{root.rstrip('/')}/client", recursive=True, allow_not_found=True)
    suffix = f".{table}.parquet"
    return sorted(
        info.path
        for info in fs.get_file_info(selector)
        if info.type == pafs.FileType.File
        and info.base_name.startswith("part-")
        and info.base_name.endswith(suffix)
    )


def read_table(run_dir: str, table: str) -> pa.Table:
    """All parts of one table, concatenated (an empty table when there are none)."""
    paths = part_files(run_dir, table)
    name, schema_fn = _TABLES[table]
    fs, _ = resolve_fs(run_dir)
    schema = schema_fn()
    tables = []
    for path in paths:
        t = pq.read_table(path, filesystem=fs)
        try:
            check_table_schema(t.schema, name)
        except SchemaVersionError as exc:
            raise SchemaVersionError(f"{path}: {exc}") from None
        tables.append(t.select(schema.names).cast(schema))
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def read_records(run_dir: str) -> list[RequestRecord]:
    return list(records_from_table(read_table(run_dir, "requests")))


def iter_jsonl(records: list[RequestRecord], *, strict: bool) -> Iterator[str]:
    for rec in records:
        yield json.dumps(record_to_dict(rec, strict=strict), ensure_ascii=False) + "\n"


def export_jsonl(
    run_dir: str, out: IO[str], *, strict: bool = True, table: pa.Table | None = None
) -> int:
    """Write the run's request records as JSON lines (§3 shape when `strict`): the
    records of `table` when given (the analysis's join of them with the server traces:
    its columns beyond the record schema are left out), else as the parts hold them."""
    if table is None:
        records = read_records(run_dir)
    else:
        schema = request_schema()
        records = list(records_from_table(table.select(schema.names).cast(schema)))
    n = 0
    for line in iter_jsonl(records, strict=strict):
        out.write(line)
        n += 1
    return n
