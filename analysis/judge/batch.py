# size: §7: lane fill, interactive SLA and throughput per compiled batch, with rules
"""Batch artifacts (spec §7): how full the compiled batch ran, what that cost and bought.

A compiled batch of B lanes runs every decode step with B lanes whether 1 or B of them
carry a sequence. From `server/steps.jsonl` (one row per request and step; rows sharing
a `job_id` ran in the same device step), for decode steps only (a prefill runs one
sequence):

    active_lanes(step) = rows of the step (its job_id)
    fill_ratio         = active_lanes / compiled_batch
    lane_waste         = 1 − useful_lane_steps / total_lane_steps
                         useful: lanes of requests that succeeded; total: B per step
    effective_tokens_s = successful generated tokens / wall time      (per cell)
                         wall time: the cell's first request start to its last end

A cell's share of a step with L active lanes is 1/L per lane it held, so a step shared
by two cells is split between them. Per cell this module sets, beside each other, the
aggregate steady-state tokens/s (analysis.tables.cells) and the single-request TPOT P99 of the
same workload (its concurrency-1 cell), then recommends a concurrency for the rules'
interactive SLA (`batch` rule: `max_tpot_p99_ms`), stating what the choice assumes. It
never calls one batch size best: a choice holds for one SLA, one workload and the
calbin this run measured; another calbin needs its own run (compare with --baseline).

`compiled_batch` comes from the batch rule; without it, from the run manifest's `batch`
section (the vendor's statement for the calbin: its B and how lanes that are not filled
are handled, which this section carries as `vendor_statement`); without either, it is
the most active lanes any decode step had — a lower bound, exact once a cell filled the
batch (§7 measures lanes 1..B).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.judge.evidence import Context, Evidence, column_np, not_evaluated, verdict_for
from analysis.judge.rules import BatchRule
from analysis.judge.verdict import RuleVerdict, Status
from analysis.stats.quantiles import quantile
from analysis.tables.cells import CellKey, CellSummary
from analysis.tables.join import FloatArray, IntArray, positions

__all__ = [
    "BATCH_METHOD",
    "HANDLERS",
    "BatchAnalysis",
    "BatchCell",
    "LaneLevel",
    "analyze_batch",
    "batch_section",
    "cached_batch",
]

BATCH_METHOD = (
    "decode steps of steps.jsonl grouped by job_id: active lanes = rows per step; "
    "fill = lanes/B; lane waste = 1 − successful-request lane-steps / (B · steps); a cell "
    "takes 1/L of a step per lane it held; effective tokens/s = successful output tokens "
    "/ the cell's wall time; TPOT P99 with its binomial order-statistic interval"
)


@dataclass(frozen=True, slots=True)
class LaneLevel:
    """Decode steps that ran with `active_lanes` of the compiled batch's lanes.

    `step_ms` is h2d + device wait + d2h + sampling of the step; `lane_tokens_per_s`
    = active_lanes / median step time: the rate one step cadence yields at this fill."""

    active_lanes: int
    fill_ratio: float
    decode_steps: int
    share_of_steps: float
    device_ms_p50: float | None
    device_ms_p99: float | None
    step_ms_p50: float | None
    lane_tokens_per_s: float | None


@dataclass(frozen=True, slots=True)
class BatchCell:
    cell: str
    workload: str
    concurrency: int | None
    arrival: str | None
    stream: bool | None
    requests: int
    ok: int
    lane_steps: int
    useful_lane_steps: int
    total_lane_steps: float
    mean_active_lanes: float | None
    fill_ratio: float | None
    lane_waste: float | None
    wall_time_s: float | None
    effective_tokens_s: float | None
    aggregate_tokens_s: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    tpot_p99_lo: float | None
    tpot_p99_hi: float | None
    tpot_n: int
    single_request_tpot_p99_ms: float | None


@dataclass(frozen=True, slots=True)
class BatchAnalysis:
    compiled_batch: int
    compiled_batch_source: str
    decode_steps: int
    prefill_steps: int
    lane_steps: int
    useful_lane_steps: int
    total_lane_steps: int
    fill_ratio: float | None
    lane_waste: float | None
    by_active_lanes: list[LaneLevel]
    cells: list[BatchCell]
    recommendations: list[dict[str, Any]]
    sla_tpot_p99_ms: float | None
    notes: list[str]
    # the manifest's batch section: compiled_batch, partial_lanes, reference (spec §7)
    vendor_statement: dict[str, Any] | None = None
    method: str = BATCH_METHOD


def _floats(table: pa.Table, name: str, rows: IntArray) -> FloatArray:
    """The column's values at `rows` (taken first: tens of millions of step rows)."""
    col = table.column(name).take(pa.array(rows))
    return np.asarray(column_np(pc.cast(col, pa.float64()), np.nan), np.float64)


