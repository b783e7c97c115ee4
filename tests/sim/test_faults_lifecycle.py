"""Spec §12.3 lifecycle faults: each shows its designed behaviour, and its broken mode
violates it observably (what the client sees, /admin/state, server_events)."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.faultkit import (
    FAST,
    arm,
    background,
    error_type,
    events,
    ok_ids,
    stream_events,
    wait_event,
    wait_state,
    whole,
)
from tests.support.simhelpers import prompt_ids
from tests.support.simproc import ADMIN_TOKEN, SimProcess

StartSim = Callable[..., SimProcess]

SCENARIOS_TESTED = {
    "shutdown_with_queue",
    "load_while_ready",
    "configure_failure",
    "reset_failure",
    "repeated_faults",
    "maintenance_window",
}

NEW_SHA = "ab" * 32


def _fast(start_sim: StartSim, *args: str) -> SimProcess:
    return start_sim(*FAST, *args, faults=True)


# ----------------------------------------------------------------- shutdown_with_queue


def _shutdown(start_sim: StartSim, broken: bool) -> tuple[SimProcess, Any, dict[str, Any]]:
    """One streaming request on the only slot, one queued; then shutdown.

    Returns the sim, the streamed request's (status, events, clean) and the shutdown body.
    """
    sim = _fast(start_sim, "--set", "scheduling.slots=1", "--set", "timing.decode_base_ms=60")
    if broken:
        arm(sim, "shutdown_with_queue", broken=True)
    streamed = background(lambda: stream_events(sim, 300, "sd-running"))
    wait_event(sim, "admitted", "sd-running")
    queued = background(lambda: whole(sim, 8, "sd-queued"))
    wait_state(sim, lambda s: s["queue"]["waiting"] == 1, "a queued request")
    status, body = sim.admin("POST", "/admin/shutdown")
    assert status == 200, body
    status, qbody = queued.result(timeout=20)
    assert status == 503 and error_type(qbody) == "shutting_down", qbody
    assert not events(sim, "admitted", "sd-queued")
    st = sim.state()
    assert st["state"] == "stopped" and body["state"] == "stopped"
    assert body["cancelled_queued"] == 1 and body["drained_in_flight"] == 1
    status, hbody = sim.json("GET", "/health")
    assert status == 503 and hbody["state"] == "stopped"
    status, late = whole(sim, 8, "sd-late")
    assert status == 503, late
    status, reset = sim.admin("POST", "/admin/reset")  # a stopped instance stays stopped
    assert status == 409 and sim.state()["state"] == "stopped", reset
    return sim, streamed.result(timeout=20), body


def test_shutdown_cancels_queued_and_drains_submitted(start_sim: StartSim) -> None:
    _, (status, evs, clean), _ = _shutdown(start_sim, broken=False)
    assert status == 200 and clean
    assert evs[-1]["stop"] is True and evs[-1]["tokens_predicted"] == 300


def test_shutdown_broken_cuts_submitted_streams(start_sim: StartSim) -> None:
    _, (status, evs, _), _ = _shutdown(start_sim, broken=True)
    assert status == 200
    assert not any(e.get("stop") for e in evs)  # cut without a final event
    assert not evs or evs[-1]["tokens_predicted"] < 300


# -------------------------------------------------------------------- load_while_ready


def _load_while_running(
    start_sim: StartSim, broken: bool
) -> tuple[SimProcess, list[int], tuple[int, dict[str, Any]]]:
    """Load a new artifact while a request runs: (sim, golden, the request's response)."""
    # 60 ms simulated decode steps (3 ms real): 200 tokens take over half a second.
    sim = _fast(start_sim, "--set", "timing.decode_base_ms=60")
    prompt = prompt_ids(8, salt=5)
    golden = ok_ids(sim, 200, "load-golden", prompt)
    if broken:
        arm(sim, "load_while_ready", broken=True)
    running = background(lambda: whole(sim, 200, "load-running", prompt))
    wait_event(sim, "sampled", "load-running")  # mid-generation
    status, load = sim.admin("POST", "/admin/load", {"calbin_sha256": NEW_SHA})
    assert status == 200, load
    assert load["in_flight"] == 1 and load["generation"] == 2
    st = sim.state()
    assert st["generation"] == 2 and st["calbin_sha256"] == NEW_SHA and st["state"] == "ready"
    return sim, golden, running.result(timeout=20)


def _switch_and_end(sim: SimProcess) -> tuple[int, int]:
    """mono_ns of the generation switch and of the running request's last event."""
    rows = events(sim)
    switch = next(r for r in rows if r["event"] == "generation_change")
    assert switch["detail"]["why"] == "load"
    end = [r for r in rows if r["event"] in ("finished", "failed")]
    return switch["mono_ns"], next(r for r in end if r["request_id"] == "load-running")["mono_ns"]


def test_load_while_ready_drains_then_switches(start_sim: StartSim) -> None:
    sim, golden, (status, body) = _load_while_running(start_sim, broken=False)
    assert status == 200, body
    assert body["tokens"] == golden
    switch_ns, end_ns = _switch_and_end(sim)
    assert switch_ns > end_ns
    states = [r["detail"]["to"] for r in events(sim, "state_change")]
    assert states[-2:] == ["loading", "ready"]
    assert ok_ids(sim, 200, "load-after", prompt_ids(8, salt=5)) == golden


def test_load_while_ready_broken_switches_under_running_requests(start_sim: StartSim) -> None:
    sim, golden, (status, body) = _load_while_running(start_sim, broken=True)
    # The request ran into the switch: its job in flight fails the generation check (503)
    # or, when the switch fell between two jobs, it finishes with the new weights' tokens.
    if status == 200:
        assert body["tokens"] != golden
    else:
        assert status == 503 and error_type(body) == "device_reset", body
    switch_ns, end_ns = _switch_and_end(sim)
    assert switch_ns < end_ns


# ------------------------------------------------------------------- configure_failure


def test_configure_failure_keeps_the_old_generation(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    golden = ok_ids(sim, 8, "cfg-golden")
    before = sim.state()
    status, body = sim.admin("POST", "/admin/load", {"calbin_sha256": "not-a-sha256"})
    assert status == 422 and "calbin_sha256" in body["error"], body
    arm(sim, "configure_failure", count=1)
    status, body = sim.admin("POST", "/admin/load", {"calbin_sha256": NEW_SHA})
    assert status == 422 and body["generation"] == 1 and body["state"] == "ready", body
    st = sim.state()
    assert st["state"] == "ready" and st["generation"] == before["generation"] == 1
    assert st["calbin_sha256"] == before["calbin_sha256"]
    kept = [r["detail"]["kept_old"] for r in events(sim, "reconfigure")]
    assert kept == [True, True]
    assert ok_ids(sim, 8, "cfg-after") == golden
    # The fault fired once: the next load goes through.
    status, body = sim.admin("POST", "/admin/load", {"calbin_sha256": NEW_SHA})
    assert status == 200 and body["generation"] == 2, body


def test_configure_failure_broken_loses_the_instance(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    arm(sim, "configure_failure", count=1, broken=True)
    status, body = sim.admin("POST", "/admin/load", {"calbin_sha256": NEW_SHA})
    assert status == 500, body
    assert sim.state()["state"] == "failed"
    status, body = whole(sim, 8, "cfg-after")
    assert status == 503 and error_type(body) == "unavailable", body
    assert sim.json("GET", "/health")[0] == 503


# ----------------------------------------------------------------------- reset_failure


def test_reset_failure_supervisor_restarts(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    golden = ok_ids(sim, 8, "rf-golden")
    arm(sim, "reset_failure", count=1)
    status, body = sim.admin("POST", "/admin/reset")
    assert status == 500 and body["reset"] == "failed" and body["state"] == "failed", body
    st = wait_state(sim, lambda s: s["state"] == "ready", "supervisor restart")
    assert st["generation"] == 2
    changes = [r["detail"] for r in events(sim, "state_change")]
    assert [c["to"] for c in changes[-3:]] == ["resetting", "failed", "ready"]
    assert changes[-1]["why"] == "supervisor restart"
    assert [r["detail"]["ok"] for r in events(sim, "reset")] == [False]
    assert ok_ids(sim, 8, "rf-after") == golden


def test_reset_failure_broken_stays_failed(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    arm(sim, "reset_failure", count=1, broken=True)
    status, body = sim.admin("POST", "/admin/reset")
    assert status == 500 and body["state"] == "failed", body
    # The designed supervisor restarts within 25 ms real (500 ms simulated): wait 20x.
    time.sleep(0.5)
    st = sim.state()
    assert st["state"] == "failed" and st["generation"] == 1
    status, body = whole(sim, 8, "rf-after")
    assert status == 503 and error_type(body) == "unavailable", body


# --------------------------------------------------------------------- repeated_faults

TIMEOUTS = 4


def _repeated(start_sim: StartSim, broken: bool) -> tuple[list[dict[str, Any]], list[int]]:
    """`TIMEOUTS` consecutive Wait timeouts; the reset backoff events and reset times."""
    # A Wait times out after 200 ms simulated (10 ms real): well inside the 3 s (0.15 s
    # real) minimum interval between resets, so every reset after the first backs off.
    sim = _fast(
        start_sim,
        "--set",
        "scheduling.wait_timeout_ms=200",
        "--set",
        "scheduling.reset_min_interval_ms=3000",
    )
    arm(sim, "repeated_faults", count=TIMEOUTS, broken=broken)
    for i in range(TIMEOUTS):
        status, body = whole(sim, 8, f"rep-{i}")
        assert status == 504 and error_type(body) == "wait_timeout", body
    st = wait_state(sim, lambda s: s["reset_count"] == TIMEOUTS, "a reset per timeout")
    assert st["state"] == "ready"
    assert len(ok_ids(sim, 8, "rep-after")) == 8
    backoffs = [r for r in events(sim, "backoff") if "level_ms" in r["detail"]]
    resets = [r["mono_ns"] for r in events(sim, "reset")]
    return backoffs, resets


def test_repeated_faults_back_off_exponentially(start_sim: StartSim) -> None:
    backoffs, resets = _repeated(start_sim, broken=False)
    assert [b["detail"]["level_ms"] for b in backoffs] == [3000.0, 6000.0, 12000.0]
    waits = [b["detail"]["backoff_ms"] for b in backoffs]
    assert waits == sorted(waits) and len(set(waits)) == len(waits)
    # Each reset waited out its backoff: (simulated ms) x time scale 0.05 x 1e6 ns.
    gaps = [b - a for a, b in itertools.pairwise(resets)]
    for gap, wait in zip(gaps, waits, strict=True):
        assert gap >= wait * 0.05 * 1e6


def test_repeated_faults_broken_reset_storm(start_sim: StartSim) -> None:
    backoffs, resets = _repeated(start_sim, broken=True)
    assert backoffs == []
    assert len(resets) == TIMEOUTS


pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ maintenance_window
def test_maintenance_window_audit_log_read_with_the_token_and_never_truncated(
    start_sim: StartSim,
) -> None:
    """§12.4: the audit log is served (`/traces/audit`) to the admin token only, and a
    reset appends to it; the broken mode truncates it at the next reset (a cover-up)."""
    sim = _fast(start_sim)
    assert sim.request("GET", "/traces/audit")[0] == 401
    assert sim.request("GET", "/traces/audit", headers={"Authorization": "Bearer nope"})[0] == 403
    arm(sim, "maintenance_window")
    assert sim.admin("POST", "/admin/reset")[0] == 200
    auth = {"Authorization": "Bearer " + ADMIN_TOKEN, "X-Operator": "pytest"}
    status, hdrs, body = sim.request("GET", "/traces/audit?offset=0", headers=auth)
    assert status == 200 and hdrs["content-type"].startswith("application/x-ndjson")
    rows = [json.loads(x) for x in body.splitlines()]
    assert [r["action"] for r in rows] == ["read_audit", "read_audit", "arm_fault", "reset"]
    assert [r["http_status"] for r in rows[:2]] == [401, 403]
    assert sim.state()["versions"]["calbin_sha256"] == "0" * 64
    designed = sim.audit()
    assert designed[: len(rows)] == rows  # the read itself was appended after it

    arm(sim, "maintenance_window", broken=True)
    assert sim.admin("POST", "/admin/reset")[0] == 200
    after = sim.audit()
    assert [r["action"] for r in after] == ["reset"]  # every earlier row is gone
    assert len(designed) > 1
