"""Absolute limits (spec §14, exit 4): latency SLOs and device power/temperature; capacity
at the target rate (analysis.judge.capacity) uses `limit_verdict` too. A limit passes when the
statistic's interval lies below it, fails when the interval lies wholly above it, and is
inconclusive otherwise."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from analysis.judge.evidence import Context, not_evaluated, verdict_for
from analysis.judge.rules import CellSelector, DeviceLimitsRule, SloRule
from analysis.judge.verdict import RuleVerdict, Status, TooShort
from analysis.stats.quantiles import mean_ci, min_n_for_ci, quantile, quantile_ci
from analysis.tables.join import device_extremes

__all__ = ["HANDLERS", "limit_verdict"]


@dataclass(frozen=True, slots=True)
class _CellLimit:
    cell: str
    value: float
    lo: float | None
    hi: float | None
    n: int
    status: Status


def _interval(
    values: Any, statistic: str, level: float
) -> tuple[float | None, float | None, float | None]:
    if statistic == "mean":
        lo, hi = mean_ci(values, level)
        finite = values[~np.isnan(values)]
        return (float(np.mean(finite)) if finite.size else None), lo, hi
    q = float(statistic[1:]) / 100
    lo, hi = quantile_ci(values, q, level)
    return quantile(values, q), lo, hi


def limit_verdict(
    rule: Any,
    ctx: Context,
    select: CellSelector,
    metric: str,
    statistic: str,
    limit: float,
    suffix: str = "",
) -> RuleVerdict:
    """An absolute limit on a statistic per cell: pass if the interval is below it."""
    level = ctx.settings.confidence_level
    threshold = f"{metric} {statistic} ≤ {limit:g}"
    rows: list[_CellLimit] = []
    for key, values in ctx.candidate.values().items():
        if not select.matches(key):
            continue
        v = values[metric]
        n = int(np.count_nonzero(~np.isnan(v)))
        est, lo, hi = _interval(v, statistic, level)
        if n == 0 or est is None:
            continue
        status = Status.INCONCLUSIVE
        if hi is not None and hi <= limit:
            status = Status.PASS
        elif lo is not None and lo > limit:
            status = Status.FAIL
        rows.append(_CellLimit(key.label, est, lo, hi, n, status))
    if not rows:
        return not_evaluated(
            rule,
            f"no data: no {metric} in cells matching {select.describe()}",
            threshold=threshold,
            suffix=suffix,
        )
    n_all = sum(r.n for r in rows)
    details = [dataclasses.asdict(r) for r in rows]
    worst = max(rows, key=lambda r: r.value)
    seen = (
        f"{worst.cell}: {statistic} {worst.value:.3f} "
        f"(CI {_num(worst.lo)}..{_num(worst.hi)}, n={worst.n})"
    )
    failed = [r for r in rows if r.status is Status.FAIL]
    if failed:
        bad = failed[0]
        return verdict_for(
            rule,
            Status.FAIL,
            worst.value,
            threshold,
            n_all,
            f"{bad.cell}: {statistic} {metric} {bad.value:.3f} is above {limit:g} with "
            f"{level:.0%} confidence; the SLA is not met at this load",
            details,
            suffix=suffix,
        )
    unsure = [r for r in rows if r.status is Status.INCONCLUSIVE]
    if unsure:
        # every undecided cell lacks its upper bound: too few requests, not a close call
        short = None
        if statistic != "mean" and all(r.hi is None for r in unsure):
            need = min_n_for_ci(float(statistic[1:]) / 100, level)
            short = TooShort(f"n ≥ {need} per cell for a {statistic.upper()} bound")
        return verdict_for(
            rule,
            Status.INCONCLUSIVE,
            worst.value,
            threshold,
            n_all,
            f"{seen}: the interval reaches past {limit:g} or has no bound (too few values); "
            "collect more requests",
            details,
            suffix=suffix,
            too_short=short,
        )
    return verdict_for(
        rule, Status.PASS, worst.value, threshold, n_all, seen, details, suffix=suffix
    )


def _num(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"


def _slo(rule: SloRule, ctx: Context) -> list[RuleVerdict]:
    if rule.max_ms is None:
        return [
            not_evaluated(
                rule, "not configured: set max_ms (the interactive SLA) in the rules file"
            )
        ]
    return [limit_verdict(rule, ctx, rule.select, rule.metric, rule.statistic, rule.max_ms)]


def _device_limits(rule: DeviceLimitsRule, ctx: Context) -> list[RuleVerdict]:
    dev = ctx.candidate.run.device
    out = []
    t_max, p_max, rows = device_extremes(dev) if dev is not None else (None, None, 0)
    for suffix, limit, value, unit, field in (
        (".temperature", rule.max_temperature_c, t_max, "°C", "max_temperature_c"),
        (".power", rule.max_power_w, p_max, "W", "max_power_w"),
    ):
        if dev is None or rows == 0:
            out.append(
                not_evaluated(
                    rule,
                    "no data: no server/device.jsonl",
                    observed=value,
                    threshold=limit,
                    suffix=suffix,
                )
            )
        elif limit is None:
            seen = "no chip readable" if value is None else f"max {value:g} {unit}"
            out.append(
                not_evaluated(
                    rule,
                    f"not configured: set {field} ({seen} observed)",
                    observed=value,
                    n=rows,
                    suffix=suffix,
                )
            )
        elif value is None:
            out.append(
                not_evaluated(
                    rule, "no data: no chip readable", threshold=limit, n=rows, suffix=suffix
                )
            )
        else:
            ok = value <= limit
            out.append(
                verdict_for(
                    rule,
                    Status.PASS if ok else Status.FAIL,
                    value,
                    limit,
                    rows,
                    f"max {value:g} {unit} over {rows} device samples; allowed {limit:g} {unit}"
                    + ("" if ok else ": check cooling and power mode before trusting the figures"),
                    suffix=suffix,
                )
            )
    return out


HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {
    "slo": _slo,
    "device_limits": _device_limits,
}