def _jobs(steps: pa.Table) -> tuple[Any, IntArray, IntArray, FloatArray, FloatArray]:
    """Decode rows, and per row: its step's lane count and step index; per step: the
    device and whole-step milliseconds."""
    is_decode = np.asarray(pc.fill_null(pc.equal(steps.column("kind"), "decode"), False))
    job = column_np(steps.column("job_id"), -1, np.int64)
    decode = np.flatnonzero(is_decode & (job >= 0))
    job = job[decode]
    ids, inverse, counts = np.unique(job, return_inverse=True, return_counts=True)
    del job
    device = _floats(steps, "device_wait_ms", decode)
    step = device.copy()
    for phase in ("h2d_ms", "d2h_ms", "sampling_ms"):
        step += _floats(steps, phase, decode)
    job_device = np.full(ids.size, np.nan)
    job_step = np.full(ids.size, np.nan)
    job_device[inverse] = device  # every lane of a step carries the step's figures
    job_step[inverse] = step
    return (
        decode,
        counts.astype(np.int64, copy=False),
        inverse.astype(np.int64, copy=False),
        job_device,
        job_step,
    )


def _levels(counts: IntArray, dev: FloatArray, step: FloatArray, b: int) -> list[LaneLevel]:
    out = []
    total = counts.size
    for lanes in range(1, max(b, int(counts.max(initial=0))) + 1):
        sel = counts == lanes
        n = int(np.count_nonzero(sel))
        if n == 0:
            continue
        step_p50 = quantile(step[sel], 0.5)
        out.append(
            LaneLevel(
                active_lanes=lanes,
                fill_ratio=lanes / b,
                decode_steps=n,
                share_of_steps=n / total,
                device_ms_p50=quantile(dev[sel], 0.5),
                device_ms_p99=quantile(dev[sel], 0.99),
                step_ms_p50=step_p50,
                lane_tokens_per_s=lanes / (step_p50 / 1000) if step_p50 else None,
            )
        )
    return out


def _workload(t: pa.Table, rows: IntArray) -> str:
    prompt = column_np(t.column("workload.prompt_tokens"), -1, np.int64)[rows]
    out = column_np(t.column("workload.requested_output_tokens"), -1, np.int64)[rows]
    if rows.size == 0 or bool(np.any(prompt != prompt[0])) or bool(np.any(out != out[0])):
        return "mixed"
    return f"p{int(prompt[0])}-o{int(out[0])}"


def _wall_time_s(t: pa.Table, rows: IntArray) -> float | None:
    start = column_np(t.column("join.wall_start_ns"), -1, np.int64)[rows]
    end = column_np(t.column("join.wall_end_ns"), -1, np.int64)[rows]
    ok = (start >= 0) & (end >= start)
    if not ok.any():
        return None
    span = int(end[ok].max()) - int(start[ok].min())
    return span / 1e9 if span > 0 else None


def _p99(summary: CellSummary | None) -> tuple[Any, Any, Any, Any, int]:
    if summary is None or "tpot_ms" not in summary.metrics:
        return None, None, None, None, 0
    s = summary.metrics["tpot_ms"]
    return s.p50.value, s.p99.value, s.p99.lo, s.p99.hi, s.count


