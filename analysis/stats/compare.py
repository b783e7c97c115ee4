"""Baseline vs candidate per cell and metric (spec §9, §14): deltas, their confidence
intervals, and a direction-aware verdict against thresholds given as data.

    delta_abs   = candidate − baseline                     (metric unit)
    delta_pct   = (candidate / baseline − 1) · 100
    badness_pct = +delta_pct if lower is better (latency), −delta_pct if higher is
                  better (throughput): > 0 always means "worse"

Decision rule (DECISION_RULE), on the interval [L, U] of badness_pct at `level`:

    REGRESSION    L > regression_pct          worse than allowed, with confidence
    IMPROVEMENT   U < −improvement_pct        better than the target, with confidence
    PASS          U ≤ regression_pct          any regression is within the allowance
    INCONCLUSIVE  otherwise                   the interval straddles the allowance

(checked in that order; IMPROVEMENT only when an improvement target is given). With
identical distributions and regression_pct ≥ 0, P(REGRESSION) ≤ P(L > 0) ≈ (1 − level)/2
per comparison; across many gated comparisons raise `level` (e.g. Bonferroni).
A sample too small for the statistic's interval is INCONCLUSIVE, never PASS.

The two sides are independent samples (different runs); the pairing is by cell. The
interval is within-run: it does not cover run-to-run variance, which needs repetitions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt
from scipy import stats as st

from analysis.stats.quantiles import (
    FloatArray,
    finite_values,
    min_n_for_ci,
    order_stat_bootstrap_cdf,
    percentile_name,
    quantile_rank,
)

__all__ = [
    "DECISION_RULE",
    "MEAN_DELTA_METHOD",
    "QUANTILE_DELTA_METHOD",
    "THROUGHPUT_DELTA_METHOD",
    "Comparison",
    "Direction",
    "MetricRule",
    "Thresholds",
    "Verdict",
    "compare_cells",
    "compare_mean",
    "compare_quantile",
    "compare_throughput",
    "decide",
    "direction_for",
]

DECISION_RULE = (
    "REGRESSION if CI_low(badness%) > regression%; IMPROVEMENT if CI_high < −improvement%; "
    "PASS if CI_high ≤ regression%; else INCONCLUSIVE"
)

QUANTILE_DELTA_METHOD = "exact bootstrap of each order statistic, percentile interval"
"""Each side's bootstrap distribution of its estimate X*_(k) is known in closed form:
P*(X*_(k) ≤ x_(j)) = P(Binomial(n, j/n) ≥ k). B draws per side are taken from it by
inverse CDF (seeded), the B differences and ratios formed, and their α/2, 1 − α/2
quantiles are the interval. Equal to a two-sample Monte-Carlo bootstrap without the
resampling: O(n) partition + O(w log w) sort of a ±10σ rank window + O(B log w)."""

MEAN_DELTA_METHOD = "Welch t, baseline mean as the % scale"
"""(c̄ − b̄) ± t_ν · √(s_c²/n_c + s_b²/n_b), ν by Welch–Satterthwaite; delta_pct's interval
is that interval · 100 / b̄ (the baseline mean taken as known: first-order exact when the
ratio is near 1). Hand-written from scipy's t distribution because scipy's ttest_ind
warns and returns NaN on (near-)constant samples."""


THROUGHPUT_DELTA_METHOD = "batch means of each window, Welch t on the log ratio"
"""Each side's steady-state tokens/s is the mean of its window's K batch rates
(analysis.stats.quantiles.THROUGHPUT_CI_METHOD), with variance s²/K. The ratio r = c̄/b̄
has the interval exp(ln r ± t_ν · √(s_c²/(K_c c̄²) + s_b²/(K_b b̄²))) (delta method on
ln, ν by Welch–Satterthwaite on the two relative variances); delta_pct's interval is
(that − 1) · 100 and delta_abs's is b̄ · (that − 1). Within-run: a second run of each
side is what covers run-to-run variance."""


class Direction(StrEnum):
    LOWER_IS_BETTER = "lower_is_better"
    HIGHER_IS_BETTER = "higher_is_better"


class Verdict(StrEnum):
    PASS = "pass"
    REGRESSION = "regression"
    IMPROVEMENT = "improvement"
    INCONCLUSIVE = "inconclusive"


_DIRECTION_BY_SUFFIX = (
    ("_per_s", Direction.HIGHER_IS_BETTER),
    ("_ms", Direction.LOWER_IS_BETTER),
)


def direction_for(metric: str) -> Direction:
    """Direction from the unit in the name: `*_ms` (latency) lower is better, `*_per_s`
    (throughput) higher is better. Any other metric must declare its direction."""
    for suffix, direction in _DIRECTION_BY_SUFFIX:
        if metric.endswith(suffix):
            return direction
    raise ValueError(f"metric {metric!r}: no unit suffix (_ms, _per_s); declare its direction")


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Allowed regression and (optional) improvement target, both in % of the baseline,
    both ≥ 0, and the confidence level of the interval the verdict reads."""

    regression_pct: float
    improvement_pct: float | None = None
    level: float = 0.95

    def __post_init__(self) -> None:
        if self.regression_pct < 0 or (self.improvement_pct or 0) < 0:
            raise ValueError("thresholds are magnitudes in %: give them as numbers >= 0")
        if not 0 < self.level < 1:
            raise ValueError(f"confidence level {self.level} is outside (0, 1)")


