"""Pre-registered quality rules (spec §8, §9): which records enter the statistics.

Outliers are never removed for being outliers. A record leaves the measured set only
for one of these reasons, each counted:

    dropped           ext.dropped: an open-loop arrival the client never sent
    cut_at_stop       ext.cancelled_at == "run_stop": cut because the run ended
    warmup            quality.warmup: a warmup request (§8.4), not measured
    clock_incomplete  a success whose client stamps are incomplete (not quality.clock_complete)
    network_break     the request overlaps a network break: declared (network_breaks.json)
                      or detected (RTT probe rounds whose connects were lost, bursts
                      of connect timeouts / unreachable: analysis.tables.netbreaks; an
                      interval the server's restart explains is not a break)
    client_saturated  the client's self-watch saw CPU > SATURATED_CPU_PERCENT in a
                      sample covering the request; or loop lag > SATURATED_LAG_MS in
                      such a sample, unless the request is judged by its own bounds
                      (below), and then those passed SATURATED_LAG_MS
    interrupted_attempt  a record of a cell attempt that plan.json lists under "excluded"
                      ({cell, worker, reason}): the pipeline was cut in that cell and
                      ran it again on resume, so the cut attempt does not count

and a throttled record (quality.throttled, or a throttling chip in device.jsonl during
the request) is measured but reported apart (§8.7). Every record gets exactly one
partition, the first that applies in this order:

    dropped, cut_at_stop, warmup, excluded, throttled, measured

Dropped and cut-at-stop records are neither successes nor server errors. A record may
have several reasons; `QualityReport.by_reason` counts each.

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
                              shared a read with later bytes)
    start to sent             t1 − t0, less a new connection's ext.connect_ms: how long
                              the client held the request between its start stamp and
                              its write, which every duration from t0 carries (not of a
                              stale retry: its start was the first attempt's)

A closed-loop request is not: how soon its user sends the next one is the loop's, and
no figure of the request says it, so loop lag still judges it (a client that could not
keep its users' requests going is the bottleneck of the cell's throughput, however
exact each stamp). A request judged by its own bounds under a sample that saw only loop
lag is counted (`QualityReport.lag_judged_by_own_bounds`), so the verdict can say why
it was not flagged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.errors import ArtifactError
from analysis.tables.join import BoolArray, FloatArray, IntArray
from analysis.tables.load import NetworkBreak, RunData
from analysis.tables.netbreaks import detect_breaks
from calculet_load.schema.clocks import to_reference_ns
from calculet_load.schema.selfwatch import SATURATED_CPU_PERCENT, SATURATED_LAG_MS

__all__ = [
    "QUALITY_COLUMNS",
    "Partition",
    "QualityReport",
    "Reason",
    "apply_quality",
]


class Reason(StrEnum):
    DROPPED = "dropped"
    CUT_AT_STOP = "cut_at_stop"
    WARMUP = "warmup"
    CLOCK_INCOMPLETE = "clock_incomplete"
    NETWORK_BREAK = "network_break"
    CLIENT_SATURATED = "client_saturated"
    INTERRUPTED_ATTEMPT = "interrupted_attempt"


class Partition(StrEnum):
    DROPPED = "dropped"
    CUT_AT_STOP = "cut_at_stop"
    WARMUP = "warmup"
    EXCLUDED = "excluded"
    THROTTLED = "throttled"
    MEASURED = "measured"


QUALITY_COLUMNS: dict[str, pa.DataType] = {
    "quality.partition": pa.string(),
    "quality.reasons": pa.string(),
    "quality.client_saturated": pa.bool_(),
}
"""Columns `apply_quality` adds: the record's partition, its reasons joined by ";"
(null when none) and its self-watch flag."""

_EXCLUDING = (
    Reason.CLOCK_INCOMPLETE,
    Reason.NETWORK_BREAK,
    Reason.CLIENT_SATURATED,
    Reason.INTERRUPTED_ATTEMPT,
)


@dataclass(frozen=True, slots=True)
class QualityReport:
    """Counts of the quality step. `sent` = records minus dropped arrivals."""

    records: int
    sent: int
    successes: int
    by_reason: dict[str, int]
    by_partition: dict[str, int]
    clock_incomplete_successes: int
    saturated: int
    selfwatch_samples: int
    workers_without_selfwatch: tuple[str, ...]
    network_break_records: int
    thresholds: dict[str, float] = field(default_factory=dict)
    selfwatch_warmup_samples: int = 0  # of selfwatch_samples: start-up, not judged
    # every break, declared and detected, with its evidence and the records it holds;
    # then the intervals set aside as a server restart (source "server_restart", 0 records)
    network_breaks: tuple[dict[str, object], ...] = ()
    # the judged self-watch samples that saw the client saturated, the longest loop lag
    # first: {worker, mono_ns, loop_lag_ms, cpu_percent} (what the verdict names)
    saturated_samples: tuple[dict[str, Any], ...] = ()
    # records judged by their own bounds (open loop, the kernel's stamps) that a
    # loop-lag-only sample covered; of all records, those flagged by their own bounds
    # (and by no CPU sample)
    lag_judged_by_own_bounds: int = 0
    saturated_by_own_bounds: int = 0


def _bools(table: pa.Table, name: str) -> BoolArray:
    col = pc.fill_null(table.column(name), False)
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=bool)


def _ints(table: pa.Table, name: str) -> tuple[IntArray, BoolArray]:
    col = table.column(name)
    ok = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)
    v = np.asarray(pc.fill_null(col, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    return v, ok


def _span(d: pa.Table) -> tuple[IntArray, IntArray, BoolArray]:
    """[t0, last stamp] of each request on its worker's monotonic clock."""
    t0, ok = _ints(d, "client_ns.request_start")
    end = t0.copy()
    for name in ("headers_sent", "response_headers", "first_event", "first_token"):
        v, m = _ints(d, f"client_ns.{name}")
        end = np.where(m, np.maximum(end, v), end)
    for name in ("last_token", "response_end"):
        v, m = _ints(d, f"client_ns.{name}")
        end = np.where(m, np.maximum(end, v), end)
    return t0, end, ok


