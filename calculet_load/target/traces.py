"""Copying the target's server traces (DESIGN §3.2) into a run folder's `server/`.

The one way a run's traces are collected when it ends: the acceptance pipeline and the
Locust master (at each test stop) call `collect_traces`, which reads
`GET /traces/{kind}?offset=0` through `TargetAPI.trace_bytes` for `server_events`,
`steps` and `device` (and `vendor`, spec §17, where the target offers it: `optional`),
and writes `server/<kind>.jsonl` where the analysis joins them
(`analysis.tables.join`). It returns what it did, as a JSON-ready record for the run's
index or log:

    {"status": "fetched" | "not_available" | "error", "reason": str | None,
     "seconds": float, "window": {...} | None,
     "kinds": {kind: {"status", "rows", "bytes", "dropped_rows", "reason"}}}

A target that answers 401/403/404/405/501 for a trace, or answers with something that
is not JSON lines, has no traces to give (`not_available`: a plain OpenAI server, a
gateway): never a failure of the run. No answer, or a 5xx, is an `error`. Either way
nothing else of the run folder is touched.

A `TraceWindow` keeps only this run's rows: a row that names a request is kept when the
request id is one of the run's (`<run id>.<worker>.<seq>`, as the session names them)
and its server wall time lies in the window; a row of no request (device samples,
lifecycle events) when its wall time does. The window's margin covers a server clock
that is off by a little. Without a window (a target started for this one run, as the
demo's simulator) every row is kept as read.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Literal

import gevent

from calculet_load.schema.fs import write_file
from calculet_load.target.api import HTTPStatusError, TargetAPI

__all__ = ["OPTIONAL_KINDS", "TRACE_KINDS", "TraceWindow", "collect_traces"]

TRACE_KINDS = ("server_events", "steps", "device")
# offered by some targets only (spec §17: the vendor's counters); its absence is the norm,
# so it never makes the collection `not_available` or an `error`
OPTIONAL_KINDS = ("vendor",)
# the target does not give us this trace: not Calculet, or not to this client
NOT_OFFERED = frozenset({401, 403, 404, 405, 501})
Status = Literal["fetched", "not_available", "error"]


@dataclasses.dataclass(frozen=True, slots=True)
class TraceWindow:
    """The rows of one run: its request ids' prefix and its wall-clock span (ns)."""

    run_id: str
    start_wall_ns: int
    end_wall_ns: int
    margin_ns: int = 30_000_000_000

    def keeps(self, row: dict[str, Any]) -> bool:
        wall = row.get("wall_ns")
        if not isinstance(wall, int):
            return False
        if not self.start_wall_ns - self.margin_ns <= wall <= self.end_wall_ns + self.margin_ns:
            return False
        rid = row.get("request_id")
        return rid is None or str(rid).startswith(f"{self.run_id}.")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _NotJsonLines(ValueError):
    """The target answered 200 with something that is not trace rows."""


def _select(data: bytes, window: TraceWindow | None) -> tuple[bytes, int, int]:
    """(the lines kept, rows kept, rows dropped); raises _NotJsonLines when the first
    line is not a JSON object (an HTML page, a gateway's catch-all answer)."""
    lines = data.splitlines(keepends=True)
    first = next((x for x in lines if x.strip()), None)
    if first is None:
        return b"", 0, 0
    try:
        if not isinstance(json.loads(first), dict):
            raise ValueError("not an object")
    except ValueError:
        raise _NotJsonLines(f"the answer is not JSON lines (starts {first[:40]!r})") from None
    if window is None:
        return data, sum(1 for x in lines if x.strip()), 0
    kept: list[bytes] = []
    dropped = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(row, dict) and window.keeps(row):
            kept.append(line)
        else:
            dropped += 1
    return b"".join(kept), len(kept), dropped


def _fetch_one(
    api: TargetAPI, run_dir: str, kind: str, window: TraceWindow | None, timeout_s: float
) -> dict[str, Any]:
    try:
        data = api.trace_bytes(kind, timeout_s=timeout_s)
    except HTTPStatusError as exc:
        status: Status = "not_available" if exc.status in NOT_OFFERED else "error"
        return {"status": status, "reason": str(exc)}
    except OSError as exc:
        return {"status": "error", "reason": f"/traces/{kind}: {exc or type(exc).__name__}"}
    try:
        kept, rows, dropped = _select(data, window)
    except _NotJsonLines as exc:
        return {"status": "not_available", "reason": f"/traces/{kind}: {exc}"}
    if rows:
        write_file(run_dir, f"server/{kind}.jsonl", kept)
    return {"status": "fetched", "rows": rows, "bytes": len(kept), "dropped_rows": dropped}


def collect_traces(
    api: TargetAPI,
    run_dir: str,
    *,
    window: TraceWindow | None = None,
    settle_s: float = 1.0,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Copy each trace the target offers into `run_dir/server/`; return what was done.

    Call it inside a gevent loop (the reads run off the loop). `settle_s`: a wait for
    the target to flush its trace files (it flushes periodically); `timeout_s` bounds
    the whole collection (a kind not read by then is an `error`)."""
    t0 = time.monotonic()
    gevent.sleep(settle_s)
    deadline = t0 + max(timeout_s, 0.1)

    def fetch(kind: str) -> dict[str, Any]:
        left = deadline - time.monotonic()
        if left <= 0:
            return {"status": "error", "reason": f"not read: {timeout_s:g} s spent"}
        try:
            with gevent.Timeout(left):
                return _fetch_one(api, run_dir, kind, window, left)
        except gevent.Timeout:
            return {"status": "error", "reason": f"/traces/{kind}: no answer in {left:.1f} s"}

    kinds = {kind: fetch(kind) for kind in TRACE_KINDS}
    statuses = {k["status"] for k in kinds.values()}
    status: Status
    if "error" in statuses:
        status = "error"
    elif statuses == {"not_available"}:
        status = "not_available"
    else:
        status = "fetched"
    reasons = [k["reason"] for k in kinds.values() if k.get("reason") and k["status"] != "fetched"]
    optional = {kind: fetch(kind) for kind in OPTIONAL_KINDS}
    return {
        "status": status,
        "reason": "; ".join(reasons) or None,
        "source": f"{api.url}/traces/{{kind}}",
        "seconds": round(time.monotonic() - t0, 3),
        "window": window.to_json() if window is not None else None,
        "kinds": kinds,
        "optional": optional,
    }
