"""When the client itself was the bottleneck: which requests the quality step flags
`client_saturated` (analysis.tables.quality).

Self-watch sample k of a worker covers (mono_{k−1}, mono_k] of that worker's monotonic
clock (the first covers one median interval before it); a request of that worker is
flagged when any sample covering part of [t0, its last stamp] is saturated. Requests of
a worker without samples are not flagged by samples: that is reported as no data, not
as clean.

Samples marked `warmup` (the worker's start-up, before its prompts, tokenization and
connections were ready; calculet_load.measure.selfwatch) are left out first: the worker sends
nothing until its warm-up ends, and it closes the warm-up with a sample, so the judged
samples cover every request and no start-up work.

Loop lag (how late the self-watch's timer fired on the worker's gevent loop) bounds how
late a stamp taken on that loop can be, and how late the loop sends a request. Neither
holds for an open-loop request whose stamps are the kernel's receive times of its bytes
(SO_TIMESTAMPNS: both I/O engines on plain sockets, the thread engine over TLS too): its
stamps wait for no loop, and its send is timed against its schedule. Such a request
(ext.stamp_source "kernel" and ext.send_lag_ms recorded) is judged by its own bounds
instead, which the client records for it (calculet_load.locust.accuracy checks the same
figures per cell at the end of a Locust run):

    ext.send_lag_ms           its send against its schedule (not of a stale retry: its
                              first send kept the schedule)
    ext.stamp_late_bound_ms   the most its first-token stamp can be late (its first token
                              shared a read with later bytes), under a sample that saw
                              loop lag only (below)
    start to sent             t1 − t0, less a new connection's ext.connect_ms: how long
                              the client held the request between its start stamp and
                              its write, which every duration from t0 carries (not of a
                              stale retry: its start was the first attempt's)

The send lag and start to sent are delays the client measured; the late bound is not.
It is the time from the read before to the kernel's stamp of the read that carried the
first token with later bytes: the most that token can have waited, when it arrived just
after the read before. A server that writes two events back to back after its prefill
(the simulator's batched steps do; so does a chat stream's role chunk and first token)
puts them in one read however soon the client reads, and the bound is then the prefill
(7.3 ms in one fresh clone's crosstalk cell of a quiet serial test) while the stamp is
exact. So a late bound over the limit flags a request only under a self-watch sample
that saw the client's loop lag over it (the Locust run's self-check counts the bound in
its cell's P99 the same way: calculet_load.locust.accuracy).

A closed-loop request is judged by its cell's hold as well: how soon its user sends the
next one is the client's too, and a client that could not keep its users' requests
going is the bottleneck of the cell's throughput, however exact each stamp. The client
records that hold on each request (ext.turnaround_ms: its send to t0, t6 to the outcome
back in the user's hands); per cell and worker, the mean hold and its share of the
users' time Σ turnaround / Σ (t6 − t0 + turnaround), by which the streams the server
had fell short of the cell's (Little's law). A closed-loop kernel-stamped request is
flagged when its cell and worker passed both (mean over SATURATED_LAG_MS, share over
HELD_SHARE_LIMIT), or its own start to sent passed SATURATED_LAG_MS (its late bound:
as above).

Both figures are needed. A client stopped 100 ms in every 110 held its users 96 ms a
request, 88 % of their time. 256 streams of 680-ms requests are held 12 ms a request by
their waves, 1.7 %: the server's request rate does not show it. A cell of 1-ms requests
is held 0.7 ms, 56 %: any client's round trip (the reference client's is 0.13 ms) is a
large share of a request that short, which the cell's workload chose, not a stall.

Before, loop lag judged the closed loop: one 1-Hz sample over 5 ms (one stall of the
loop, which the next requests' holds show or not) flagged a second of records, so one
sample decided a run's exit code. A closed-loop request without a turnaround in its
cell (records from before it) is still judged by loop lag. The requests judged by their
own bounds or their cell's hold under a sample that saw only loop lag are counted
(`QualityReport.lag_judged_by_own_bounds`), so the verdict can say why they were not
flagged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.tables.cellkey import rows_by_cell
from analysis.tables.columns import bools, floats, ints, span
from analysis.tables.join import BoolArray
from analysis.tables.load import RunData

__all__ = ["Saturation", "judge_saturation", "warmup_samples"]


def _own_bounds(d: pa.Table, limit_ms: float, own: BoolArray) -> tuple[BoolArray, BoolArray]:
    """(which open-loop requests are judged by their own bounds: the kernel's stamps and
    an open loop's schedule, which of those passed `limit_ms`: the send lag, or `own`,
    the bounds every kernel-stamped request has)."""
    lag = floats(d, "ext.send_lag_ms")
    judged = _kernel_stamped(d) & ~np.isnan(lag)
    over = own | (~bools(d, "ext.stale_retry") & (lag > limit_ms))
    return judged, judged & over


def _kernel_stamped(d: pa.Table) -> BoolArray:
    return np.asarray(
        pc.fill_null(pc.equal(d.column("ext.stamp_source"), "kernel"), False).to_numpy(
            zero_copy_only=False
        ),
        dtype=bool,
    )


def _direct(d: pa.Table, limit_ms: float) -> BoolArray:
    """Start to sent over `limit_ms` (not of a stale retry: its start was the first
    attempt's): how long the client held the request between its start stamp and its
    write, which every duration from t0 carries."""
    retry = bools(d, "ext.stale_retry")
    t0, t0_ok = ints(d, "client_ns.request_start")
    t1, t1_ok = ints(d, "client_ns.headers_sent")
    # less a new connection's connect; NaN (not judged, as in the Locust self-check) for a
    # new connection whose connect was not recorded (records from before ext.connect_ms)
    connect = np.where(bools(d, "ext.connection_reused"), 0.0, floats(d, "ext.connect_ms"))
    held_ms = np.where(t0_ok & t1_ok, (t1 - t0) / 1e6, np.nan) - connect
    return ~retry & (held_ms > limit_ms)


def _late(d: pa.Table, limit_ms: float) -> BoolArray:
    """The first token's late bound over `limit_ms`: an upper bound, not a delay (see the
    module's docstring), so it flags only where a sample saw the client's loop lag."""
    return floats(d, "ext.stamp_late_bound_ms") > limit_ms


def _closed_loop_holds(
    d: pa.Table, limit_ms: float, share_limit: float, own: BoolArray
) -> tuple[BoolArray, BoolArray, tuple[dict[str, Any], ...]]:
    """(which closed-loop requests are judged by their cell's hold and their own bounds,
    which of those are flagged, each judged cell and worker's hold, most held first).

    A closed-loop user sends its next request when the client hands the last one back:
    `ext.turnaround_ms` is the client's time around a request (its send to t0, t6 to the
    outcome back). Per cell and worker, over the requests that have it: the mean hold
    and the share of the users' time it took, Σ turnaround / Σ (t6 − t0 + turnaround),
    by which the streams the server had fell short of the cell's (Little's law). The
    cell and worker is held when both pass: the mean over `limit_ms` (the bound the
    stamps have) and the share over `share_limit`. Every closed-loop request of it is
    then flagged; so is one whose own bounds passed (`own`: start to sent, or the first
    token's late bound under a sample that saw loop lag)."""
    n = d.num_rows
    judged = np.zeros(n, dtype=bool)
    over = np.zeros(n, dtype=bool)
    arrival = np.asarray(d.column("ext.arrival").fill_null("").to_numpy(zero_copy_only=False))
    closed = np.flatnonzero((arrival == "closed") & _kernel_stamped(d))
    if closed.size == 0 or "ext.turnaround_ms" not in d.column_names:
        return judged, over, ()
    turn = floats(d, "ext.turnaround_ms")
    t0, t0_ok = ints(d, "client_ns.request_start")
    t6, t6_ok = ints(d, "client_ns.response_end")
    has = ~np.isnan(turn) & t0_ok & t6_ok
    busy = np.where(has, (t6 - t0) / 1e6, 0.0)
    holds: list[dict[str, Any]] = []
    for (key, (worker,)), rows in rows_by_cell(d, closed, ("ext.worker",)).items():
        kept = rows[has[rows]]
        if kept.size == 0:
            continue  # no turnaround (records from before it): loop lag judges them
        held_ms = float(turn[kept].sum())
        share = held_ms / (held_ms + float(busy[kept].sum()))
        mean = held_ms / kept.size
        flagged = mean > limit_ms and share > share_limit
        judged[rows] = True
        over[rows] = flagged
        holds.append(
            {
                "cell": key.label,
                "worker": worker,
                "records": int(kept.size),
                "mean_hold_ms": round(mean, 3),
                "held_share": round(share, 4),
                "held": flagged,
            }
        )
    over |= judged & own
    holds.sort(key=lambda h: -h["held_share"])
    return judged, over, tuple(holds)


@dataclass(frozen=True, slots=True)
class Saturation:
    flagged: BoolArray
    without: tuple[str, ...]  # workers without samples
    samples: tuple[dict[str, Any], ...]  # the saturated samples, worst first
    spared: int  # judged by their own bounds (or their cell's hold), under a lag-only sample
    own: int  # flagged by their own bounds or their cell's hold, by no CPU sample
    holds: tuple[dict[str, Any], ...]  # each closed-loop cell and worker's hold


def judge_saturation(
    run: RunData, lag_ms: float, cpu_percent: float, held_share: float
) -> Saturation:
    """Which of `run`'s requests the client's saturation flags, and why: by a self-watch
    sample (CPU over `cpu_percent`, loop lag over `lag_ms` for a request judged by
    neither its own bounds nor its cell's hold), its own bounds over `lag_ms`, or its
    closed-loop cell's hold (`held_share`)."""
    d = run.requests
    n = d.num_rows
    by_cpu = np.zeros(n, dtype=bool)
    by_lag = np.zeros(n, dtype=bool)
    t0, end, ok = span(d)
    workers = np.asarray(d.column("ext.worker").fill_null("").to_numpy(zero_copy_only=False))
    sw = run.selfwatch
    if "warmup" in sw.column_names:
        sw = sw.filter(pc.invert(pc.fill_null(sw.column("warmup"), False)))
    sw_workers = np.asarray(sw.column("worker").fill_null("").to_numpy(zero_copy_only=False))
    mono, _ = ints(sw, "mono_ns")
    lag = np.nan_to_num(
        np.asarray(pc.fill_null(sw.column("loop_lag_ms"), 0.0).to_numpy(zero_copy_only=False)),
        nan=0.0,
    )
    cpu = np.asarray(
        pc.fill_null(sw.column("cpu_percent"), 0.0).to_numpy(zero_copy_only=False),
        dtype=np.float64,
    )
    lagging, busy = lag > lag_ms, cpu > cpu_percent
    bad = lagging | busy
    worst_first = np.flatnonzero(bad)[np.argsort(-lag[bad], kind="stable")]
    seen = tuple(
        {
            "worker": str(sw_workers[i]),
            "mono_ns": int(mono[i]),
            "loop_lag_ms": float(lag[i]),
            "cpu_percent": float(cpu[i]),
        }
        for i in worst_first
    )
    without = []
    for w in sorted(set(workers[ok].tolist())):  # a set: np.unique sorts 1 M objects
        rows = np.flatnonzero(sw_workers == w)
        req = np.flatnonzero((workers == w) & ok)
        if rows.size == 0:
            without.append(str(w))
            continue
        order = rows[np.argsort(mono[rows], kind="stable")]
        m = mono[order]
        first = m[0] - (int(np.median(np.diff(m))) if m.size > 1 else 1_000_000_000)
        lo = np.searchsorted(m, t0[req], side="left")
        hi = np.minimum(np.searchsorted(m, end[req], side="left"), m.size - 1)
        covered = (lo < m.size) & (end[req] > first)
        lo_c = np.minimum(lo, m.size - 1)
        for flags, b in ((by_cpu, busy[order]), (by_lag, lagging[order])):
            cum = np.concatenate(([0], np.cumsum(b)))
            flags[req] = covered & (cum[hi + 1] - cum[lo_c] > 0)
    # the bounds every kernel-stamped request has: start to sent, and the late bound
    # where a sample saw loop lag
    bounds = _direct(d, lag_ms) | (by_lag & _late(d, lag_ms))
    judged, own = _own_bounds(d, lag_ms, bounds)
    closed, held, holds = _closed_loop_holds(d, lag_ms, held_share, bounds)
    judged |= closed
    own |= held
    return Saturation(
        flagged=by_cpu | (by_lag & ~judged) | own,
        without=tuple(without),
        samples=seen,
        spared=int(np.count_nonzero(by_lag & judged & ~by_cpu)),
        own=int(np.count_nonzero(own & ~by_cpu)),
        holds=holds,
    )


def warmup_samples(run: RunData) -> int:
    sw = run.selfwatch
    if "warmup" not in sw.column_names:
        return 0
    return int(pc.sum(pc.fill_null(sw.column("warmup"), False).cast(pa.int64())).as_py() or 0)
