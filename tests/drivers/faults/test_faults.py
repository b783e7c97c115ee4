"""The fault matrix (`calculet-load faults`, spec §12.1–§12.4) against the real simulator.

Designed behaviour: the whole matrix runs once on one shared simulator (time scale 0.02,
faults enabled) under a manifest that authorizes maintenance actions (§12.4), and every
scenario must PASS, exit 0. Broken modes: each scenario runs alone on a fresh simulator
with its `target_fault` armed broken; it must FAIL (exit 1) with evidence naming the
expectation the broken mode violates. Without the authorization: tests/drivers/faults/
test_maintenance.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from calculet_drivers.faults.check import check_requests
from calculet_drivers.faults.facts import released_in_flight, shared_leases
from calculet_drivers.faults.observe import Observation, ReqObs
from calculet_drivers.faults.spec import RequestCheck, load_scenarios
from tests.conftest import REPO
from tests.support.simproc import ADMIN_TOKEN, SimProcess

StartSim = Callable[..., SimProcess]
SCENARIO_DIR = REPO / "configs" / "faults"
MANIFEST = REPO / "configs" / "manifest.sim.yaml"
GOLDEN = REPO / "configs" / "golden" / "sim.yaml"
SCENARIOS = [s.name for s in load_scenarios(SCENARIO_DIR)]
FAST = ("--time-scale", "0.02")
Designed = tuple[int, dict[str, Any], Path]

# The check each scenario's broken mode must fail (a substring of the check's name).
BROKEN_EVIDENCE = {
    "illegal_length": "requests[illegal]",
    "kv_full": "fact cpu_share.kv_wait",
    "buffer_pool_full": "invariant: no OutputBuf lease shared",
    "cancel_waiting": "state slots.in_use",
    "cancel_submitted": "fact released_in_flight",
    "device_busy": "state reset_count",
    "device_unavailable": "events[reset]",
    "wait_timeout": "events[quarantine]",
    "ccu_exception": "events[logits_ready]",
    "invalid_shape": "state reset_count",
    "stale_completion": "events[stale_completion_delivered]",
    "output_nan": "invariant: no NaN/Inf",
    "load_while_ready": "fact generation_switch_after_drain",
    "configure_failure": "admin load",
    "reset_failure": "invariant: ready after recovery",
    "repeated_faults": "fact reset_backoffs",
    "shutdown_with_queue": "requests[running]",
    "maintenance_window": "audit log: only appended to",
}
AUTHORIZATION = {
    "operator": "alice@example.com",
    "window": {"duration_s": 3600},
    "actions": ["device_reset", "reload", "shutdown"],
    "ticket": "CHG-0001",
}


def manifest_file(tmp: Path, maintenance: dict[str, Any] | None = AUTHORIZATION) -> Path:
    """configs/manifest.sim.yaml, with this maintenance authorization (None: without)."""
    import yaml

    data = yaml.safe_load(MANIFEST.read_text())
    data.pop("maintenance", None)
    if maintenance is not None:
        data["maintenance"] = maintenance
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"manifest-{len(list(tmp.glob('manifest-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def faults_cli(
    sim: SimProcess,
    run_dir: Path,
    *args: str,
    token: bool = True,
    maintenance: dict[str, Any] | None = AUTHORIZATION,
) -> int:
    env = dict(os.environ)
    env.pop("CALCULET_ADMIN_TOKEN", None)
    if token:
        env["CALCULET_ADMIN_TOKEN"] = ADMIN_TOKEN
    manifest = manifest_file(run_dir.parent / f"{run_dir.name}-manifests", maintenance)
    cmd = [sys.executable, "-m", "calculet_drivers.cli", "faults", "--manifest", str(manifest)]
    cmd += ["--url", sim.url, "--run-dir", str(run_dir), "--scenarios", str(SCENARIO_DIR)]
    proc = subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, timeout=600)
    (run_dir / "cli.log").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "cli.log").write_bytes(proc.stdout + proc.stderr)
    return proc.returncode


def document(run_dir: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((run_dir / "faults.json").read_text())
    return doc


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in doc["scenarios"]}


def test_every_scenario_of_the_spec_has_a_file() -> None:
    assert set(SCENARIOS) == set(BROKEN_EVIDENCE)
    sections = {s.name: s.section for s in load_scenarios(SCENARIO_DIR)}
    assert sorted(set(sections.values())) == ["12.1", "12.2", "12.3", "12.4"]
    assert SCENARIOS[-1] == "shutdown_with_queue"  # stops the target: always last


# ------------------------------------------------------------------ designed behaviour
# Every matrix here runs a 50x time-scaled simulator: its backoffs and waits are short
# enough that a busy machine turns a designed PASS into a FAIL, and even one neighbour of
# the quiet phase did (repeated_faults' backoff doubling): the designed runs go alone
# (serial). A broken mode fails whatever the load (a busy machine adds failures, never
# the missing evidence): those run side by side with the rest of the suite.
@pytest.fixture(scope="module")
def designed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Designed]:
    tmp = tmp_path_factory.mktemp("faults-designed")
    sim = SimProcess(tmp, *FAST, faults=True)
    try:
        code = faults_cli(sim, tmp / "run", "--golden", str(GOLDEN), "--allow-stop")
        yield code, document(tmp / "run"), tmp / "run"
    finally:
        sim.stop()


@pytest.mark.serial
def test_designed_matrix_exits_0(designed: Designed) -> None:
    code, doc, _ = designed
    failed = {s["name"]: s["evidence"] for s in doc["scenarios"] if s["verdict"] != "PASS"}
    assert code == 0, json.dumps(failed, indent=1, default=str)[:4000]
    assert doc["summary"] == {"PASS": len(SCENARIOS), "FAIL": 0, "ERROR": 0, "SKIPPED": 0,
                              "NOT_RUN": 0, "NOT_AVAILABLE": 0}  # fmt: skip
    assert doc["maintenance_authorization"]["operator"] == "alice@example.com"
    assert doc["time_scale"] == 0.02


@pytest.mark.serial
@pytest.mark.parametrize("name", SCENARIOS)
def test_designed_behaviour_passes(designed: Designed, name: str) -> None:
    sc = by_name(designed[1])[name]
    assert sc["verdict"] == "PASS", json.dumps(sc["evidence"], indent=1, default=str)[:3000]
    assert sc["broken_rehearsal"] is False
    assert len(sc["checks"]) >= 4 and all(c["ok"] for c in sc["checks"])
    assert sc["requests"], "the scenario sent requests"
    if name != "shutdown_with_queue":
        assert sc["golden_after"]["passed"] is True  # golden passes after recovery
        assert sc["state_after"]["state"] == "ready"


@pytest.mark.serial
def test_designed_run_folder(designed: Designed) -> None:
    _, doc, run = designed
    # the scenario requests' records stay apart from the performance records
    assert list((run / "faults" / "client" / "faults").glob("part-*.requests.parquet"))
    assert not (run / "client").exists()
    text = (run / "faults" / "server_events.jsonl").read_text()
    rows = [json.loads(x) for x in text.splitlines()]
    assert {r["scenario"] for r in rows} == set(SCENARIOS)
    reset_free = {"illegal_length", "kv_full", "device_busy", "invalid_shape", "output_nan"}
    for name in reset_free:
        assert by_name(doc)[name]["facts"]["resets"] == 0, name
    # every maintenance action the matrix performed is recorded (spec §12.4)
    records = [
        json.loads(x) for x in (run / "faults" / "maintenance.jsonl").read_text().splitlines()
    ]
    performed = {(r["scenario"], r["action"]) for r in records}
    assert performed == {
        ("invalid_shape", "reload"), ("load_while_ready", "reload"),
        ("configure_failure", "reload"), ("reset_failure", "device_reset"),
        ("repeated_faults", "device_reset"), ("maintenance_window", "device_reset"),
        ("shutdown_with_queue", "shutdown"),
    }  # fmt: skip
    for r in records:
        assert r["operator"] == "alice@example.com" and r["ticket"] == "CHG-0001"
        assert r["before"]["versions"] and r["after"]["versions"], r
        assert r["before"]["health"]["status"] == 200 and r["in_flight"]["target"] is not None
        assert r["affected"] is not None and r["recovery"] is not None
        assert r["audit_row"]["operator"] == "alice@example.com", r
    for name, sc in by_name(doc).items():  # the audit log checked wherever one was performed
        audit = [c for c in sc["checks"] if c["check"].startswith("audit log")]
        assert bool(audit) == bool(sc["maintenance_actions"]), name


# ------------------------------------------------------------------------ broken modes
# kv_full's evidence is the share of CPU spent waiting on the KV cache: a busy machine
# can make the broken mode look like the designed one, so that one runs alone too
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.serial) if n == "kv_full" else n for n in SCENARIOS],
)
def test_broken_mode_fails_with_evidence(start_sim: StartSim, tmp_path: Path, name: str) -> None:
    sim = start_sim(*FAST, faults=True)
    code = faults_cli(sim, tmp_path, "--only", name, "--broken", name, "--allow-stop")
    log = (tmp_path / "cli.log").read_text()
    assert code == 1, log[-2000:]
    sc = by_name(document(tmp_path))[name]
    assert sc["verdict"] == "FAIL" and sc["broken_rehearsal"] is True
    names = [e["check"] for e in sc["evidence"]]
    assert any(BROKEN_EVIDENCE[name] in n for n in names), names
    for ev in sc["evidence"]:  # evidence: what was expected and what was observed
        assert ev["ok"] is False and "expected" in ev and "observed" in ev
    assert f"FAILED {BROKEN_EVIDENCE[name]}" in log or "FAILED" in log


# ------------------------------------------------------------------------ exit codes
def test_without_fault_api_is_infrastructure(start_sim: StartSim, tmp_path: Path) -> None:
    sim = start_sim(*FAST)  # no --enable-faults: /admin/* is 404
    assert faults_cli(sim, tmp_path, "--only", "device_busy") == 3
    doc = document(tmp_path)
    assert "no fault API" in doc["infrastructure_error"]


def test_invalid_scenario_file_exits_2(start_sim: StartSim, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    text = (SCENARIO_DIR / "12.2-1-device_busy.yaml").read_text()
    (bad / "x.yaml").write_text(text.replace('section: "12.2"', 'section: "12.9"'))
    env = {**os.environ, "CALCULET_ADMIN_TOKEN": ADMIN_TOKEN}
    cmd = [sys.executable, "-m", "calculet_drivers.cli", "faults", "--manifest", str(MANIFEST)]
    proc = subprocess.run([*cmd, "--scenarios", str(bad)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "x.yaml: section" in proc.stderr


def test_stop_scenario_skipped_without_allow_stop(start_sim: StartSim, tmp_path: Path) -> None:
    sim = start_sim(*FAST, faults=True)
    code = faults_cli(sim, tmp_path, "--only", "configure_failure,shutdown_with_queue")
    doc = by_name(document(tmp_path))
    assert code == 0
    assert doc["configure_failure"]["verdict"] == "PASS"
    assert doc["shutdown_with_queue"]["verdict"] == "SKIPPED"
    assert sim.state()["state"] == "ready"


# ------------------------------------------------------------------------ judging units
def _obs(reqs: list[ReqObs], events: list[dict[str, Any]] | None = None) -> Observation:
    return Observation(scale=0.5, slack_s=0.1, requests=reqs, events=events or [])


def test_request_check_every_where_and_count() -> None:
    reqs = [
        ReqObs("g", None, status=503, error_type="admission_timeout", elapsed_s=10.0),
        ReqObs("g", None, status=429, error_type="queue_full", elapsed_s=0.01),
        ReqObs("h", None, status=200, elapsed_s=0.2),
    ]
    every = RequestCheck(group="g", status=[429, 503])
    assert check_requests(every, _obs(reqs)).ok
    # a bound in target seconds: 15 x 0.5 + 0.1 = 7.6 s real < 10 s observed
    slow = RequestCheck.model_validate({"group": "g", "where": {"status": 503},
                                        "latency_s": {"max": 15}})  # fmt: skip
    result = check_requests(slow, _obs(reqs))
    assert not result.ok and "latency 10.000 s real (20 s)" in json.dumps(result.observed)
    counted = RequestCheck.model_validate({"group": "*", "where": {"status": 429}, "count": 1})
    assert check_requests(counted, _obs(reqs)).ok
    none = RequestCheck.model_validate({"group": "h", "where": {"status": 500}, "status": 500})
    assert check_requests(none, _obs(reqs)).ok  # `where` selecting nothing holds
    missing = RequestCheck(group="nobody", status=200)
    assert check_requests(missing, _obs(reqs)).observed == "no such request"


def _ev(event: str, rid: str | None, t: int, **kw: Any) -> dict[str, Any]:
    return {"event": event, "request_id": rid, "mono_ns": t, "wall_ns": t, **kw}


def test_shared_lease_and_release_in_flight_detection() -> None:
    events = [
        _ev("admitted", "a", 1, detail={"lease": 0}),
        _ev("admitted", "b", 2, detail={"lease": 0}),  # a still holds lease 0
        _ev("finished", "a", 3),
        _ev("admitted", "c", 4, detail={"lease": 0}),  # b holds it now
    ]
    assert [s["request_id"] for s in shared_leases(events)] == ["b", "c"]
    ok = [_ev("admitted", "a", 1, detail={"lease": 0}), _ev("failed", "a", 2),
          _ev("admitted", "b", 3, detail={"lease": 0})]  # fmt: skip
    assert shared_leases(ok) == []
    cut = [
        _ev("submit_ok", "x", 1, job_id=7),
        _ev("cancelled", "x", 2, detail={"drained": False}),
        _ev("wait_done", "x", 3, job_id=7),
    ]
    assert released_in_flight(cut)[0]["jobs_in_flight"] == [7]
    drained = [
        _ev("submit_ok", "x", 1, job_id=7),
        _ev("cancelled", "x", 2, detail={"drained": "pending"}),
        _ev("wait_done", "x", 3, job_id=7),
        _ev("cancelled", "x", 4, detail={"drained": True}),
    ]
    assert released_in_flight(drained) == []


pytestmark = pytest.mark.timeout(900)


# ------------------------------------------------------------------ the accept step
def _accept(
    start_sim: StartSim,
    tmp_path: Path,
    broken: str | None,
    maintenance: dict[str, Any] | None = AUTHORIZATION,
) -> tuple[int, Path, str]:
    """`calculet-load accept --faults` with a one-cell matrix and one scenario."""
    import yaml

    manifest = yaml.safe_load(MANIFEST.read_text())
    sim = start_sim(*FAST, "--set", f"versions.calbin_sha256={manifest['model']['calbin_sha256']}",
                    faults=True)  # fmt: skip
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(
        "schema: calculet-matrix/v1\nname: tiny\nrepetitions: 30\n"
        "cells:\n  - {kind: single, prompt_tokens: 16, max_tokens: 8}\n"
    )
    env = {**os.environ, "CALCULET_ADMIN_TOKEN": ADMIN_TOKEN}
    env.pop("CALCULET_SIGNING_KEY_FILE", None)
    env.pop("CALCULET_SIGNING_KEY", None)
    if broken:
        env["CALCULET_FAULTS_BROKEN"] = broken
    run = tmp_path / "run"
    manifest_path = manifest_file(tmp_path / "manifests", maintenance)
    cmd = [sys.executable, "-m", "calculet_drivers.cli", "accept", "--manifest", str(manifest_path),
           "--matrix", str(matrix), "--golden", str(GOLDEN), "--url", sim.url,
           "--run-dir", str(run), "--faults", str(SCENARIO_DIR / "12.3-2-configure_failure.yaml"),
           "--idle-window-s", "0.3", "--idle-gap-s", "0", "--min-repetitions", "2",
           "--skip-report"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, run, proc.stdout + proc.stderr


def _steps(run: Path) -> list[tuple[str, str]]:
    rows = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    return [(r["step"], r["status"]) for r in rows]


@pytest.mark.serial
def test_accept_runs_the_fault_step(start_sim: StartSim, tmp_path: Path) -> None:
    code, run, out = _accept(start_sim, tmp_path, broken=None)
    steps = _steps(run)
    # after the matrix, before golden after
    order = [s for s, status in steps if status == "start"]
    assert order.index("matrix") < order.index("faults") < order.index("golden_after"), order
    end = next(json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()
               if '"faults"' in x and '"end"' in x)  # fmt: skip
    assert end["code"] == 0 and end["failed"] == [], out[-2000:]
    assert by_name(document(run))["configure_failure"]["verdict"] == "PASS"
    assert code in (0, 3), out[-3000:]  # 3 only if this busy host saturated the client


def test_accept_exits_1_with_a_broken_scenario(start_sim: StartSim, tmp_path: Path) -> None:
    code, run, out = _accept(start_sim, tmp_path, broken="configure_failure")
    assert code == 1, out[-3000:]
    sc = by_name(document(run))["configure_failure"]
    assert sc["verdict"] == "FAIL" and sc["evidence"]
    assert "faults: 1 scenario(s) failed: configure_failure" in out
