"""One window of the capacity search judged: its metrics over the measured part
(arrivals, rejects, served rate, backlog growth, P99 latencies, goodput) and the reasons
it is not stable (capacity.search's docstring lists the criteria)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from analysis.stats.goodput import meets_slos
from analysis.stats.trend import theil_sen
from calculet_drivers.capacity.sla import SLA, GoodputSLA

__all__ = ["Req", "goodput", "judge_window", "ms", "p99", "scaled", "target_ms"]


@dataclasses.dataclass
class Req:
    """One request of a window, as the window's judgement needs it (monotonic s)."""

    sent_mono: float
    rid: str | None = None
    status: int | None = None
    error: str | None = None
    e2e_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int | None = None
    done_mono: float | None = None


def p99(values: list[float]) -> float | None:
    """P99 as an observed value (numpy's "higher": x_(ceil(0.99 (n-1)) + 1))."""
    if not values:
        return None
    xs = sorted(values)
    return xs[min(len(xs) - 1, math.ceil(0.99 * (len(xs) - 1)))]


def judge_window(
    sla: SLA,
    scale: float,
    rate: float,
    reqs: list[Req],
    dropped: int,
    samples: list[tuple[float, int]],
    measure_from: float,
    end: float,
    cut: int,
    queue: float | None,
    queue_limit: float | None,
) -> dict[str, Any]:
    """A window's metrics over its measured part (from `measure_from` to `end`,
    monotonic s), and why it is not stable (none: stable). `samples`: (monotonic s,
    requests in flight); `queue`: the P99 server queue time (target ms), judged against
    `queue_limit`."""
    s = scale
    measured = [r for r in reqs if r.sent_mono >= measure_from]
    arrivals = len(measured) + dropped
    span = end - measure_from
    rejects = sum(1 for r in measured if r.status in (429, 503))
    errors = sum(1 for r in measured if r.error is not None)
    ok = [r for r in measured if r.error is None and r.e2e_s is not None]
    served = sum(
        1
        for r in reqs
        if r.done_mono is not None and r.error is None and measure_from <= r.done_mono <= end
    )
    pts = [(t, n) for t, n in samples if t >= measure_from]
    slope = float(theil_sen([t for t, _ in pts], [float(n) for _, n in pts]).slope)
    growth = slope * span
    reject_rate = (rejects + dropped) / arrivals if arrivals else 0.0
    metrics: dict[str, Any] = {
        "arrivals": arrivals,
        "completed_ok": len(ok),
        "errors": errors,
        "rejects": rejects,
        "dropped": dropped,
        "cut_at_window_end": cut,
        "reject_rate": reject_rate,
        "served_rate": served / span * s if span > 0 else 0.0,  # per target second
        "backlog_growth": growth,
        "in_flight_end": pts[-1][1] if pts else None,
        "e2e_p99_ms": scaled(p99([r.e2e_s for r in ok if r.e2e_s is not None]), s),
        "ttft_p99_ms": scaled(p99([r.ttft_s for r in ok if r.ttft_s is not None]), s),
        "queue_p99_ms": queue,
    }
    if sla.goodput is not None:
        metrics.update(goodput(sla.goodput, s, measured, arrivals, span, measure_from, end))
    reasons = []
    allowed = max(2.0, sla.backlog_tolerance * arrivals)
    if growth > allowed:
        reasons.append(f"backlog grew by {growth:.1f} requests (allowed {allowed:.1f})")
    if sla.max_reject_rate is not None and reject_rate > sla.max_reject_rate:
        reasons.append(f"reject rate {reject_rate:.2%} > {sla.max_reject_rate:.2%}")
    for key, limit in (
        ("queue_p99_ms", queue_limit),
        ("ttft_p99_ms", sla.max_ttft_p99_ms),
        ("e2e_p99_ms", sla.max_e2e_p99_ms),
    ):
        value = metrics[key]
        if limit is not None and (value is None or value > limit):
            reasons.append(f"{key} {ms(value)} > {limit:g} ms")
    if sla.goodput is not None and metrics["goodput_share"] < sla.goodput.min_share:
        reasons.append(
            f"goodput share {metrics['goodput_share']:.1%} < {sla.goodput.min_share:.1%}"
        )
    if errors - rejects > 0:
        reasons.append(f"{errors - rejects} request(s) failed (not rejections)")
    if not ok:
        reasons.append("no request completed in the measured part")
    return {"rate": rate, "stable": not reasons, "reasons": reasons, "metrics": metrics}


def goodput(
    slo: GoodputSLA,
    scale: float,
    measured: list[Req],
    arrivals: int,
    span: float,
    measure_from: float,
    end: float,
) -> dict[str, Any]:
    """The measured arrivals that met the objectives (target ms): their share of all
    arrivals (a dropped one is not good), and those ended inside the measured part per
    target second."""
    s = scale
    good = meets_slos(
        [r.error is None and r.e2e_s is not None for r in measured],
        [target_ms(r.ttft_s, s) for r in measured],
        [target_ms(r.tpot_s, s) for r in measured],
        [float("nan") if r.output_tokens is None else r.output_tokens for r in measured],
        max_ttft_ms=slo.max_ttft_ms,
        max_tpot_ms=slo.max_tpot_ms,
    )
    n_good = int(sum(bool(g) for g in good))
    ended = sum(
        1
        for r, g in zip(measured, good, strict=True)
        if g and r.done_mono is not None and measure_from <= r.done_mono <= end
    )
    return {
        "goodput_good": n_good,
        "goodput_share": n_good / arrivals if arrivals else 0.0,
        "goodput_rate": ended / span * s if span > 0 else 0.0,  # per target second
    }


def scaled(seconds: float | None, scale: float) -> float | None:
    return None if seconds is None else seconds * 1000.0 / scale


def target_ms(seconds: float | None, scale: float) -> float:
    """Real seconds as target ms; NaN for a figure the request does not have."""
    return float("nan") if seconds is None else seconds * 1000.0 / scale


def ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"
