"""`accept --resume` of a run killed before its plan existed (issue 7): the cut attempt is
set aside, kept, and the run starts over in the same folder."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.load.test_pipeline import (  # noqa: F401  (fixtures: accept_env, procs, signing_key)
    CLI,
    SMALL_MATRIX,
    _accept,
    _child_env,
    _events,
    _manifest,
    _matrix,
    _plan,
    _records,
    _relaxed_rules,
    _sim,
    accept_env,
    procs,
    signing_key,
)
from tests.simproc import SimProcess


def test_a_run_killed_before_its_plan_restarts_and_keeps_the_cut_attempt_aside(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    procs: list[subprocess.Popen[Any]],  # noqa: F811
    signing_key: Path,  # noqa: F811
) -> None:
    sim = _sim(start_sim)
    run_dir = tmp_path / "run"
    args = _accept(_manifest(tmp_path, sim.url), _matrix(tmp_path, SMALL_MATRIX[:2]), run_dir)
    args += ["--min-repetitions", "5", "--rules", str(_relaxed_rules(tmp_path)), "--skip-report"]
    env = _child_env(signing_key)
    first = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, env=env)
    procs.append(first)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill it once it is in the warmup: records, no plan
        events = _events(run_dir) if (run_dir / "events.jsonl").exists() else []
        if any(e["step"] == "warmup" for e in events):
            break
        time.sleep(0.05)
    first.kill()
    first.wait(30)
    assert not (run_dir / "plan.json").exists()

    again = subprocess.run([*CLI, *args, "--resume"], capture_output=True, text=True, env=env,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:]
    aside = run_dir / "aborted" / "attempt-1"
    assert (aside / "events.jsonl").exists()  # the cut attempt is kept…
    assert any(e["step"] == "golden_before" for e in _events(aside))
    # …and out of the run: one golden pass before, one after, all from the new attempt
    golden = [r for r in _records(run_dir) if r["cell"].startswith("golden_before")]
    assert len(golden) == 4 and {r["worker"] for r in golden} == {"w00"}
    assert _events(run_dir)[0]["step"] == "run" and _events(run_dir)[0]["status"] == "start"
    assert all(c["status"] == "done" for c in _plan(run_dir)["cells"])
