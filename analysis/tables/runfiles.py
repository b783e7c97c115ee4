"""The report's reads of a run folder beyond the records: the pipeline's event log, the
plan, the manifest text, the signed bundle's statement, the server's lifecycle and
runtime events (with their `detail`, which the analysis does not load) and the device
rows (with the memory columns the leak trends need).

Every read is tolerant: a missing optional file is `None`, a damaged one is `None` plus
a note naming it; the report then says "no data" for what depended on it. Secrets never
leave this module: `redact` drops credential-looking keys and URL user-info before any
value reaches the view model.
"""

from __future__ import annotations

import base64
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.json as pajson

from calculet_load.schema.fs import resolve_fs

__all__ = [
    "LIFECYCLE_EVENTS",
    "RUNTIME_EVENTS",
    "BundleInfo",
    "RunFiles",
    "ServerScan",
    "redact",
]

RUNTIME_EVENTS = (
    "runtime_error",
    "failed",
    "rejected",
    "quarantine",
    "artifact_isolated",
    "stale_completion_blocked",
    "stale_completion_delivered",
    "numeric_check_failed",
    "backoff",
)
"""Server events that are a runtime non-success (or its direct consequence)."""

LIFECYCLE_EVENTS = (
    "reset",
    "reconfigure",
    "generation_change",
    "state_change",
    "fault_armed",
    "fault_cleared",
)

_SECRET_KEY = re.compile(
    r"(api[_-]?key|secret|passw(or)?d|authori[sz]ation|bearer|credential|private[_-]?key"
    r"|admin[_-]?token|access[_-]?token|auth[_-]?token|^token$|signing[_-]?key)",
    re.I,
)
_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.I)
_BEARER = re.compile(r"(bearer\s+)\S+", re.I)
REDACTED = "[redacted]"
_CHUNK = 64 << 20


def redact(value: Any) -> Any:
    """A copy of `value` with credential-looking keys' values, URL user-info and bearer
    tokens replaced by "[redacted]"."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if _SECRET_KEY.search(str(k)) and v is not None else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _BEARER.sub(r"\1" + REDACTED, _USERINFO.sub(r"\1" + REDACTED + "@", value))
    return value


@dataclass(frozen=True, slots=True)
class BundleInfo:
    """What `bundle.intoto.json` claims (not verified here: `calculet-load verify` does)."""

    signed: bool
    key_id: str | None
    created: str | None
    files: int | None
    tool: str | None
    lists_report: bool
    error: str | None = None


@dataclass(slots=True)
class ServerScan:
    """Rows of the chosen server events (parsed, with `detail`), at most `limit`; and the
    count of every chosen event in the file, parsed or not."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    capped: bool = False


