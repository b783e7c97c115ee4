# size: one reader per file kind of a run folder, each with its version check
"""Reading a run folder (DESIGN §3.4) into Arrow tables, then joining it (`analysis.tables.join`).

    <run>/client/<worker>/part-NNNNN.{requests,tokens,selfwatch}.parquet
    <run>/client/index.json          the Locust master's index (optional: probes have none)
    <run>/server/server_events.jsonl, steps.jsonl, device.jsonl   (optional; a
                                     `<kind>.parquet` beside one is read instead)
    <run>/server/vendor.jsonl        the vendor's counters (optional, spec §17:
                                     calculet_load.schema.traces.VendorRow)
    <run>/server/resources.jsonl     resources sampled during the run (optional, §13);
                                     without it, built from server/metrics.jsonl and
                                     server/process.jsonl when the run has those
    <run>/server/clock.json          {"ntp_offset_ns": int}        (optional)
    <run>/manifest.yaml, plan.json, network_breaks.json            (optional)

The run folder may be a local path or a URI (pyarrow.fs). A file that exists but cannot
be read — a corrupt Parquet part, a trace line that is not JSON, a part the index lists
but the folder lacks, a newer schema — raises `ArtifactError` naming the file (exit 2).
A missing optional file is not an error: what depends on it is reported as "no data".

Reading is columnar (Parquet and pyarrow's JSON reader, block by block); nothing loops
over rows. Token events are not read here: `RunData.tokens` names their parts (their
schemas checked), which `analysis.tables.tokens` reads and reduces one at a time.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.json as pajson
import pyarrow.parquet as pq
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from analysis.errors import ArtifactError
from calculet_load.schema import ResourceRow
from calculet_load.schema.arrow import (
    ADDED_SELFWATCH_COLUMNS,
    SELFWATCH_SCHEMA,
    arrow_schema,
    check_table_schema,
    request_schema,
    selfwatch_schema,
    token_event_schema,
    trace_columns,
)
from calculet_load.schema.clocks import rtt_measured
from calculet_load.schema.fs import resolve_fs
from calculet_load.schema.records import (
    ADDED_REQUEST_COLUMNS,
    RENAMED_REQUEST_COLUMNS,
    REQUEST_SCHEMA,
    TOKEN_EVENT_SCHEMA,
    SchemaVersionError,
    check_schema,
)
from calculet_load.schema.runfolder import CLIENT_INDEX_SCHEMA as INDEX_SCHEMA
from calculet_load.schema.runfolder import ClientIndex, part_files
from calculet_load.schema.traces import DeviceRow, ServerEventRow, StepRow, VendorRow

__all__ = [
    "INDEX_SCHEMA",
    "MANIFEST_SCHEMA",
    "NETWORK_BREAKS_SCHEMA",
    "TRACE_FILES",
    "NetworkBreak",
    "Progress",
    "RunData",
    "TokenParts",
    "read_run_files",
]

MANIFEST_SCHEMA = "calculet-perf-run/v1"
NETWORK_BREAKS_SCHEMA = "calculet-network-breaks/v1"

TRACE_FILES = {
    "server_events": "server/server_events.jsonl",
    "steps": "server/steps.jsonl",
    "device": "server/device.jsonl",
    "resources": "server/resources.jsonl",
    "vendor": "server/vendor.jsonl",
}

Progress = Callable[[str], None]

# The trace columns the analysis reads (calculet_load.schema.traces declares them, with
# their types); other fields (`detail`, chip units the analysis does not use) are skipped.
_EVENT_COLUMNS = trace_columns(
    ServerEventRow,
    ("wall_ns", "mono_ns", "event", "request_id", "job_id", "step_index", "kind", "generation"),
)
_STEP_TIMES = ("queue_ms", "h2d_ms", "device_wait_ms", "d2h_ms", "sampling_ms")
_STEP_COLUMNS = trace_columns(
    StepRow, ("wall_ns", "mono_ns", "request_id", "job_id", "kind", "step", *_STEP_TIMES)
)
_DEVICE_COLUMNS = trace_columns(
    DeviceRow,
    ("wall_ns", "mono_ns", "chips", "pending_jobs", "reset_count"),
    (("chips", ("chip", "temperature_c", "power_w", "frequency_mhz", "throttled")),),
)
_TRACE_SCHEMAS = {
    "server_events": _EVENT_COLUMNS,
    "steps": _STEP_COLUMNS,
    "device": _DEVICE_COLUMNS,
    "resources": arrow_schema(ResourceRow, "calculet-resources/v1").remove_metadata(),
    "vendor": trace_columns(VendorRow),
}


class NetworkBreak(BaseModel):
    """A network break: requests overlapping it are excluded (spec §9). Declared in
    network_breaks.json, or detected from the run's own evidence
    (analysis.tables.netbreaks: `source` "detected", what was seen in `evidence`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    start_wall_ns: int
    end_wall_ns: int
    reason: str = Field(min_length=1)
    source: Literal["declared", "detected"] = "declared"
    evidence: tuple[str, ...] = ()


class _Breaks(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_: str = Field(alias="schema")
    breaks: list[NetworkBreak]


@dataclass(frozen=True, slots=True)
class TokenParts:
    """The run's token-event parts, their schemas checked: iterating reads them one at a
    time as (path, table of request_id — dictionary-encoded — event_index, arrival_ns,
    tokens); a part that turns out unreadable raises ArtifactError then."""

    fs: pafs.FileSystem
    paths: tuple[str, ...]

    def __iter__(self) -> Iterator[tuple[str, pa.Table]]:
        schema = _token_columns()
        for path in self.paths:
            yield path, _read_part(self.fs, path, TOKEN_EVENT_SCHEMA, schema)

    def __len__(self) -> int:
        return len(self.paths)


@dataclass(slots=True)
class RunData:
    """Everything read from one run folder. `requests` has the record columns (Arrow
    schema of calculet_load.schema) plus, after `load_run`, the columns of
    `analysis.tables.join.JOIN_COLUMNS`; a table absent from the folder is None. Token events
    (tens of millions) are read part by part when they are reduced: `tokens`."""

    uri: str
    requests: pa.Table
    tokens: TokenParts
    selfwatch: pa.Table
    server_events: pa.Table | None = None
    steps: pa.Table | None = None
    device: pa.Table | None = None
    resources: pa.Table | None = None
    vendor: pa.Table | None = None  # server/vendor.jsonl (spec §17), when the run has it
    index: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None
    golden: dict[str, str] = field(default_factory=dict)  # golden.json: cell -> hash
    network_breaks: list[NetworkBreak] = field(default_factory=list)
    client_offsets_ns: dict[str, int] = field(default_factory=dict)
    server_offset_ns: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str | None:
        ids = self.requests.column("run_id").unique().drop_null().to_pylist()
        if len(ids) == 1:
            return str(ids[0])
        for source in (self.index, self.manifest):
            if source and isinstance(source.get("run_id"), str):
                return str(source["run_id"])
        return None


def _path(root: str, rel: str) -> str:
    return f"{root.rstrip('/')}/{rel}"


def _exists(fs: pafs.FileSystem, path: str) -> bool:
    return bool(fs.get_file_info(path).type == pafs.FileType.File)


def _read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    try:
        with fs.open_input_stream(path) as f:
            return bytes(f.read())
    except (OSError, pa.ArrowException) as exc:
        raise ArtifactError(f"{path}: cannot read: {exc}") from None


_IDS = pa.dictionary(pa.int32(), pa.string())


def _token_columns() -> pa.Schema:
    """The token-event columns the analysis reads, ids dictionary-encoded (tens of
    millions of events name far fewer requests)."""
    full = token_event_schema()
    return pa.schema(
        [pa.field("request_id", _IDS)]
        + [full.field(n) for n in ("event_index", "arrival_ns", "tokens")],
        metadata=full.metadata,
    )


def _check_part(fs: pafs.FileSystem, path: str, name: str, schema: pa.Schema) -> set[str]:
    """Refuse a part whose footer is unreadable, whose schema is newer, or that lacks a
    column of `schema`; the part's column names."""
    try:
        found = pq.read_schema(path, filesystem=fs)
    except (OSError, pa.ArrowException) as exc:
        raise ArtifactError(f"{path}: unreadable Parquet part: {exc}") from None
    try:
        check_table_schema(found, name)
    except SchemaVersionError as exc:
        raise ArtifactError(f"{path}: {exc}") from None
    missing = [n for n in schema.names if n not in found.names and n not in _ADDED.get(name, ())]
    if missing:
        raise ArtifactError(f"{path}: column {missing[0]!r} missing from a {name} part")
    return set(found.names)


def _read_part(
    fs: pafs.FileSystem, path: str, name: str, schema: pa.Schema, present: set[str] | None = None
) -> pa.Table:
    """The part's columns of `schema` (`present`: its column names, when `_check_part` read
    them; needed only where columns were added since v1); a dictionary-typed column is read
    as dictionary-encoded from the Parquet pages, never materialized as strings."""
    encoded = [f.name for f in schema if pa.types.is_dictionary(f.type)]
    columns = schema.names
    try:
        if _ADDED.get(name):
            if present is None:
                present = set(pq.read_schema(path, filesystem=fs).names)
            renamed = _RENAMED.get(name, {})
            columns = [n for n in schema.names if n in present]
            columns += [
                old for old, new in renamed.items() if old in present and new not in present
            ]
        t = pq.read_table(
            path,
            columns=columns,
            filesystem=fs,
            read_dictionary=encoded or None,
        )
    except (OSError, pa.ArrowException) as exc:
        raise ArtifactError(f"{path}: unreadable Parquet part: {exc}") from None
    t = _upgrade(t, name, schema)
    try:
        return t.select(schema.names).cast(schema)
    except (pa.ArrowException, ValueError) as exc:
        raise ArtifactError(f"{path}: column types differ from {name}: {exc}") from None


# Optional columns added to a table's v1 after its first release: absent in older parts.
_ADDED: dict[str, tuple[str, ...]] = {
    REQUEST_SCHEMA: ADDED_REQUEST_COLUMNS,
    SELFWATCH_SCHEMA: ADDED_SELFWATCH_COLUMNS,
}
_RENAMED: dict[str, dict[str, str]] = {REQUEST_SCHEMA: RENAMED_REQUEST_COLUMNS}


def _upgrade(table: pa.Table, name: str, schema: pa.Schema) -> pa.Table:
    """An older v1 part's table with its renamed columns under their new names and the
    columns added since filled with nulls."""
    for old, new in _RENAMED.get(name, {}).items():
        if old in table.column_names and new not in table.column_names:
            table = table.rename_columns([new if n == old else n for n in table.column_names])
    for column in _ADDED.get(name, ()):
        if column in schema.names and column not in table.column_names:
            field = schema.field(column)
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table


def _read_parts(fs: pafs.FileSystem, paths: list[str], name: str, schema: pa.Schema) -> pa.Table:
    """The parts as one table of `schema`."""
    tables = []
    for path in paths:
        present = _check_part(fs, path, name, schema)
        tables.append(_read_part(fs, path, name, schema, present))
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def _json_table(source: Any, schema: pa.Schema) -> pa.Table:
    """JSON lines read block by block (pyarrow's streaming reader: on gigabytes of step
    rows ~1.5× faster than reading the file whole, and without its peak), keeping the
    columns of `schema`; `request_id` dictionary-encoded as from Parquet."""
    opts = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    reader = pajson.open_json(source, parse_options=opts)
    table = pa.Table.from_batches(list(reader), schema=reader.schema).select(schema.names)
    if "request_id" not in schema.names:
        return table
    # one chunk, one dictionary: the chunks of a block-wise read would each need a lookup
    ids = table.column("request_id").combine_chunks().dictionary_encode()
    table = table.set_column(schema.get_field_index("request_id"), "request_id", ids)
    # the parser's blocks, freed, stay with the allocator otherwise (~0.4 GB for 3.4 GB)
    pa.default_memory_pool().release_unused()
    return table


def _read_trace(fs: pafs.FileSystem, path: str, kind: str, notes: list[str]) -> pa.Table:
    schema = _TRACE_SCHEMAS[kind]
    if fs.get_file_info(path).size == 0:
        return schema.empty_table()
    try:  # the common case, streamed: no copy of the file in memory
        with fs.open_input_stream(path) as f:
            return _json_table(f, schema)
    except pa.ArrowInvalid:
        pass
    data = _read_bytes(fs, path)
    cut = data.rfind(b"\n") + 1
    if cut < len(data) and data[cut:].strip():
        # A server killed mid-write leaves a partial last line: the rows before it stand.
        notes.append(f"{path}: a partial last line ({len(data) - cut} bytes) was ignored")
    if not data[:cut].strip():
        return schema.empty_table()
    try:
        return _json_table(pa.BufferReader(pa.py_buffer(data)[:cut]), schema)
    except pa.ArrowException as exc:
        raise ArtifactError(f"{path}: not valid JSON lines of {kind}: {exc}") from None


def _json_lines(fs: pafs.FileSystem, path: str) -> list[Any]:
    data = _read_bytes(fs, path)
    lines = data.split(b"\n")
    if lines and lines[-1].strip():
        lines = lines[:-1]  # a line cut by a crash: the rows before it stand
    try:
        return [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: not valid JSON lines: {exc}") from None


def _resources_from_scrapes(fs: pafs.FileSystem, root: str, notes: list[str]) -> pa.Table | None:
    """ResourceRow columns from the harness's /metrics scrapes (server/metrics.jsonl),
    with the process's RSS, FDs and threads from server/process.jsonl where sampled
    (the last process row at or before each scrape)."""
    from calculet_load.schema.prometheus import resource_fields

    mpath = _path(root, "server/metrics.jsonl")
    if not _exists(fs, mpath):
        return None
    rows = []
    for row in _json_lines(fs, mpath):
        samples = row.get("samples") if isinstance(row, dict) and row.get("ok") else None
        if not isinstance(samples, dict):
            continue
        summed: dict[str, float] = {}
        for key, value in samples.items():
            if isinstance(value, int | float):
                name = str(key).split("{", 1)[0]
                summed[name] = summed.get(name, 0.0) + float(value)
        rows.append({"wall_ns": row.get("wall_ns"), "mono_ns": row.get("mono_ns"),
                     **resource_fields(summed)})  # fmt: skip
    if not rows:
        return None
    ppath = _path(root, "server/process.jsonl")
    procs = [
        r
        for r in (_json_lines(fs, ppath) if _exists(fs, ppath) else [])
        if isinstance(r, dict) and r.get("alive") and isinstance(r.get("mono_ns"), int)
    ]
    procs.sort(key=lambda r: r["mono_ns"])
    if procs:
        monos = [r["mono_ns"] for r in procs]
        for row in rows:
            i = bisect.bisect_right(monos, row["mono_ns"] or 0) - 1
            if i >= 0:
                for field in ("rss_bytes", "fds", "threads"):
                    if procs[i].get(field) is not None:
                        row[field] = procs[i][field]
    scaled = any(r.get("time_scale") for r in rows)
    notes.append(
        "no server/resources.jsonl: resources read from server/metrics.jsonl"
        + (" and server/process.jsonl" if procs else "")
        + ("" if scaled else " (no time scale exposed: leak slopes are per hour of wall time)")
    )
    try:
        return pa.Table.from_pylist(rows, schema=_TRACE_SCHEMAS["resources"])
    except (pa.ArrowException, TypeError) as exc:
        raise ArtifactError(f"{mpath}: unexpected values: {exc}") from None


def _read_trace_parquet(fs: pafs.FileSystem, path: str, kind: str) -> pa.Table:
    """A trace in its columnar form (`server/<kind>.parquet`, the JSON lines' rows as
    written by a collector that converted them): only the columns the analysis reads,
    `request_id` dictionary-encoded."""
    schema = _TRACE_SCHEMAS[kind]
    try:
        names = pq.read_schema(path, filesystem=fs).names
        missing = [n for n in schema.names if n not in names]
        if missing:
            raise ArtifactError(f"{path}: column {missing[0]!r} missing from a {kind} trace")
        ids = ["request_id"] if "request_id" in schema.names else None
        table = pq.read_table(path, columns=schema.names, filesystem=fs, read_dictionary=ids)
        if ids:  # read dictionary-encoded: millions of rows name far fewer requests
            i = schema.get_field_index("request_id")
            schema = schema.set(i, pa.field("request_id", _IDS))
        return table.cast(schema)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise ArtifactError(f"{path}: unreadable {kind} trace: {exc}") from None


def _read_json(fs: pafs.FileSystem, path: str) -> Any:
    try:
        return json.loads(_read_bytes(fs, path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: invalid JSON: {exc}") from None


def _check_versioned(doc: Any, path: str, expected: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ArtifactError(f"{path}: top level must be a mapping")
    try:
        check_schema(doc.get("schema"), expected)
    except SchemaVersionError as exc:
        raise ArtifactError(f"{path}: {exc}") from None
    return doc


def _read_index(fs: pafs.FileSystem, root: str) -> dict[str, Any] | None:
    path = _path(root, "client/index.json")
    if not _exists(fs, path):
        return None
    doc = _read_json(fs, path)
    try:
        index = ClientIndex.parse(doc)
    except (SchemaVersionError, ValueError) as exc:
        raise ArtifactError(f"{path}: {exc}") from None
    for w in index.workers:
        for part in w.parts:
            if not _exists(fs, _path(root, f"client/{w.worker}/{part}")):
                raise ArtifactError(
                    f"{_path(root, f'client/{w.worker}/{part}')}: listed in client/index.json "
                    "but missing from the run folder"
                )
    return dict(doc)  # as written: the views show what the writer put there


def _read_breaks(fs: pafs.FileSystem, root: str) -> list[NetworkBreak]:
    path = _path(root, "network_breaks.json")
    if not _exists(fs, path):
        return []
    doc = _check_versioned(_read_json(fs, path), path, NETWORK_BREAKS_SCHEMA)
    try:
        return _Breaks.model_validate(doc).breaks
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ArtifactError(f"{path}: {where}: {err['msg']}") from None


def _offsets(index: dict[str, Any] | None, fs: pafs.FileSystem, root: str) -> tuple[Any, int]:
    """Host NTP offsets where the run recorded them: reference − wall, ns
    (calculet_load.schema.clocks; reference ≈ wall + offset)."""
    client: dict[str, int] = {}
    for w in (index or {}).get("workers") or []:
        if isinstance(w, dict) and isinstance(w.get("ntp_offset_ns"), int):
            client[str(w.get("worker"))] = int(w["ntp_offset_ns"])
    server = 0
    path = _path(root, "server/clock.json")
    if _exists(fs, path):
        doc = _read_json(fs, path)
        value = doc.get("ntp_offset_ns") if isinstance(doc, dict) else None
        if not isinstance(value, int):
            raise ArtifactError(f"{path}: ntp_offset_ns: expected an integer (ns)")
        server = value
    return client, server


def read_run_files(uri: str, *, progress: Progress | None = None) -> RunData:
    """Read every file of the run folder, unjoined. Raises ArtifactError (exit 2)."""
    say = progress or (lambda _msg: None)
    fs, root = resolve_fs(uri)
    info = fs.get_file_info(root)
    if info.type != pafs.FileType.Directory:
        raise ArtifactError(f"{uri}: not a run folder (no such directory)")
    notes: list[str] = []
    index = _read_index(fs, root)
    tables: dict[str, pa.Table] = {}
    for table, name, schema in (
        ("requests", REQUEST_SCHEMA, request_schema()),
        ("selfwatch", SELFWATCH_SCHEMA, selfwatch_schema()),
    ):
        paths = part_files(uri, table)
        say(f"reading {len(paths)} {table} part(s)")
        tables[table] = _read_parts(fs, paths, name, schema)
    token_paths = part_files(uri, "tokens")
    token_columns = _token_columns()
    for path in token_paths:
        _check_part(fs, path, TOKEN_EVENT_SCHEMA, token_columns)
    if tables["requests"].num_rows == 0:
        raise ArtifactError(f"{uri}: no request records under client/")
    traces: dict[str, pa.Table | None] = {}
    for kind, rel in TRACE_FILES.items():
        path = _path(root, rel)
        columnar = path.removesuffix(".jsonl") + ".parquet"
        if _exists(fs, columnar):
            say(f"reading {rel.removesuffix('.jsonl')}.parquet")
            traces[kind] = _read_trace_parquet(fs, columnar, kind)
        elif _exists(fs, path):
            say(f"reading {rel}")
            traces[kind] = _read_trace(fs, path, kind, notes)
        else:
            traces[kind] = None
    if traces["resources"] is None:
        traces["resources"] = _resources_from_scrapes(fs, root, notes)
    manifest = None
    mpath = _path(root, "manifest.yaml")
    if _exists(fs, mpath):
        try:
            doc = yaml.safe_load(_read_bytes(fs, mpath))
        except yaml.YAMLError:
            raise ArtifactError(f"{mpath}: invalid YAML") from None
        manifest = _check_versioned(doc, mpath, MANIFEST_SCHEMA)
    ppath = _path(root, "plan.json")
    plan = _read_json(fs, ppath) if _exists(fs, ppath) else None
    gpath = _path(root, "golden.json")
    golden_doc = _read_json(fs, gpath) if _exists(fs, gpath) else None
    golden = _golden_expected(golden_doc, gpath)
    client_offsets, server_offset = _offsets(index, fs, root)
    _check_vpn(manifest, index, mpath)
    return RunData(
        uri=uri,
        requests=tables["requests"],
        tokens=TokenParts(fs, tuple(token_paths)),
        selfwatch=tables["selfwatch"],
        server_events=traces["server_events"],
        steps=traces["steps"],
        device=traces["device"],
        resources=traces["resources"],
        vendor=traces["vendor"],
        index=index,
        manifest=manifest,
        plan=plan if isinstance(plan, dict) else None,
        golden=golden,
        network_breaks=_read_breaks(fs, root),
        client_offsets_ns=client_offsets,
        server_offset_ns=server_offset,
        notes=notes,
    )


def _check_vpn(manifest: dict[str, Any] | None, index: Any, where: str) -> None:
    """Spec §5: with a VPN in the path, RTT and jitter to the target must be measured."""
    env = (manifest or {}).get("environment")
    if isinstance(env, dict) and env.get("vpn_in_path") is True and not rtt_measured(index):
        raise ArtifactError(
            f"{where}: environment.vpn_in_path is true but the run measured no RTT/jitter "
            "to the target (client/index.json workers[].target_rtt; --rtt-samples >= 2)"
        )


def _golden_expected(doc: Any, where: str) -> dict[str, str]:
    """`golden.json` (written by `accept`): the golden set's expected token hash per golden
    cell, e.g. {"cases": [{"cell": "golden_before:short", "token_hash": "..."}]}."""
    if doc is None:
        return {}
    cases = doc.get("cases") if isinstance(doc, dict) else None
    if not isinstance(cases, list):
        raise ArtifactError(f"{where}: cases: expected a list")
    out: dict[str, str] = {}
    for i, case in enumerate(cases):
        if not (isinstance(case, dict) and isinstance(case.get("cell"), str)
                and isinstance(case.get("token_hash"), str)):  # fmt: skip
            raise ArtifactError(f"{where}: cases.{i}: needs a cell and a token_hash string")
        out[case["cell"]] = case["token_hash"]
    return out
