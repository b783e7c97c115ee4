"""Soak stages (spec §13) against the real simulator: a time-scaled dev-soak rehearsal
passes with the simulator's leak knob off and reports the leak (exit 1) with it on;
resources and traces are collected during the run; the client's memory stays flat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from calculet_load.soak import STAGE_DIR, load_stage
from tests.conftest import REPO
from tests.simproc import ADMIN_TOKEN, SimProcess

StartSim = Callable[..., SimProcess]
MANIFEST = REPO / "configs" / "manifest.sim.yaml"
RULES = REPO / "tests" / "load" / "data" / "soak-rules.yaml"
FAST = ("--time-scale", "0.02")
# dev: 3600 target s x 0.5 x 0.02 = 36 s real, at 0.7 x 0.25 req per target s = 8.75/s real
REHEARSAL = ("--stage", "dev", "--duration-scale", "0.5", "--target-rate", "0.25")
LEAK = (
    "--set", "knobs.leak.fds_per_request=1",
    "--set", "knobs.leak.rss_bytes_per_request=262144",
)  # fmt: skip


def soak(sim: SimProcess, run_dir: Path, *args: str) -> tuple[int, str]:
    env = {**os.environ, "CALCULET_ADMIN_TOKEN": ADMIN_TOKEN}
    cmd = [sys.executable, "-m", "calculet_load.cli", "soak", "--manifest", str(MANIFEST)]
    cmd += ["--url", sim.url, "--run-dir", str(run_dir), "--rules", str(RULES), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def conditions(run_dir: Path) -> dict[str, dict[str, Any]]:
    doc = json.loads((run_dir / "soak.json").read_text())
    return {c["condition"]: c for c in doc["conditions"]}


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_stages_of_the_spec_are_data() -> None:
    stages = {p.stem: load_stage(p.stem) for p in STAGE_DIR.glob("*.yaml")}
    hours = {name: s.duration_s / 3600 for name, s in stages.items()}
    assert hours == {"smoke": 1 / 6, "dev": 1, "candidate": 8, "release": 24, "endurance": 72}
    assert stages["dev"].load.rate_fraction == 0.7
    assert stages["candidate"].bursts is not None and stages["release"].bursts is not None
    assert stages["smoke"].load.kind == "closed" and stages["smoke"].pass_.golden


def test_dev_rehearsal_passes_without_leak(start_sim: StartSim, tmp_path: Path) -> None:
    sim = start_sim(*FAST, faults=True)
    code, out = soak(sim, tmp_path, *REHEARSAL)
    assert code == 0, out[-3000:]
    doc = json.loads((tmp_path / "soak.json").read_text())
    assert doc["verdict"] == "PASS" and doc["duration_scale"] == 0.5 and doc["rehearsal"]
    c = conditions(tmp_path)
    assert c["no leak"]["ok"] is True and not c["no leak"]["observed"]["leaking"]
    assert c["no hang"]["ok"] and c["no abort"]["ok"] and c["error rate"]["ok"]
    assert c["analysis"]["ok"]
    # the client's memory is flat over the stage (Theil–Sen slope under the gate)
    client = c["client memory flat"]
    assert client["ok"] is True, client
    assert client["observed"]["samples"] >= 40
    # resources and traces were collected during the run, not only at its end
    res = jsonl(tmp_path / "server" / "resources.jsonl")
    span_s = (res[-1]["mono_ns"] - res[0]["mono_ns"]) / 1e9
    assert len(res) >= 40 and span_s >= 0.9 * doc["run_duration_real_s"]
    assert doc["trace_collections"] >= 10
    events = jsonl(tmp_path / "server" / "server_events.jsonl")
    finished = {e["request_id"] for e in events if e["event"] == "finished"}
    assert len(finished) >= 0.95 * c["error rate"]["observed"]["sent"]
    assert (tmp_path / "verdict.json").exists() and (tmp_path / "client" / "index.json").exists()


def test_dev_rehearsal_reports_the_leak(start_sim: StartSim, tmp_path: Path) -> None:
    sim = start_sim(*FAST, *LEAK, faults=True)
    code, out = soak(sim, tmp_path, *REHEARSAL)
    assert code == 1, out[-3000:]
    c = conditions(tmp_path)
    leak = c["no leak"]
    assert leak["ok"] is False
    leaking = {r["series"] for r in leak["observed"]["leaking"]}
    assert {"fds", "rss_bytes"} <= leaking, leak
    assert "FAIL no leak" in out
    assert c["no hang"]["ok"] and c["no abort"]["ok"]  # a leak, nothing else


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "calculet_load.cli", "soak", "--manifest", str(MANIFEST)]
    for extra, message in (
        (["--stage", "nope"], "known stages"),
        (["--stage", "dev", "--duration-scale", "2"], "--duration-scale"),
    ):
        proc = subprocess.run([*cmd, *extra, "--run-dir", str(tmp_path)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


pytestmark = pytest.mark.timeout(300)