def analyze_batch(ev: Evidence, rule: BatchRule | None = None) -> BatchAnalysis | None:
    """The §7 batch figures of one run; None without decode steps in steps.jsonl."""
    steps = ev.run.steps
    if steps is None or steps.num_rows == 0:
        return None
    decode, counts, inverse, job_dev, job_step = _jobs(steps)
    if counts.size == 0:
        return None
    notes: list[str] = []
    seen = int(counts.max())
    stated = _vendor_statement(ev)
    stated_b = stated.get("compiled_batch") if stated is not None else None
    b, source = seen, "inferred"
    if rule is not None and rule.compiled_batch is not None:
        b, source = rule.compiled_batch, "rules"
        if isinstance(stated_b, int) and stated_b != b:
            notes.append(
                f"the rules' compiled_batch {b} differs from the manifest's batch."
                f"compiled_batch {stated_b}: B taken from the rules"
            )
    elif isinstance(stated_b, int) and stated_b > 0:
        b, source = stated_b, "manifest"
    if source == "inferred":
        notes.append(
            f"compiled batch inferred as {b}, the most active lanes of any decode step "
            "(a lower bound until a cell fills the batch): set compiled_batch in the batch "
            "rule or the manifest's batch section"
        )
    elif seen > b:
        notes.append(
            f"decode steps with {seen} active lanes exceed compiled_batch {b} of the "
            f"{source}: B taken as {seen}; set compiled_batch to the calbin's batch"
        )
        b, source = seen, "inferred"
    t = ev.table
    ok_row = column_np(t.column("ext.error_class"), "", object) == ""
    pos = positions(steps.column("request_id").take(pa.array(decode)), t.column("request_id"))
    lanes_of_row = counts[inverse]
    succeeded = np.zeros(decode.size, dtype=bool)
    succeeded[pos >= 0] = ok_row[pos[pos >= 0]]
    useful = int(np.count_nonzero(succeeded))
    total = int(counts.size) * b
    cells = _cells(ev, b, pos, lanes_of_row, succeeded, rule)
    sla = rule.max_tpot_p99_ms if rule is not None else None
    return BatchAnalysis(
        compiled_batch=b,
        compiled_batch_source=source,
        decode_steps=int(counts.size),
        prefill_steps=int(pc.sum(pc.equal(steps.column("kind"), "prefill")).as_py() or 0),
        lane_steps=int(decode.size),
        useful_lane_steps=useful,
        total_lane_steps=total,
        fill_ratio=decode.size / total,
        lane_waste=1.0 - useful / total,
        by_active_lanes=_levels(counts, job_dev, job_step, b),
        cells=cells,
        recommendations=_recommend(cells, b, source, sla),
        sla_tpot_p99_ms=sla,
        notes=notes,
        vendor_statement=stated,
    )


def _vendor_statement(ev: Evidence) -> dict[str, Any] | None:
    """The run manifest's `batch` section (spec §7: the calbin's compiled batch and the
    vendor's partial-lane policy), None when the manifest has none."""
    manifest = ev.run.manifest
    section = manifest.get("batch") if isinstance(manifest, dict) else None
    if not isinstance(section, dict):
        return None
    return {k: section.get(k) for k in ("compiled_batch", "partial_lanes", "reference")}


def _cells(
    ev: Evidence,
    b: int,
    pos: IntArray,
    lanes: IntArray,
    succeeded: Any,
    rule: BatchRule | None,
) -> list[BatchCell]:
    t = ev.table
    data = ev.cell_data()
    keys = [k for k in data if rule is None or rule.select.matches(k)]
    cell_of_row = np.full(t.num_rows, -1, dtype=np.int64)
    for i, k in enumerate(keys):
        cell_of_row[data[k].rows] = i
    c = np.where(pos >= 0, cell_of_row[np.maximum(pos, 0)], -1)
    sel = c >= 0
    c, succeeded, lanes = c[sel], succeeded[sel], lanes[sel]
    m = len(keys)
    lane_steps = np.bincount(c, minlength=m)
    useful = np.bincount(c, weights=succeeded.astype(np.float64), minlength=m)
    share = np.bincount(c, weights=1.0 / lanes, minlength=m)  # steps held
    tokens = column_np(t.column("workload.actual_output_tokens"), 0, np.float64)
    ok_row = column_np(t.column("ext.error_class"), "", object) == ""
    rows_out: list[tuple[CellKey, BatchCell]] = []
    for i, k in enumerate(keys):
        rows = data[k].rows
        succ = rows[ok_row[rows]]
        wall = _wall_time_s(t, rows)
        summary = ev.summary(k)
        p50, p99, lo, hi, n = _p99(summary)
        total = float(share[i]) * b
        rows_out.append(
            (
                k,
                BatchCell(
                    cell=k.label,
                    workload=_workload(t, rows),
                    concurrency=k.concurrency,
                    arrival=k.arrival,
                    stream=k.stream,
                    requests=int(rows.size),
                    ok=int(succ.size),
                    lane_steps=int(lane_steps[i]),
                    useful_lane_steps=int(useful[i]),
                    total_lane_steps=total,
                    mean_active_lanes=float(lane_steps[i] / share[i]) if share[i] else None,
                    fill_ratio=float(lane_steps[i] / total) if total else None,
                    lane_waste=1.0 - float(useful[i]) / total if total else None,
                    wall_time_s=wall,
                    effective_tokens_s=float(tokens[succ].sum()) / wall if wall else None,
                    aggregate_tokens_s=summary.steady_output_tokens_per_s if summary else None,
                    tpot_p50_ms=p50,
                    tpot_p99_ms=p99,
                    tpot_p99_lo=lo,
                    tpot_p99_hi=hi,
                    tpot_n=n,
                    single_request_tpot_p99_ms=None,
                ),
            )
        )
    single = {
        (c.workload, c.stream): c.tpot_p99_ms
        for k, c in rows_out
        if (k.concurrency == 1 or k.arrival == "single") and c.tpot_p99_ms is not None
    }
    return [
        dataclasses.replace(c, single_request_tpot_p99_ms=single.get((c.workload, c.stream)))
        for _, c in rows_out
    ]


