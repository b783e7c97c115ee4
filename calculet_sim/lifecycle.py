"""Lifecycle of the instance (spec §12.2 recovery, §12.3): reset, supervisor restart,
load of a new generation, shutdown. States: ready, recovering, resetting, loading,
draining, failed, stopped.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from calculet_load.schema import ServerEvent

if TYPE_CHECKING:
    from calculet_sim.engine import Engine

_SHA256 = re.compile(r"[0-9a-f]{64}")
# The loop keeps only weak references to tasks: hold recovery tasks until they finish.
_TASKS: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, Any]) -> None:
    """Run a recovery action in the background (a reset, a supervisor restart)."""
    task = asyncio.get_running_loop().create_task(coro)
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


def _fail_active(eng: Engine, status: int, code: str, message: str) -> int:
    n = 0
    for seq in eng.iter_active():
        if seq.busy:
            # Its job is still on the device: fail the request now, free the buffers
            # only when the Wait returns (the generation check drops the result).
            seq.cancelled = True
            seq.out.put_nowait(("error", status, code, message))
            eng.event(ServerEvent.FAILED, seq, detail={"http_status": status, "code": code})
        else:
            eng.fail(seq, status, code, message)
        n += 1
    return n


def _switch_generation(eng: Engine, reason: str) -> None:
    # a reset or a new artifact leaves no KV behind: nothing cached survives it
    eng.cache.clear()
    before = eng.generation
    eng.generation += 1
    eng.generation_changes += 1
    eng.event(
        ServerEvent.GENERATION_CHANGE,
        None,
        detail={"from": before, "to": eng.generation, "why": reason},
    )


async def reset(eng: Engine, reason: str, operator: str | None = None) -> dict[str, Any]:
    """Soft-reset the device: rate-limited with exponential backoff (spec §12.3)."""
    if eng.state == "stopped":
        return {"reset": "refused", "state": eng.state}
    if eng._resetting:
        return {"reset": "coalesced"}
    eng._resetting = True
    try:
        return await _reset(eng, reason, operator)
    finally:
        eng._resetting = False


async def _reset(eng: Engine, reason: str, operator: str | None) -> dict[str, Any]:
    sched = eng.p.scheduling
    scale = eng.scale or 1.0
    now = time.monotonic_ns()
    broken = eng.faults.broken("repeated_faults")
    if eng._last_reset_ns is not None and not broken:
        since_ms = (now - eng._last_reset_ns) / 1e6 / scale
        if since_ms < eng._backoff_ms:
            wait_ms = eng._backoff_ms - since_ms
            eng.set_state("recovering", reason)
            eng.event(
                ServerEvent.BACKOFF,
                None,
                detail={
                    "why": reason,
                    "backoff_ms": round(wait_ms, 3),
                    "level_ms": eng._backoff_ms,
                },
            )
            eng._backoff_ms = min(eng._backoff_ms * 2, sched.reset_backoff_max_ms)
            await eng.sleep_ms(wait_ms)
        elif since_ms > 4 * eng._backoff_ms:
            eng._backoff_ms = sched.reset_min_interval_ms
    t0 = time.monotonic_ns()
    eng.set_state("resetting", reason)
    failed = _fail_active(eng, 503, "device_reset", f"device reset ({reason})")
    await eng.sleep_ms(sched.reset_ms)
    eng._last_reset_ns = time.monotonic_ns()
    eng.reset_count += 1
    if eng.faults.fire("reset_failure", scale):
        eng.event(
            ServerEvent.RESET, None, detail={"why": reason, "ok": False, "operator": operator}
        )
        eng.set_state("failed", "reset_failure")
        if not eng.faults.broken("reset_failure"):
            spawn(_supervisor_restart(eng))
        return {"reset": "failed", "state": eng.state}
    _scrub_quarantine(eng)
    _switch_generation(eng, reason)
    recovery_ms = (time.monotonic_ns() - t0) / 1e6
    eng.event(
        ServerEvent.RESET,
        None,
        detail={
            "why": reason,
            "ok": True,
            "operator": operator,
            "failed_requests": failed,
            "recovery_ms": round(recovery_ms, 3),
        },
    )
    eng.set_state("ready", "reset done")
    return {"reset": "ok", "generation": eng.generation, "recovery_ms": recovery_ms}


def _scrub_quarantine(eng: Engine) -> None:
    """After a reset the device writes nothing more: quarantined memory is safe again."""
    eng.kv_quarantined = 0
    eng.leases_quarantined = 0
    eng.unavailable_until_ns = 0  # a device that dropped out (rc=18) is back


async def _supervisor_restart(eng: Engine) -> None:
    """The supervisor restarts a Failed instance: fresh process state, new generation."""
    await eng.sleep_ms(eng.p.scheduling.supervisor_restart_ms)
    if eng.state != "failed":
        return
    _fail_active(eng, 503, "instance_restarted", "instance restarted by supervisor")
    _scrub_quarantine(eng)
    eng.isolated_shapes.clear()
    eng._warm_left = eng.p.timing.warmup_requests
    _switch_generation(eng, "supervisor_restart")
    eng.set_state("ready", "supervisor restart")


async def load(eng: Engine, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Load a new generation (artifact); returns (http status, body)."""
    sha = params.get("calbin_sha256")
    if not isinstance(sha, str):
        return 400, {"error": "calbin_sha256: required string"}
    if eng.state not in ("ready",):
        return 409, {"error": f"cannot load while {eng.state}"}
    bad = _SHA256.fullmatch(sha) is None
    config_fault = eng.faults.fire("configure_failure", eng.scale or 1.0)
    if bad or config_fault is not None:
        why = "calbin_sha256: not a sha256" if bad else "configure failed (injected)"
        if config_fault is not None and config_fault.broken:
            # Broken: the old generation is torn down before the new one is known good.
            eng.set_state("failed", "configure_failure")
            eng.event(ServerEvent.RECONFIGURE, None, detail={"ok": False, "kept_old": False})
            return 500, {"error": why, "state": eng.state}
        eng.event(
            ServerEvent.RECONFIGURE,
            None,
            detail={"ok": False, "kept_old": True, "generation": eng.generation},
        )
        return 422, {"error": why, "generation": eng.generation, "state": eng.state}
    t0 = time.monotonic_ns()
    in_flight = len(eng.active)
    if eng.faults.broken("load_while_ready"):
        # Broken: switches under running requests; their remaining tokens change.
        _switch_generation(eng, "load")
        for seq in eng.iter_active():
            seq.model.rekey(seq.model._key ^ 0xBADBAD)
    else:
        eng.set_state("loading", "load: draining")
        await eng.idle.wait()
        _switch_generation(eng, "load")
    eng.calbin_sha256 = sha
    eng.isolated_shapes.clear()  # the new artifact may run the shapes the old one could not
    eng._warm_left = eng.p.timing.warmup_requests
    drain_ms = (time.monotonic_ns() - t0) / 1e6
    eng.event(
        ServerEvent.RECONFIGURE,
        None,
        detail={"ok": True, "calbin_sha256": sha, "in_flight": in_flight, "drain_ms": drain_ms},
    )
    eng.set_state("ready", "load done")
    return 200, {"generation": eng.generation, "drain_ms": drain_ms, "in_flight": in_flight}


async def shutdown(eng: Engine) -> dict[str, Any]:
    """Queued requests are cancelled; submitted ones drain; then Stopped (spec §12.3)."""
    eng.set_state("draining", "shutdown")
    cancelled = 0
    while eng.waiting:
        seq = eng.waiting.popleft()
        eng.fail(seq, 503, "shutting_down", "instance shutting down; request was queued")
        cancelled += 1
    in_flight = len(eng.active)
    if eng.faults.broken("shutdown_with_queue"):
        for seq in eng.iter_active():
            seq.out.put_nowait(("abort",))
            eng.release(seq)
    else:
        await eng.idle.wait()
    eng.set_state("stopped", "shutdown")
    return {"cancelled_queued": cancelled, "drained_in_flight": in_flight, "state": eng.state}
