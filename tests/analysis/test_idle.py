"""Spec §8.2's idle criterion (analysis.judge.idle) as the default rules file states it:
over the window, each series' range and |Theil–Sen slope| per minute within its limits."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.errors import RulesError
from analysis.judge.idle import IdleCriterion, idle_criterion
from analysis.judge.rules import DEFAULT_RULES, parse_rules

WINDOW = 60.0


def _series(temp: np.ndarray, power: float = 36.0, freq: float = 1200.0) -> dict[str, list[float]]:
    n = len(temp)
    return {"temperature_c": list(temp), "power_w": [power] * n, "frequency_mhz": [freq] * n}


def _criterion() -> IdleCriterion:
    return idle_criterion(str(DEFAULT_RULES), window_s=WINDOW)


def test_the_default_rules_state_the_criterion() -> None:
    crit = idle_criterion(None)
    assert (crit.window_s, crit.timeout_s) == (300.0, 1800.0)  # spec §8.2: 5 minutes
    assert crit.describe()["limits"] == {
        "temperature_c": {"max_range": 0.5, "max_slope_per_min": 0.1},
        "power_w": {"max_range": 1.0, "max_slope_per_min": 0.2},
        "frequency_mhz": {"max_range": 0.0, "max_slope_per_min": 0.0},
    }
    assert idle_criterion(None, window_s=3, timeout_s=9).describe()["window_s"] == 3


def test_flat_or_noisy_but_level_series_are_stable() -> None:
    t = list(np.arange(0, 120.0, 1.0))
    assert _criterion().check(t, _series(np.full(len(t), 46.2))).stable
    rng = np.random.default_rng(7)
    noisy = 46.2 + rng.uniform(-0.2, 0.2, len(t))  # within 0.5 C, no trend
    check = _criterion().check(t, _series(noisy))
    assert check.stable, check.failing
    assert check.samples == 61 and check.span_s == WINDOW  # only the last window counts


def test_a_drift_inside_the_range_fails_on_its_slope() -> None:
    t = np.arange(0, 120.0, 1.0)
    drift = 46.0 + 0.3 / 60 * t  # 0.3 C/min: 0.3 C over the window, inside 0.5 C
    check = _criterion().check(list(t), _series(drift))
    assert not check.stable
    (failing,) = check.failing
    assert failing.startswith("temperature_c slope +0.3 C/min, |slope| > 0.1"), failing
    assert "range" not in failing
    assert check.series["temperature_c"]["slope_per_min"] == pytest.approx(0.3)


def test_a_swing_fails_on_its_range_and_a_frequency_change_at_all() -> None:
    t = np.arange(0, 120.0, 0.5)
    temp = np.full(len(t), 46.0)
    power = {"power_w": list(36.0 + 3 * np.sin(t / 5)), "frequency_mhz": [1200.0] * len(t)}
    power["frequency_mhz"][-1] = 1199.0
    check = _criterion().check(list(t), {"temperature_c": list(temp), **power})
    names = [f.split()[0] for f in check.failing]
    assert names == ["power_w", "frequency_mhz"], check.failing
    assert check.failing[0].startswith("power_w range 6 W > 1 W"), check.failing
    assert check.failing[1].startswith("frequency_mhz range 1 MHz > 0 MHz"), check.failing


def test_not_stable_before_the_window_is_covered() -> None:
    t = list(np.arange(0, 30.0, 1.0))
    check = _criterion().check(t, _series(np.full(len(t), 46.0)))
    assert not check.stable and check.failing == ("29.0 s of 60 s",)


def test_an_invalid_idle_section_names_the_field() -> None:
    doc = {"schema": "calculet-acceptance-rules/v1", "idle": {"power_w": {"max_slope": 1}}}
    with pytest.raises(RulesError, match=r"idle\.power_w\.max_slope: Extra inputs"):
        parse_rules(doc, "r.yaml")
    with pytest.raises(RulesError, match=r"idle\.window_s: Input should be greater than 0"):
        parse_rules({**doc, "idle": {"window_s": 0}}, "r.yaml")