_SOURCES = {"rules": "from the rules", "manifest": "from the manifest", "inferred": "inferred"}


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def _recommend(
    cells: list[BatchCell], b: int, source: str, sla: float | None
) -> list[dict[str, Any]]:
    """One recommendation per workload (and streaming) over its closed-loop cells."""
    groups: dict[tuple[str, bool | None], list[BatchCell]] = {}
    for c in cells:
        if c.concurrency is not None and c.tpot_p99_ms is not None:
            groups.setdefault((c.workload, c.stream), []).append(c)
    out = []
    for (workload, stream), rows in sorted(groups.items(), key=lambda g: str(g[0])):
        rows.sort(key=lambda r: r.concurrency or 0)
        tput = [r for r in rows if r.aggregate_tokens_s is not None]
        peak = max(tput, key=lambda r: r.aggregate_tokens_s or 0.0) if tput else None
        single = rows[0].single_request_tpot_p99_ms
        assumptions = [
            (
                f"interactive SLA: TPOT P99 ≤ {sla:g} ms, met when the upper bound of the "
                "P99 interval is within it"
                if sla is not None
                else "no interactive SLA given (batch rule: max_tpot_p99_ms)"
            ),
            f"workload {workload}, {'streamed' if stream else 'whole responses'}, closed loop",
            f"compiled batch B{b} ({_SOURCES.get(source, source)})",
            "aggregate tokens/s: steady-state output tokens/s of each cell",
            "one calbin per run: compare B1/B4/B8/B16 by running each (analyze --baseline)",
        ]
        choice: BatchCell | None = None
        if sla is None:
            text = (
                f"{workload}: no interactive SLA given, so no concurrency is recommended; "
                f"throughput peaks at concurrency {peak.concurrency if peak else 'n/a'} "
                f"({_fmt(peak.aggregate_tokens_s if peak else None)} tokens/s, TPOT P99 "
                f"{_fmt(peak.tpot_p99_ms if peak else None)} ms, fill "
                f"{_fmt((peak.fill_ratio or 0) * 100 if peak else None, '.0f')}%); "
                f"single-request TPOT P99 {_fmt(single)} ms. Set max_tpot_p99_ms to choose."
            )
        else:
            meets = [r for r in tput if r.tpot_p99_hi is not None and r.tpot_p99_hi <= sla]
            if meets:
                choice = max(meets, key=lambda r: r.aggregate_tokens_s or 0.0)
                text = (
                    f"For TPOT P99 ≤ {sla:g} ms ({workload}, B{b}): run at concurrency "
                    f"{choice.concurrency} (fill {_fmt((choice.fill_ratio or 0) * 100, '.0f')}"
                    f"%): {_fmt(choice.aggregate_tokens_s)} tokens/s with TPOT P99 "
                    f"{_fmt(choice.tpot_p99_ms)} ms (upper bound {_fmt(choice.tpot_p99_hi)})."
                )
                better = [
                    r
                    for r in tput
                    if (r.aggregate_tokens_s or 0.0) > (choice.aggregate_tokens_s or 0.0)
                ]
                if better:
                    r = max(better, key=lambda r: r.aggregate_tokens_s or 0.0)
                    text += (
                        f" Concurrency {r.concurrency} gives {_fmt(r.aggregate_tokens_s)} "
                        f"tokens/s but its TPOT P99 {_fmt(r.tpot_p99_ms)} ms is not shown "
                        "within the SLA."
                    )
            else:
                low = rows[0]
                text = (
                    f"For TPOT P99 ≤ {sla:g} ms ({workload}, B{b}): no measured concurrency "
                    f"is shown to meet it (lowest, concurrency {low.concurrency}: TPOT P99 "
                    f"{_fmt(low.tpot_p99_ms)} ms, upper bound {_fmt(low.tpot_p99_hi)}, n="
                    f"{low.tpot_n}); measure more requests, lower the concurrency, or use a "
                    "smaller compiled batch."
                )
        out.append(
            {
                "workload": workload,
                "stream": stream,
                "sla_tpot_p99_ms": sla,
                "choice": None
                if choice is None
                else {
                    "cell": choice.cell,
                    "concurrency": choice.concurrency,
                    "fill_ratio": choice.fill_ratio,
                    "aggregate_tokens_s": choice.aggregate_tokens_s,
                    "tpot_p99_ms": choice.tpot_p99_ms,
                    "tpot_p99_hi": choice.tpot_p99_hi,
                },
                "text": text,
                "assumptions": assumptions,
            }
        )
    return out


