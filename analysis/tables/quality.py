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
                      such a sample, unless the request is judged by its own bounds,
                      and then those passed SATURATED_LAG_MS, or its closed-loop
                      cell's hold of its users passed its limits (analysis.tables.saturation)
    interrupted_attempt  a record of a cell attempt that plan.json lists under "excluded"
                      ({cell, worker, reason}): the pipeline was cut in that cell and
                      ran it again on resume, so the cut attempt does not count

and a throttled record (quality.throttled, or a throttling chip in device.jsonl during
the request) is measured but reported apart (§8.7). Every record gets exactly one
partition, the first that applies in this order:

    dropped, cut_at_stop, warmup, excluded, throttled, measured

Dropped and cut-at-stop records are neither successes nor server errors. A record may
have several reasons; `QualityReport.by_reason` counts each.

The client_saturated rule (which self-watch samples flag which requests, and the
requests judged by their own bounds or their closed-loop cell's hold instead) is
analysis.tables.saturation's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.errors import ArtifactError
from analysis.tables.columns import bools, ints, span
from analysis.tables.join import BoolArray
from analysis.tables.load import NetworkBreak, RunData
from analysis.tables.netbreaks import detect_breaks
from analysis.tables.saturation import judge_saturation, warmup_samples
from calculet_load.schema.clocks import to_reference_ns
from calculet_load.schema.selfwatch import (
    HELD_SHARE_LIMIT,
    SATURATED_CPU_PERCENT,
    SATURATED_LAG_MS,
)

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
    # each closed-loop cell and worker judged by its hold, most held first: {cell,
    # worker, records, mean_hold_ms, held_share, held}
    closed_loop_holds: tuple[dict[str, Any], ...] = ()


def _network_breaks(run: RunData, breaks: list[NetworkBreak], counts: list[int]) -> BoolArray:
    """Records overlapping any of `breaks`; `counts` gets each break's own count."""
    d = run.requests
    hit = np.zeros(d.num_rows, dtype=bool)
    if not breaks:
        return hit
    anchor, ok = ints(d, "ext.wall_anchor_ns")
    t0, end, t_ok = span(d)
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
    held_share: float = HELD_SHARE_LIMIT,
) -> tuple[pa.Table, QualityReport]:
    """The joined requests with QUALITY_COLUMNS added, and the counts."""
    d = run.requests
    n = d.num_rows
    dropped = bools(d, "ext.dropped")
    cut = np.asarray(
        pc.fill_null(pc.equal(d.column("ext.cancelled_at"), "run_stop"), False).to_numpy(
            zero_copy_only=False
        ),
        dtype=bool,
    )
    success = np.asarray(pc.is_null(d.column("ext.error_class")).to_numpy(), dtype=bool)
    success &= ~dropped
    sat = judge_saturation(run, lag_ms, cpu_percent, held_share)
    saturated = sat.flagged & ~dropped
    detected = detect_breaks(run)
    breaks = [*run.network_breaks, *detected.breaks]
    in_break: list[int] = []
    reasons: dict[Reason, BoolArray] = {
        Reason.DROPPED: dropped,
        Reason.CUT_AT_STOP: cut & ~dropped,
        Reason.WARMUP: bools(d, "quality.warmup") & ~dropped,
        Reason.CLOCK_INCOMPLETE: success & ~bools(d, "quality.clock_complete"),
        Reason.NETWORK_BREAK: _network_breaks(run, breaks, in_break) & ~dropped,
        Reason.CLIENT_SATURATED: saturated,
        Reason.INTERRUPTED_ATTEMPT: _interrupted(run) & ~dropped,
    }
    excluded = np.zeros(n, dtype=bool)
    for r in _EXCLUDING:
        excluded |= reasons[r]
    throttled = bools(d, "quality.throttled")
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
        workers_without_selfwatch=sat.without,
        network_break_records=int(np.count_nonzero(reasons[Reason.NETWORK_BREAK])),
        thresholds={
            "saturated_lag_ms": lag_ms,
            "saturated_cpu_percent": cpu_percent,
            "held_share": held_share,
        },
        selfwatch_warmup_samples=warmup_samples(run),
        network_breaks=tuple(
            {**b.model_dump(), "evidence": list(b.evidence), "records": n}
            for b, n in zip(breaks, in_break, strict=True)
        )
        + tuple(x.to_json() for x in detected.set_aside),
        saturated_samples=sat.samples,
        lag_judged_by_own_bounds=sat.spared,
        saturated_by_own_bounds=sat.own,
        closed_loop_holds=sat.holds,
    )
    return table, report
