"""Fault-injection admin API (DESIGN §3.3, spec §11, §12.4).

Absent (404, like any unknown path) unless the server was started with faults enabled;
then every call needs `Authorization: Bearer <token>` (401 without, 403 with a wrong
one). Ordinary request fields can never arm a fault. Every admin call, refused ones
included, is appended to the audit log, which nothing truncates. The token is never
written anywhere.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any

import psutil
from aiohttp import web

from calculet_load.schema import AuditRow, ServerEvent
from calculet_sim import lifecycle
from calculet_sim.engine import Engine
from calculet_sim.faults import SCENARIOS, FaultSpecError
from calculet_sim.profile import Knobs
from calculet_sim.traces import now_ns

ENGINE = web.AppKey("engine", Engine)
# GET /traces/audit: set only with faults enabled (the server's /traces/{kind} asks it)
AuditReader = Callable[[web.Request], Awaitable[web.StreamResponse]]
AUDIT_READER: web.AppKey[AuditReader] = web.AppKey("audit_reader")
# lifecycle.reset outcome -> HTTP status of POST /admin/reset
_RESET_STATUS = {"ok": 200, "coalesced": 409, "refused": 409, "failed": 500}
_OPERATOR = re.compile(r"[A-Za-z0-9._@\-]{1,64}")
_Action = Callable[[web.Request, Any], Awaitable[tuple[int, dict[str, Any]]]]


# Spec §7: the simulator's own statement of how lanes that are not filled are handled
# (what calculet_sim.engine._pick/device_ms do; docs/simulator.md "Compiled batch").
PARTIAL_LANES = (
    "masked: a decode step runs all B lanes at the cost of a full batch; lanes without a "
    "sequence are padding whose output is discarded; every step refills the lanes from "
    "the active sequences not in flight (round robin past B); a prefill runs one "
    "sequence alone"
)


def state_of(eng: Engine) -> dict[str, Any]:
    sched = eng.p.scheduling
    proc = psutil.Process(os.getpid())
    return {
        "state": eng.state,
        "generation": eng.generation,
        "calbin_sha256": eng.calbin_sha256,
        "reset_count": eng.reset_count,
        "generation_changes": eng.generation_changes,
        "profile": eng.p.name,
        "time_scale": eng.p.time_scale,
        "batch": {
            "compiled_batch": sched.compiled_batch,
            "ping_pong": sched.ping_pong,
            "partial_lanes": PARTIAL_LANES,
        },
        "slots": {"total": sched.slots, "in_use": eng.slots_in_use},
        "queue": {"waiting": len(eng.waiting), "max": sched.queue_max},
        "sequences_active": len(eng.active),
        "kv": {
            "budget_tokens": sched.kv_budget_tokens,
            "allocated_tokens": eng.kv_allocated,
            "free_tokens": eng.kv_free(),
            "quarantined_tokens": eng.kv_quarantined,
            "waits": eng.kv_waits,
        },
        "prefix_cache": {"enabled": eng.p.prefix_cache.enabled, **eng.cache.state()},
        "buffer_pool": {
            "total": sched.buffer_pool_size,
            "free": eng.free_leases(),
            "leased": len(eng.leases),
            "quarantined": eng.leases_quarantined,
            "quarantined_total": eng.quarantined_total,
            "leaked": eng.leases_leaked,
        },
        "jobs": {
            "pending": eng.pending_jobs,
            "in_flight": eng.left_jobs,
            "finished": eng.finished_jobs,
        },
        "isolated_shapes": sorted(eng.isolated_shapes),
        "versions": {**eng.p.versions, "calbin_sha256": eng.calbin_sha256},
        "armed_faults": [f.public() for f in eng.faults.armed()],
        "counters": dict(eng.counters),
        "process": {
            "rss_bytes": proc.memory_info().rss,
            "open_fds": proc.num_fds(),
            "threads": proc.num_threads(),
        },
        "device_extra_memory_mib": eng.device.extra_memory_mib,
    }


def add_routes(
    app: web.Application, eng: Engine, *, faults_enabled: bool, token: str | None
) -> None:
    if not faults_enabled:
        return  # /admin/* falls through to 404 like any unknown path
    if not token:
        raise ValueError("faults enabled without an admin token")
    expected = token.encode()

    def guarded(action: str, fn: _Action) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            before = _Before(eng)
            operator = request.headers.get("X-Operator", "unknown")
            if not _OPERATOR.fullmatch(operator):
                operator = "invalid-operator-header"
            auth = request.headers.get("Authorization", "")
            params: Any = {}
            if auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].encode(), expected):
                if request.can_read_body:
                    try:
                        params = await request.json()
                    except ValueError:
                        body = {"error": "body: invalid JSON"}
                        return _audit(eng, before, operator, action, {}, 400, body)
                status, result = await fn(request, params)
                return _audit(eng, before, operator, action, params, status, result)
            status = 401 if not auth else 403
            message = "admin token required" if status == 401 else "admin token rejected"
            resp = _audit(eng, before, operator, action, {}, status, {"error": message})
            if status == 401:
                resp.headers["WWW-Authenticate"] = 'Bearer realm="calculet-sim admin"'
            return resp

        return handler

    async def read_audit(request: web.Request) -> web.StreamResponse:
        """`GET /traces/audit?offset=N`: the audit log's bytes, with the admin token only
        (it names operators and parameters). The read itself is audited after it."""
        before = _Before(eng)
        operator = request.headers.get("X-Operator", "unknown")
        if not _OPERATOR.fullmatch(operator):
            operator = "invalid-operator-header"
        auth = request.headers.get("Authorization", "")
        if not (auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].encode(), expected)):
            status = 401 if not auth else 403
            message = "admin token required" if status == 401 else "admin token rejected"
            return _audit(eng, before, operator, "read_audit", {}, status, {"error": message})
        try:
            offset = int(request.query.get("offset", "0"))
        except ValueError:
            offset = -1
        if offset < 0:
            body = {"error": "offset: expected an integer >= 0"}
            return _audit(eng, before, operator, "read_audit", {}, 400, body)
        data = eng.traces.read("audit", offset)
        _audit(eng, before, operator, "read_audit", {"offset": offset}, 200, {})
        return web.Response(
            body=data,
            content_type="application/x-ndjson",
            headers={"X-Next-Offset": str(offset + len(data))},
        )

    app[AUDIT_READER] = read_audit
    app.router.add_get("/admin/state", guarded("state", _state))
    app.router.add_get("/admin/faults", guarded("list_faults", _list))
    app.router.add_post("/admin/faults", guarded("arm_fault", _arm))
    app.router.add_delete("/admin/faults", guarded("clear_faults", _clear))
    app.router.add_post("/admin/knobs", guarded("set_knobs", _knobs))
    app.router.add_post("/admin/reset", guarded("reset", _reset))
    app.router.add_post("/admin/load", guarded("load", _load))
    app.router.add_post("/admin/shutdown", guarded("shutdown", _shutdown))


class _Before:
    """What the audit log records of the instance as an admin call arrives."""

    __slots__ = ("generation", "in_flight", "queued", "state")

    def __init__(self, eng: Engine) -> None:
        self.state = eng.state
        self.generation = eng.generation
        # The requests an action may affect: admitted and not finished (spec §12.4).
        self.in_flight = len(eng.active)
        self.queued = len(eng.waiting)


def _audit(
    eng: Engine,
    before: _Before,
    operator: str,
    action: str,
    params: Any,
    status: int,
    body: dict[str, Any],
) -> web.Response:
    wall, mono = now_ns()
    eng.traces.write(
        "audit",
        AuditRow(
            wall_ns=wall,
            mono_ns=mono,
            operator=operator,
            action=action,
            params=params if isinstance(params, dict) else {"value": repr(params)[:200]},
            outcome="ok" if status < 400 else "refused" if status in (401, 403) else "error",
            http_status=status,
            state_before=before.state,
            state_after=eng.state,
            generation_before=before.generation,
            generation_after=eng.generation,
            in_flight_jobs=before.in_flight,
            queued_requests=before.queued,
            versions={**eng.p.versions, "calbin_sha256": eng.calbin_sha256},
        ),
    )
    return web.json_response(body, status=status)


async def _state(request: web.Request, params: Any) -> tuple[int, dict[str, Any]]:
    return 200, state_of(request.app[ENGINE])


def _engine(request: web.Request) -> Engine:
    return request.app[ENGINE]


async def _list(request: web.Request, params: Any) -> tuple[int, dict[str, Any]]:
    eng = _engine(request)
    catalog = {k: {"section": v[0], "effect": v[1]} for k, v in SCENARIOS.items()}
    return 200, {"armed": [f.public() for f in eng.faults.armed()], "scenarios": catalog}


async def _arm(request: web.Request, params: Any) -> tuple[int, dict[str, Any]]:
    eng = _engine(request)
    specs = params.get("faults", [params]) if isinstance(params, dict) else None
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        return 400, {"error": "body: expected a fault object or {faults: [...]}"}
    armed = []
    for spec in specs:
        try:
            fault = eng.faults.arm(spec)
        except FaultSpecError as exc:
            return 400, {"error": str(exc)}
        eng.event(ServerEvent.FAULT_ARMED, None, detail=fault.public())
        if fault.duration_ms is not None:
            eng.wake_later(fault.duration_ms)
        armed.append(fault.public())
    return 200, {"armed": armed}


async def _clear(request: web.Request, params: Any) -> tuple[int, dict[str, Any]]:
    eng = _engine(request)
    scenario = request.query.get("scenario")
    cleared = eng.faults.clear(scenario)
    eng.event(ServerEvent.FAULT_CLEARED, None, detail={"cleared": cleared})
    eng.try_admit()
    return 200, {"cleared": cleared}


async def _knobs(request: web.Request, params: Any) -> tuple[int, dict[str, Any]]:
    eng = _engine(request)
    try:
        knobs = Knobs.model_validate({**eng.p.knobs.model_dump(), **params})
    except ValueError as exc:
        return 400, {"error": str(exc).splitlines()[0]}
    eng.p = eng.p.model_copy(update={"knobs": knobs})
    return 200, {"knobs": knobs.model_dump()}


async def _reset(request: web.Request, params: Any) -> tuple[int, dict[str, Any]]:
    eng = _engine(request)
    operator = request.headers.get("X-Operator", "unknown")
    result = await lifecycle.reset(eng, "admin", operator=operator)
    if eng.faults.broken("maintenance_window"):
        eng.traces.truncate_audit()  # a cover-up: the earlier rows are gone
    return _RESET_STATUS[result["reset"]], result


async def _load(request: web.Request, params: Any) -> tuple[int, dict[str, Any]]:
    eng = _engine(request)
    if not isinstance(params, dict):
        return 400, {"error": "body: expected an object"}
    return await lifecycle.load(eng, params)


async def _shutdown(request: web.Request, params: Any) -> tuple[int, dict[str, Any]]:
    eng = _engine(request)
    return 200, await lifecycle.shutdown(eng)