def batch_section(analysis: BatchAnalysis | None) -> dict[str, Any] | None:
    """The `batch` section of verdict.json (None: no decode steps in the traces)."""
    return None if analysis is None else dataclasses.asdict(analysis)


def cached_batch(ctx: Context, rule: BatchRule | None) -> BatchAnalysis | None:
    key = ("batch", None if rule is None else rule.model_dump_json())
    if key not in ctx.cache:
        ctx.cache[key] = analyze_batch(ctx.candidate, rule)
    result: BatchAnalysis | None = ctx.cache[key]
    return result


def _batch_rule(rule: BatchRule, ctx: Context) -> list[RuleVerdict]:
    suffix = ".low_fill_sla"
    result = cached_batch(ctx, rule)
    if rule.max_tpot_p99_ms is None:
        return [
            not_evaluated(
                rule,
                "not configured: set max_tpot_p99_ms (the interactive SLA) in the batch rule",
                suffix=suffix,
            )
        ]
    sla = rule.max_tpot_p99_ms
    threshold = f"tpot_ms p99 ≤ {sla:g} at fill ≤ {rule.low_fill_ratio:g}"
    if result is None:
        return [
            not_evaluated(
                rule,
                "no data: no decode steps in server/steps.jsonl",
                threshold=threshold,
                suffix=suffix,
            )
        ]
    low = [
        c
        for c in result.cells
        if c.fill_ratio is not None
        and c.fill_ratio <= rule.low_fill_ratio
        and c.tpot_p99_ms is not None
    ]
    if not low:
        return [
            not_evaluated(
                rule,
                f"no data: no selected cell ran at fill ≤ {rule.low_fill_ratio:g} of "
                f"B{result.compiled_batch}",
                threshold=threshold,
                suffix=suffix,
            )
        ]
    details = [dataclasses.asdict(c) for c in low]
    n = sum(c.tpot_n for c in low)
    worst = max(low, key=lambda c: c.tpot_p99_ms or 0.0)
    failed = [c for c in low if c.tpot_p99_lo is not None and c.tpot_p99_lo > sla]
    if failed:
        c = failed[0]
        return [
            verdict_for(
                rule,
                Status.FAIL,
                c.tpot_p99_ms,
                threshold,
                n,
                f"{c.cell} (fill {_fmt((c.fill_ratio or 0) * 100, '.0f')}% of "
                f"B{result.compiled_batch}): TPOT P99 {_fmt(c.tpot_p99_ms)} ms, interval "
                f"from {_fmt(c.tpot_p99_lo)}, above the {sla:g} ms SLA: at low fill the "
                "batch step costs the interactive user; keep a smaller-batch profile for it",
                details,
                suffix=suffix,
            )
        ]
    unproven = [c for c in low if c.tpot_p99_hi is None or c.tpot_p99_hi > sla]
    if unproven:
        c = unproven[0]
        return [
            verdict_for(
                rule,
                Status.INCONCLUSIVE,
                worst.tpot_p99_ms,
                threshold,
                n,
                f"{c.cell}: TPOT P99 {_fmt(c.tpot_p99_ms)} ms, upper bound "
                f"{_fmt(c.tpot_p99_hi)} (n={c.tpot_n}) reaches past {sla:g} ms or has none "
                "(P99 at 95% needs n ≥ 368): collect more requests",
                details,
                suffix=suffix,
            )
        ]
    return [
        verdict_for(
            rule,
            Status.PASS,
            worst.tpot_p99_ms,
            threshold,
            n,
            f"every cell at fill ≤ {rule.low_fill_ratio:g} of B{result.compiled_batch} keeps "
            f"TPOT P99 within {sla:g} ms (worst {worst.cell}: {_fmt(worst.tpot_p99_ms)} ms, "
            f"upper bound {_fmt(worst.tpot_p99_hi)})",
            details,
            suffix=suffix,
        )
    ]


HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {"batch": _batch_rule}
