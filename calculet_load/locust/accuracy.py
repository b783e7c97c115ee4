"""The client's self-check (issue 18): did this client keep up with its load, per cell?

Three figures per cell tell how far off a process's timings can be, from its own records:

    stamp_late_bound_ms
                   with kernel stamps (calculet_load.measure.client), the most a
                   request's first-token stamp (TTFT) can be late: token events that
                   arrived while the client's loop was busy come out of one read and
                   share the stamp of its last bytes; the first arrived after the previous
                   read returned (null with read stamps: over TLS the analysis's
                   saturation check stands alone). Per request, not per event: one late
                   pair among 64 tokens would flag most requests of a run, while the ITL
                   P99 it moves is over every token (analysis: join.coalesced)
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

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from calculet_load.errors import ExitCode
from calculet_load.locust.livestats import LogHistogram
from calculet_load.locust.llmstats import cell_name

if TYPE_CHECKING:
    from locust.env import Environment

    from calculet_load.schema.records import RequestRecord

log = logging.getLogger("calculet_load")

FIGURES = ("stamp_late_bound_ms", "send_lag_ms", "start_to_sent_ms")
QUANTILE = 0.99
BUDGET_MS = 10.0


class Accuracy:
    """Per cell: histograms of the three figures over the whole run (never reset)."""

    def __init__(self) -> None:
        self.cells: dict[str, dict[str, LogHistogram]] = {}

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
        hists = self._cell(cell_name(record))
        if e.stamp_late_bound_ms is not None:
            hists["stamp_late_bound_ms"].add(max(e.stamp_late_bound_ms, 0.0))
        # A stale retry (its kept-alive connection was closed or reset under it) went out
        # on schedule the first time; timed from the retry, its lag is the dead
        # connection's wait (a server that restarted), not the client's.
        if e.send_lag_ms is not None and not e.stale_retry:
            hists["send_lag_ms"].add(max(e.send_lag_ms, 0.0))
        t0, t1 = record.client_ns.request_start, record.client_ns.headers_sent
        if e.stale_retry or t0 is None or t1 is None:
            return
        if e.connection_reused:
            hists["start_to_sent_ms"].add(max(t1 - t0, 0) / 1e6)
        elif e.connect_ms is not None:  # records written before it had no connect_ms
            hists["start_to_sent_ms"].add(max((t1 - t0) / 1e6 - e.connect_ms, 0.0))

    def to_wire(self) -> dict[str, Any]:
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
                    over.append(f"{f.removesuffix('_ms').replace('_', ' ')} P99 {p:.1f} ms")
            if over:
                out.append(f"{cell}: {', '.join(over)}")
        return out


def check_reports(reports: Iterable[dict[str, Any]], budget_ms: float) -> list[str]:
    """The cells over budget across the workers' end-of-run reports (`accuracy`)."""
    return Accuracy.from_wires(r.get("accuracy") for r in reports).problems(budget_ms)


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
