"""Tests for analysis.stats.trend: known answers, edge cases, and detection/false-alarm rates
over seeded 1-hour, 1 Hz RSS series."""

import numpy as np
import pytest
from scipy import stats as st
from scipy.signal import lfilter

from analysis.stats import trend as L
from analysis.stats.trend import LeakStatus

MB = 1_000_000.0
HOUR_S = 3600

# --- known answers -----------------------------------------------------------------------


def test_a_clean_linear_series_gives_its_exact_slope() -> None:
    t = np.arange(0, HOUR_S + 1, 10)  # every 10 s for an hour
    rss = 1_000_000 + 2 * t  # bytes: 2 B/s = 7200 B/h
    r = L.detect_leak(t, rss, min_slope_per_h=1000.0, unit="B", resource="rss")
    # warmup 10% = 360 s; 360..3600 s in 60 s bins of 6 samples: 54 bins + t = 3600 alone
    # = 55. Every pairwise slope of the bin means is 2 B/s.
    assert r.status is LeakStatus.LEAK and r.leak
    assert r.slope_per_h == pytest.approx(7200.0) and r.ci_per_h == pytest.approx((7200, 7200))
    assert (r.warmup_s, r.bin_s, r.n_bins) == (360.0, 60.0, 55)
    assert r.p_value is not None and r.p_value < 1e-10
    assert r.reason.startswith("rss: slope +7200 B/h") and r.reason.endswith("gate: leak")
    small = L.detect_leak(t, rss, min_slope_per_h=10_000.0, unit="B")
    assert small.status is LeakStatus.NO_LEAK and "below the 10000 B/h gate" in small.reason


def test_mann_kendall_s_and_variance_by_hand() -> None:
    y = np.array([1.0, 3.0, 2.0, 4.0, 5.0])
    # Pairs i<j: only (3, 2) decreases → S = 9 − 1 = 8; Var(S) = 5·4·15/18 = 16.667.
    r = L.mann_kendall_hamed_rao(np.arange(5.0), y, slope=1.0)
    assert r.s == 8.0 and r.var_s == pytest.approx(5 * 4 * 15 / 18)
    assert r.autocorr_factor >= 1.0
    # z = (S − 1)/√(Var·factor), one-sided p = 1 − Φ(z).
    assert r.p_increasing == pytest.approx(st.norm.sf(7 / np.sqrt(r.var_s * r.autocorr_factor)))


def test_mann_kendall_s_agrees_with_kendalls_tau() -> None:
    rng = np.random.default_rng(8)
    t, y = np.arange(80.0), rng.normal(size=80).cumsum()
    r = L.mann_kendall_hamed_rao(t, y, slope=0.0)
    assert r.s / (80 * 79 / 2) == pytest.approx(st.kendalltau(t, y).statistic)


def test_a_constant_series_is_no_leak() -> None:
    t = np.arange(0.0, HOUR_S)
    r = L.detect_leak(t, np.full(t.size, 42.0), min_slope_per_h=0.0)
    assert r.status is LeakStatus.NO_LEAK and r.slope_per_h == 0.0 and r.p_value == 0.5


def test_too_few_samples_after_warmup_is_insufficient_data() -> None:
    t = np.arange(0.0, 600.0, 30.0)  # 20 samples, 18 after a 60 s warmup
    r = L.detect_leak(t, t * 1e3, min_slope_per_h=1.0, warmup_s=60.0, bin_s=1.0)
    assert r.status is LeakStatus.INSUFFICIENT_DATA and not r.leak
    assert r.slope_per_h is None and "18 bins" in r.reason
    # what would decide it: 21 samples 30 s apart after the 60 s warmup
    assert r.min_span_s == pytest.approx(60 + 21 * 30)
    empty = L.detect_leak([], [], min_slope_per_h=1.0)
    assert empty.status is LeakStatus.INSUFFICIENT_DATA


def test_nan_samples_are_dropped_and_bad_gates_rejected() -> None:
    t = np.arange(0.0, HOUR_S)
    y = 2.0 * t
    y[::7] = np.nan
    assert L.detect_leak(t, y, min_slope_per_h=1.0).slope_per_h == pytest.approx(7200.0)
    with pytest.raises(ValueError):
        L.detect_leak(t, y, min_slope_per_h=-1.0)


# --- detection and false alarms on realistic 1-hour RSS series ---------------------------