@dataclass(slots=True)
class RunFiles:
    """A run folder (local path or URI) and the notes its reads produced."""

    uri: str
    fs: pafs.FileSystem = field(init=False)
    root: str = field(init=False)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fs, self.root = resolve_fs(self.uri)

    def path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    def is_dir(self) -> bool:
        return bool(self.fs.get_file_info(self.root).type == pafs.FileType.Directory)

    def exists(self, rel: str) -> bool:
        return bool(self.fs.get_file_info(self.path(rel)).type == pafs.FileType.File)

    def read_bytes(self, rel: str) -> bytes | None:
        if not self.exists(rel):
            return None
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                return bytes(f.read())
        except (OSError, pa.ArrowException) as exc:
            self.notes.append(f"{rel}: cannot be read ({exc}); shown as no data")
            return None

    def read_text(self, rel: str) -> str | None:
        data = self.read_bytes(rel)
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            self.notes.append(f"{rel}: not UTF-8; shown as no data")
            return None

    def read_json(self, rel: str) -> Any:
        text = self.read_text(rel)
        if text is None:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            self.notes.append(f"{rel}: invalid JSON ({exc}); shown as no data")
            return None

    def read_jsonl(self, rel: str) -> list[dict[str, Any]] | None:
        """Every JSON-object line; a damaged line is skipped with a note."""
        text = self.read_text(rel)
        if text is None:
            return None
        rows, bad = [], 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
        if bad:
            self.notes.append(f"{rel}: {bad} damaged line(s) skipped")
        return rows

    def bundle(self) -> BundleInfo | None:
        raw = self.read_bytes("bundle.intoto.json")
        if raw is None:
            return None
        try:
            env = json.loads(raw)
            st = json.loads(base64.b64decode(env["payload"], validate=True))
            pred = st["predicate"]
            names = {s.get("name") for s in st.get("subject") or [] if isinstance(s, dict)}
            tool = pred.get("tool") or {}
            return BundleInfo(
                signed=bool(pred.get("signed")) and bool(env.get("signatures")),
                key_id=pred.get("key_id"),
                created=pred.get("created"),
                files=pred.get("files"),
                tool=f"{tool.get('name', '?')} {tool.get('version', '?')}" if tool else None,
                lists_report="report.html" in names,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return BundleInfo(False, None, None, None, None, False, error=f"unreadable: {exc}")

    def scan_server_events(self, names: tuple[str, ...], limit: int) -> ServerScan | None:
        """The rows of `server/server_events.jsonl` whose event is one of `names`, found
        by a byte search (the chain events, nearly all of a large file, are never
        parsed), read in chunks so a multi-GB trace needs bounded memory."""
        rel = "server/server_events.jsonl"
        if not self.exists(rel):
            return None
        pattern = re.compile(rb'"event"\s*:\s*"(' + b"|".join(n.encode() for n in names) + rb')"')
        scan = ServerScan()
        carry = b""
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                while True:
                    chunk = f.read(_CHUNK)
                    if not chunk and not carry:
                        break
                    data = carry + bytes(chunk)
                    cut = data.rfind(b"\n") + 1 if chunk else len(data)
                    data, carry = data[:cut], data[cut:]
                    self._scan_chunk(data, pattern, scan, limit)
                    if not chunk:
                        break
        except (OSError, pa.ArrowException) as exc:
            self.notes.append(f"{rel}: cannot be read ({exc}); server events are no data")
            return None
        return scan

    @staticmethod
    def _scan_chunk(data: bytes, pattern: re.Pattern[bytes], scan: ServerScan, limit: int) -> None:
        for m in pattern.finditer(data):
            scan.counts[m.group(1).decode()] += 1
            if len(scan.rows) >= limit:
                scan.capped = True
                continue
            start = data.rfind(b"\n", 0, m.start()) + 1
            end = data.find(b"\n", m.end())
            try:
                row = json.loads(data[start : end if end >= 0 else len(data)])
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(row, dict) and row.get("event") == m.group(1).decode():
                scan.rows.append(row)

    def device_rows(self) -> pa.Table | None:
        """`server/device.jsonl` with the chip columns the timeline and trends use."""
        rel = "server/device.jsonl"
        if not self.exists(rel):
            return None
        chip = pa.struct(
            [
                ("chip", pa.int64()),
                ("temperature_c", pa.float64()),
                ("power_w", pa.float64()),
                ("frequency_mhz", pa.float64()),
                ("memory_used_mib", pa.float64()),
                ("throttled", pa.bool_()),
            ]
        )
        schema = pa.schema(
            [
                ("wall_ns", pa.int64()),
                ("chips", pa.list_(chip)),
                ("pending_jobs", pa.int64()),
                ("finished_jobs", pa.int64()),
                ("left_jobs", pa.int64()),
                ("reset_count", pa.int64()),
            ]
        )
        data = self.read_bytes(rel)
        if data is None:
            return None
        data = data[: data.rfind(b"\n") + 1]
        if not data.strip():
            return schema.empty_table()
        opts = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
        try:
            return pajson.read_json(pa.BufferReader(data), parse_options=opts).select(schema.names)
        except pa.ArrowException as exc:
            self.notes.append(f"{rel}: not valid JSON lines ({exc}); device data is no data")
            return None
