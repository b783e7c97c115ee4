"""The client's self-check: did this client keep up with its load, per cell?

Three figures per cell tell how far off a process's timings can be, from its own records:

    late_bound_under_lag_ms
                   with kernel stamps (calculet_load.measure.client), the most a
                   request's first-token stamp (TTFT) can be late (ext.stamp_late_bound_ms:
                   its first token shared a read with later bytes, and arrived after the
                   read before returned), counted where a self-watch sample covering the
                   request saw this process's loop lag over SATURATED_LAG_MS, and as 0
                   elsewhere. The bound is an upper bound, not a delay: a server that
                   writes tokens in bursts (vLLM's multi-step scheduling, SGLang's stream
                   interval, the simulator's batched steps) puts its first two in one
                   read however soon the client reads, and the bound is then the prefill
                   while the stamp is exact; only a client too busy to read makes it a
                   delay. The analysis judges it the same way
                   (analysis.tables.saturation). Null with read stamps: over TLS the
                   analysis's saturation check stands alone. Per request, not per event:
                   one late pair among 64 tokens would flag most requests of a run, while
                   the ITL P99 it moves is over every token (analysis: join.coalesced)
    send_lag_ms    open loop: actual send − the schedule's instant (a late send shifts
                   the arrival law, and hides queueing from latency-from-send); not of
                   a stale retry, whose first send kept the schedule
    start_to_sent_ms
                   the start stamp t0 to the request written (t1), less a new
                   connection's connect and TLS handshake (`ext.connect_ms`, the
                   request's own wait on the network): what is left is a non-blocking
                   write, so what is more than that is the client's own wait (its loop,
                   or the interpreter lock the engine thread shares), which every
                   duration from t0 (TTFT) would carry and neither figure above sees.
                   Both engines wait on their loop only when the kernel has not
                   connected the socket by the time `connect` returns (on loopback and on
                   the same host it usually has: measure.client.connect_now); a connect
                   that waits, a TLS handshake (its round trips) and a process's first
                   name lookup keep the loop's lag in noticing them inside `connect_ms`,
                   where this figure does not see it

At the end of a Locust run the master adds up every worker's histograms; a cell whose
P99 of any of them passes the run's budget (`--accuracy-ms`, 10 ms by default) is named, and
the run exits 3 (infrastructure invalid): its figures are the client's, not the
server's. Add worker processes or lower the rate (docs/measurement.md says how to size).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from calculet_load.errors import ExitCode
from calculet_load.locust.livestats import LogHistogram
from calculet_load.locust.llmstats import cell_name
from calculet_load.schema.selfwatch import SATURATED_LAG_MS

if TYPE_CHECKING:
    from locust.env import Environment

    from calculet_load.schema.records import RequestRecord

log = logging.getLogger("calculet_load")

# each figure, with the name an error line gives it
LABELS = {
    "late_bound_under_lag_ms": "first-token late bound under loop lag",
    "send_lag_ms": "send lag",
    "start_to_sent_ms": "start to sent",
}
FIGURES = tuple(LABELS)
QUANTILE = 0.99
BUDGET_MS = 10.0
# the lagging samples' intervals kept for requests that end after them (a request's span
# is seconds at most; a run whose loop lags this often is flagged many times over)
LAGGING_KEPT = 4096


class _Late:
    """A request whose first-token late bound waits for the samples that cover it."""

    __slots__ = ("bound_ms", "cell", "end", "lagged", "t0")

    def __init__(self, cell: str, t0: int, end: int, bound_ms: float, lagged: bool) -> None:
        self.cell, self.t0, self.end, self.bound_ms, self.lagged = cell, t0, end, bound_ms, lagged


class Accuracy:
    """Per cell: histograms of the three figures over the whole run (never reset).

    The late bound is judged against this process's self-watch samples
    (`observe_sample`), as the analysis judges it: sample k covers (sample k−1, sample k]
    of the process's monotonic clock, and a request [t0, its last stamp] under any sample
    that saw loop lag over `lag_limit_ms` counts its bound; the rest count 0. A request
    that ends after the last sample waits for the next one (`_waiting`); at the end of
    the run it is judged by the samples seen (`to_wire`)."""

    def __init__(self, lag_limit_ms: float = SATURATED_LAG_MS) -> None:
        self.cells: dict[str, dict[str, LogHistogram]] = {}
        self.lag_limit_ms = lag_limit_ms
        self._since: int | None = None  # the last sample's instant: the next one's start
        self._lagging: collections.deque[tuple[int, int]] = collections.deque(
            maxlen=LAGGING_KEPT
        )  # the lagging samples' intervals (start, end], oldest first
        self._waiting: list[_Late] = []

    def _cell(self, name: str) -> dict[str, LogHistogram]:
        hists = self.cells.get(name)
        if hists is None:
            hists = self.cells[name] = {f: LogHistogram() for f in FIGURES}
        return hists

    def observe(self, record: RequestRecord) -> None:
        """One sent request (a dropped arrival was never sent: nothing to judge)."""
        e = record.ext
        if e.dropped:
            return
        cell = cell_name(record)
        hists = self._cell(cell)
        c = record.client_ns
        t0 = c.request_start
        if e.stamp_late_bound_ms is not None:
            bound = max(e.stamp_late_bound_ms, 0.0)
            if bound == 0.0 or t0 is None:
                hists["late_bound_under_lag_ms"].add(0.0)
            else:
                end = c.last_stamp() or t0
                late = _Late(cell, t0, end, bound, self._lagged(t0, end))
                if late.lagged or (self._since is not None and late.end <= self._since):
                    self._settle(late)
                else:
                    self._waiting.append(late)
        # A stale retry (its kept-alive connection was closed or reset under it) went out
        # on schedule the first time; timed from the retry, its lag is the dead
        # connection's wait (a server that restarted), not the client's.
        if e.send_lag_ms is not None and not e.stale_retry:
            hists["send_lag_ms"].add(max(e.send_lag_ms, 0.0))
        t1 = c.headers_sent
        if e.stale_retry or t0 is None or t1 is None:
            return
        if e.connection_reused:
            hists["start_to_sent_ms"].add(max(t1 - t0, 0) / 1e6)
        elif e.connect_ms is not None:  # records written before it had no connect_ms
            hists["start_to_sent_ms"].add(max((t1 - t0) / 1e6 - e.connect_ms, 0.0))

    def observe_sample(self, mono_ns: int, lag_ms: float, warmup: bool = False) -> None:
        """A self-watch sample of this process: it covers (the sample before, mono_ns],
        the first one all before it (a warm-up sample is not judged: nothing is sent
        before the warm-up ends)."""
        start, self._since = self._since, mono_ns
        lagging = not warmup and lag_ms > self.lag_limit_ms
        if lagging:
            # the first sample covers everything before it
            self._lagging.append((start if start is not None else -1, mono_ns))
        keep = []
        for late in self._waiting:
            if lagging and late.t0 <= mono_ns and (start is None or late.end > start):
                late.lagged = True
            if late.lagged or late.end <= mono_ns:
                self._settle(late)
            else:
                keep.append(late)
        self._waiting = keep

    def _lagged(self, t0: int, end: int) -> bool:
        """Whether a lagging sample seen so far covers part of [t0, end]."""
        for start, at in reversed(self._lagging):
            if at < t0:
                return False  # the older ones end before it too
            if end > start:
                return True
        return False

    def _settle(self, late: _Late) -> None:
        self._cell(late.cell)["late_bound_under_lag_ms"].add(late.bound_ms if late.lagged else 0.0)

    def to_wire(self) -> dict[str, Any]:
        """The histograms, the requests still waiting judged by the samples seen (those
        after the last sample: no sample saw lag over them)."""
        for late in self._waiting:
            self._settle(late)
        self._waiting = []
        return {
            cell: {f: h.to_wire() for f, h in hists.items() if h.count}
            for cell, hists in self.cells.items()
        }

    @classmethod
    def from_wires(cls, wires: Iterable[dict[str, Any] | None]) -> Accuracy:
        acc = cls()
        for wire in wires:
            for cell, hists in (wire or {}).items():
                mine = acc._cell(str(cell))
                for f, h in hists.items():
                    if f in mine:
                        mine[f].merge_wire(h)
        return acc

    def problems(self, budget_ms: float) -> list[str]:
        """One line per cell whose P99 of a figure passes the budget (none: it kept up)."""
        out = []
        for cell in sorted(self.cells):
            over = []
            for f, h in self.cells[cell].items():
                p = h.quantile(QUANTILE) if h.count else None
                if p is not None and p > budget_ms:
                    over.append(f"{LABELS[f]} P99 {p:.1f} ms")
            if over:
                out.append(f"{cell}: {', '.join(over)}")
        return out


def check_reports(reports: Iterable[dict[str, Any]], budget_ms: float) -> list[str]:
    """The cells over budget across the workers' end-of-run reports (`accuracy`)."""
    return Accuracy.from_wires(r.get("accuracy") for r in reports).problems(budget_ms)


