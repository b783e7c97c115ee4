# size: spec §9 per-cell statistics: percentiles with two intervals, mean/std/MAD, throughput
"""Summary statistics of one cell (spec §9): percentiles with distribution-free intervals,
mean/std/MAD with their intervals, and steady-state throughput (§2.2, §9).

Inputs are 1-D arrays of one metric for one cell (a duration in ms, a rate in tokens/s).
NaN marks a missing value (TPOT of a one-token reply, a stamp that never came): it is
excluded and counted, never read as 0. ±inf is a caller error. No data gives None.

Method names are constants so that every output can print what it did.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from scipy import stats as st

__all__ = [
    "BOOTSTRAP_CI_METHOD",
    "MAD_METHOD",
    "MEAN_CI_METHOD",
    "MIN_N_BOOTSTRAP",
    "PERCENTILE_METHOD",
    "QUANTILE_CI_METHOD",
    "RULES_INTERVAL",
    "SPREAD_CI_METHOD",
    "THROUGHPUT_BATCHES",
    "THROUGHPUT_CI_METHOD",
    "THROUGHPUT_METHOD",
    "CellStats",
    "Estimate",
    "FloatArray",
    "PercentileStat",
    "batch_means_ci",
    "finite_values",
    "mad",
    "mean_ci",
    "min_n_for_ci",
    "order_stat_bootstrap_cdf",
    "percentile_name",
    "percentile_warnings",
    "percentiles",
    "quantile",
    "quantile_ci",
    "quantile_rank",
    "spread_ci",
    "steady_throughput",
    "summarize",
    "window_tokens",
]

FloatArray = npt.NDArray[np.float64]

PERCENTILE_METHOD = "higher"
"""numpy's `method="higher"`: the estimate of the q-quantile of n values is the order
statistic x_(k), k = ceil(q·(n−1)) + 1 (1-based). Always an observed value; for
q = 1 − 1/m (p50, p90, p95, p99, p99.9) it is MLPerf LoadGen's `sorted[floor(q·n)]`."""

QUANTILE_CI_METHOD = "binomial order-statistic interval, equal tails ≤ α/2"
"""[x_(l), x_(u)] with l = F⁻¹(α/2), u = F̄⁻¹(α/2) + 1 for K ~ Binomial(n, q) (as
`scipy.stats.quantile_test(...).confidence_interval()`). Distribution-free; coverage
F(u−1) − F(l−1) ≥ level for continuous data (conservative, reported per interval)."""

BOOTSTRAP_CI_METHOD = "percentile bootstrap, exact (B → ∞), equal tails of x*_(k)"
"""Spec §9's "95% bootstrap CI". The bootstrap distribution of the estimate x_(k) under
resampling with replacement is known in closed form: P*(X*_(k) ≤ x_(j)) =
P(Binomial(n, j/n) ≥ k) (`order_stat_bootstrap_cdf`). The interval is [x_(a), x_(b)],
a the first rank where that reaches α/2, b the first where it reaches 1 − α/2: what
scipy.stats.bootstrap(method="percentile") converges to as its resamples B → ∞, without
its Monte-Carlo noise and at no cost beyond the partition (a, b depend on n, q and the
level only). Like QUANTILE_CI_METHOD its exact coverage for continuous data is
F(b−1) − F(a−1), K ~ Binomial(n, q), reported per interval; it is narrower and may fall
below the level (P99 at n = 2000: 94.0%). Given only where QUANTILE_CI_METHOD has both
bounds (`min_n_for_ci`): nearer the sample's edge the bootstrap of an order statistic
under-covers. The rules read QUANTILE_CI_METHOD (RULES_INTERVAL)."""

RULES_INTERVAL = "quantile_ci"
"""Which percentile interval the rules (SLO, batch SLA, capacity) read: the binomial
order-statistic one (QUANTILE_CI_METHOD, coverage ≥ the level); the bootstrap interval is
reported beside it. Baseline/candidate comparisons of a percentile use the exact
bootstrap of each side (analysis.stats.compare.QUANTILE_DELTA_METHOD)."""

MEAN_CI_METHOD = "Student t"
"""mean ± t_{n−1, (1+level)/2} · s/√n, s with ddof=1."""

