"""Rate stages (and periodic bursts) as a Locust load shape, for soak profiles (§13).

The shape runs on the master (or the single local process). At each stage boundary it
changes the open-loop rate through the same plan message the web UI uses, so every
worker re-times its schedule from one instant; within a stage it fires the stage's
periodic bursts. Locust's user count is held at the number of worker processes (users
are placeholders in open loop).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from locust import LoadTestShape

from calculet_load.locust import plugin as locust_plugin
from calculet_load.locust import worker as locust_worker


@dataclass(frozen=True)
class Stage:
    duration_s: float
    rate: float
    burst_size: int = 0
    burst_every_s: float = 0.0


_INLINE = re.compile(r"^(?P<d>[0-9.]+)@(?P<r>[0-9.]+)(?:@(?P<n>\d+)/(?P<e>[0-9.]+))?$")


def parse_stages(text: str) -> list[Stage]:
    """`60@1,120@2@8/30` or a YAML file of {duration_s, rate, burst_size, burst_every_s}."""
    if text and Path(text).is_file():
        rows: Any = yaml.safe_load(Path(text).read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise ValueError(f"{text}: expected a list of stages")
        stages = []
        for i, row in enumerate(rows):
            try:
                stages.append(Stage(**row))
            except TypeError as exc:
                raise ValueError(f"{text}: stage {i}: {exc}") from None
        return _checked(stages, text)
    stages = []
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        m = _INLINE.match(part)
        if m is None:
            raise ValueError(f"--stages: item {i + 1} {part!r} is not DURATION@RATE[@N/EVERY]")
        stages.append(
            Stage(
                float(m["d"]),
                float(m["r"]),
                int(m["n"]) if m["n"] else 0,
                float(m["e"]) if m["e"] else 0.0,
            )
        )
    return _checked(stages, "--stages")


def _checked(stages: list[Stage], source: str) -> list[Stage]:
    if not stages:
        raise ValueError(f"{source}: no stages")
    for i, s in enumerate(stages):
        if s.duration_s <= 0 or s.rate < 0 or s.burst_size < 0 or s.burst_every_s < 0:
            raise ValueError(f"{source}: stage {i + 1}: durations > 0, rates and bursts >= 0")
    return stages


class RateStages(LoadTestShape):
    """Stages from `--stages`; stops the run after the last one."""

    def __init__(self) -> None:
        super().__init__()
        self._stages: list[Stage] | None = None
        self._current: int | None = None
        self._next_burst = 0.0

    def stages(self) -> list[Stage]:
        if self._stages is None:
            opts = self.runner.environment.parsed_options if self.runner else None
            text = getattr(opts, "stages", "") if opts is not None else ""
            self._stages = parse_stages(text or "60@1")
        return self._stages

    def tick(self) -> tuple[int, float] | None:
        t = self.get_run_time()
        end = 0.0
        for i, stage in enumerate(self.stages()):
            start, end = end, end + stage.duration_s
            if t < end:
                self._enter(i, stage, start, t)
                users = max(len(locust_plugin.worker_slots()), 1)
                return users, float(users)
        return None

    def _enter(self, i: int, stage: Stage, start: float, t: float) -> None:
        coordinator = locust_plugin.STATE.master
        if coordinator is None:
            return
        if coordinator.plan is None:  # before the start: the plan opens at stage 1's rate
            locust_worker.options(coordinator.env).rate = stage.rate
            return
        if coordinator.plan.arrival not in locust_worker.OPEN_LOOP:
            return
        if self._current != i:
            self._current = i
            self._next_burst = start + stage.burst_every_s
            if i > 0 or stage.rate != coordinator.plan.rate:
                coordinator.change_rate(stage.rate, lead_s=0.0)
        if stage.burst_size and stage.burst_every_s and t >= self._next_burst:
            self._next_burst += stage.burst_every_s
            coordinator.fire_burst(stage.burst_size, 0.5)