@dataclass(frozen=True, slots=True)
class Comparison:
    """One (cell, metric, statistic) comparison; None where a value does not exist."""

    cell: str
    metric: str
    statistic: str
    direction: Direction
    baseline: float | None
    candidate: float | None
    n_baseline: int
    n_candidate: int
    delta_abs: float | None
    delta_pct: float | None
    ci_abs: tuple[float, float] | None
    ci_pct: tuple[float, float] | None
    badness_pct: float | None
    verdict: Verdict
    reason: str
    thresholds: Thresholds
    method: str


@dataclass(frozen=True, slots=True)
class MetricRule:
    """What to compare for every cell: `statistic` is "mean" or "pNN" (p50, p99, p99.9)."""

    metric: str
    statistic: str
    thresholds: Thresholds
    direction: Direction | None = None  # None: direction_for(metric)

    def __post_init__(self) -> None:
        if self.statistic != "mean":
            m = _QUANTILE_STAT.fullmatch(self.statistic)
            if m is None or not 0 < float(m.group(1)) < 100:
                raise ValueError(f"statistic {self.statistic!r}: use 'mean' or 'pNN' (p99.9)")

    @property
    def quantile(self) -> float | None:
        """q for a "pNN" statistic, None for "mean"."""
        return None if self.statistic == "mean" else float(self.statistic[1:]) / 100.0


_QUANTILE_STAT = re.compile(r"p(\d+(?:\.\d+)?)")


def _pct_range(lo: float, hi: float) -> str:
    return f"{lo:+.3g}..{hi:+.3g}%"


def decide(badness_ci: tuple[float, float] | None, thresholds: Thresholds) -> tuple[Verdict, str]:
    """DECISION_RULE on the interval of badness_pct; the reason says what was seen,
    what was allowed and what to do next."""
    t_reg, t_imp = thresholds.regression_pct, thresholds.improvement_pct
    level = f"{thresholds.level * 100:g}%"
    if badness_ci is None:
        return Verdict.INCONCLUSIVE, "no interval for the change: see the sample sizes"
    lo, hi = badness_ci
    seen = f"{level} CI of the change (worse > 0) is {_pct_range(lo, hi)}"
    if lo > t_reg:
        return Verdict.REGRESSION, f"{seen}: wholly worse than the {t_reg:g}% allowed"
    if t_imp is not None and hi < -t_imp:
        return Verdict.IMPROVEMENT, f"{seen}: wholly better than the {t_imp:g}% target"
    if hi <= t_reg:
        return Verdict.PASS, f"{seen}: within the {t_reg:g}% allowed"
    return (
        Verdict.INCONCLUSIVE,
        f"{seen}: straddles the {t_reg:g}% allowed; collect more samples to narrow it",
    )


def _order_stat_draws(
    x: FloatArray, q: float, size: int, rng: np.random.Generator
) -> tuple[float, FloatArray]:
    """The estimate x_(k) and `size` draws from its exact bootstrap distribution."""
    n = x.size
    k = quantile_rank(n, q)
    j0, cdf = order_stat_bootstrap_cdf(n, q)
    j1 = j0 + cdf.size - 1
    part = np.partition(x, sorted({j0 - 1, k - 1, j1 - 1}))
    xs = np.sort(part[j0 - 1 : j1])
    draws = xs[np.searchsorted(cdf, rng.random(size))]
    return float(part[k - 1]), draws


def _interval(draws: FloatArray, level: float) -> tuple[float, float]:
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(draws, [a, 1.0 - a])
    return float(lo), float(hi)