SPREAD_CI_METHOD = "percentile bootstrap of ≤ m values, width × √(m/n) when subsampled"
"""For std and MAD: scipy.stats.bootstrap(method="percentile") on the values, or for
n > m (default m = 10 000) on a seeded subsample of m values whose interval is re-centred
on the full-sample estimate and narrowed by √(m/n) (both statistics converge at 1/√n).
BCa is avoided: its jackknife is O(n²). Cost O(B·m): with the defaults B = 1000,
m = 10 000, measured 0.08 s (std) and 0.4 s (MAD, two medians per resample) at any n."""

MAD_METHOD = "median(|x − median(x)|), unscaled"
"""In the metric's unit; multiply by 1.4826 for a normal-consistent estimate of σ."""

THROUGHPUT_METHOD = "tokens inside the window / window length, prorated by overlap"

THROUGHPUT_BATCHES = 10
"""K, the equal batches the steady window is cut into for the throughput's interval."""

THROUGHPUT_CI_METHOD = f"batch means: {THROUGHPUT_BATCHES} equal batches of the window, Student t"
"""The steady window is cut into K = THROUGHPUT_BATCHES batches of equal length and each
batch's tokens/s counted like the whole window's (tokens at their own stamps, a whole
response's spread over its span); their mean is the window's rate and its interval is
mean ± t_{K−1, (1+level)/2} · s/√K (`batch_means_ci`). Per-second token counts are
autocorrelated (a request streams over many seconds); batches of a tenth of the window
each are long against one request, which makes their means nearly independent — the
classical batch-means method of simulation output analysis. Within-run only."""

MIN_N_BOOTSTRAP = 10
"""The fewest values the std and MAD intervals (SPREAD_CI_METHOD) are given for."""
_BOOTSTRAP_BATCH_ELEMS = 2_000_000  # resample values held in memory at once


@dataclass(frozen=True, slots=True)
class Estimate:
    """A point estimate and its interval; None where it does not exist."""

    value: float | None
    lo: float | None = None
    hi: float | None = None


@dataclass(frozen=True, slots=True)
class PercentileStat:
    """The q-quantile (PERCENTILE_METHOD) with its QUANTILE_CI_METHOD interval [lo, hi]
    and its BOOTSTRAP_CI_METHOD interval [boot_lo, boot_hi].

    `n` is the number of values it rests on; `coverage` is the exact coverage of
    [lo, hi] for continuous data (a missing bound counts as ∓inf), None when n = 0;
    `boot_coverage` that of the bootstrap interval, None where there is none.
    """

    q: float
    value: float | None
    lo: float | None
    hi: float | None
    n: int
    coverage: float | None
    boot_lo: float | None = None
    boot_hi: float | None = None
    boot_coverage: float | None = None

    @property
    def name(self) -> str:
        return percentile_name(self.q)


@dataclass(frozen=True, slots=True)
class CellStats:
    """Spec §9 summary of one cell and metric. `count` excludes the `missing` (NaN)."""

    count: int
    missing: int
    level: float
    p50: PercentileStat
    p90: PercentileStat
    p95: PercentileStat
    p99: PercentileStat
    min: float | None
    max: float | None
    mean: Estimate
    std: Estimate
    mad: Estimate
    warnings: tuple[str, ...]
    percentile_method: str = PERCENTILE_METHOD
    quantile_ci_method: str = QUANTILE_CI_METHOD
    bootstrap_ci_method: str = BOOTSTRAP_CI_METHOD
    mean_ci_method: str = MEAN_CI_METHOD
    spread_ci_method: str = SPREAD_CI_METHOD

    @property
    def percentiles(self) -> tuple[PercentileStat, ...]:
        return (self.p50, self.p90, self.p95, self.p99)


@dataclass(frozen=True, slots=True)
class _Ranks:
    k: int  # 1-based rank of the estimate
    lo: int | None  # 1-based rank of the lower bound, None if it does not exist
    hi: int | None
    coverage: float
    boot_lo: int | None  # 1-based ranks of the bootstrap interval, None without one
    boot_hi: int | None
    boot_coverage: float | None


def percentile_name(q: float) -> str:
    return f"p{q * 100:g}"


def _pct(level: float) -> str:
    return f"{level * 100:g}%"


