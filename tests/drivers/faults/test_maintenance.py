"""Spec §12.4, the hardware maintenance window: maintenance actions (device reset, reload,
shutdown) only with the manifest's authorization, each one recorded, the target's audit
log never cleaned. Against the real simulator, and the pure parts on small fixtures."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from calculet_drivers.faults.audit import AuditObs, audit_checks
from calculet_drivers.faults.maintenance import RECORD_FIELDS, refusal
from calculet_drivers.faults.spec import load_scenarios
from calculet_load.schema.manifest import Maintenance, ManifestError, parse_manifest
from tests.drivers.faults.test_faults import (
    AUTHORIZATION,
    MANIFEST,
    SCENARIO_DIR,
    _accept,
    by_name,
    document,
    faults_cli,
)
from tests.support.simproc import ADMIN_TOKEN, SimProcess

StartSim = Callable[..., SimProcess]
FAST = ("--time-scale", "0.02")
S = 1_000_000_000  # ns per second


def _resets(sim: SimProcess) -> list[dict[str, Any]]:
    return [r for r in sim.audit() if r["action"] == "reset"]


# ------------------------------------------------------------------ the manifest
def _manifest(maintenance: Any) -> Any:
    import yaml

    data = yaml.safe_load(MANIFEST.read_text())
    data["maintenance"] = maintenance
    return parse_manifest(data, "m.yaml")


def test_manifest_authorization_forms() -> None:
    m = _manifest(AUTHORIZATION).maintenance
    assert m is not None and m.window.bounds_ns(10 * S) == (10 * S, 3610 * S)
    wall = {**AUTHORIZATION, "window": {"start": "2026-01-01T10:00:00+01:00",
                                        "end": "2026-01-01T12:00:00Z"}}  # fmt: skip
    w = _manifest(wall).maintenance
    assert w is not None
    lo, hi = w.window.bounds_ns(0)
    assert (hi - lo) // S == 3 * 3600  # 09:00Z .. 12:00Z
    bad: dict[str, dict[str, Any]] = {
        "window: Value error, give start and end, or duration_s, not both": {
            "window": {"duration_s": 60, "start": "2026-01-01T10:00:00Z"}},
        "window: Value error, end must be after start": {
            "window": {"start": "2026-01-01T10:00:00Z", "end": "2026-01-01T09:00:00Z"}},
        "window.start: Input should have timezone info": {
            "window": {"start": "2026-01-01T10:00:00", "end": "2026-01-01T12:00:00Z"}},
        "actions: List should have at least 1 item": {"actions": []},
        "actions.0: Input should be 'device_reset', 'reload' or 'shutdown'": {
            "actions": ["pcie_hot_reset"]},
        "operator: String should match pattern": {"operator": "alice smith"},
    }  # fmt: skip
    for message, change in bad.items():
        with pytest.raises(ManifestError) as err:
            _manifest({**AUTHORIZATION, **change})
        assert f"m.yaml: maintenance.{message}" in str(err.value)


def test_refusal_rules() -> None:
    auth = Maintenance.model_validate({**AUTHORIZATION, "actions": ["reload"]})
    start = 1000 * S
    assert refusal(None, [], start, start) is None  # nothing to authorize
    assert "not authorized by the manifest: performs device_reset" in str(
        refusal(None, ["device_reset"], start, start)
    )
    assert refusal(auth, ["reload"], start + 3599 * S, start) is None
    assert "lacks device_reset" in str(refusal(auth, ["reload", "device_reset"], start, start))
    # the window is [start, start + 3600 s): its end is outside
    late = refusal(auth, ["reload"], start + 3600 * S, start)
    assert late is not None and "outside the maintenance window" in late
    early = refusal(auth, ["reload"], start - 1, start)
    assert early is not None and "outside the maintenance window" in early


def test_every_scenario_that_resets_declares_it() -> None:
    """A scenario whose designed behaviour includes a device reset (an expected `reset`
    event, a reset_count change, a wait for one) needs the authorization for it."""
    for sc in load_scenarios(SCENARIO_DIR):
        resets = any(
            e.event == "reset" and (e.count if isinstance(e.count, int) else e.count.min or 0) > 0
            for e in sc.expect.events
        ) or any(
            a.wait_state is not None and a.wait_state.path == "reset_count" for a in sc.actions
        )  # fmt: skip
        assert resets == ("device_reset" in sc.maintenance_actions()), sc.name


# ------------------------------------------------------------------ the audit check
def _row(action: str, status: int = 200, operator: str = "alice") -> bytes:
    return json.dumps({"action": action, "operator": operator, "http_status": status}).encode()


def _call(method: str, path: str, status: int = 200) -> dict[str, Any]:
    return {"wall_ns": 0, "method": method, "path": path, "status": status}


def _checks(before: bytes, after: bytes, calls: list[dict[str, Any]], token: str = "tok-123"
            ) -> dict[str, Any]:  # fmt: skip
    obs = AuditObs("alice", 200, before, 200, after, calls, token=token)
    return {c.name: c for c in audit_checks(obs)}


def test_audit_check_append_only_calls_and_token() -> None:
    before = _row("state") + b"\n"
    after = before + _row("reset") + b"\n" + _row("state") + b"\n"
    calls = [_call("POST", "/admin/reset"), _call("GET", "/admin/state?x=1")]
    ok = _checks(before, after, calls)
    assert all(c.ok for c in ok.values()), ok
    # cleaned: the earlier rows are gone, so the earlier snapshot is no prefix
    cleaned = _checks(before, _row("reset") + b"\n", [_call("POST", "/admin/reset")])
    appended = cleaned["audit log: only appended to (never cleaned)"]
    assert not appended.ok and appended.observed["rows_gone"] == 1
    assert appended.observed["examples_gone"][0]["action"] == "state"
    # a call of the client with no row (or under another operator) is missing
    other = before + _row("reset", operator="mallory") + b"\n"
    missing = _checks(before, other, [_call("POST", "/admin/reset")])
    check = missing["audit log: every admin call recorded with its operator"]
    assert not check.ok and check.observed["missing"][0]["action"] == "reset"
    # the token, if ever written, is found and not shown
    leaked = _checks(before, before + b'{"params": {"auth": "Bearer tok-123"}}\n', [])
    token = leaked["audit log: no token in it"]
    assert not token.ok and "tok-123" not in json.dumps(token.public())
    unreadable = audit_checks(AuditObs("alice", 404, b"", 404, b""))
    assert [c.name for c in unreadable] == ["audit log: readable"] and not unreadable[0].ok


# ------------------------------------------------------------------ against the simulator
def test_unauthorized_scenarios_are_not_run_and_nothing_is_reset(
    start_sim: StartSim, tmp_path: Path
) -> None:
    sim = start_sim(*FAST, faults=True)
    names = "illegal_length,reset_failure,maintenance_window"
    code = faults_cli(sim, tmp_path, "--only", names, maintenance=None)
    doc = document(tmp_path)
    assert code == 1, (tmp_path / "cli.log").read_text()[-2000:]  # NOT RUN is never a pass
    sc = by_name(doc)
    assert sc["illegal_length"]["verdict"] == "PASS"
    for name in ("reset_failure", "maintenance_window"):
        assert sc[name]["verdict"] == "NOT_RUN"
        assert sc[name]["reason"].startswith("not authorized by the manifest: performs "
                                             "device_reset")  # fmt: skip
        assert sc[name]["maintenance_actions"] == ["device_reset"]
    assert doc["summary"]["NOT_RUN"] == 2 and doc["maintenance_authorization"] is None
    assert (
        "2 NOT RUN (not authorized by the manifest); exit 1" in (tmp_path / "cli.log").read_text()
    )
    assert _resets(sim) == [] and sim.state()["reset_count"] == 0  # no reset was sent
    assert not (tmp_path / "faults" / "maintenance.jsonl").exists()


def test_outside_the_window_or_unlisted_action_is_not_run(
    start_sim: StartSim, tmp_path: Path
) -> None:
    sim = start_sim(*FAST, faults=True)
    past = {**AUTHORIZATION, "window": {"start": "2020-01-01T00:00:00Z",
                                        "end": "2020-01-01T02:00:00Z"}}  # fmt: skip
    assert faults_cli(sim, tmp_path / "past", "--only", "maintenance_window",
                      maintenance=past) == 1  # fmt: skip
    sc = by_name(document(tmp_path / "past"))["maintenance_window"]
    assert sc["verdict"] == "NOT_RUN" and "outside the maintenance window" in sc["reason"]
    reload_only = {**AUTHORIZATION, "actions": ["reload"]}
    code = faults_cli(sim, tmp_path / "reload", "--only", "maintenance_window,configure_failure",
                      maintenance=reload_only)  # fmt: skip
    doc = by_name(document(tmp_path / "reload"))
    assert code == 1
    assert doc["maintenance_window"]["verdict"] == "NOT_RUN"
    assert "maintenance.actions lacks device_reset" in doc["maintenance_window"]["reason"]
    assert doc["configure_failure"]["verdict"] == "PASS"  # a reload is authorized
    assert _resets(sim) == []


def test_authorized_maintenance_is_recorded_and_passes(start_sim: StartSim, tmp_path: Path) -> None:
    sim = start_sim(*FAST, faults=True)
    code = faults_cli(sim, tmp_path, "--only", "maintenance_window")
    assert code == 0, (tmp_path / "cli.log").read_text()[-3000:]
    sc = by_name(document(tmp_path))["maintenance_window"]
    assert sc["verdict"] == "PASS"
    lines = (tmp_path / "faults" / "maintenance.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec == json.loads(json.dumps(sc["maintenance"][0], default=str))  # also the evidence
    for field in RECORD_FIELDS:
        node: Any = rec
        for part in field.split("."):
            node = node[part]
        assert node is not None, field
    assert rec["operator"] == "alice@example.com" and rec["action"] == "device_reset"
    assert rec["wall_time"].endswith("Z") and rec["window"]["start"] < rec["wall_time"]
    # in flight at the reset: the two long requests and the load, seen by both sides
    client = rec["in_flight"]["client"]
    assert client["count"] >= 2 and {"inflight"} <= set(client["users"])
    assert all(rid for rid in client["requests"])
    assert rec["in_flight"]["target"]["sequences_active"] >= 2
    before, after = rec["before"], rec["after"]
    assert before["versions"]["generation"] + 1 == after["versions"]["generation"]
    assert before["health"]["status"] == after["health"]["status"] == 200
    assert before["versions"]["driver"] == "sim-driver-1.0"
    affected = rec["affected"]
    assert affected["count"] >= 2 and "inflight" in affected["users"]
    assert {r["error"] for r in affected["requests"]} == {"device_reset"}
    rec_ = rec["recovery"]
    assert rec_["ok"] is True and rec_["probe"]["matches_reference"] is True
    assert 0 < rec_["health_ok_s"] <= rec_["recovery_s"]
    # the target's own audit row for it names the operator and the work in flight
    assert rec["audit_row"]["operator"] == "alice@example.com"
    assert rec["audit_row"]["in_flight_jobs"] + rec["audit_row"]["queued_requests"] >= 0
    resets = _resets(sim)
    assert [r["operator"] for r in resets] == ["alice@example.com"]
    checks = {c["check"]: c for c in sc["checks"]}
    assert checks["audit log: only appended to (never cleaned)"]["ok"]
    assert checks["audit log: every admin call recorded with its operator"]["observed"][
        "client_calls"] > 5  # fmt: skip
    assert checks["audit log: no token in it"]["ok"]
    assert ADMIN_TOKEN not in (tmp_path / "faults.json").read_text()


def test_a_truncated_audit_log_fails(start_sim: StartSim, tmp_path: Path) -> None:
    sim = start_sim(*FAST, faults=True)
    code = faults_cli(sim, tmp_path, "--only", "maintenance_window", "--broken",
                      "maintenance_window")  # fmt: skip
    assert code == 1
    sc = by_name(document(tmp_path))["maintenance_window"]
    assert sc["verdict"] == "FAIL"
    evidence = {e["check"]: e for e in sc["evidence"]}
    cleaned = evidence["audit log: only appended to (never cleaned)"]
    assert cleaned["observed"]["rows_gone"] >= 3 and cleaned["observed"]["first_differing_row"] == 0
    assert "audit log: every admin call recorded with its operator" in evidence
    # the rest of the scenario held: only the audit log gives the cover-up away
    assert set(evidence) == {"audit log: only appended to (never cleaned)",
                             "audit log: every admin call recorded with its operator"}  # fmt: skip
    assert sim.audit()[0]["action"] == "reset"  # the simulator really truncated it


def test_accept_without_authorization_is_not_a_pass(start_sim: StartSim, tmp_path: Path) -> None:
    code, run, out = _accept(start_sim, tmp_path, broken=None, maintenance=None)
    assert code == 1, out[-3000:]
    sc = by_name(document(run))["configure_failure"]
    assert sc["verdict"] == "NOT_RUN" and "performs reload" in sc["reason"]
    end = next(json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()
               if '"faults"' in x and '"end"' in x)  # fmt: skip
    assert end["code"] == 1 and end["not_run"] == ["configure_failure"] and end["failed"] == []
    if "Traceback" not in out:  # (the notes are printed when the run ends)
        assert "faults: 1 scenario(s) NOT RUN (not authorized by the manifest" in out


pytestmark = pytest.mark.timeout(600)
