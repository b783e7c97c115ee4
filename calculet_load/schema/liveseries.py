"""The live figures of a Locust run over time (`client/live_series.jsonl`).

The Locust master (or the one local process) samples its merged live figures once a
second while a run goes on, and once more when it ends: the points the web UI's LLM tab
draws, kept in the run folder so a report can draw them too. They are the live view's
figures (log-bucket histograms, within 1 % of the exact order statistic), not the
analysis's: every figure a report judges is recomputed from the records.

Each point's latency percentiles and rates cover the `window_s` seconds before it (the
tab's "last 10 s" columns; shorter at the start of a run), so a change of load shows
within that window. `wall_ns` is the master's wall clock (to line points up with
records, rate changes and bursts; never for durations). No data is null, never 0.

The index says which schema the file follows: `client/index.json` has
`live_series: {"file": LIVE_SERIES_FILE, "schema": LIVE_SERIES_SCHEMA, "points": N}`.
The rate changes and bursts the charts mark are the index's `plan.rate_changes` (schedule
ns from `plan.origin_wall_ns`) and `bursts[].fire_at_wall_ns`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from calculet_load.schema.fs import resolve_fs
from calculet_load.schema.records import check_schema

LIVE_SERIES_SCHEMA = "calculet-live-series/v1"
LIVE_SERIES_FILE = "client/live_series.jsonl"


@dataclasses.dataclass(frozen=True, slots=True)
class LiveSeriesPoint:
    """One sample of a run's live figures, all processes together.

    ttft/tpot/itl: p50 and p99 of the successes that ended in the window, in ms (ITL
    per token); `window_requests` the requests that ended in it (failed and cancelled
    included). `output_tokens_per_s`, `requests_per_s`: over the window. `in_flight`:
    requests in flight, the latest gauge of every process (null before the first).
    `requests`, `failures`, `cancelled`: cumulative since Locust's last "Reset stats".
    `rate`: the open loop's target arrivals/s (null in a closed loop or bursts);
    `users`: Locust's user count. `final`: the point taken at the run's end.
    """

    wall_ns: int
    t_s: float  # seconds since the run started (the index's started_wall_ns)
    window_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    output_tokens_per_s: float | None
    requests_per_s: float | None
    window_requests: int
    in_flight: int | None
    requests: int
    failures: int
    cancelled: int
    users: int
    rate: float | None
    final: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LiveSeriesPoint:
        """A point read back; ValueError naming the field for a malformed row."""
        if not isinstance(doc, dict):
            raise ValueError("live series point: not a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(doc) - {"final"})
        if missing:
            raise ValueError(f"live series point: missing field {missing[0]}")
        try:
            return cls(**{k: v for k, v in doc.items() if k in names})
        except TypeError as exc:
            raise ValueError(f"live series point: {exc}") from None


def read_live_series(run_dir: str, descriptor: dict[str, Any] | None) -> list[LiveSeriesPoint]:
    """The points of a run folder, in the order written. `descriptor` is the index's
    `live_series` (None: the run has none, []). SchemaVersionError for a newer schema;
    ValueError (with the line) for a malformed one."""
    if not descriptor:
        return []
    check_schema(descriptor.get("schema"), LIVE_SERIES_SCHEMA)
    fs, root = resolve_fs(run_dir)
    path = f"{root.rstrip('/')}/{descriptor.get('file') or LIVE_SERIES_FILE}"
    with fs.open_input_stream(path) as f:
        text = bytes(f.read()).decode()
    points = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            points.append(LiveSeriesPoint.from_dict(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{LIVE_SERIES_FILE} line {n}: {exc}") from None
    return points