def _check_q_level(q: float, level: float) -> None:
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q={q} is outside [0, 1]")
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level {level} is outside (0, 1)")


def finite_values(values: npt.ArrayLike) -> tuple[FloatArray, int]:
    """The values as float64 without NaN, and how many NaN were dropped."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"expected a 1-D array of values, got shape {x.shape}")
    nan = np.isnan(x)
    missing = int(np.count_nonzero(nan))
    if missing:
        x = x[~nan]
    if np.isinf(x).any():
        raise ValueError("values contain ±inf; mark missing values with NaN")
    return x, missing


def quantile_rank(n: int, q: float) -> int:
    """1-based rank k of the PERCENTILE_METHOD estimate: k = ceil(q·(n−1)) + 1, n ≥ 1."""
    if n < 1:
        raise ValueError("no rank in an empty sample")
    return math.ceil((n - 1) * q) + 1


@functools.lru_cache(maxsize=1024)
def order_stat_bootstrap_cdf(n: int, q: float) -> tuple[int, FloatArray]:
    """The bootstrap distribution of the estimate x_(k), k = quantile_rank(n, q), over
    the ranks where it lives: (j0, cdf) with cdf[i] = P*(X*_(k) ≤ x_(j0 + i)) =
    P(Binomial(n, (j0 + i)/n) ≥ k) (exact for distinct values; ties only merge steps).

    The bootstrap rank of X*_(k) is ~ k ± √(k(n−k)/n); the window is ±10σ (+10) of it,
    beyond which the mass is < 1e-20; its last value is set to 1. Read-only (cached).
    """
    k = quantile_rank(n, q)
    w = math.ceil(10 * math.sqrt(k * (n - k) / n)) + 10
    j0, j1 = max(1, k - w), min(n, k + w)
    cdf = np.asarray(st.binom.sf(k - 1, n, np.arange(j0, j1 + 1) / n), dtype=np.float64)
    cdf[-1] = 1.0
    cdf.flags.writeable = False
    return j0, cdf


@functools.lru_cache(maxsize=4096)
def _ranks(n: int, q: float, level: float) -> _Ranks:
    # K = #{x_i < ξ_q} ~ Binomial(n, q); P(x_(l) ≤ ξ_q < x_(u)) = F(u−1) − F(l−1).
    dist = st.binom(n, q)
    a = (1.0 - level) / 2.0
    lo = int(dist.ppf(a))
    hi = int(dist.isf(a)) + 1

    def cover(lo: int, hi: int) -> float:
        f_hi = float(dist.cdf(hi - 1)) if hi <= n else 1.0
        f_lo = float(dist.cdf(lo - 1)) if lo >= 1 else 0.0
        return f_hi - f_lo

    boot_lo = boot_hi = None
    boot_coverage = None
    if lo >= 1 and hi <= n:
        j0, cdf = order_stat_bootstrap_cdf(n, q)
        boot_lo = j0 + int(np.searchsorted(cdf, a, side="left"))
        boot_hi = j0 + int(np.searchsorted(cdf, 1.0 - a, side="left"))
        boot_coverage = cover(boot_lo, boot_hi)
    return _Ranks(
        k=quantile_rank(n, q),
        lo=lo if lo >= 1 else None,
        hi=hi if hi <= n else None,
        coverage=cover(lo, hi),
        boot_lo=boot_lo,
        boot_hi=boot_hi,
        boot_coverage=boot_coverage,
    )


@functools.lru_cache(maxsize=256)
def min_n_for_ci(q: float, level: float = 0.95) -> int:
    """Smallest n for which QUANTILE_CI_METHOD gives both bounds of the q-quantile.

    Upper bound exists iff P(K = n) = qⁿ ≤ α/2; lower iff P(K = 0) = (1−q)ⁿ < α/2,
    α = 1 − level. P99 at 95%: 0.99ⁿ ≤ 0.025 ⇔ n ≥ ln 0.025 / ln 0.99 = 367.04 → 368.
    """
    _check_q_level(q, level)
    if q in (0.0, 1.0):
        raise ValueError(f"q={q}: the extreme order statistic has no two-sided interval")
    a = (1.0 - level) / 2.0
    n = max(1, math.ceil(max(math.log(a) / math.log(q), math.log(a) / math.log1p(-q))) - 2)
    while True:
        r = _ranks(n, q, level)
        if r.lo is not None and r.hi is not None:
            return n
        n += 1


def _percentiles(x: FloatArray, qs: tuple[float, ...], level: float) -> list[PercentileStat]:
    """Estimates and intervals of several quantiles from a single np.partition (O(n))."""
    n = x.size
    if n == 0:
        return [PercentileStat(q, None, None, None, 0, None) for q in qs]
    ranks = [_ranks(n, q, level) for q in qs]
    kth = sorted(
        {
            r - 1
            for rk in ranks
            for r in (rk.k, rk.lo, rk.hi, rk.boot_lo, rk.boot_hi)
            if r is not None
        }
    )
    part = np.partition(x, kth)

    def at(rank: int | None) -> float | None:
        return None if rank is None else float(part[rank - 1])

    return [
        PercentileStat(
            q,
            at(rk.k),
            at(rk.lo),
            at(rk.hi),
            n,
            rk.coverage,
            at(rk.boot_lo),
            at(rk.boot_hi),
            rk.boot_coverage,
        )
        for q, rk in zip(qs, ranks, strict=True)
    ]


def percentiles(
    values: npt.ArrayLike, qs: tuple[float, ...] = (0.5, 0.9, 0.95, 0.99), level: float = 0.95
) -> list[PercentileStat]:
    """The q-quantiles (PERCENTILE_METHOD) with both intervals (QUANTILE_CI_METHOD and
    BOOTSTRAP_CI_METHOD) and their exact coverages; NaN dropped. One partition, O(n)."""
    for q in qs:
        _check_q_level(q, level)
    x, _ = finite_values(values)
    return _percentiles(x, qs, level)


def quantile(values: npt.ArrayLike, q: float) -> float | None:
    """The q-quantile by PERCENTILE_METHOD: x_(k), k = ceil(q·(n−1)) + 1; None if n = 0.

    Example: x = [40, 10, 30, 20], q = 0.5 → k = ceil(1.5) + 1 = 3 → x_(3) = 30.
    """
    _check_q_level(q, 0.95)
    x, _ = finite_values(values)
    return _percentiles(x, (q,), 0.95)[0].value


def quantile_ci(
    values: npt.ArrayLike, q: float, level: float = 0.95
) -> tuple[float | None, float | None]:
    """Distribution-free interval (lo, hi) of the q-quantile (QUANTILE_CI_METHOD).

    lo = x_(l), l = binom.ppf(α/2, n, q); hi = x_(u), u = binom.isf(α/2, n, q) + 1;
    α = 1 − level. A bound whose rank falls outside 1..n does not exist and is None
    (P99 at 95% needs n ≥ 368 for an upper bound, see `min_n_for_ci`). One partition.
    """
    _check_q_level(q, level)
    x, _ = finite_values(values)
    p = _percentiles(x, (q,), level)[0]
    return p.lo, p.hi


def mean_ci(values: npt.ArrayLike, level: float = 0.95) -> tuple[float | None, float | None]:
    """MEAN_CI_METHOD: x̄ ± t_{n−1,(1+level)/2} · s/√n. (None, None) for n < 2.

    Zero variance gives a zero-width interval (x̄, x̄): the formula's answer, which
    `summarize` flags. The t quantile comes from scipy; the rest is the formula itself
    (scipy's ttest_1samp warns and returns NaN on constant data).
    """
    _check_q_level(0.5, level)
    x, _ = finite_values(values)
    return _mean_ci(x, level)


def _mean_ci(x: FloatArray, level: float) -> tuple[float | None, float | None]:
    n = x.size
    if n < 2:
        return None, None
    m = float(np.mean(x))
    s = float(np.std(x, ddof=1))
    half = float(st.t.ppf((1.0 + level) / 2.0, n - 1)) * s / math.sqrt(n)
    return m - half, m + half


def _std(a: FloatArray, axis: int = -1) -> FloatArray:
    return np.asarray(np.std(a, axis=axis, ddof=1), dtype=np.float64)


def _mad(a: FloatArray, axis: int = -1) -> FloatArray:
    return np.asarray(st.median_abs_deviation(a, axis=axis, scale=1.0), dtype=np.float64)


def mad(values: npt.ArrayLike) -> float | None:
    """MAD_METHOD: median(|x − median(x)|) in the metric's unit; None if n = 0.

    Example: x = [1, 2, 3, 4, 100] → median 3, |x − 3| = [2, 1, 0, 1, 97] → MAD 1.
    """
    x, _ = finite_values(values)
    return float(_mad(x)) if x.size else None


def _bootstrap_ci(
    x: FloatArray,
    stat: Callable[[FloatArray, int], FloatArray],
    level: float,
    seed: int,
    n_resamples: int,
    max_n: int,
) -> tuple[float | None, float | None]:
    if n_resamples < 2 or max_n < MIN_N_BOOTSTRAP:
        raise ValueError(f"need n_resamples >= 2 and max_n >= {MIN_N_BOOTSTRAP}")
    n = x.size
    if n < MIN_N_BOOTSTRAP:
        return None, None
    rng = np.random.default_rng(seed)
    sub = x if n <= max_n else rng.choice(x, size=max_n, replace=False)
    res = st.bootstrap(
        (sub,),
        stat,
        n_resamples=n_resamples,
        batch=max(1, _BOOTSTRAP_BATCH_ELEMS // sub.size),
        vectorized=True,
        method="percentile",
        confidence_level=level,
        rng=rng,
    )
    lo = float(res.confidence_interval.low)
    hi = float(res.confidence_interval.high)
    if sub is x:
        return lo, hi
    # Subsample of m: re-centre on the full estimate, shrink the width by √(m/n).
    est_full, est_sub = float(stat(x, -1)), float(stat(sub, -1))
    scale = math.sqrt(sub.size / n)
    return est_full + (lo - est_sub) * scale, est_full + (hi - est_sub) * scale


def spread_ci(
    values: npt.ArrayLike,
    statistic: Literal["std", "mad"],
    level: float = 0.95,
    *,
    seed: int = 0,
    n_resamples: int = 1000,
    max_n: int = 10_000,
) -> tuple[float | None, float | None]:
    """SPREAD_CI_METHOD interval of the sample std s (ddof=1) or of the MAD (MAD_METHOD);
    (None, None) for n < 10."""
    x, _ = finite_values(values)
    return _bootstrap_ci(x, _std if statistic == "std" else _mad, level, seed, n_resamples, max_n)


def percentile_warnings(p: PercentileStat, level: float) -> list[str]:
    """What the percentile's interval lacks ("p99 rests on n=20 < 368: no finite upper
    bound at 95%"); none where it has both bounds or n = 0."""
    if p.n == 0 or (p.lo is not None and p.hi is not None):
        return []
    which = (
        "finite bounds"
        if p.lo is None and p.hi is None
        else ("finite upper bound" if p.hi is None else "finite lower bound")
    )
    need = min_n_for_ci(p.q, level)
    return [f"{p.name} rests on n={p.n} < {need}: no {which} at {_pct(level)}"]


def summarize(
    values: npt.ArrayLike,
    *,
    level: float = 0.95,
    seed: int = 0,
    n_resamples: int = 1000,
    bootstrap_max_n: int = 10_000,
) -> CellStats:
    """Spec §9 summary of one cell: count, P50/P90/P95/P99 (with intervals and the n
    they rest on), min/max, mean with MEAN_CI_METHOD, std and MAD with SPREAD_CI_METHOD.

    n = 0: every statistic None and the warning "no data". n = 1: the value itself,
    no intervals, std None. Zero variance: std = MAD = 0 with zero-width intervals and
    a warning. Cost at n = 10⁶: one partition, two medians, two bounded bootstraps.
    """
    _check_q_level(0.5, level)
    x, missing = finite_values(values)
    n = x.size
    qs = (0.5, 0.9, 0.95, 0.99)
    pcts = _percentiles(x, qs, level)
    p50_99 = (pcts[0], pcts[1], pcts[2], pcts[3])
    if n == 0:
        none = Estimate(None)
        return CellStats(0, missing, level, *p50_99, None, None, none, none, none, ("no data",))

    warnings: list[str] = []
    for p in pcts:
        warnings += percentile_warnings(p, level)
    lo_x, hi_x = float(np.min(x)), float(np.max(x))
    mean = Estimate(float(np.mean(x)), *_mean_ci(x, level))
    mad_value = float(_mad(x))
    if n == 1:
        std = Estimate(None)
        mad_est = Estimate(mad_value)
    elif lo_x == hi_x:
        warnings.append(f"all {n} values are equal: intervals have zero width")
        std = Estimate(0.0, 0.0, 0.0)
        mad_est = Estimate(0.0, 0.0, 0.0)
    else:
        std = Estimate(
            float(_std(x)), *_bootstrap_ci(x, _std, level, seed, n_resamples, bootstrap_max_n)
        )
        mad_est = Estimate(
            mad_value, *_bootstrap_ci(x, _mad, level, seed, n_resamples, bootstrap_max_n)
        )
    if 1 < n < MIN_N_BOOTSTRAP and lo_x != hi_x:
        warnings.append(f"n={n} < {MIN_N_BOOTSTRAP}: no interval for std and MAD")
    return CellStats(
        n,
        missing,
        level,
        *p50_99,
        lo_x,
        hi_x,
        mean,
        std,
        mad_est,
        tuple(warnings),
        spread_ci_method=f"{SPREAD_CI_METHOD} (seed {seed}, {n_resamples} resamples, "
        f"m = {bootstrap_max_n})",
    )


def batch_means_ci(
    batch_rates: npt.ArrayLike, level: float = 0.95
) -> tuple[float | None, float | None]:
    """THROUGHPUT_CI_METHOD: mean ± t_{K−1,(1+level)/2} · s/√K of the K batch rates;
    (None, None) with fewer than 2 batches (a NaN batch, not measured, is dropped)."""
    return mean_ci(batch_rates, level)


def steady_throughput(
    start_ns: npt.ArrayLike,
    end_ns: npt.ArrayLike,
    tokens: npt.ArrayLike,
    window_ns: tuple[int, int],
) -> float | None:
    """Tokens per second over the steady-state window [w0, w1) (spec §9), in tokens/s.

    rate = Σᵢ tokensᵢ · shareᵢ / ((w1 − w0) / 10⁹), where shareᵢ = |[sᵢ, eᵢ] ∩ [w0, w1]| /
    (eᵢ − sᵢ) is the part of item i's interval inside the window (its tokens taken as
    evenly spread from sᵢ to eᵢ, e.g. t4 first token → t5 last token); an item with
    sᵢ = eᵢ (one token event, stamped once) counts wholly iff w0 ≤ sᵢ < w1. Passing
    per-event stamps (start = end) makes it exact. Not a mean of per-request rates:
    it weights every token once, whichever request carried it.

    None when the window is empty or no item touches it (nothing observed).
    """
    inside = window_tokens(start_ns, end_ns, tokens, window_ns)
    w0, w1 = window_ns
    return None if inside is None else inside / ((w1 - w0) / 1e9)


def window_tokens(
    start_ns: npt.ArrayLike,
    end_ns: npt.ArrayLike,
    tokens: npt.ArrayLike,
    window_ns: tuple[int, int],
) -> float | None:
    """Σᵢ tokensᵢ · shareᵢ, the numerator of `steady_throughput` (tokens); None when the
    window is empty or no item touches it."""
    s = np.asarray(start_ns, dtype=np.int64)
    e = np.asarray(end_ns, dtype=np.int64)
    tok = np.asarray(tokens, dtype=np.float64)
    if not (s.ndim == e.ndim == tok.ndim == 1 and s.size == e.size == tok.size):
        raise ValueError("start_ns, end_ns and tokens must be 1-D arrays of one length")
    if np.any(e < s) or np.any(tok < 0) or not np.all(np.isfinite(tok)):
        raise ValueError("need end_ns >= start_ns and finite tokens >= 0")
    w0, w1 = window_ns
    if w1 <= w0:
        return None
    point = s == e
    overlap = np.clip(np.minimum(e, w1) - np.maximum(s, w0), 0, None)
    span = np.where(point, 1, e - s)
    share = np.where(point, ((s >= w0) & (s < w1)).astype(np.float64), overlap / span)
    touched = np.where(point, share > 0, overlap > 0)
    if not touched.any():
        return None
    return float(np.sum(tok * share))
