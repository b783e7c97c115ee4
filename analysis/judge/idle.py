"""Spec §8.2: is the idle device stable? The rules file's `idle` criterion
(analysis.judge.rules.IdleRules) applied to the chip samples `accept` takes.

The series are those of one `/metrics` reading (calculet_load.schema.prometheus.
device_sample): the hottest chip's temperature (°C), the chips' summed power (W) and the
slowest chip's frequency (MHz). Over the last `window_s` of samples each series must
hold both of its limits: its range (max − min) and the magnitude of its Theil–Sen slope
(the one of analysis.stats.trend), in unit per minute of the client's monotonic clock.
The acceptance run's idle step asks `idle_criterion` for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from analysis.judge.rules import IdleRules, load_rules
from analysis.stats.trend import theil_sen

__all__ = ["SERIES_UNITS", "IdleCheck", "IdleCriterion", "idle_criterion"]

SERIES_UNITS = {"temperature_c": "C", "power_w": "W", "frequency_mhz": "MHz"}


@dataclass(frozen=True, slots=True)
class IdleCheck:
    """One look at the samples: `stable` when the window is covered and every series holds
    its limits; `failing` says, per series that did not, which limit it broke and by how
    much (one short phrase each); `series` the measured range and slope of each."""

    stable: bool
    samples: int
    span_s: float
    series: dict[str, dict[str, float]] = field(default_factory=dict)
    failing: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """What the idle step's `end` event keeps."""
        return {
            "stable": self.stable,
            "window_samples": self.samples,
            "window_span_s": round(self.span_s, 3),
            "series": self.series,
            "failing": list(self.failing),
        }


class IdleCriterion:
    """The `idle` section of a rules file, with the durations a command line may override."""

    def __init__(
        self, rules: IdleRules, *, window_s: float | None = None, timeout_s: float | None = None
    ) -> None:
        self.rules = rules
        self.window_s = float(window_s if window_s is not None else rules.window_s)
        self.timeout_s = float(timeout_s if timeout_s is not None else rules.timeout_s)

    def describe(self) -> dict[str, Any]:
        """The criterion as the idle step's `start` event records it."""
        return {
            "window_s": self.window_s,
            "timeout_s": self.timeout_s,
            "limits": {k: v.model_dump() for k, v in self.rules.series.items()},
        }

    def check(self, t: Sequence[float], values: Mapping[str, Sequence[float]]) -> IdleCheck:
        """The samples at times `t` (s, increasing) with each series' `values`, judged
        over the last `window_s`. Not stable while the samples span less than the window."""
        if not t:
            return IdleCheck(False, 0, 0.0, failing=("no samples yet",))
        start = t[-1] - self.window_s
        first = next(i for i, ti in enumerate(t) if ti >= start)
        tw = [ti - t[first] for ti in t[first:]]
        covered = t[-1] - t[0] >= self.window_s
        failing: list[str] = [] if covered else [f"{t[-1] - t[0]:.1f} s of {self.window_s:g} s"]
        measured: dict[str, dict[str, float]] = {}
        for name, limits in self.rules.series.items():
            ys = list(values[name][first:])
            unit = SERIES_UNITS[name]
            rng = max(ys) - min(ys)
            slope = theil_sen(tw, ys).slope * 60.0
            measured[name] = {"range": round(rng, 6), "slope_per_min": round(slope, 6),
                              "last": ys[-1]}  # fmt: skip
            broke = []
            if limits.max_range is not None and rng > limits.max_range:
                broke.append(f"range {rng:.3g} {unit} > {limits.max_range:g} {unit}")
            if limits.max_slope_per_min is not None and abs(slope) > limits.max_slope_per_min:
                broke.append(
                    f"slope {slope:+.3g} {unit}/min, |slope| > {limits.max_slope_per_min:g}"
                )
            if broke:
                failing.append(f"{name} {' and '.join(broke)}")
        stable = covered and not failing
        return IdleCheck(stable, len(tw), tw[-1], measured, tuple(failing))


def idle_criterion(
    rules_path: str | None, *, window_s: float | None = None, timeout_s: float | None = None
) -> IdleCriterion:
    """The rules file's idle criterion (RulesError, exit 2, when the file is invalid)."""
    rules, _ = load_rules(rules_path)
    return IdleCriterion(rules.idle, window_s=window_s, timeout_s=timeout_s)
