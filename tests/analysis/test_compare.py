"""Tests for analysis.stats.compare: known answers, the decision table, the exact bootstrap
against brute force, and verdict rates under injected and absent shifts."""

from collections import Counter

import numpy as np
import pytest
from scipy import stats as st

from analysis.stats import compare as C
from analysis.stats.compare import Direction, MetricRule, Thresholds, Verdict

NS_PER_MS = 1_000_000
LOWER, HIGHER = Direction.LOWER_IS_BETTER, Direction.HIGHER_IS_BETTER

# --- known answers -----------------------------------------------------------------------


def test_mean_delta_and_welch_interval_by_hand() -> None:
    base = np.array([10, 20, 30, 40]) * NS_PER_MS / NS_PER_MS
    cand = np.array([11, 22, 33, 44]) * NS_PER_MS / NS_PER_MS
    r = C.compare_mean(base, cand, direction=LOWER, thresholds=Thresholds(5.0), metric="ttft_ms")
    # means 25 → 27.5: delta_abs 2.5, delta_pct (27.5/25 − 1)·100 = +10%.
    assert (r.baseline, r.candidate) == (25.0, 27.5)
    assert r.delta_abs == pytest.approx(2.5) and r.delta_pct == pytest.approx(10.0)
    # s_b²/4 = (225+25+25+225)/3/4 = 41.667, s_c²/4 = 1.21·41.667 = 50.417, se = 9.5960;
    # ν = 92.083² / ((41.667² + 50.417²)/3) = 5.9463, t_{ν,0.975} = 2.45228 → ±23.532.
    assert r.ci_abs == pytest.approx((2.5 - 23.532070, 2.5 + 23.532070))
    # % interval: ±23.532 / 25 · 100 around +10% → −84.13..+104.13%: straddles +5%.
    assert r.ci_pct == pytest.approx((-84.128278, 104.128278))
    assert r.verdict is Verdict.INCONCLUSIVE and r.badness_pct == pytest.approx(10.0)


def test_welch_interval_agrees_with_scipy_on_ordinary_data() -> None:
    rng = np.random.default_rng(3)
    b, c = rng.normal(100, 10, 300), rng.normal(104, 15, 200)
    r = C.compare_mean(b, c, direction=LOWER, thresholds=Thresholds(5.0))
    ref = st.ttest_ind(c, b, equal_var=False).confidence_interval(0.95)
    assert r.ci_abs == pytest.approx((ref.low, ref.high))


def test_quantile_deltas_by_hand_and_too_few_values_is_inconclusive() -> None:
    base = np.array([10, 20, 30, 40]) * NS_PER_MS / NS_PER_MS
    cand = np.array([11, 22, 33, 44]) * NS_PER_MS / NS_PER_MS
    r = C.compare_quantile(base, cand, 0.5, direction=LOWER, thresholds=Thresholds(5.0))
    # p50 (k = ceil(1.5) + 1 = 3): 30 → 33, +3 ms, +10%; but n = 4 < min_n_for_ci = 6.
    assert (r.baseline, r.candidate, r.statistic) == (30.0, 33.0, "p50")
    assert r.delta_abs == pytest.approx(3.0) and r.delta_pct == pytest.approx(10.0)
    assert r.verdict is Verdict.INCONCLUSIVE
    assert "needs ≥ 6 values per side" in r.reason


def test_identical_samples_pass() -> None:
    x = np.random.default_rng(1).lognormal(3, 0.5, 20_000)
    for q in (0.5, 0.99):
        r = C.compare_quantile(x, x, q, direction=LOWER, thresholds=Thresholds(5.0))
        assert r.delta_abs == 0.0 and r.verdict is Verdict.PASS
    assert C.compare_mean(x, x, direction=LOWER, thresholds=Thresholds(3.0)).verdict == "pass"


def test_zero_baseline_and_constant_samples() -> None:
    z = np.zeros(500)
    r = C.compare_quantile(z, z + 1, 0.5, direction=LOWER, thresholds=Thresholds(5.0))
    assert r.delta_pct is None and r.verdict is Verdict.INCONCLUSIVE and "≤ 0" in r.reason
    r = C.compare_mean(z + 2, z + 2, direction=LOWER, thresholds=Thresholds(0.0))
    assert r.ci_abs == (0.0, 0.0) and r.verdict is Verdict.PASS


