"""The fault-injection admin API (DESIGN §3.3, spec §11, §12.4): absent without the flag,
guarded by a bearer token, never reachable through ordinary requests, and audited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from calculet_sim.faults import SCENARIOS
from tests.sim import test_faults_lifecycle, test_faults_requests, test_faults_runtime
from tests.support.faultkit import (
    FAST,
    PROMPT,
    background,
    events,
    ok_ids,
    wait_event,
    wait_state,
    whole,
)
from tests.support.simhelpers import COMPLETIONS, LLAMA
from tests.support.simproc import ADMIN_TOKEN, SimProcess

StartSim = Callable[..., SimProcess]

WRONG_TOKEN = "wrong-token-fedcba9876543210"


def _call(
    sim: SimProcess,
    method: str,
    path: str,
    body: Any = None,
    token: str | None = ADMIN_TOKEN,
    operator: str = "pytest",
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], Any]:
    headers = {"X-Operator": operator}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    status, hdrs, out = sim.request(method, path, body, headers=headers, raw=raw)
    return status, hdrs, json.loads(out)


def test_every_scenario_is_tested() -> None:
    tested = (
        test_faults_requests.SCENARIOS_TESTED
        | test_faults_runtime.SCENARIOS_TESTED
        | test_faults_lifecycle.SCENARIOS_TESTED
    )
    assert tested == set(SCENARIOS)


def test_admin_api_absent_without_the_flag(start_sim: StartSim) -> None:
    sim = start_sim(*FAST)
    for method, path in [
        ("GET", "/admin/state"),
        ("POST", "/admin/faults"),
        ("DELETE", "/admin/faults"),
        ("POST", "/admin/reset"),
        ("POST", "/admin/shutdown"),
    ]:
        status, _, body = _call(sim, method, path, {"scenario": "ccu_exception"})
        assert status == 404, (method, path, body)
    assert len(ok_ids(sim, 8, "no-admin")) == 8
    assert not (sim.trace_dir / "audit.jsonl").read_text()


def _run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "CALCULET_SIM_ADMIN_TOKEN"}
    cmd = [sys.executable, "-m", "calculet_sim.cli", "--port", "0", "--enable-faults", *args]
    return subprocess.run(
        cmd, env={**full, **env}, capture_output=True, text=True, timeout=30, check=False
    )


@pytest.mark.parametrize(
    ("env", "args"),
    [
        ({}, ()),
        ({"CALCULET_SIM_ADMIN_TOKEN": "short"}, ()),
        ({}, ("--admin-token-file", "/nonexistent/token")),
    ],
    ids=["no-token", "short-token", "missing-token-file"],
)
def test_enable_faults_without_a_token_exits_2(env: dict[str, str], args: tuple[str, ...]) -> None:
    proc = _run_cli(env, *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("calculet-sim: "), proc.stderr
    assert "token" in lines[0]


def test_token_file_is_accepted(start_sim: StartSim, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    sim = start_sim(*FAST, "--enable-faults", "--admin-token-file", str(token_file))
    status, _, body = _call(sim, "GET", "/admin/state")
    assert status == 200 and body["state"] == "ready"


def test_refusals_and_the_audit_log(start_sim: StartSim) -> None:
    sim = start_sim(*FAST, faults=True)
    steps: list[tuple[tuple[int, dict[str, str], Any], str, str, int, str]] = []

    def step(expect: int, action: str, outcome: str, operator: str = "pytest", **kw: Any) -> Any:
        result = _call(sim, operator=operator, **kw)
        assert result[0] == expect, result
        steps.append((result, action, outcome, expect, operator))
        return result

    _, hdrs, body = step(401, "state", "refused", method="GET", path="/admin/state", token=None)
    assert hdrs["www-authenticate"].startswith("Bearer") and "error" in body
    arm = {"scenario": "ccu_exception"}
    step(403, "arm_fault", "refused", method="POST", path="/admin/faults", body=arm,
         token=WRONG_TOKEN)  # fmt: skip
    step(403, "reset", "refused", method="POST", path="/admin/reset", token="")
    assert sim.state()["armed_faults"] == []  # (itself audited: action "state", ok)
    steps.append(((200, {}, None), "state", "ok", 200, "pytest"))
    step(400, "arm_fault", "error", method="POST", path="/admin/faults",
         body={"scenario": "no_such_fault"})  # fmt: skip
    step(400, "arm_fault", "error", method="POST", path="/admin/faults",
         body={"scenario": "kv_full", "count": "3"})  # fmt: skip
    step(400, "arm_fault", "error", method="POST", path="/admin/faults",
         body={"scenario": "invalid_shape", "rc": 13})  # fmt: skip
    step(400, "arm_fault", "error", method="POST", path="/admin/faults", raw=b"{not json")
    step(200, "arm_fault", "ok", operator="alice", method="POST", path="/admin/faults", body=arm)
    step(200, "clear_faults", "ok", method="DELETE", path="/admin/faults")
    step(200, "reset", "ok", operator="bob", method="POST", path="/admin/reset")
    step(200, "list_faults", "ok", operator="bad operator!", method="GET", path="/admin/faults")

    rows = sim.audit()
    assert len(rows) == len(steps)
    for row, (_, action, outcome, status, operator) in zip(rows, steps, strict=True):
        assert row["action"] == action
        assert row["outcome"] == outcome
        assert row["http_status"] == status
        want_op = "invalid-operator-header" if " " in operator else operator
        assert row["operator"] == want_op
        assert row["versions"]["calbin_sha256"] == "0" * 64
        assert row["in_flight_jobs"] == 0 and row["queued_requests"] == 0
    reset = rows[-2]
    assert (reset["state_before"], reset["state_after"]) == ("ready", "ready")
    assert (reset["generation_before"], reset["generation_after"]) == (1, 2)
    refused_reset = rows[2]
    assert refused_reset["generation_after"] == refused_reset["generation_before"] == 1
    assert rows[-1]["generation_before"] == 2
    assert all(r["params"] == {} for r in rows[:3])  # a refused call logs nothing it sent
    assert rows[8]["params"] == arm


def test_audit_records_in_flight_work_and_state_changes(start_sim: StartSim) -> None:
    sim = start_sim(*FAST, "--set", "timing.decode_base_ms=60", faults=True)
    running = background(lambda: whole(sim, 200, "audit-running"))
    wait_event(sim, "sampled", "audit-running")
    status, body = sim.admin("POST", "/admin/load", {"calbin_sha256": "cd" * 32})
    assert status == 200, body
    assert running.result(timeout=20)[0] == 200
    status, body = sim.admin("POST", "/admin/shutdown")
    assert status == 200, body
    load, shutdown = sim.audit()
    assert load["action"] == "load" and load["in_flight_jobs"] == 1
    assert (load["generation_before"], load["generation_after"]) == (1, 2)
    assert load["versions"]["calbin_sha256"] == "cd" * 32
    assert (shutdown["state_before"], shutdown["state_after"]) == ("ready", "stopped")


def test_audit_log_is_appended_across_restarts(start_sim: StartSim) -> None:
    first = start_sim(*FAST, faults=True)
    assert first.admin("POST", "/admin/reset")[0] == 200
    first.stop()
    before = first.audit()
    assert [r["action"] for r in before] == ["reset"]
    second = start_sim(*FAST, "--trace-dir", str(first.trace_dir), faults=True)
    assert second.admin("GET", "/admin/faults")[0] == 200
    after = first.audit()
    assert after[: len(before)] == before
    assert [r["action"] for r in after] == ["reset", "list_faults"]


def test_ordinary_requests_cannot_arm_faults(start_sim: StartSim) -> None:
    sim = start_sim(*FAST, faults=True)
    golden = ok_ids(sim, 8, "plain")
    smuggled = {
        "fault": {"scenario": "ccu_exception", "broken": True},
        "faults": [{"scenario": "output_nan"}],
        "scenario": "ccu_exception",
        "broken": True,
        "admin_token": ADMIN_TOKEN,
    }
    status, body = whole(sim, 8, "smuggle-llama", **smuggled)
    assert status == 200 and body["tokens"] == golden, body
    body = {"prompt": PROMPT, "max_tokens": 8, **smuggled}
    status, out = sim.json("POST", COMPLETIONS, body, headers={"Authorization": "Bearer x"})
    assert status == 200, out
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "X-Fault": "ccu_exception"}
    status, out = sim.json("POST", LLAMA, {"prompt": PROMPT, "n_predict": 8}, headers=headers)
    assert status == 200, out
    st = sim.state()
    assert st["armed_faults"] == [] and st["reset_count"] == 0
    assert not events(sim, "fault_armed")
    assert [r["action"] for r in sim.audit()] == ["state"]


def test_token_never_written_anywhere(start_sim: StartSim) -> None:
    sim = start_sim(*FAST, faults=True)
    assert sim.admin("POST", "/admin/faults", {"scenario": "ccu_exception", "count": 1})[0] == 200
    assert whole(sim, 8, "tok-1")[0] == 500
    assert _call(sim, "GET", "/admin/state", token=WRONG_TOKEN)[0] == 403
    wait_state(sim, lambda s: s["reset_count"] == 1, "the reset after the CCU exception")
    assert sim.admin("POST", "/admin/reset")[0] == 200
    status, _, metrics = sim.request("GET", "/metrics")
    assert status == 200 and ADMIN_TOKEN.encode() not in metrics
    for kind in ("server_events", "steps", "device"):
        assert sim.request("GET", f"/traces/{kind}")[0] == 200
    sim.stop()  # flushes every trace file
    files = [*sim.trace_dir.iterdir(), sim.stderr_path]
    assert {p.name for p in files} >= {"audit.jsonl", "server_events.jsonl"}
    for path in files:
        data = path.read_bytes()
        assert ADMIN_TOKEN.encode() not in data, path
        assert WRONG_TOKEN.encode() not in data, path
    assert sim.audit()  # the audit log was written, just without the token


pytestmark = pytest.mark.timeout(60)
