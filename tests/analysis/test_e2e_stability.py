"""End to end on loopback, real simulator and Locust: the simulator's leak knob gives a
LEAK verdict and exit 1 (its absence none), from resources sampled during the run; a
fault scenario in its broken mode gives exit 1 where the designed mode passes."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.judge.rules import DEFAULT_RULES
from calculet_drivers.cli import main
from calculet_load.target.resources import ResourceSampler, sample_resources
from tests.support.locustproc import LocustRun
from tests.support.simproc import ADMIN_TOKEN, SimProcess

# the leak's RSS growth needs the request count a quiet machine reaches; the fault run's
# time-scaled simulator needs its timing (quiet: after the parallel phase, beside one other
# file at most)
pytestmark = pytest.mark.quiet

StartSim = Callable[..., SimProcess]
SCALE = ["--time-scale", "0.02"]  # 50 server seconds per second
LOAD = ["-u", "2", "-r", "2", "--prompt-tokens", "16", "--max-tokens", "8"]
LEAK = ["--set", "knobs.leak.rss_bytes_per_request=65536",
        "--set", "knobs.leak.device_mib_per_request=0.05"]  # fmt: skip


def _rules(tmp: Path, **edits: Any) -> str:
    """The default rules, except that this shared machine's own load must not make the
    run infrastructure-invalid (that check has its own tests)."""
    rules = yaml.safe_load(DEFAULT_RULES.read_text())
    rules["infrastructure"]["max_saturated_fraction"] = None
    for r in rules["rules"]:
        r.update(edits.get(r["id"], {}))
    path = tmp / f"rules-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(rules))
    return str(path)


def _collect(sim: SimProcess, run: LocustRun, *, failures: bool = False) -> str:
    # Locust itself exits 1 when requests failed: expected under an armed fault
    assert run.wait(90) in ((0, 1) if failures else (0,)), run.log_text()
    sim.stop()  # flushes the traces
    shutil.copytree(sim.trace_dir, run.run_dir / "server", dirs_exist_ok=True)
    return str(run.run_dir)


class _SampledRun:
    """A 12 s Locust run; resources sampled every 0.2 s from when the load is on until
    after it stopped (the last sample is idle). Started, then finished: two of them run
    side by side."""

    def __init__(self, start_sim: StartSim, tmp: Path, *sim_args: str) -> None:
        self.sim = start_sim(*SCALE, *sim_args, faults=True)
        self.run = LocustRun(tmp, self.sim.url, LOAD, workers=0, run_time_s=12).start()
        self.sampler: ResourceSampler | None = None

    def sample_when_loaded(self) -> None:
        deadline = time.monotonic() + 30
        while (sample_resources(self.sim.url).get("sequences_active") or 0) == 0:
            assert time.monotonic() < deadline, self.run.log_text()
            time.sleep(0.05)
        path = self.run.run_dir / "server" / "resources.jsonl"
        self.sampler = ResourceSampler(self.sim.url, path, admin_token=ADMIN_TOKEN, interval_s=0.2)
        self.sampler.start()

    def finish(self) -> str:
        assert self.sampler is not None
        assert self.run.wait(90) == 0, self.run.log_text()
        self.sampler.stop()
        assert self.sampler.samples >= 30 and self.sampler.failures == 0
        return _collect(self.sim, self.run)


def _verdicts(run_dir: str) -> dict[str, dict[str, Any]]:
    doc = json.loads((Path(run_dir) / "verdict.json").read_text())
    return {v["rule"]: v for v in doc["verdicts"]}


def test_the_leak_knob_gives_a_leak_verdict_and_exit_1(
    tmp_path: Path, start_sim: StartSim, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [_SampledRun(start_sim, tmp_path, *LEAK), _SampledRun(start_sim, tmp_path)]
    for run in runs:
        run.sample_when_loaded()
    leaky, clean = (run.finish() for run in runs)
    rules = _rules(tmp_path)

    code = main(["analyze", leaky, "--rules", rules])
    out = capsys.readouterr().out
    assert code == 1, out
    v = _verdicts(leaky)
    for series in ("rss_bytes", "device_memory_mib"):
        assert v[f"leaks.{series}"]["status"] == "fail", v[f"leaks.{series}"]["reason"]
    # 64 KiB per request at hundreds of requests per second: far above the 64 MiB/h gate
    assert v["leaks.rss_bytes"]["observed"] > 4 * 64 * 2**20
    assert v["leaks.fds"]["status"] == "pass"
    assert v["leaks.idle_baseline"]["status"] == "pass"  # released when idle: not a KV leak
    assert v["error_rate"]["status"] == "pass"  # a leak is not an error

    code = main(["analyze", clean, "--rules", rules])
    out = capsys.readouterr().out
    assert code == 0, out
    v = _verdicts(clean)
    leaks = {k: x for k, x in v.items() if k.startswith("leaks.")}
    assert all(x["status"] != "fail" for x in leaks.values()), leaks
    assert v["leaks.rss_bytes"]["status"] == "pass"


def _fault_run(start_sim: StartSim, tmp: Path, *, broken: bool) -> tuple[SimProcess, LocustRun]:
    sim = start_sim(*SCALE, faults=True)
    fault = {"scenario": "output_nan", "broken": broken, "probability": 0.2}
    status, body = sim.admin("POST", "/admin/faults", fault)
    assert status == 200, body
    return sim, LocustRun(tmp, sim.url, LOAD, workers=0, run_time_s=6).start()


def test_a_fault_in_its_broken_mode_exits_1_where_the_designed_mode_passes(
    tmp_path: Path, start_sim: StartSim, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [_fault_run(start_sim, tmp_path, broken=b) for b in (False, True)]  # side by side
    designed, broken = (_collect(sim, run, failures=True) for sim, run in runs)
    # §12.2 output NaN: the designed behaviour fails the request (500, numeric check), so
    # a fault-scenario run allows errors; NaN must never reach a success response
    rules = _rules(tmp_path, error_rate={"max_error_rate": 1.0})

    code = main(["analyze", designed, "--rules", rules])
    out = capsys.readouterr().out
    assert code == 0, out
    v = _verdicts(designed)
    assert v["no_nonfinite"]["status"] == "pass"
    assert v["error_rate"]["observed"] > 0  # the designed 500s are there

    code = main(["analyze", broken, "--rules", rules])
    out = capsys.readouterr().out
    assert code == 1, out
    v = _verdicts(broken)
    assert v["no_nonfinite"]["status"] == "fail"
    assert v["no_nonfinite"]["observed"] > 0
    assert "NaN" in out or "nonfinite" in out
