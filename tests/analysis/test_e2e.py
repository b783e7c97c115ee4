"""End to end on loopback: real simulator and Locust processes, then `calculet-load
analyze`. A build whose decode step is 30% slower is a REGRESSION (exit 4); a second run
of the same build is not (exit 0)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from analysis.judge.rules import DEFAULT_RULES
from calculet_drivers.cli import main
from tests.support.locustproc import LocustRun
from tests.support.simproc import SimProcess

RUN_S = 8.0
LOAD = ["-u", "1", "-r", "1", "--prompt-tokens", "512", "--max-tokens", "16"]
SLOWER_DECODE = ["--set", "timing.decode_base_ms=15.6"]  # default 12.0 ms × 1.3


def _start(
    start_sim: Callable[..., SimProcess], tmp: Path, *sim_args: str
) -> tuple[SimProcess, LocustRun]:
    sim = start_sim(*sim_args)
    return sim, LocustRun(tmp, sim.url, LOAD, workers=0, run_time_s=RUN_S).start()


def _finish(sim: SimProcess, run: LocustRun) -> str:
    assert run.wait(60) == 0, run.log_text()
    sim.stop()  # flushes the traces
    shutil.copytree(sim.trace_dir, run.run_dir / "server", dirs_exist_ok=True)
    return str(run.run_dir)


@pytest.mark.quiet  # two real-time runs compared: on a busy machine the interval widens
def test_slower_decode_is_a_regression_and_the_same_build_is_not(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the baseline and a second run of the same build side by side: equal conditions
    a = _start(start_sim, tmp_path)
    b = _start(start_sim, tmp_path)
    baseline, same = _finish(*a), _finish(*b)
    candidate = _finish(*_start(start_sim, tmp_path, *SLOWER_DECODE))

    # Every default rule, except that this shared test machine's own load must not make
    # the run infrastructure-invalid: that check has its own tests (test_cli.py).
    rules = yaml.safe_load(DEFAULT_RULES.read_text())
    rules["infrastructure"]["max_saturated_fraction"] = None
    rules_path = tmp_path / "rules.yaml"
    rules_path.write_text(yaml.safe_dump(rules))

    code = main(["analyze", candidate, "--baseline", baseline, "--rules", str(rules_path)])
    out = capsys.readouterr().out
    assert code == 4, out
    doc = json.loads((Path(candidate) / "verdict.json").read_text())
    assert doc["run"]["joined"] == doc["run"]["records"]  # every record met its trace
    refactor = {v["rule"]: v for v in doc["verdicts"]}["refactor"]
    assert refactor["status"] == "fail"
    tpot = next(
        d for d in refactor["details"] if (d["metric"], d["statistic"]) == ("tpot_ms", "p50")
    )
    assert tpot["verdict"] == "regression"
    assert 15 < tpot["delta_pct"] < 45, tpot
    assert "decode" in refactor["reason"]  # the server phase that grew is named

    code = main(["analyze", same, "--baseline", baseline, "--rules", str(rules_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads((Path(same) / "verdict.json").read_text())
    verdicts = {v["rule"]: v for v in doc["verdicts"]}
    assert verdicts["refactor"]["status"] in ("pass", "inconclusive"), verdicts["refactor"]
    assert verdicts["error_rate"]["status"] == "pass"
    assert verdicts["token_counts"]["status"] == "pass"
