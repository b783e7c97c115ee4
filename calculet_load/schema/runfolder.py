"""The run folder: its client index (`client/index.json`, the one model every writer
and reader uses), the closed parts of every worker, and the §3 JSONL export.

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
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from calculet_load.configfile import first_error
from calculet_load.schema.arrow import (
    SELFWATCH_SCHEMA,
    check_table_schema,
    records_from_table,
    request_schema,
    selfwatch_schema,
    token_event_schema,
)
from calculet_load.schema.fs import resolve_fs, write_file
from calculet_load.schema.records import (
    REQUEST_SCHEMA,
    TOKEN_EVENT_SCHEMA,
    RequestRecord,
    SchemaVersionError,
    check_schema,
    record_to_dict,
)

CLIENT_INDEX_SCHEMA = "calculet-client-index/v1"
CLIENT_INDEX = "client/index.json"


def sink_status(stats: dict[str, Any] | None) -> str | None:
    """Why a worker's sink (its `SinkStats` as a dict, as the index keeps it) did not
    write everything into its parts, or None when it did (or nothing is known)."""
    if not stats:
        return None
    problems = []
    if stats.get("quarantined"):
        files = ", ".join(stats.get("quarantine_files") or []) or "no file"
        problems.append(f"{stats['quarantined']} row(s) quarantined ({files})")
    if stats.get("lost"):
        problems.append(f"{stats['lost']} row(s) lost")
    if stats.get("errors") and not problems:
        problems.append(f"{len(stats['errors'])} write error(s)")
    return "; ".join(problems) or None


class IndexWorker(BaseModel):
    """One client process (a Locust worker, the accept process, a soak attempt) in the
    client index. Writers add what they know (host, pid, clock provenance, target_rtt,
    bursts...): kept as given."""

    model_config = ConfigDict(extra="allow")

    worker: str
    status: str | None = None  # reported | incomplete | missing | interrupted
    parts: list[str] = Field(default_factory=list)
    sink: dict[str, Any] | None = None
    sink_problem: str | None = None

    def check_sink(self) -> bool:
        """Mark the worker `incomplete` when its sink did not write every row into its
        parts (the run then says so: exit 3); True if it did not."""
        problem = sink_status(self.sink)
        if problem is None:
            return False
        self.status, self.sink_problem = "incomplete", problem
        return True


class ClientIndex(BaseModel):
    """`client/index.json` (`calculet-client-index/v1`): the run's client processes and
    their parts, and whether the run completed. Written by the Locust master, the accept
    pipeline and the soak driver; read by the analysis (`analysis.tables.load`)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    schema_: str = Field(CLIENT_INDEX_SCHEMA, alias="schema")
    run_id: str
    status: str  # running | stopping | complete | incomplete | interrupted...
    workers: list[IndexWorker] = Field(default_factory=list)
    target: str | None = None
    server_traces: dict[str, Any] | None = None  # what the run's stop fetched of the traces
    # the live figures over time (schema.liveseries: file, schema, points), Locust runs
    live_series: dict[str, Any] | None = None

    def check_sinks(self) -> None:
        """Every worker's sink checked (IndexWorker.check_sink); one that lost rows
        makes the run `incomplete`."""
        if any([w.check_sink() for w in self.workers]):
            self.status = "incomplete"

    def to_dict(self) -> dict[str, Any]:
        """The document as written: what the writer set, the schema first."""
        doc = self.model_dump(by_alias=True, exclude_unset=True)
        doc.pop("schema", None)
        doc["workers"] = [w.model_dump(exclude_unset=True) for w in self.workers]
        return {"schema": self.schema_, **doc}

    def write(self, run_dir: str) -> None:
        """Write `<run_dir>/client/index.json` whole (schema.fs.write_file)."""
        write_file(
            run_dir, CLIENT_INDEX, json.dumps(self.to_dict(), indent=1, default=str).encode()
        )

    @classmethod
    def parse(cls, doc: Any) -> ClientIndex:
        """A client index read back; SchemaVersionError for another schema or a newer
        version, ValueError (with the field) for a malformed document."""
        if not isinstance(doc, dict):
            raise ValueError("top level must be a mapping")
        check_schema(doc.get("schema"), CLIENT_INDEX_SCHEMA)
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            raise ValueError(first_error(exc)) from None


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
