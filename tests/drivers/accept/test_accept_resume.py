"""`accept --resume` of a run killed before its plan existed: the cut attempt is
set aside, kept, and the run starts over in the same folder."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.acceptkit import (
    CLI,
    SMALL_MATRIX,
    accept_args,
    accept_sim,
    child_env,
    read_events,
    read_plan,
    record_rows,
    relaxed_rules,
    write_manifest,
    write_matrix,
)
from tests.support.simproc import SimProcess


def test_a_run_killed_before_its_plan_restarts_and_keeps_the_cut_attempt_aside(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    procs: list[subprocess.Popen[Any]],
    signing_key: Path,
) -> None:
    sim = accept_sim(start_sim)
    run_dir = tmp_path / "run"
    args = accept_args(
        write_manifest(tmp_path, sim.url), write_matrix(tmp_path, SMALL_MATRIX[:2]), run_dir
    )
    args += ["--min-repetitions", "5", "--rules", str(relaxed_rules(tmp_path)), "--skip-report"]
    env = child_env(signing_key)
    first = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, env=env)
    procs.append(first)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill it once it is in the warmup: records, no plan
        events = read_events(run_dir) if (run_dir / "events.jsonl").exists() else []
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
    assert any(e["step"] == "golden_before" for e in read_events(aside))
    # …and out of the run: one golden pass before, one after, all from the new attempt
    golden = [r for r in record_rows(run_dir) if r["cell"].startswith("golden_before")]
    assert len(golden) == 4 and {r["worker"] for r in golden} == {"w00"}
    assert read_events(run_dir)[0]["step"] == "run" and read_events(run_dir)[0]["status"] == "start"
    assert all(c["status"] == "done" for c in read_plan(run_dir)["cells"])
