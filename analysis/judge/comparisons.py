"""Baseline vs candidate rules (spec §14, exit 4): regression allowances, optimization
targets, throughput gains. Comparisons are per matched cell (same label on both sides,
`measured` partition) with analysis.stats.compare; the reason of a regression names the server
phase whose median moved most between the runs, where both carry server traces."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.judge.evidence import Context, column_np, not_evaluated, verdict_for
from analysis.judge.rules import (
    CellSelector,
    ImprovementSpec,
    OptimizationRule,
    RegressionRule,
    RegressionSpec,
    ThroughputGainRule,
)
from analysis.judge.verdict import RuleVerdict, Status
from analysis.stats.compare import (
    Comparison,
    MetricRule,
    Thresholds,
    Verdict,
    compare_cells,
    compare_throughput,
)
from analysis.tables.cells import CellKey

__all__ = ["HANDLERS", "NO_BASELINE"]

_PHASES = (
    "server_ms.queue",
    "server_ms.prefill",
    "server_ms.decode_total",
    "server_ms.postprocess",
    "runtime_ms.infer_prefill",
    "runtime_ms.infer_decode",
    "join.unattributed_ttft_ms",
    "join.unattributed_e2e_ms",
)
NO_BASELINE = "no data: needs a baseline run (calculet-load analyze RUN --baseline BASE)"


def _phase_hint(ctx: Context, label: str) -> str:
    assert ctx.baseline is not None
    sides = []
    for ev in (ctx.baseline, ctx.candidate):
        cells = {k.label: c for k, c in ev.cell_data().items()}
        cell = cells.get(label)
        if cell is None:
            return ""
        ok = column_np(ev.table.column("ext.error_class"), "", object)[cell.rows] == ""
        rows = cell.rows[ok]
        joined = column_np(ev.table.column("quality.server_trace_joined"), False, bool)[rows]
        if not joined.any():
            return "; no server traces joined: add the server's traces to locate the phase"
        sides.append(
            {p: column_np(pc.cast(ev.table.column(p), pa.float64()), np.nan)[rows] for p in _PHASES}
        )
    moves = []
    for p in _PHASES:
        b, c = sides[0][p], sides[1][p]
        if np.isnan(b).all() or np.isnan(c).all():
            continue
        mb, mc = float(np.nanmedian(b)), float(np.nanmedian(c))
        moves.append((mc - mb, p, mb, mc))
    if not moves:
        return ""
    delta, phase, mb, mc = max(moves)
    if delta <= 0:
        return "; no server phase grew: the time was added outside the server (network/client)"
    pct = f" ({(mc / mb - 1) * 100:+.1f}%)" if mb > 0 else ""
    return f"; server phase that grew most: {phase} median {mb:.3f} → {mc:.3f} ms{pct}"


def _compare(
    ctx: Context, select: CellSelector, rules: list[MetricRule]
) -> tuple[list[Comparison], list[CellKey]]:
    assert ctx.baseline is not None
    base, cand = ctx.baseline.values(), ctx.candidate.values()
    keys = sorted({k for k in (*base, *cand) if select.matches(k)})
    bmap = {k.label: base[k] for k in keys if k in base}
    cmap = {k.label: cand[k] for k in keys if k in cand}
    return compare_cells(bmap, cmap, rules), keys


def _regression_rules(specs: Sequence[RegressionSpec], level: float) -> list[MetricRule]:
    return [
        MetricRule(s.metric, s.statistic, Thresholds(s.max_regression_pct, None, level))
        for s in specs
    ]


def _comparison_detail(c: Comparison) -> dict[str, Any]:
    return dataclasses.asdict(c)


def _judge_comparisons(
    rule: Any, ctx: Context, comps: list[Comparison], threshold: str, suffix: str = ""
) -> RuleVerdict:
    n = len(comps)
    details = [_comparison_detail(c) for c in comps]
    regressed = [c for c in comps if c.verdict is Verdict.REGRESSION]
    unsure = [c for c in comps if c.verdict is Verdict.INCONCLUSIVE]
    badness = [c.badness_pct for c in comps if c.badness_pct is not None]
    worst = max(badness) if badness else None
    if regressed:
        c = max(regressed, key=lambda x: x.badness_pct or 0.0)
        return verdict_for(
            rule,
            Status.FAIL,
            worst,
            threshold,
            n,
            f"{len(regressed)} of {n} comparisons regressed; worst {c.cell}: {c.reason}"
            f"{_phase_hint(ctx, c.cell)}",
            details,
            suffix=suffix,
        )
    if unsure:
        c = unsure[0]
        return verdict_for(
            rule,
            Status.INCONCLUSIVE,
            worst,
            threshold,
            n,
            f"{len(unsure)} of {n} comparisons inconclusive, none regressed (first {c.cell}: "
            f"{c.reason})",
            details,
            suffix=suffix,
        )
    return verdict_for(
        rule,
        Status.PASS,
        worst,
        threshold,
        n,
        f"all {n} comparisons within their allowance (largest change "
        f"{'n/a' if worst is None else f'{worst:+.2f}%'}, worse > 0)",
        details,
        suffix=suffix,
    )


def _regression(rule: RegressionRule, ctx: Context) -> list[RuleVerdict]:
    threshold = "; ".join(
        f"{s.metric} {s.statistic} ≤ +{s.max_regression_pct:g}%" for s in rule.metrics
    )
    if ctx.baseline is None:
        return [not_evaluated(rule, NO_BASELINE, threshold=threshold)]
    comps, keys = _compare(
        ctx, rule.select, _regression_rules(rule.metrics, ctx.settings.confidence_level)
    )
    if not keys:
        return [
            not_evaluated(
                rule,
                f"no data: no measured cell matches {rule.select.describe()} on either side",
                threshold=threshold,
            )
        ]
    return [_judge_comparisons(rule, ctx, comps, threshold)]


def _reached(c: Comparison, target_pct: float) -> Status:
    """Did the change reach an improvement of target_pct %? From the CI of badness."""
    if c.ci_pct is None or c.n_baseline == 0 or c.n_candidate == 0:
        return Status.INCONCLUSIVE
    sign = 1.0 if c.direction.value == "lower_is_better" else -1.0
    lo, hi = sorted((sign * c.ci_pct[0], sign * c.ci_pct[1]))
    if hi < -target_pct:
        return Status.PASS
    if lo > -target_pct:
        return Status.FAIL
    return Status.INCONCLUSIVE


def _optimization(rule: OptimizationRule, ctx: Context) -> list[RuleVerdict]:
    specs: list[ImprovementSpec] = [*rule.target_metrics, *rule.key_metrics]
    threshold = " or ".join(
        f"{s.metric} {s.statistic} ≥ {s.min_improvement_pct:g}% better" for s in specs
    )
    if ctx.baseline is None:
        return [not_evaluated(rule, NO_BASELINE, threshold=threshold)]
    level = ctx.settings.confidence_level
    metric_rules = [
        MetricRule(s.metric, s.statistic, Thresholds(0.0, s.min_improvement_pct, level))
        for s in specs
    ]
    comps, keys = _compare(ctx, rule.target, metric_rules)
    out: list[RuleVerdict] = []
    if not keys:
        out.append(
            not_evaluated(
                rule,
                f"no data: no measured cell matches the target {rule.target.describe()}",
                threshold=threshold,
                suffix=".target",
            )
        )
    else:
        target_of = {
            (m.metric, m.statistic): s.min_improvement_pct
            for m, s in zip(metric_rules, specs, strict=True)
        }
        states = [(c, _reached(c, target_of[(c.metric, c.statistic)])) for c in comps]
        details = [{**_comparison_detail(c), "target_reached": s.value} for c, s in states]
        best = min((c.badness_pct for c in comps if c.badness_pct is not None), default=None)
        hits = [c for c, s in states if s is Status.PASS]
        if hits:
            c = hits[0]
            status, reason = Status.PASS, f"{c.cell}: {c.reason}"
        elif all(s is Status.FAIL for _, s in states):
            status = Status.FAIL
            reason = (
                f"no target metric reached its improvement (best change "
                f"{'n/a' if best is None else f'{best:+.2f}%'}, worse > 0); the candidate "
                "does not deliver the optimization it claims"
            )
        else:
            status = Status.INCONCLUSIVE
            reason = "no target reached with confidence, not all ruled out: collect more requests"
        out.append(
            verdict_for(
                rule, status, best, threshold, len(comps), reason, details, suffix=".target"
            )
        )
    if rule.non_target_metrics:
        others = rule.target.model_copy(update={"names": None, "exclude": rule.target.names})
        nt_threshold = "; ".join(
            f"{s.metric} {s.statistic} ≤ +{s.max_regression_pct:g}%"
            for s in rule.non_target_metrics
        )
        nt, nt_keys = _compare(ctx, others, _regression_rules(rule.non_target_metrics, level))
        if not nt_keys:
            out.append(
                not_evaluated(
                    rule,
                    "no data: no non-target cell",
                    threshold=nt_threshold,
                    suffix=".non_target",
                )
            )
        else:
            out.append(_judge_comparisons(rule, ctx, nt, nt_threshold, ".non_target"))
    return out


def _throughput_gain(rule: ThroughputGainRule, ctx: Context) -> list[RuleVerdict]:
    """Per matched cell, the gain of steady-state output tokens/s with its interval
    (analysis.stats.compare.THROUGHPUT_DELTA_METHOD): PASS when every cell's interval
    lies at or above the target, FAIL when one lies wholly below, else INCONCLUSIVE."""
    if rule.min_gain_pct is None:
        return [
            not_evaluated(
                rule,
                "not configured: set min_gain_pct (the explicit throughput target) in the rules",
            )
        ]
    target = rule.min_gain_pct
    threshold = f"≥ +{target:g}% output tokens/s"
    if ctx.baseline is None:
        return [not_evaluated(rule, NO_BASELINE, threshold=threshold)]
    thresholds = Thresholds(0.0, target if target > 0 else None, ctx.settings.confidence_level)
    states: list[tuple[Comparison, Status]] = []
    for s in ctx.candidate.summaries:
        if s.partition != "measured" or not rule.select.matches(s.key):
            continue
        b = ctx.baseline.summary(s.key)
        if b is None or not b.steady_output_tokens_per_s or s.steady_output_tokens_per_s is None:
            continue
        c = compare_throughput(
            b.throughput_batches, s.throughput_batches, thresholds=thresholds, cell=s.key.label
        )
        states.append((c, _reached(c, target)))
    if not states:
        return [
            not_evaluated(
                rule,
                f"no data: no cell matching {rule.select.describe()} has throughput on both sides",
                threshold=threshold,
            )
        ]
    details = [{**_comparison_detail(c), "target_reached": st.value} for c, st in states]
    gains = [c.delta_pct for c, _ in states if c.delta_pct is not None]
    worst = min(gains) if gains else None

    def seen(c: Comparison) -> str:
        ci = "no interval" if c.ci_pct is None else f"{_pct_ci(c.ci_pct)} at {_level(ctx)}"
        return (
            f"{c.cell}: {c.baseline or 0:.1f} → {c.candidate or 0:.1f} tokens/s, gain "
            f"{c.delta_pct or 0:+.1f}% ({ci})"
        )

    failed = [c for c, st in states if st is Status.FAIL]
    if failed:
        c = min(failed, key=lambda x: x.delta_pct or 0.0)
        return [
            verdict_for(
                rule,
                Status.FAIL,
                worst,
                threshold,
                len(states),
                f"{seen(c)}: wholly below the +{target:g}% target; compare the lane fill "
                "(steps per job) and the decode step time of the two builds",
                details,
            )
        ]
    unsure = [c for c, st in states if st is Status.INCONCLUSIVE]
    if unsure:
        c = unsure[0]
        return [
            verdict_for(
                rule,
                Status.INCONCLUSIVE,
                worst,
                threshold,
                len(states),
                f"{len(unsure)} of {len(states)} cells inconclusive (first {seen(c)}): the "
                f"interval straddles the +{target:g}% target; run the cells longer to narrow it",
                details,
            )
        ]
    c = min((c for c, _ in states), key=lambda x: x.delta_pct or 0.0)
    return [
        verdict_for(
            rule,
            Status.PASS,
            worst,
            threshold,
            len(states),
            f"every cell's gain is at least +{target:g}% with confidence (lowest {seen(c)})",
            details,
        )
    ]


def _pct_ci(ci: tuple[float, float]) -> str:
    return f"CI {ci[0]:+.1f}..{ci[1]:+.1f}%"


def _level(ctx: Context) -> str:
    return f"{ctx.settings.confidence_level * 100:g}%"


HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {
    "regression": _regression,
    "optimization": _optimization,
    "throughput_gain": _throughput_gain,
}
