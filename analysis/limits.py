"""Absolute limits (spec §14, exit 4): latency SLOs, capacity at the target rate, and
device power/temperature. A limit passes when the statistic's interval lies below it,
fails when the interval lies wholly above it, and is inconclusive otherwise."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from analysis.evidence import Context, column_np, verdict_for
from analysis.join import device_extremes
from analysis.rules import CapacityRule, CellSelector, DeviceLimitsRule, SloRule
from analysis.stats import mean_ci, quantile, quantile_ci
from analysis.verdict import RuleVerdict, Status

__all__ = ["HANDLERS"]


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


def _limit(
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
        return verdict_for(
            rule,
            Status.NOT_EVALUATED,
            None,
            threshold,
            0,
            f"no data: no {metric} in cells matching {select.describe()}",
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
    if any(r.status is Status.INCONCLUSIVE for r in rows):
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
        )
    return verdict_for(
        rule, Status.PASS, worst.value, threshold, n_all, seen, details, suffix=suffix
    )


def _num(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"


def _slo(rule: SloRule, ctx: Context) -> list[RuleVerdict]:
    if rule.max_ms is None:
        return [
            verdict_for(
                rule,
                Status.NOT_EVALUATED,
                None,
                None,
                0,
                "not configured: set max_ms (the interactive SLA) in the rules file",
            )
        ]
    return [_limit(rule, ctx, rule.select, rule.metric, rule.statistic, rule.max_ms)]


def _capacity(rule: CapacityRule, ctx: Context) -> list[RuleVerdict]:
    out = []
    if rule.max_queue_p99_ms is None:
        out.append(
            verdict_for(
                rule,
                Status.NOT_EVALUATED,
                None,
                None,
                0,
                "not configured: set max_queue_p99_ms",
                suffix=".queue_p99",
            )
        )
    else:
        out.append(
            _limit(
                rule,
                ctx,
                rule.select,
                "server_queue_ms",
                "p99",
                rule.max_queue_p99_ms,
                ".queue_p99",
            )
        )
    if rule.max_reject_rate is None:
        out.append(
            verdict_for(
                rule,
                Status.NOT_EVALUATED,
                None,
                None,
                0,
                "not configured: set max_reject_rate",
                suffix=".reject_rate",
            )
        )
    else:
        t = ctx.candidate.table
        status = column_np(t.column("result.http_status"), 0, np.int64)
        worst: tuple[float, str, int] | None = None
        n_all = 0
        for key, cell in ctx.candidate.cell_data().items():
            if not rule.select.matches(key) or cell.rows.size == 0:
                continue
            rejected = int(np.count_nonzero(np.isin(status[cell.rows], (429, 503))))
            n_all += cell.rows.size
            rate = rejected / cell.rows.size
            if worst is None or rate > worst[0]:
                worst = (rate, key.label, cell.rows.size)
        if worst is None:
            out.append(
                verdict_for(
                    rule,
                    Status.NOT_EVALUATED,
                    None,
                    rule.max_reject_rate,
                    0,
                    f"no data: no cell matches {rule.select.describe()}",
                    suffix=".reject_rate",
                )
            )
        else:
            ok = worst[0] <= rule.max_reject_rate
            out.append(
                verdict_for(
                    rule,
                    Status.PASS if ok else Status.FAIL,
                    worst[0],
                    rule.max_reject_rate,
                    n_all,
                    f"worst {worst[1]}: {worst[0]:.2%} of {worst[2]} answered 429/503; allowed "
                    f"{rule.max_reject_rate:.2%}"
                    + ("" if ok else ": lower the rate or raise capacity"),
                    suffix=".reject_rate",
                )
            )
    out.append(
        verdict_for(
            rule,
            Status.NOT_EVALUATED,
            None,
            rule.max_utilisation,
            0,
            "no data: the device traces carry no utilisation figure",
            suffix=".utilisation",
        )
    )
    out.append(
        verdict_for(
            rule,
            Status.NOT_EVALUATED,
            None,
            "30-minute windows",
            0,
            "no data: stable max QPS needs a rate sweep with a 30-minute window per rate",
            suffix=".stable_max_qps",
        )
    )
    return out


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
                verdict_for(
                    rule,
                    Status.NOT_EVALUATED,
                    value,
                    limit,
                    0,
                    "no data: no server/device.jsonl",
                    suffix=suffix,
                )
            )
        elif limit is None:
            seen = "no chip readable" if value is None else f"max {value:g} {unit}"
            out.append(
                verdict_for(
                    rule,
                    Status.NOT_EVALUATED,
                    value,
                    None,
                    rows,
                    f"not configured: set {field} ({seen} observed)",
                    suffix=suffix,
                )
            )
        elif value is None:
            out.append(
                verdict_for(
                    rule,
                    Status.NOT_EVALUATED,
                    None,
                    limit,
                    rows,
                    "no data: no chip readable",
                    suffix=suffix,
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
    "capacity": _capacity,
    "device_limits": _device_limits,
}