def _finish(
    *,
    cell: str,
    metric: str,
    statistic: str,
    direction: Direction,
    thresholds: Thresholds,
    method: str,
    b: float | None,
    c: float | None,
    nb: int,
    nc: int,
    ci_abs: tuple[float, float] | None,
    ci_pct: tuple[float, float] | None,
    blocker: str | None,
) -> Comparison:
    delta_abs = None if b is None or c is None else c - b
    delta_pct = None if b is None or c is None or b <= 0 else (c / b - 1.0) * 100.0
    sign = 1.0 if direction is Direction.LOWER_IS_BETTER else -1.0
    badness = None if delta_pct is None else sign * delta_pct
    if blocker is not None:
        verdict, reason = Verdict.INCONCLUSIVE, blocker
    else:
        badness_ci = None if ci_pct is None else sorted((sign * ci_pct[0], sign * ci_pct[1]))
        verdict, reason = decide(
            None if badness_ci is None else (badness_ci[0], badness_ci[1]), thresholds
        )
    return Comparison(
        cell=cell,
        metric=metric,
        statistic=statistic,
        direction=direction,
        baseline=b,
        candidate=c,
        n_baseline=nb,
        n_candidate=nc,
        delta_abs=delta_abs,
        delta_pct=delta_pct,
        ci_abs=ci_abs,
        ci_pct=ci_pct,
        badness_pct=badness,
        verdict=verdict,
        reason=f"{f'{statistic} {metric}'.strip()}: {reason}",
        thresholds=thresholds,
        method=method,
    )


def compare_quantile(
    baseline: npt.ArrayLike,
    candidate: npt.ArrayLike,
    q: float,
    *,
    direction: Direction,
    thresholds: Thresholds,
    metric: str = "",
    cell: str = "",
    seed: int = 0,
    n_resamples: int = 20_000,
) -> Comparison:
    """Compare the q-quantiles (PERCENTILE_METHOD) with QUANTILE_DELTA_METHOD intervals.

    INCONCLUSIVE when a side has fewer values than `min_n_for_ci(q, level)` (P99 at 95%:
    368), since the bootstrap of an order statistic that close to the sample's edge
    under-covers; INCONCLUSIVE too when the baseline is ≤ 0 (no % change).
    """
    b, _ = finite_values(baseline)
    c, _ = finite_values(candidate)
    level = thresholds.level
    need = min_n_for_ci(q, level)
    rng = np.random.default_rng(seed)
    bv = cv = None
    ci_abs = ci_pct = None
    blocker = None
    if b.size and c.size:
        bv, rb = _order_stat_draws(b, q, n_resamples, rng)
        cv, rc = _order_stat_draws(c, q, n_resamples, rng)
        ci_abs = _interval(rc - rb, level)
        if np.all(rb > 0):
            ci_pct = _interval((rc / rb - 1.0) * 100.0, level)
    if min(b.size, c.size) < need:
        blocker = (
            f"needs ≥ {need} values per side for a {level * 100:g}% interval; "
            f"baseline has {b.size}, candidate {c.size}"
        )
    elif ci_pct is None:
        blocker = "the baseline is ≤ 0: a % change is undefined"
    return _finish(
        cell=cell,
        metric=metric,
        statistic=percentile_name(q),
        direction=direction,
        thresholds=thresholds,
        method=QUANTILE_DELTA_METHOD,
        b=bv,
        c=cv,
        nb=b.size,
        nc=c.size,
        ci_abs=ci_abs,
        ci_pct=ci_pct,
        blocker=blocker,
    )


def _welch_ci(c: FloatArray, b: FloatArray, level: float) -> tuple[float, float]:
    vc, vb = float(np.var(c, ddof=1)) / c.size, float(np.var(b, ddof=1)) / b.size
    diff = float(np.mean(c) - np.mean(b))
    se2 = vc + vb
    if se2 == 0.0:
        return diff, diff
    nu = se2**2 / (vc**2 / (c.size - 1) + vb**2 / (b.size - 1))
    half = float(st.t.ppf((1.0 + level) / 2.0, nu)) * math.sqrt(se2)
    return diff - half, diff + half


def compare_mean(
    baseline: npt.ArrayLike,
    candidate: npt.ArrayLike,
    *,
    direction: Direction,
    thresholds: Thresholds,
    metric: str = "",
    cell: str = "",
) -> Comparison:
    """Compare the means with MEAN_DELTA_METHOD (Welch). INCONCLUSIVE for n < 2 a side
    or a baseline mean ≤ 0."""
    b, _ = finite_values(baseline)
    c, _ = finite_values(candidate)
    bv = float(np.mean(b)) if b.size else None
    cv = float(np.mean(c)) if c.size else None
    ci_abs = ci_pct = None
    blocker = None
    if min(b.size, c.size) < 2:
        blocker = f"needs ≥ 2 values per side; baseline has {b.size}, candidate {c.size}"
    else:
        ci_abs = _welch_ci(c, b, thresholds.level)
        if bv is not None and bv > 0:
            ci_pct = (ci_abs[0] * 100.0 / bv, ci_abs[1] * 100.0 / bv)
        else:
            blocker = "the baseline is ≤ 0: a % change is undefined"
    return _finish(
        cell=cell,
        metric=metric,
        statistic="mean",
        direction=direction,
        thresholds=thresholds,
        method=MEAN_DELTA_METHOD,
        b=bv,
        c=cv,
        nb=b.size,
        nc=c.size,
        ci_abs=ci_abs,
        ci_pct=ci_pct,
        blocker=blocker,
    )


