"""Time series the harness samples from the target while a run goes on (spec §10.2, §10.3).

Written by `calculet_load.target.scrape` into the run folder, read by the analysis (leaks,
report time series). Unlike the trace files of `traces.py`, the harness writes these
itself: `wall_ns` is the sampling host's wall clock (for lining rows up with records
and traces, never for durations) and `mono_ns` the sampling process's monotonic clock.
A value that could not be read is ``None`` (JSON null), never 0.
"""

from __future__ import annotations

import dataclasses

SCRAPE_SCHEMA_VERSION = 1
SERVER_METRICS_FILE = "server/metrics.jsonl"
SERVER_PROCESS_FILE = "server/process.jsonl"


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsScrapeRow:
    """One scrape of the server's Prometheus `/metrics` (`server/metrics.jsonl`).

    `samples` maps each exposed series, written as in the exposition
    (`name{label="value",...}`, or `name` alone), to its value; NaN and ±Inf are None.
    Histogram buckets (`*_bucket` series) are cumulative counters, so they are kept in
    the first row, every `bucket_every`-th row and the last row only (`buckets` says
    which): the last row minus the first is the run's distribution. `*_sum` and
    `*_count` are in every row. A failed scrape has `ok` false, `error` set and no
    samples.
    """

    wall_ns: int
    mono_ns: int
    url: str
    ok: bool
    scrape_ms: float | None
    error: str | None
    buckets: bool
    samples: dict[str, float | None]


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessRow:
    """One sample of the server's process (`server/process.jsonl`), read with psutil
    when the server runs on the sampling host.

    `rss_bytes`, `threads`, `fds` and `cpu_seconds` are the process's own (the names the
    leak analysis uses for every resource series); `tree_*` add up the process and
    every descendant (servers such as vLLM run their engine in child processes).
    `alive` is false once the process is gone; `error` says why a field is None.
    """

    wall_ns: int
    mono_ns: int
    pid: int
    alive: bool
    rss_bytes: int | None
    vms_bytes: int | None
    cpu_seconds: float | None
    cpu_percent: float | None
    threads: int | None
    fds: int | None
    children: int | None
    tree_rss_bytes: int | None
    tree_threads: int | None
    tree_fds: int | None
    error: str | None = None
