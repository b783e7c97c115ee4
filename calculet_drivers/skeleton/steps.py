"""A driver as a sequence of steps: each step runs on the driver's typed context and ends
`ok`, `failed` or `not_available` with a reason; the run's event log (`events.jsonl`)
records its start and its end, the outcome with it.

A step that cannot run against this target (no admin API, no traces, no device
telemetry) returns `StepResult.not_available(reason)`: the run goes on and says why,
and the rules that depend on it are then not evaluated. A step that fails returns
`StepResult.failed(reason)` (the driver decides what that costs) or raises `RunStop`,
which ends the sequence; the log says so in a `stopped` row written by the driver.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from calculet_drivers.skeleton.jsonl import JsonLines

__all__ = ["EventLog", "Step", "StepOutcome", "StepResult", "run_steps"]

C = TypeVar("C")


class StepOutcome(enum.StrEnum):
    OK = "ok"
    FAILED = "failed"
    NOT_AVAILABLE = "not_available"  # the target cannot support it: not run, and why


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """How a step ended; `detail` goes into its `end` row of the event log."""

    outcome: StepOutcome = StepOutcome.OK
    reason: str | None = None
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def ok(cls, **detail: Any) -> StepResult:
        return cls(StepOutcome.OK, None, detail)

    @classmethod
    def failed(cls, reason: str, **detail: Any) -> StepResult:
        return cls(StepOutcome.FAILED, reason, detail)

    @classmethod
    def not_available(cls, reason: str, **detail: Any) -> StepResult:
        return cls(StepOutcome.NOT_AVAILABLE, reason, detail)


class EventLog:
    """The run's `events.jsonl`: one row a line, `{wall_ns, step, status, ...}`, the one
    format of every driver's log. `always`: fields every row carries (the soak's worker)."""

    def __init__(self, path: Path, **always: Any) -> None:
        self.rows = JsonLines(path)
        self.path = path
        self.always = always

    def write(self, step: str, status: str, **detail: Any) -> None:
        self.rows.write({"wall_ns": time.time_ns(), "step": step, "status": status,
                         **self.always, **detail})  # fmt: skip

    def end(self, step: str, result: StepResult) -> None:
        """The step's `end` row: its outcome, the reason unless ok, and its detail."""
        why = {} if result.reason is None else {"reason": result.reason}
        self.write(step, "end", outcome=str(result.outcome), **why, **result.detail)


@dataclasses.dataclass(frozen=True, slots=True)
class Step(Generic[C]):
    """One step of a driver: `run(context)`; None from it means ok. `logged`: the
    runner writes its start and end rows (False for a step that logs its own rows,
    e.g. one whose start row says what it is about to do). `when(context)` false: the
    step is left out of this run (an option turned it off)."""

    name: str
    run: Callable[[C], StepResult | None]
    logged: bool = True
    when: Callable[[C], bool] = lambda _: True


def run_steps(
    steps: Sequence[Step[C]], context: C, log: EventLog | None = None
) -> dict[str, StepResult]:
    """Run the steps in order on `context`, each logged (when the run has a `log`); their
    results by name. A `RunStop` from a step ends the sequence (the driver records it)."""
    results: dict[str, StepResult] = {}
    for step in steps:
        if not step.when(context):
            continue
        logged = step.logged and log is not None
        if logged:
            assert log is not None
            log.write(step.name, "start")
        result = step.run(context) or StepResult.ok()
        if logged:
            assert log is not None
            log.end(step.name, result)
        results[step.name] = result
    return results