def compare_throughput(
    baseline_batches: npt.ArrayLike,
    candidate_batches: npt.ArrayLike,
    *,
    thresholds: Thresholds,
    metric: str = "output_tokens_per_s",
    cell: str = "",
) -> Comparison:
    """Compare two steady-state throughputs from their batch rates with
    THROUGHPUT_DELTA_METHOD; higher is better. INCONCLUSIVE with fewer than 2 batches a
    side or a mean ≤ 0 (no ratio)."""
    b, _ = finite_values(baseline_batches)
    c, _ = finite_values(candidate_batches)
    bv = float(np.mean(b)) if b.size else None
    cv = float(np.mean(c)) if c.size else None
    ci_abs = ci_pct = None
    blocker = None
    if min(b.size, c.size) < 2:
        blocker = f"needs ≥ 2 batch rates per side; baseline has {b.size}, candidate {c.size}"
    elif bv is None or cv is None or bv <= 0 or cv <= 0:
        blocker = "a side's throughput is ≤ 0: a ratio is undefined"
    else:
        vb = float(np.var(b, ddof=1)) / (b.size * bv**2)
        vc = float(np.var(c, ddof=1)) / (c.size * cv**2)
        se2 = vb + vc
        half = 0.0
        if se2 > 0:
            nu = se2**2 / (vc**2 / (c.size - 1) + vb**2 / (b.size - 1))
            half = float(st.t.ppf((1.0 + thresholds.level) / 2.0, nu)) * math.sqrt(se2)
        log_r = math.log(cv / bv)
        lo, hi = math.exp(log_r - half), math.exp(log_r + half)
        ci_pct = ((lo - 1.0) * 100.0, (hi - 1.0) * 100.0)
        ci_abs = (bv * (lo - 1.0), bv * (hi - 1.0))
    return _finish(
        cell=cell,
        metric=metric,
        statistic="steady",
        direction=Direction.HIGHER_IS_BETTER,
        thresholds=thresholds,
        method=THROUGHPUT_DELTA_METHOD,
        b=bv,
        c=cv,
        nb=b.size,
        nc=c.size,
        ci_abs=ci_abs,
        ci_pct=ci_pct,
        blocker=blocker,
    )


def _compare_rule(
    rule: MetricRule, b: npt.ArrayLike, c: npt.ArrayLike, cell: str, seed: int
) -> Comparison:
    direction = rule.direction or direction_for(rule.metric)
    if rule.quantile is None:
        return compare_mean(
            b, c, direction=direction, thresholds=rule.thresholds, metric=rule.metric, cell=cell
        )
    return compare_quantile(
        b,
        c,
        rule.quantile,
        direction=direction,
        thresholds=rule.thresholds,
        metric=rule.metric,
        cell=cell,
        seed=seed,
    )


def compare_cells(
    baseline: Mapping[str, Mapping[str, npt.ArrayLike]],
    candidate: Mapping[str, Mapping[str, npt.ArrayLike]],
    rules: Sequence[MetricRule],
    *,
    seed: int = 0,
) -> list[Comparison]:
    """Every rule on every cell of either side (cell → metric → values), in cell order
    of the baseline then the candidate's extra cells. A cell or metric present on one
    side only gives an INCONCLUSIVE row that says which side lacks it."""
    cells = list(baseline) + [c for c in candidate if c not in baseline]
    out: list[Comparison] = []
    for cell in cells:
        for rule in rules:
            b = baseline.get(cell, {}).get(rule.metric)
            c = candidate.get(cell, {}).get(rule.metric)
            if b is not None and c is not None:
                out.append(_compare_rule(rule, b, c, cell, seed))
                continue
            lacking = " and ".join(s for s, v in (("baseline", b), ("candidate", c)) if v is None)
            out.append(
                _finish(
                    cell=cell,
                    metric=rule.metric,
                    statistic=rule.statistic,
                    direction=rule.direction or direction_for(rule.metric),
                    thresholds=rule.thresholds,
                    method="",
                    b=None,
                    c=None,
                    nb=0,
                    nc=0,
                    ci_abs=None,
                    ci_pct=None,
                    blocker=f"no values for cell {cell!r} in the {lacking}",
                )
            )
    return out
