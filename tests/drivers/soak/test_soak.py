"""Soak stages (spec §13) against the real simulator: a time-scaled dev-soak rehearsal
passes with the simulator's leak knob off and reports the leak (exit 1) with it on;
resources and traces are collected during the run; the client's memory stays flat. A
soak killed mid-stage (SIGKILL) and resumed ends at its planned end with the gap
recorded; one stopped by SIGTERM leaves every record on disk and resumes.

Acceptance rules: the default rules (configs/acceptance/default.yaml), with two bounds of
its infrastructure section widened (`bounded_rules`): the client-saturation share from
5% to 20%, and the open-loop send-lag P99 from 10 ms to 50 ms. This 2-core host runs the
simulator, the soak client and other jobs at once; on a quiet host the rehearsal sees
0% saturated and a P99 of ~6 ms, under contention tens of ms. The widened bounds
still catch a broken client mechanism: building each prompt (a tokenizer round trip) on
the send path, as the soak did before, gave 12–34% saturated and a P99 of 100–145 ms.
Every other rule, and every other infrastructure check, is the default's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from calculet_drivers.soak.stage import STAGE_DIR, load_stage
from tests.conftest import REPO
from tests.support.simproc import ADMIN_TOKEN, SimProcess

StartSim = Callable[..., SimProcess]
MANIFEST = REPO / "configs" / "manifest.sim.yaml"
DEFAULT_RULES = REPO / "configs" / "acceptance" / "default.yaml"
FAST = ("--time-scale", "0.02")
# dev: 3600 target s x 0.5 x 0.02 = 36 s real, at 0.7 x 0.25 req per target s = 8.75/s real
REHEARSAL = ("--stage", "dev", "--duration-scale", "0.5", "--target-rate", "0.25")
LEAK = (
    "--set", "knobs.leak.fds_per_request=1",
    "--set", "knobs.leak.rss_bytes_per_request=262144",
)  # fmt: skip


def bounded_rules(folder: Path) -> Path:
    """The default rules with the saturation and send-lag bounds widened to what only a
    broken client mechanism exceeds on this shared host (see the module docstring)."""
    rules = yaml.safe_load(DEFAULT_RULES.read_text())
    rules["infrastructure"]["max_saturated_fraction"] = 0.20
    rules["infrastructure"]["max_send_lag_p99_ms"] = 50.0
    path = folder / "soak-rules.yaml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def soak_cmd(sim: SimProcess, run_dir: Path, *args: str) -> list[str]:
    cmd = [sys.executable, "-m", "calculet_drivers.cli", "soak", "--manifest", str(MANIFEST)]
    rules = bounded_rules(run_dir.parent)
    return [*cmd, "--url", sim.url, "--run-dir", str(run_dir), "--rules", str(rules), *args]


ENV = {**os.environ, "CALCULET_ADMIN_TOKEN": ADMIN_TOKEN}


def soak(sim: SimProcess, run_dir: Path, *args: str) -> tuple[int, str]:
    cmd = soak_cmd(sim, run_dir, *args)
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
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


# The leak rule reads trends of the simulator's resources: on a busy machine its starved
# requests hold leases longer as the run goes on, a trend the rule cannot tell from a leak
# (leases_unavailable +1.4/h in a fresh-clone run's parallel phase): two neighbours at most.
@pytest.mark.quiet
def test_dev_rehearsal_passes_without_leak(start_sim: StartSim, tmp_path: Path) -> None:
    sim = start_sim(*FAST, faults=True)
    tmp_path = tmp_path / "run"
    code, out = soak(sim, tmp_path, *REHEARSAL)
    assert code == 0, out[-3000:]
    doc = json.loads((tmp_path / "soak.json").read_text())
    assert doc["verdict"] == "PASS" and doc["duration_scale"] == 0.5 and doc["rehearsal"]
    c = conditions(tmp_path)
    assert c["no leak"]["ok"] is True and not c["no leak"]["observed"]["leaking"]
    assert c["no hang"]["ok"] and c["no abort"]["ok"] and c["error rate"]["ok"]
    assert c["analysis"]["ok"]
    # the client's memory is flat over the stage (Theil–Sen slope under the gate, or a
    # rise under the allocators' step): the stage's own condition, judged here (not "n/a")
    client = c["client memory flat"]
    assert client["ok"] is True, client
    assert client["observed"]["samples"] >= 40
    obs = client["observed"]
    assert obs["slope_mib_per_h"] <= 256 or obs["rise_mib"] < 8, obs
    assert c["client continuity"]["ok"] is True and doc["gaps"] == []
    # the default infrastructure checks ran (bounded, not disabled)
    infra = {r["rule"]: r for r in json.loads((tmp_path / "verdict.json").read_text())["verdicts"]
             if r["rule"] in ("client_saturation", "send_lag")}  # fmt: skip
    assert {r["status"] for r in infra.values()} == {"pass"}, infra
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
    tmp_path = tmp_path / "run"
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
    cmd = [sys.executable, "-m", "calculet_drivers.cli", "soak", "--manifest", str(MANIFEST)]
    for extra, message in (
        (["--stage", "nope"], "known stages"),
        (["--stage", "dev", "--duration-scale", "2"], "--duration-scale"),
        (["--stage", "dev", "--resume", str(tmp_path)], "not a soak run"),
    ):
        proc = subprocess.run([*cmd, *extra, "--run-dir", str(tmp_path)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def _records(run_dir: Path) -> pa.Table:
    cols = ["request_id", "ext.worker", "ext.wall_anchor_ns", "ext.cell"]
    parts = sorted((run_dir / "client").glob("*/part-*.requests.parquet"))
    return pa.concat_tables([pq.read_table(p, columns=cols) for p in parts])


def _wait_for_load(run_dir: Path, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    state = run_dir / "soak" / "state.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the soak ended before its load started"
        if state.exists() and json.loads(state.read_text()).get("status") == "running":
            return
        time.sleep(0.1)
    raise AssertionError("the soak's load did not start")


def test_killed_soak_resumes_to_its_planned_end_and_records_the_gap(
    start_sim: StartSim, tmp_path: Path
) -> None:
    """SIGKILL a dev rehearsal (36 s real) 12 s into its load, re-run the same command
    with --resume: the stage ends at its planned end (wall clock), both processes'
    records are kept under distinct workers, the gap is recorded with its bounds, and the
    verdict is INCOMPLETE (exit 3) while every condition on the target passes."""
    sim = start_sim(*FAST, faults=True)
    run = tmp_path / "run"
    cmd = soak_cmd(sim, run, *REHEARSAL)
    with (tmp_path / "first.log").open("wb") as log:
        first = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        _wait_for_load(run, first)
        time.sleep(12)
        killed_ns = time.time_ns()
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
    state = json.loads((run / "soak" / "state.json").read_text())
    assert state["status"] == "running" and [a["worker"] for a in state["attempts"]] == ["w00"]
    assert not (run / "soak.json").exists()
    time.sleep(2)
    resumed_ns = time.time_ns()
    code, out = soak(sim, run, *REHEARSAL, "--resume", str(run))
    assert code == 3, out[-3000:]
    doc = json.loads((run / "soak.json").read_text())
    assert doc["verdict"] == "INCOMPLETE" and doc["exit_code"] == 3

    # the stage's clock continued: the resumed attempt loaded until the planned end
    planned_start, planned_end = doc["planned_start_wall_ns"], doc["planned_end_wall_ns"]
    assert planned_end - planned_start == pytest.approx(doc["run_duration_real_s"] * 1e9, abs=1e6)
    w0, w1 = doc["attempts"]
    assert (w0["worker"], w0["status"]) == ("w00", "killed")
    assert (w1["worker"], w1["status"]) == ("w00-r1", "finished")
    assert planned_end <= w1["load_ended_wall_ns"] <= planned_end + 5e9

    # records of both processes, under distinct worker names, no request twice
    rec = _records(run)
    workers = rec.column("ext.worker").to_pylist()
    assert set(workers) == {"w00", "w00-r1"} and min(map(workers.count, {"w00", "w00-r1"})) >= 50
    ids = rec.column("request_id").to_pylist()
    assert len(ids) == len(set(ids))
    index = json.loads((run / "client" / "index.json").read_text())
    assert [w["worker"] for w in index["workers"]] == ["w00", "w00-r1"]
    assert index["workers"][0]["open_part_lost"] is True and index["status"] == "complete"
    anchors = [a for a, w in zip(rec.column("ext.wall_anchor_ns").to_pylist(), workers,
                                 strict=True) if w == "w00-r1" and a is not None]  # fmt: skip
    assert planned_end - 2e9 < max(anchors) < planned_end + 1e9  # load up to the end
    assert min(a for a, w in zip(rec.column("ext.wall_anchor_ns").to_pylist(), workers,
                                 strict=True) if w == "w00" and a) < killed_ns  # fmt: skip

    # the gap: from the dead process' last record or sample to the resume
    (gap,) = doc["gaps"]
    assert killed_ns - 3e9 <= gap["start_wall_ns"] <= killed_ns
    assert resumed_ns <= gap["end_wall_ns"] <= resumed_ns + 20e9
    assert gap["duration_s"] == pytest.approx((gap["end_wall_ns"] - gap["start_wall_ns"]) / 1e9,
                                              abs=2e-3)  # fmt: skip
    assert gap["duration_s"] >= 2.0
    assert "without a clean stop" in gap["reason"] and gap["open_part_lost"] is True
    assert gap["lost_requests"] == "unknown" and gap["lost_requests_at_least"] >= 0
    assert (gap["before_worker"], gap["after_worker"]) == ("w00", "w00-r1")
    events = jsonl(run / "events.jsonl")
    assert [e["status"] for e in events] == ["start", "gap", "resume", "end"]
    assert events[1]["start_wall_ns"] == gap["start_wall_ns"]
    assert "GAP  1:" in out
    # nothing was sampled in the gap, and the samples on either side are kept
    for name in ("soak/health.jsonl", "server/resources.jsonl", "client/resources.jsonl"):
        walls = [r["wall_ns"] for r in jsonl(run / name)]
        assert not [w for w in walls if gap["start_wall_ns"] < w < gap["end_wall_ns"]], name
        assert min(walls) < gap["start_wall_ns"] and max(walls) > gap["end_wall_ns"], name

    # judged: the target's conditions from its own samples; the client's restart is an
    # infrastructure failure, so the run is not a clean pass
    c = conditions(run)
    for name in ("error rate", "no hang", "no abort", "no leak", "analysis"):
        assert c[name]["class"] in ("target", "infrastructure"), c[name]
        # the analysis may also call the client saturated (infrastructure: this shared
        # 2-core machine's other tests starving it, as test_pipeline allows): not the target
        assert c[name]["ok"] is True or (name, c[name]["class"]) == (
            "analysis",
            "infrastructure",
        ), c[name]
    assert c["no abort"]["observed"]["unsampled"][0]["duration_s"] == gap["duration_s"]
    leak = c["no leak"]["observed"]
    assert [s["worker"] for s in leak["segments"]] == ["w00", "w00-r1"]
    assert "joined across 1 gap" in leak["joined"]["note"]
    client = c["client memory flat"]["observed"]["segments"]  # per process, never joined
    assert [s["worker"] for s in client] == ["w00", "w00-r1"]
    cont = c["client continuity"]
    assert cont["ok"] is False and cont["class"] == "infrastructure"
    assert cont["observed"]["gaps"] == 1 and 0.5 < cont["observed"]["coverage"] < 1
    # the HTML report shows the gap, in its notes and in the soak's section (the view
    # model of `calculet-load report`; rendering the whole report here would cost 15 s)
    from analysis.tables.runfiles import RunFiles
    from analysis.views.model import RunView, fmt_num
    from analysis.views.soakgaps import gap_notes, soak_verdict_section

    view = RunView(RunFiles(str(run)))
    assert gap_notes(view) == [
        f"soak gap 1: no client from {gap['start']} to {gap['end']} "
        f"({fmt_num(gap['duration_s'])} s real): {gap['reason']}; nothing was sent or sampled "
        "in it; the killed process' open part was lost"
    ]
    section = soak_verdict_section(view)
    assert "INCOMPLETE (exit 3)" in section.intro[0]
    (row,) = section.tables[0].rows
    assert row[:3] == ("1", gap["start"], gap["end"]) and section.tables[0].name == "soak-gaps"
    # a finished run is not resumed again
    code, out = soak(sim, run, *REHEARSAL, "--resume", str(run))
    assert code == 2 and "finished already" in out


@pytest.mark.slow  # the kill-and-resume test above covers the resume; this, SIGTERM
def test_sigterm_flushes_and_leaves_a_resumable_state(start_sim: StartSim, tmp_path: Path) -> None:
    """SIGTERM mid-stage: exit 143, every record of the process on disk (nothing lost),
    state `interrupted`; --resume finishes the stage with a gap marked as a clean stop."""
    sim = start_sim(*FAST, faults=True)
    run = tmp_path / "run"
    args = ("--stage", "dev", "--duration-scale", "0.2", "--target-rate", "0.25")  # 14.4 s
    first = subprocess.Popen(soak_cmd(sim, run, *args), cwd=REPO, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    _wait_for_load(run, first)
    time.sleep(5)
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=60)
    assert first.returncode == 143, out.decode()[-2000:]
    state = json.loads((run / "soak" / "state.json").read_text())
    assert state["status"] == "interrupted"
    (attempt,) = state["attempts"]
    assert attempt["status"] == "terminated" and attempt["signal"] == "SIGTERM"
    sent = jsonl(run / "client" / "resources.jsonl")[-1]["sent"]
    assert sent > 0 and _records(run).num_rows >= sent  # flushed: nothing lost
    assert json.loads((run / "client" / "index.json").read_text())["status"] == "interrupted"
    code, text = soak(sim, run, *args, "--resume", str(run))
    assert code == 3, text[-3000:]
    (gap,) = json.loads((run / "soak.json").read_text())["gaps"]
    assert gap["open_part_lost"] is False and "SIGTERM" in gap["reason"]
    assert gap["start_evidence"] == "clean stop"


pytestmark = pytest.mark.timeout(300)
