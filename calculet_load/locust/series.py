"""A run's live figures over time: one point a second, for the LLM tab's charts and for
`client/live_series.jsonl` (its shape: calculet_load.schema.liveseries).

The master (or the one local process) takes a point from its merged `LLMTable` and
`LiveStats` at each tick, and one more when the run ends. The web UI reads the last
`KEEP` points (an hour) from memory; the file keeps them all, appended as they are taken
(an object store gets the whole file rewritten every `FLUSH_S` and at the end:
calculet_load.target.scrape.JsonlAppender). A file that cannot be written is logged
once and left: the points stay on view, and the records are untouched.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import pyarrow.fs as pafs

from calculet_load.locust.livestats import LiveStats
from calculet_load.locust.llmstats import AGGREGATED, LLMTable
from calculet_load.schema.fs import resolve_fs
from calculet_load.schema.liveseries import LIVE_SERIES_FILE, LIVE_SERIES_SCHEMA, LiveSeriesPoint
from calculet_load.target.scrape import JsonlAppender

log = logging.getLogger("calculet_load")

KEEP = 3600  # points in memory: an hour at one a second
SERIES_METRICS = ("ttft_ms", "tpot_ms", "itl_ms")
FLUSH_S = 30.0


def point_of(
    table: LLMTable,
    live: LiveStats | None,
    *,
    wall_ns: int,
    started_wall_ns: int,
    users: int,
    rate: float | None,
    final: bool = False,
) -> LiveSeriesPoint:
    """The live figures now: percentiles and rates over the table's window, counts
    since its last reset, the in-flight gauges of every process."""
    recent = table.entries(recent=True, metrics=SERIES_METRICS)[AGGREGATED]
    total = table.entries(metrics=())[AGGREGATED].counts
    # two order statistics each, not figures()' six: this runs every second on the
    # master's loop (a local run's too)
    ttft, tpot, itl = (
        {"p50": recent.hist[m].quantile(0.5), "p99": recent.hist[m].quantile(0.99)}
        for m in SERIES_METRICS
    )
    return LiveSeriesPoint(
        wall_ns=wall_ns,
        t_s=round((wall_ns - started_wall_ns) / 1e9, 3),
        window_s=round(table.span_s(recent=True), 3),
        ttft_p50_ms=_f(ttft["p50"]),
        ttft_p99_ms=_f(ttft["p99"]),
        tpot_p50_ms=_f(tpot["p50"]),
        tpot_p99_ms=_f(tpot["p99"]),
        itl_p50_ms=_f(itl["p50"]),
        itl_p99_ms=_f(itl["p99"]),
        output_tokens_per_s=_f(table.per_s(recent, "output_tokens", recent=True)),
        requests_per_s=_f(table.per_s(recent, "requests", recent=True)),
        window_requests=recent.counts["requests"],
        in_flight=sum(live.in_flight.values()) if live is not None and live.in_flight else None,
        requests=total["requests"],
        failures=total["failures"],
        cancelled=total["cancelled"],
        users=users,
        rate=rate,
        final=final,
    )


def _f(value: float | int | None) -> float | None:
    """Three decimals are below the histograms' 1 %: a shorter file, the same figure."""
    return None if value is None else round(float(value), 3)


class LiveSeries:
    """The points of the current run: the last `keep` in memory, all in the run folder."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self.points: collections.deque[tuple[int, LiveSeriesPoint]] = collections.deque(maxlen=keep)
        self.seq = 0  # the number of points taken this run: the next one's is seq + 1
        self.closed = True
        self._file: JsonlAppender | None = None
        self._written = 0
        self._file_error: str | None = None

    def start(self, run_dir: str) -> None:
        """A new run: no points, a new file in its folder."""
        self.close()
        self.points.clear()
        self.seq, self._written, self._file_error = 0, 0, None
        self.closed = False
        try:
            # the folder's index is this run's from now on, and so is its series (a web
            # UI run started again with the same --run-dir does not append to the last)
            fs, root = resolve_fs(run_dir)
            path = f"{root.rstrip('/')}/{LIVE_SERIES_FILE}"
            if fs.get_file_info(path).type == pafs.FileType.File:
                fs.delete_file(path)
            self._file = JsonlAppender(run_dir, LIVE_SERIES_FILE, flush_s=FLUSH_S)
        except OSError as exc:
            self._failed(exc)

    def add(self, point: LiveSeriesPoint) -> None:
        self.seq += 1
        self.points.append((self.seq, point))
        if self._file is None:
            return
        try:
            self._file.add(point)
            self._written += 1
        except OSError as exc:
            self._failed(exc)

    def close(self) -> None:
        """The run ended: the file complete (an object store's written whole)."""
        self.closed = True
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._failed(exc)
            self._file = None

    def _failed(self, exc: OSError) -> None:
        self._file_error = f"{type(exc).__name__}: {exc}"
        log.error(
            "calculet: cannot write %s (%s): the live series stays on view, the records "
            "are not affected",
            LIVE_SERIES_FILE,
            self._file_error,
        )
        self._file = None

    def since(self, seq: int) -> list[dict[str, Any]]:
        """The points after point `seq` still in memory, oldest first, each with its seq."""
        return [{"seq": n, **p.to_dict()} for n, p in self.points if n > seq]

    def descriptor(self) -> dict[str, Any]:
        """What the index says of the file (None-free: the reader's contract)."""
        out: dict[str, Any] = {
            "file": LIVE_SERIES_FILE,
            "schema": LIVE_SERIES_SCHEMA,
            "points": self._written,
        }
        if self._file_error is not None:
            out["error"] = self._file_error
        return out