def rss_series(
    rng: np.random.Generator,
    slope_mb_h: float,
    *,
    sawtooth_mb: float = 4.0,
    ar_phi: float | None = None,
    ar_sd_mb: float = 2.0,
) -> tuple[np.ndarray, np.ndarray]:
    """1 h at 1 Hz: 500 MB + leak + uniform ±5 MB noise + GC sawtooth (rises by
    `sawtooth_mb` then drops, period 20..90 s, random phase) + optional AR(1) noise."""
    t = np.arange(float(HOUR_S))
    y = 500 * MB + slope_mb_h * MB * t / HOUR_S + rng.uniform(-5 * MB, 5 * MB, t.size)
    period = rng.uniform(20.0, 90.0)
    y += sawtooth_mb * MB * ((t + rng.uniform(0.0, period)) % period) / period
    if ar_phi is not None:
        shocks = rng.normal(0.0, ar_sd_mb * MB * np.sqrt(1 - ar_phi**2), t.size)
        y += lfilter([1.0], [1.0, -ar_phi], shocks)
    return t, y


REPS = 500
GATE = 0.5 * MB  # bytes per hour


def _leak_rate(slope_mb_h: float, **kw: float) -> float:
    hits = 0
    for i in range(REPS):
        t, y = rss_series(np.random.default_rng(5000 + i), slope_mb_h, **kw)
        hits += L.detect_leak(t, y, min_slope_per_h=GATE, unit="B").leak
    return hits / REPS


def test_catches_a_one_mb_per_hour_leak_in_one_hour() -> None:
    rate = _leak_rate(1.0)
    print(f"1 MB/h leak, ±5 MB noise + 4 MB sawtooth: detected {rate:.3f}")
    assert rate >= 0.95


@pytest.mark.parametrize(
    "noise",
    [
        {},  # i.i.d. ±5 MB + sawtooth
        {"sawtooth_mb": 8.0},
        {"ar_phi": 0.95},  # correlation time 20 s
        {"ar_phi": 0.99},  # correlation time 100 s
    ],
    ids=["iid+sawtooth", "iid+8MB-sawtooth", "ar1-20s", "ar1-100s"],
)
def test_drift_free_series_raise_few_false_alarms(noise: dict[str, float]) -> None:
    rate = _leak_rate(0.0, **noise)
    print(f"no leak, {noise or 'iid'}: false alarms {rate:.3f}")
    assert rate <= 0.05


def test_allocation_spikes_do_not_make_a_leak() -> None:
    # Three 5-second +300 MB spikes, one in the last minutes: the bins they hit are
    # outliers, but Theil–Sen and Mann–Kendall are rank-based across bins.
    alarms = 0
    for i in range(50):
        rng = np.random.default_rng(9000 + i)
        t, y = rss_series(rng, 0.0)
        for start in (1200, 2500, 3500):
            y[start : start + 5] += 300 * MB
        alarms += L.detect_leak(t, y, min_slope_per_h=GATE).leak
    assert alarms <= 2


@pytest.mark.parametrize("step_s", [0.5, 2.0, 10.0, 45.0])
def test_a_series_as_long_as_it_said_is_decided(step_s: float) -> None:
    """The span an undecided series names (min_span_s) is enough: sampled the same way
    for that long, it has its 20 bins."""
    t = np.arange(0.0, 12 * step_s, step_s)
    short = L.detect_leak(t, np.zeros_like(t), min_slope_per_h=1.0)
    assert short.status is LeakStatus.INSUFFICIENT_DATA and short.min_span_s is not None
    t = np.arange(0.0, short.min_span_s + step_s / 2, step_s)
    long = L.detect_leak(t, np.zeros_like(t), min_slope_per_h=1.0)
    assert long.status is not LeakStatus.INSUFFICIENT_DATA, long.reason


def test_theil_sen_on_a_day_of_one_second_samples_stays_small() -> None:
    """86,400 points would be 86,400² pairs (56 GiB): the slope comes from equal-time
    bin means instead, and is the same slope."""
    rng = np.random.default_rng(3)
    t = np.arange(86_400, dtype=np.float64)
    y = 40.0 + 2e-5 * t + rng.normal(0, 0.5, t.size)  # 0.072 °C per hour, noisy
    fit = L.theil_sen(t, y)
    assert fit.slope == pytest.approx(2e-5, rel=0.05)
    assert fit.low < 2e-5 < fit.high
    # below the cap, every pair as before: a clean line's exact slope
    assert L.theil_sen(t[: L.THEIL_SEN_MAX_POINTS], 3.0 * t[: L.THEIL_SEN_MAX_POINTS]).slope == 3.0