def _floats(table: pa.Table, name: str) -> FloatArray:
    """A float column, NaN where null: a comparison with NaN is False, so a figure the
    record does not have passes no limit."""
    col = pc.fill_null(pc.cast(table.column(name), pa.float64()), np.nan)
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)


def _own_bounds(d: pa.Table, limit_ms: float) -> tuple[BoolArray, BoolArray]:
    """(which requests are judged by their own bounds: the kernel's stamps and an open
    loop's schedule, which of those passed `limit_ms`: the send lag, start to sent, or
    the first token's late bound)."""
    kernel = np.asarray(
        pc.fill_null(pc.equal(d.column("ext.stamp_source"), "kernel"), False).to_numpy(
            zero_copy_only=False
        ),
        dtype=bool,
    )
    lag = _floats(d, "ext.send_lag_ms")
    # a stale retry's start and send are its retry's; its first send kept the schedule
    retry = _bools(d, "ext.stale_retry")
    t0, t0_ok = _ints(d, "client_ns.request_start")
    t1, t1_ok = _ints(d, "client_ns.headers_sent")
    # start to sent, less a new connection's connect; NaN (not judged, as in the Locust
    # self-check) for a new connection whose connect was not recorded (records from
    # before ext.connect_ms)
    connect = np.where(_bools(d, "ext.connection_reused"), 0.0, _floats(d, "ext.connect_ms"))
    held_ms = np.where(t0_ok & t1_ok, (t1 - t0) / 1e6, np.nan) - connect
    over = (_floats(d, "ext.stamp_late_bound_ms") > limit_ms) | (
        ~retry & ((lag > limit_ms) | (held_ms > limit_ms))
    )
    judged = kernel & ~np.isnan(lag)
    return judged, judged & over