# --- the decision table ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ci", "reg", "imp", "expected"),
    [
        ((6.0, 9.0), 5.0, None, Verdict.REGRESSION),  # wholly worse than +5%
        ((5.0, 9.0), 5.0, None, Verdict.INCONCLUSIVE),  # touches the allowance
        ((3.0, 7.0), 5.0, None, Verdict.INCONCLUSIVE),  # straddles it
        ((-1.0, 5.0), 5.0, None, Verdict.PASS),  # within it
        ((-12.0, -9.0), 5.0, 8.0, Verdict.IMPROVEMENT),  # wholly better than the 8% target
        ((-12.0, -7.0), 5.0, 8.0, Verdict.PASS),  # better, target not proven
        ((-12.0, -9.0), 5.0, None, Verdict.PASS),  # no target: never IMPROVEMENT
        ((0.5, 1.0), 0.0, None, Verdict.REGRESSION),  # zero allowance: any proven worsening
    ],
)
def test_decide(ci: tuple[float, float], reg: float, imp: float | None, expected: Verdict) -> None:
    verdict, reason = C.decide(ci, Thresholds(reg, imp))
    assert verdict is expected
    assert f"{ci[0]:+.3g}..{ci[1]:+.3g}%" in reason


def test_decide_without_an_interval_is_inconclusive() -> None:
    assert C.decide(None, Thresholds(5.0))[0] is Verdict.INCONCLUSIVE


def test_higher_is_better_flips_the_sign() -> None:
    rng = np.random.default_rng(2)
    base = rng.normal(1000.0, 20.0, 5000)  # e.g. output_tokens_per_s
    worse = C.compare_mean(base, base * 0.9, direction=HIGHER, thresholds=Thresholds(5.0))
    assert worse.delta_pct == pytest.approx(-10.0) and worse.badness_pct == pytest.approx(10.0)
    assert worse.verdict is Verdict.REGRESSION
    better = C.compare_mean(base, base * 1.1, direction=HIGHER, thresholds=Thresholds(5.0, 8.0))
    assert better.verdict is Verdict.IMPROVEMENT


def test_direction_from_the_unit_suffix() -> None:
    assert C.direction_for("ttft_ms") is LOWER
    assert C.direction_for("output_tokens_per_s") is HIGHER
    with pytest.raises(ValueError, match="declare its direction"):
        C.direction_for("error_rate")


def test_thresholds_and_rules_are_validated() -> None:
    with pytest.raises(ValueError):
        Thresholds(-1.0)
    with pytest.raises(ValueError):
        MetricRule("ttft_ms", "median", Thresholds(3.0))
    assert MetricRule("ttft_ms", "p99.9", Thresholds(3.0)).quantile == pytest.approx(0.999)
    assert MetricRule("ttft_ms", "mean", Thresholds(3.0)).quantile is None


def test_compare_cells_runs_every_rule_and_reports_missing_cells() -> None:
    rng = np.random.default_rng(4)
    x = rng.lognormal(3, 0.4, 3000)
    base = {"c1": {"ttft_ms": x}, "c2": {"ttft_ms": x}}
    cand = {"c1": {"ttft_ms": x * 1.2}, "c3": {"ttft_ms": x}}
    rules = [
        MetricRule("ttft_ms", "p50", Thresholds(3.0)),
        MetricRule("ttft_ms", "mean", Thresholds(3.0)),
    ]
    rows = C.compare_cells(base, cand, rules)
    assert [(r.cell, r.statistic) for r in rows] == [
        (c, s) for c in ("c1", "c2", "c3") for s in ("p50", "mean")
    ]
    assert [r.verdict for r in rows[:2]] == [Verdict.REGRESSION, Verdict.REGRESSION]
    assert all(r.verdict is Verdict.INCONCLUSIVE for r in rows[2:])
    assert "no values for cell 'c2' in the candidate" in rows[2].reason
    assert "no values for cell 'c3' in the baseline" in rows[4].reason


# --- the exact bootstrap of an order statistic ---------------------------------------------


@pytest.mark.parametrize(("n", "q"), [(300, 0.9), (1000, 0.99), (500, 0.5)])
def test_exact_order_statistic_bootstrap_matches_brute_force(n: int, q: float) -> None:
    rng = np.random.default_rng(n)
    x = np.round(rng.lognormal(3, 0.5, n), 1)  # rounded: ties are allowed
    draws = 20_000
    value, exact = C._order_stat_draws(x, q, draws, np.random.default_rng(1))
    assert value == np.quantile(x, q, method="higher")
    resamples = x[rng.integers(0, n, size=(draws, n))]
    brute = np.quantile(resamples, q, axis=1, method="higher")
    # Same distribution: KS distance within Monte-Carlo noise (1.36·√(2/20000) = 0.0136).
    assert st.ks_2samp(exact, brute).statistic < 0.02


