"""The drivers' shared steps (calculet_drivers.skeleton.steps): a sequence run on a typed
context, each step's start and end in events.jsonl with its outcome and reason."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from calculet_drivers.skeleton.finish import analyze
from calculet_drivers.skeleton.steps import EventLog, Step, StepResult, run_steps
from calculet_load.errors import RunStop


@dataclasses.dataclass
class Ctx:
    admin: bool
    done: list[str] = dataclasses.field(default_factory=list)


def _admin(c: Ctx) -> StepResult:
    c.done.append("admin")
    if not c.admin:
        return StepResult.not_available("no admin API", checked=False)
    return StepResult.ok(checked=True)


def _own_rows(c: Ctx) -> None:
    c.done.append("own")


def _stop(c: Ctx) -> None:
    raise RunStop(1, "golden failed")


STEPS: tuple[Step[Ctx], ...] = (
    Step("admin", _admin),
    Step("own", _own_rows, logged=False),
    Step("off", _own_rows, when=lambda c: False),
    Step("load", lambda c: c.done.append("load")),
)


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_each_step_runs_in_order_and_its_outcome_is_logged(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", worker="w00")
    ctx = Ctx(admin=False)
    results = run_steps(STEPS, ctx, log)
    assert ctx.done == ["admin", "own", "load"]  # "off" left out by its `when`
    assert results["admin"].outcome == "not_available"
    assert results["admin"].reason == "no admin API"
    assert results["load"] == StepResult.ok()
    rows = _rows(tmp_path / "events.jsonl")
    assert [(r["step"], r["status"]) for r in rows] == [
        ("admin", "start"), ("admin", "end"), ("load", "start"), ("load", "end"),
    ]  # fmt: skip
    end = rows[1]
    assert end["outcome"] == "not_available" and end["reason"] == "no admin API"
    assert end["checked"] is False and end["worker"] == "w00"
    assert rows[3]["outcome"] == "ok" and "reason" not in rows[3]
    assert all(isinstance(r["wall_ns"], int) for r in rows)


def test_without_a_log_the_steps_still_run() -> None:
    ctx = Ctx(admin=True)
    results = run_steps(STEPS, ctx)  # the fault matrix on its own: faults.json says it
    assert ctx.done == ["admin", "own", "load"] and results["admin"].detail == {"checked": True}


def test_a_run_stop_ends_the_sequence(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    ctx = Ctx(admin=True)
    with pytest.raises(RunStop, match="golden failed"):
        run_steps((Step("admin", _admin), Step("golden", _stop), *STEPS[3:]), ctx, log)
    assert ctx.done == ["admin"]
    rows = _rows(tmp_path / "events.jsonl")
    assert [(r["step"], r["status"]) for r in rows][-1] == ("golden", "start")
    assert rows[1]["outcome"] == "ok" and rows[1]["checked"] is True


def test_the_analysis_step_carries_the_analysis_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = analyze(tmp_path, quiet=True)  # a folder without records: invalid (exit 2)
    assert result.outcome == "ok" and result.detail == {"code": 2}
    assert "no request records" in capsys.readouterr().err
