"""Spec §12.2 runtime faults: each shows its designed behaviour, and its broken mode
violates it observably (what the client sees, /admin/state, server_events)."""

from __future__ import annotations

import json
import math
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
from tests.support.simproc import SimProcess

StartSim = Callable[..., SimProcess]

SCENARIOS_TESTED = {
    "device_busy",
    "device_unavailable",
    "wait_timeout",
    "ccu_exception",
    "invalid_shape",
    "stale_completion",
    "output_nan",
}


def _fast(start_sim: StartSim, *args: str) -> SimProcess:
    return start_sim(*FAST, *args, faults=True)


def _resets(sim: SimProcess) -> list[dict[str, Any]]:
    return events(sim, "reset")


# ------------------------------------------------------------------------- device_busy


def test_device_busy_bounded_backoff_then_503_without_reset(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    golden = ok_ids(sim, 8, "busy-golden")
    arm(sim, "device_busy", count=3)  # busy_retries = 3: the fourth submit goes through
    assert ok_ids(sim, 8, "busy-retried") == golden
    backoffs = [r["detail"]["backoff_ms"] for r in events(sim, "backoff")]
    assert backoffs == [2.0, 4.0, 8.0]  # busy_backoff_ms * 2**attempt
    arm(sim, "device_busy", count=4)
    status, body = whole(sim, 8, "busy-failed")
    assert status == 503 and error_type(body) == "device_busy", body
    assert len(events(sim, "backoff")) == 6
    st = sim.state()
    assert st["reset_count"] == 0 and st["generation"] == 1
    assert not _resets(sim)
    assert ok_ids(sim, 8, "busy-after") == golden


def test_device_busy_broken_resets(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    arm(sim, "device_busy", count=1, broken=True)
    status, body = whole(sim, 8, "busy-broken")
    assert status == 503 and error_type(body) == "device_busy", body
    st = wait_state(sim, lambda s: s["reset_count"] == 1, "a reset")
    assert st["generation"] == 2
    assert not events(sim, "backoff")


# ------------------------------------------------------------------ device_unavailable


def _unavailable_sim(start_sim: StartSim) -> SimProcess:
    return _fast(start_sim, "--set", "scheduling.reset_ms=8000")  # 0.4 s real


def test_device_unavailable_stops_admission_and_recovers(start_sim: StartSim) -> None:
    sim = _unavailable_sim(start_sim)
    golden = ok_ids(sim, 8, "unavail-golden")
    arm(sim, "device_unavailable", count=1)
    status, body = whole(sim, 8, "unavail-1")
    assert status == 503 and error_type(body) == "device_unavailable", body
    assert sim.state()["state"] in ("recovering", "resetting")
    # Sent while the instance recovers: held in the queue, admitted after the reset.
    assert ok_ids(sim, 8, "unavail-2") == golden
    rows = events(sim)
    states = [r["detail"]["to"] for r in rows if r["event"] == "state_change"]
    assert states[-3:] == ["recovering", "resetting", "ready"]
    reset = next(r for r in rows if r["event"] == "reset")
    assert reset["detail"]["ok"] is True and reset["detail"]["why"] == "device_unavailable"
    admitted = next(r for r in rows if r["event"] == "admitted" and r["request_id"] == "unavail-2")
    assert admitted["mono_ns"] > reset["mono_ns"]
    st = sim.state()
    assert st["reset_count"] == 1 and st["generation"] == 2 and st["state"] == "ready"


def test_device_unavailable_broken_never_recovers(start_sim: StartSim) -> None:
    sim = _unavailable_sim(start_sim)
    arm(sim, "device_unavailable", count=1, broken=True)
    for rid in ("unavail-1", "unavail-2", "unavail-3"):
        status, body = whole(sim, 8, rid)
        assert status == 503 and error_type(body) == "device_unavailable", (rid, body)
    st = sim.state()
    assert st["state"] == "ready"  # admission never stopped
    assert st["reset_count"] == 0 and not _resets(sim)
    # Only an operator's reset brings the device back.
    status, body = sim.admin("POST", "/admin/reset")
    assert status == 200, body
    assert len(ok_ids(sim, 8, "unavail-after-reset")) == 8


# ------------------------------------------------------------------------ wait_timeout


def test_wait_timeout_504_and_quarantine(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    golden = ok_ids(sim, 8, "wt-golden")
    arm(sim, "wait_timeout", count=1)
    status, body = whole(sim, 8, "wt-1")
    assert status == 504 and error_type(body) == "wait_timeout", body
    q = events(sim, "quarantine", "wt-1")
    assert len(q) == 1 and q[0]["detail"]["kv"] > 0 and q[0]["detail"]["lease"] is not None
    st = wait_state(sim, lambda s: s["reset_count"] == 1, "the reset after the timeout")
    assert st["buffer_pool"]["quarantined_total"] == 1
    assert st["counters"]["runtime_rc13"] == 1
    # The reset scrubbed the quarantine: everything is free again.
    assert st["buffer_pool"]["quarantined"] == 0 and st["kv"]["quarantined_tokens"] == 0
    assert ok_ids(sim, 8, "wt-after") == golden


def test_wait_timeout_broken_returns_buffers(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    arm(sim, "wait_timeout", count=1, broken=True)
    status, body = whole(sim, 8, "wt-1")
    assert status == 504 and error_type(body) == "wait_timeout", body
    assert not events(sim, "quarantine")
    assert sim.state()["buffer_pool"]["quarantined_total"] == 0


# ----------------------------------------------------------------------- ccu_exception


def test_ccu_exception_withholds_logits_and_recovers(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    golden = ok_ids(sim, 8, "ccu-golden")
    arm(sim, "ccu_exception", count=1)
    status, body = whole(sim, 8, "ccu-1")
    assert status == 500 and error_type(body) == "ccu_exception", body
    assert not events(sim, "logits_ready", "ccu-1")
    st = wait_state(sim, lambda s: s["generation"] == 2, "generation recovered")
    assert st["state"] == "ready" and st["reset_count"] == 1
    assert ok_ids(sim, 8, "ccu-golden-rerun") == golden  # the golden re-run still matches


def test_ccu_exception_broken_delivers_garbage(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    golden = ok_ids(sim, 8, "ccu-golden")
    arm(sim, "ccu_exception", count=1, broken=True)
    status, body = whole(sim, 8, "ccu-1")
    assert status == 200, body
    assert body["tokens"] != golden
    st = sim.state()
    assert st["generation"] == 1 and st["reset_count"] == 0 and not _resets(sim)
    assert st["buffer_pool"]["leased"] == 0  # the broken mode corrupts, it does not leak


# ----------------------------------------------------------------------- invalid_shape


@pytest.mark.parametrize(("rc", "code"), [(21, "invalid_shape"), (22, "invalid_dtype")])
def test_invalid_shape_isolates_the_artifact_without_resets(
    start_sim: StartSim, rc: int, code: str
) -> None:
    sim = _fast(start_sim)
    arm(sim, "invalid_shape", count=1, rc=rc)
    status, body = whole(sim, 8, "shape-1")
    assert status == 500 and error_type(body) == code, body
    iso = events(sim, "artifact_isolated")
    assert len(iso) == 1 and iso[0]["detail"]["rc"] == rc
    shape = iso[0]["detail"]["shape"]
    assert sim.state()["isolated_shapes"] == [shape]
    # Same shape (an 8-token prefill), other prompts: refused before the device.
    for i in range(3):
        rid = f"shape-same-{i}"
        status, body = whole(sim, 8, rid, prompt_ids(8, salt=i + 1))
        assert status == 503 and error_type(body) == "artifact_isolated", body
        assert not events(sim, "submit_ok", rid)
    assert len(ok_ids(sim, 8, "shape-other", prompt_ids(100))) == 8  # another shape runs
    st = sim.state()
    assert st["reset_count"] == 0 and not _resets(sim)
    assert st["counters"][f"runtime_rc{rc}"] == 1  # one device rejection, not one per request
    # A new artifact may run the shape again.
    status, body = sim.admin("POST", "/admin/load", {"calbin_sha256": "ab" * 32})
    assert status == 200, body
    assert sim.state()["isolated_shapes"] == []
    assert len(ok_ids(sim, 8, "shape-after-load", prompt_ids(8, salt=1))) == 8


def test_invalid_shape_broken_resets_per_occurrence(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    arm(sim, "invalid_shape", count=3, broken=True)
    for i in range(3):
        status, body = whole(sim, 8, f"shape-{i}", prompt_ids(8, salt=i))
        assert status == 500 and error_type(body) == "invalid_shape", body
        sim.wait_for(lambda n=i + 1: sim.state()["reset_count"] == n, what=f"reset {i + 1}")
    assert not events(sim, "artifact_isolated")
    assert sim.state()["isolated_shapes"] == []


# -------------------------------------------------------------------- stale_completion


def _stale(start_sim: StartSim, broken: bool) -> tuple[SimProcess, list[int], dict[str, Any]]:
    """A job completes 0.5 s late, after a reset; meanwhile another request is admitted.

    Returns the sim, the bystander's golden output and its response.
    """
    sim = _fast(start_sim)
    prompt = prompt_ids(8, salt=3)
    golden = ok_ids(sim, 16, "stale-golden", prompt)
    arm(sim, "stale_completion", count=1, delay_ms=10_000, broken=broken)
    late = background(lambda: whole(sim, 8, "stale-1"))
    wait_event(sim, "reset")
    bystander = background(lambda: whole(sim, 16, "stale-bystander", prompt))
    wait_event(sim, "admitted", "stale-bystander")
    status, body = late.result(timeout=20)
    assert status == 503 and error_type(body) == "device_reset", body
    status, body = bystander.result(timeout=20)
    assert status == 200, body
    return sim, golden, body


def test_stale_completion_blocked_by_generation_check(start_sim: StartSim) -> None:
    sim, golden, bystander = _stale(start_sim, broken=False)
    blocked = events(sim, "stale_completion_blocked")
    assert len(blocked) == 1
    assert blocked[0]["detail"] == {"job_generation": 1, "current_generation": 2}
    assert not events(sim, "stale_completion_delivered")
    assert bystander["tokens"] == golden


def test_stale_completion_broken_is_delivered(start_sim: StartSim) -> None:
    sim, golden, bystander = _stale(start_sim, broken=True)
    assert len(events(sim, "stale_completion_delivered")) == 1
    assert not events(sim, "stale_completion_blocked")
    assert bystander["tokens"] != golden  # the late result landed in a live request


# -------------------------------------------------------------------------- output_nan


def test_output_nan_fails_the_numeric_check(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    golden = ok_ids(sim, 8, "nan-golden")
    arm(sim, "output_nan", count=1)
    status, body = whole(sim, 8, "nan-1")
    assert status == 500 and error_type(body) == "numeric_check_failed", body
    assert len(events(sim, "numeric_check_failed", "nan-1")) == 1
    assert ok_ids(sim, 8, "nan-golden-rerun") == golden


def _has_nan(obj: Any) -> bool:
    if isinstance(obj, float):
        return math.isnan(obj) or math.isinf(obj)
    if isinstance(obj, dict):
        return any(_has_nan(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_nan(v) for v in obj)
    return False


def test_output_nan_broken_streams_nan_in_a_200(start_sim: StartSim) -> None:
    sim = _fast(start_sim)
    arm(sim, "output_nan", count=1, broken=True)
    status, evs, clean = stream_events(sim, 8, "nan-1")
    assert status == 200 and clean
    assert evs[-1]["stop"] is True
    assert any(_has_nan(e) for e in evs), json.dumps(evs, allow_nan=True)[:300]
    assert not events(sim, "numeric_check_failed")


pytestmark = pytest.mark.timeout(60)