def _saturation(
    run: RunData, lag_ms: float, cpu_percent: float
) -> tuple[BoolArray, tuple[str, ...], tuple[dict[str, Any], ...], int, int]:
    """(flagged records, workers without samples, the saturated samples worst first,
    records judged by their own bounds that a loop-lag-only sample covered, records
    flagged by their own bounds)."""
    d = run.requests
    n = d.num_rows
    by_cpu = np.zeros(n, dtype=bool)
    by_lag = np.zeros(n, dtype=bool)
    t0, end, ok = _span(d)
    workers = np.asarray(d.column("ext.worker").fill_null("").to_numpy(zero_copy_only=False))
    sw = run.selfwatch
    if "warmup" in sw.column_names:
        sw = sw.filter(pc.invert(pc.fill_null(sw.column("warmup"), False)))
    sw_workers = np.asarray(sw.column("worker").fill_null("").to_numpy(zero_copy_only=False))
    mono, _ = _ints(sw, "mono_ns")
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
    judged, own = _own_bounds(d, lag_ms)
    flagged = by_cpu | (by_lag & ~judged) | own
    spared = int(np.count_nonzero(by_lag & judged & ~by_cpu))
    return flagged, tuple(without), seen, spared, int(np.count_nonzero(own & ~by_cpu))


def _warmup_samples(run: RunData) -> int:
    sw = run.selfwatch
    if "warmup" not in sw.column_names:
        return 0
    return int(pc.sum(pc.fill_null(sw.column("warmup"), False).cast(pa.int64())).as_py() or 0)


def _network_breaks(run: RunData, breaks: list[NetworkBreak], counts: list[int]) -> BoolArray:
    """Records overlapping any of `breaks`; `counts` gets each break's own count."""
    d = run.requests
    hit = np.zeros(d.num_rows, dtype=bool)
    if not breaks:
        return hit
    anchor, ok = _ints(d, "ext.wall_anchor_ns")
    t0, end, t_ok = _span(d)
    offset = np.zeros(d.num_rows, dtype=np.int64)
    workers = np.asarray(d.column("ext.worker").fill_null("").to_numpy(zero_copy_only=False))
    for w, off in run.client_offsets_ns.items():
        offset[workers == w] = off
    start = to_reference_ns(anchor, offset)  # on the reference clock, as the breaks are
    stop = start + np.where(t_ok, end - t0, 0)
    for b in breaks:
        inside = ok & (start <= b.end_wall_ns) & (stop >= b.start_wall_ns)
        counts.append(int(np.count_nonzero(inside)))
        hit |= inside
    return hit


def _interrupted(run: RunData) -> BoolArray:
    """Records of the cell attempts plan.json excludes: `excluded` entries name a cell
    (`ext.cell`) and the worker that ran the cut attempt (`ext.worker`; an entry
    without a worker excludes the cell's records of every worker)."""
    d = run.requests
    hit = np.zeros(d.num_rows, dtype=bool)
    entries = (run.plan or {}).get("excluded") or []
    where = f"{run.uri.rstrip('/')}/plan.json"
    if not isinstance(entries, list):
        raise ArtifactError(f"{where}: excluded: expected a list")
    if not entries:
        return hit
    cells = np.asarray(d.column("ext.cell").fill_null("").to_numpy(zero_copy_only=False))
    workers = np.asarray(d.column("ext.worker").fill_null("").to_numpy(zero_copy_only=False))
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("cell"), str):
            raise ArtifactError(f"{where}: excluded[{i}]: expected {{cell, worker, reason}}")
        mask = cells == e["cell"]
        if e.get("worker") is not None:
            mask &= workers == str(e["worker"])
        hit |= mask
    return hit