# --- verdict rates under injected and absent shifts ----------------------------------------

REPS = 100


def _verdicts(q: float | None, n: int, shift: float, reg: float, reps: int) -> Counter[str]:
    out: Counter[str] = Counter()
    for i in range(reps):
        rng = np.random.default_rng(1000 + i)
        b = rng.lognormal(3.0, 0.5, n)
        c = rng.lognormal(3.0, 0.5, n) * shift
        t = Thresholds(reg)
        if q is None:
            r = C.compare_mean(b, c, direction=LOWER, thresholds=t)
        else:
            r = C.compare_quantile(b, c, q, direction=LOWER, thresholds=t, seed=i)
        out[r.verdict.value] += 1
    return out


@pytest.mark.parametrize(("q", "n"), [(0.5, 20_000), (0.99, 100_000), (None, 20_000)])
def test_a_ten_percent_latency_shift_is_a_regression(q: float | None, n: int) -> None:
    got = _verdicts(q, n, 1.10, 5.0, REPS)
    print(f"q={q} n={n} +10% vs 5% allowed: {dict(got)}")
    assert got["regression"] >= 0.95 * REPS
    assert got["pass"] == 0


@pytest.mark.parametrize(("q", "n"), [(0.5, 20_000), (0.99, 100_000), (None, 20_000)])
def test_no_shift_is_never_a_regression_against_a_five_percent_allowance(
    q: float | None, n: int
) -> None:
    got = _verdicts(q, n, 1.0, 5.0, REPS)
    print(f"q={q} n={n} no shift vs 5% allowed: {dict(got)}")
    assert got["regression"] == 0
    assert got["pass"] >= 0.9 * REPS


@pytest.mark.parametrize(("q", "n"), [(0.5, 2000), (0.99, 2000), (None, 2000)])
def test_false_regression_rate_at_zero_allowance_is_nominal(q: float | None, n: int) -> None:
    # With no allowance a REGRESSION needs only CI_low > 0: expected (1 − 0.95)/2 = 2.5%.
    reps = 400
    got = _verdicts(q, n, 1.0, 0.0, reps)
    print(f"q={q} n={n} no shift vs 0% allowed: {dict(got)}")
    assert got["regression"] <= 0.05 * reps


# --- throughput: batch means of each window -----------------------------------------------


def test_throughput_comparison_by_hand() -> None:
    b = np.array([90.0, 110.0] * 5)  # mean 100, s² = 111.1, K = 10
    c = np.array([108.0, 132.0] * 5)  # mean 120, s² = 160, K = 10
    r = C.compare_throughput(b, c, thresholds=Thresholds(0.0))
    vb, vc = (1000 / 9) / (10 * 100**2), 160 / (10 * 120**2)
    nu = (vb + vc) ** 2 / (vb**2 / 9 + vc**2 / 9)
    half = st.t.ppf(0.975, nu) * np.sqrt(vb + vc)
    assert r.delta_pct == pytest.approx(20.0)
    assert r.ci_pct == pytest.approx(
        ((1.2 * np.exp(-half) - 1) * 100, (1.2 * np.exp(half) - 1) * 100)
    )
    assert r.direction is Direction.HIGHER_IS_BETTER and r.statistic == "steady"
    assert r.verdict is Verdict.PASS  # higher is better: +20% is no regression
    flat = C.compare_throughput([5.0, 5.0], [5.0, 5.0], thresholds=Thresholds(0.0))
    assert flat.ci_pct == (0.0, 0.0)
    one = C.compare_throughput([5.0], [6.0, 6.0], thresholds=Thresholds(0.0))
    assert one.verdict is Verdict.INCONCLUSIVE and "≥ 2 batch rates" in one.reason


def test_throughput_ratio_interval_covers_95_percent() -> None:
    """10 batch rates a side, candidate 1.1× the baseline: the interval of the ratio
    holds the true +10% in 93–97% of 2000 seeded pairs (MC SE 0.49 points)."""
    rng = np.random.default_rng(19)
    reps, hits = 2000, 0
    for _ in range(reps):
        b = rng.normal(100.0, 8.0, 10)
        c = rng.normal(110.0, 8.0, 10)
        r = C.compare_throughput(b, c, thresholds=Thresholds(0.0))
        assert r.ci_pct is not None
        hits += r.ci_pct[0] <= 10.0 <= r.ci_pct[1]
    assert 0.93 <= hits / reps <= 0.97