def verdict_line(reports: Iterable[dict[str, Any]], budget_ms: float) -> str:
    """The self-check's verdict in one line, for the end of a run's console: whether the
    client kept up in every cell it sent requests in, or where it did not."""
    acc = Accuracy.from_wires(r.get("accuracy") for r in reports)
    judged = [cell for cell, hists in acc.cells.items() if any(h.count for h in hists.values())]
    if not judged:
        return "calculet self-check: no request was sent, so there is no timing to judge"
    problems = acc.problems(budget_ms)
    figures = ", ".join(LABELS.values())
    if not problems:
        return (
            f"calculet self-check: the client kept up in every cell ({_cells(len(judged))}: "
            f"{figures} P99 within {budget_ms:g} ms, --accuracy-ms): the timings are the "
            "server's"
        )
    return (
        f"calculet self-check: CLIENT SATURATED in {len(problems)} of {_cells(len(judged))} "
        f"(budget {budget_ms:g} ms, --accuracy-ms): {'; '.join(problems)}; the "
        "timings there are the client's, not the server's (exit 3): add worker processes "
        "or lower the load"
    )


def _cells(n: int) -> str:
    return f"{n} cell" if n == 1 else f"{n} cells"


def self_check(environment: Environment, reports: Iterable[dict[str, Any]], run_id: str) -> None:
    """At the end of a run (the master, or the one local process): the cells where the
    client could not keep up are named, and the run exits 3."""
    budget = float(getattr(environment.parsed_options, "accuracy_ms", BUDGET_MS))
    problems = check_reports(reports, budget)
    if problems:
        log.error(
            "calculet run %s: the client did not keep up (budget %g ms, --accuracy-ms) in "
            "%d cell(s): %s; its timings there are the client's, not the server's: add "
            "worker processes or lower the load (docs/measurement.md)",
            run_id,
            budget,
            len(problems),
            "; ".join(problems),
        )
        environment.process_exit_code = int(ExitCode.INFRASTRUCTURE)