def apply_quality(
    run: RunData,
    *,
    lag_ms: float = SATURATED_LAG_MS,
    cpu_percent: float = SATURATED_CPU_PERCENT,
) -> tuple[pa.Table, QualityReport]:
    """The joined requests with QUALITY_COLUMNS added, and the counts."""
    d = run.requests
    n = d.num_rows
    dropped = _bools(d, "ext.dropped")
    cut = np.asarray(
        pc.fill_null(pc.equal(d.column("ext.cancelled_at"), "run_stop"), False).to_numpy(
            zero_copy_only=False
        ),
        dtype=bool,
    )
    success = np.asarray(pc.is_null(d.column("ext.error_class")).to_numpy(), dtype=bool)
    success &= ~dropped
    saturated, without, saturated_samples, spared, own = _saturation(run, lag_ms, cpu_percent)
    saturated &= ~dropped
    detected = detect_breaks(run)
    breaks = [*run.network_breaks, *detected.breaks]
    in_break: list[int] = []
    reasons: dict[Reason, BoolArray] = {
        Reason.DROPPED: dropped,
        Reason.CUT_AT_STOP: cut & ~dropped,
        Reason.WARMUP: _bools(d, "quality.warmup") & ~dropped,
        Reason.CLOCK_INCOMPLETE: success & ~_bools(d, "quality.clock_complete"),
        Reason.NETWORK_BREAK: _network_breaks(run, breaks, in_break) & ~dropped,
        Reason.CLIENT_SATURATED: saturated,
        Reason.INTERRUPTED_ATTEMPT: _interrupted(run) & ~dropped,
    }
    excluded = np.zeros(n, dtype=bool)
    for r in _EXCLUDING:
        excluded |= reasons[r]
    throttled = _bools(d, "quality.throttled")
    partition = np.full(n, Partition.MEASURED.value, dtype=object)
    for part, mask in reversed(
        (
            (Partition.DROPPED, reasons[Reason.DROPPED]),
            (Partition.CUT_AT_STOP, reasons[Reason.CUT_AT_STOP]),
            (Partition.WARMUP, reasons[Reason.WARMUP]),
            (Partition.EXCLUDED, excluded),
            (Partition.THROTTLED, throttled),
        )
    ):
        partition[mask] = part.value
    labelled = [pc.if_else(pa.array(mask), r.value, "") for r, mask in reasons.items()]
    # (pyarrow 26 returns an empty array from null_handling="skip" when every input
    # is null: join with empties instead, then squeeze the separators)
    joined = pc.binary_join_element_wise(*labelled, ";")
    joined = pc.utf8_trim(pc.replace_substring_regex(joined, ";+", ";"), ";")
    joined = pc.if_else(pc.equal(joined, ""), pa.scalar(None, pa.string()), joined)
    table = (
        d.append_column("quality.partition", pa.array(partition, type=pa.string()))
        .append_column("quality.reasons", joined)
        .append_column("quality.client_saturated", pa.array(saturated, type=pa.bool_()))
    )
    parts, counts = np.unique(partition.astype(str), return_counts=True)
    report = QualityReport(
        records=n,
        sent=int(n - np.count_nonzero(dropped)),
        successes=int(np.count_nonzero(success)),
        by_reason={r.value: int(np.count_nonzero(m)) for r, m in reasons.items()},
        by_partition={str(p): int(c) for p, c in zip(parts, counts, strict=True)},
        clock_incomplete_successes=int(np.count_nonzero(reasons[Reason.CLOCK_INCOMPLETE])),
        saturated=int(np.count_nonzero(saturated)),
        selfwatch_samples=run.selfwatch.num_rows,
        workers_without_selfwatch=without,
        network_break_records=int(np.count_nonzero(reasons[Reason.NETWORK_BREAK])),
        thresholds={"saturated_lag_ms": lag_ms, "saturated_cpu_percent": cpu_percent},
        selfwatch_warmup_samples=_warmup_samples(run),
        network_breaks=tuple(
            {**b.model_dump(), "evidence": list(b.evidence), "records": n}
            for b, n in zip(breaks, in_break, strict=True)
        )
        + tuple(x.to_json() for x in detected.set_aside),
        saturated_samples=saturated_samples,
        lag_judged_by_own_bounds=spared,
        saturated_by_own_bounds=own,
    )
    return table, report
