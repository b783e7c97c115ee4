"""The actions of a fault scenario (`faults.spec.Action`): one handler per kind,
dispatched from a table. Each acts on the target through the fault matrix's admin client
and sessions, and records what it saw in the scenario's `Observation`; judging is
`faults.check`'s, the driver loop and the verdicts `faults.matrix`'s.

An admin call that is a maintenance action (spec §12.4: a device reset, a reload, a
shutdown) is sent only while the manifest authorizes it, and is recorded (operator, time,
in-flight work, versions and health before and after; the affected requests and the
recovery are added when the scenario ends).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import gevent

from calculet_drivers.faults.check import get_path
from calculet_drivers.faults.maintenance import record_base, snapshot_of
from calculet_drivers.faults.observe import ReqObs
from calculet_drivers.faults.scenariorun import Bench, Run, send_one, spawn
from calculet_drivers.faults.spec import (
    MAINTENANCE_PATHS,
    PATH_OF,
    Action,
    Admin,
    Illegal,
    Maintenance,
    Send,
    WaitEvent,
    WaitState,
)
from calculet_load.measure.prompts import Prompt

UINT32_MAX = 2**32 - 1
# The probe a maintenance action's recovery waits for: a reference request of its own.
PROBE_KEY = (16, 900, 8)


class ActionFailed(Exception):
    pass


class NotAuthorized(ActionFailed):
    """A maintenance action the manifest does not authorize now: not sent (spec §12.4)."""


# ------------------------------------------------------------------ actions
Handler = Callable[[Bench, Run, Any], None]


def act(fm: Bench, run: Run, a: Action) -> None:
    """Run one action (the one field it has set) through its handler."""
    kind = a.kind
    HANDLERS[kind](fm, run, getattr(a, kind))


def _clear(fm: Bench, run: Run, name: str) -> None:
    path = "/admin/faults" if name == "all" else f"/admin/faults?scenario={name}"
    admin(fm, run, "DELETE", path, None, None)


def _wait_group(fm: Bench, run: Run, group: str) -> None:
    jobs = run.background.get(group, [])
    if not jobs:
        raise ActionFailed(f"no background requests in group {group!r}")
    gevent.joinall(jobs, timeout=fm.manifest.timeout_s)
    if not all(g.dead for g in jobs):
        raise ActionFailed(f"group {group!r} still running after the timeout")


def _wait_admin(fm: Bench, run: Run, label: str) -> None:
    g = run.admin_bg.get(label)
    if g is None:
        raise ActionFailed(f"no background admin call {label!r}")
    g.join(timeout=fm.manifest.timeout_s)
    if not g.dead:
        raise ActionFailed(f"admin call {label!r} did not answer")


def _admin_action(fm: Bench, run: Run, adm: Admin) -> None:
    body = _substitute(adm.body, run.served_calbin)
    label = adm.label or adm.path
    if adm.background:
        _authorize(fm, adm.method, adm.path)  # refused here, before anything is sent
        run.admin_bg[label] = gevent.spawn(admin, fm, run, adm.method, adm.path, body, label)
        gevent.sleep(0)
    else:
        admin(fm, run, adm.method, adm.path, body, label)


def _health(fm: Bench, run: Run, label: str) -> None:
    run.obs.admin[label] = fm.api.health()


def _cpu_start(fm: Bench, run: Run, name: str) -> None:
    run.cpu_marks[name] = (_cpu(fm), time.monotonic())


def _cpu_stop(fm: Bench, run: Run, name: str) -> None:
    cpu0, t0 = run.cpu_marks.get(name, (None, time.monotonic()))
    cpu1, t1 = _cpu(fm), time.monotonic()
    share = None if cpu0 is None or cpu1 is None or t1 <= t0 else (cpu1 - cpu0) / (t1 - t0)
    run.obs.cpu_share[name] = share


def _authorize(fm: Bench, method: str, path: str) -> str | None:
    """The maintenance action of an admin call (None: not one); NotAuthorized when the
    manifest does not authorize it at this moment."""
    action = MAINTENANCE_PATHS.get(path.split("?")[0]) if method == "POST" else None
    if action is not None:
        refused = fm.refusal([action])
        if refused is not None:
            raise NotAuthorized(refused)
    return action


def admin(
    fm: Bench, run: Run, method: str, path: str, body: Any, label: str | None
) -> tuple[int, Any]:
    action = _authorize(fm, method, path)
    record = None
    if action is not None:
        state, health = _state_and_health(fm)
        record = record_base(run.sc.name, action, method, path, label, fm.authorization(),
                             state, health, run.obs.requests)  # fmt: skip
        run.obs.maintenance.append(record)
    wall = time.time_ns()
    status, answer = fm.api.json(method, path, body)
    seconds = round((time.time_ns() - wall) / 1e9, 4)
    run.admin_calls.append(
        {
            "wall_ns": wall,
            "method": method,
            "path": path,
            "body": body,
            "status": status,
            "answer": answer,
            "seconds": seconds,
        }
    )
    if label is not None:
        run.obs.admin[label] = (status, answer)
    if record is not None:
        record["answer"] = {"status": status, "body": answer, "seconds": seconds}
        record["after_call"] = snapshot_of(*_state_and_health(fm))
    return status, answer


def _state_and_health(fm: Bench) -> tuple[dict[str, Any], tuple[int | None, Any]]:
    try:
        state = fm.api.state()
    except OSError as exc:
        state = {"error": str(exc)}
    try:
        health: tuple[int | None, Any] = fm.api.health()
    except OSError as exc:
        health = (None, str(exc))
    return state, health


def _maintenance(fm: Bench, run: Run, m: Maintenance) -> None:
    """The action, then its recovery: `/health` 200 with the target ready, then the probe
    request with its reference output. Times are real; the record gives target seconds."""
    label = m.label or m.action
    admin(fm, run, "POST", PATH_OF[m.action], _substitute(m.body, run.served_calbin), label)
    record = run.obs.maintenance[-1]
    t0 = int(record["wall_ns"])

    def healthy() -> bool:
        status, _ = fm.api.health()
        return status == 200 and fm.api.state().get("state") == "ready"

    recovery: dict[str, Any] = {"ok": False, "health_ok_s": None, "probe": None}
    if m.action != "shutdown" and fm.api.wait_until(healthy, fm.real(m.recovery_timeout_s)):
        recovery["health_ok_s"] = round((time.time_ns() - t0) / 1e9 / fm.scale, 4)
        p, sample, n = PROBE_KEY
        req = send_one(fm, run, "probe", fm.prompt(p, sample), n, key=PROBE_KEY, stream=False)
        same = req.ok and req.token_hash == fm.references.get(PROBE_KEY)
        recovery["probe"] = {**req.brief(), "matches_reference": same}
        recovery["ok"] = same
        if req.end_wall_ns is not None:
            recovery["end_wall_ns"] = req.end_wall_ns
            recovery["recovery_s"] = round((req.end_wall_ns - t0) / 1e9 / fm.scale, 4)
    elif m.action == "shutdown":
        recovery.update(ok=None, note="the target stays stopped after a shutdown")
    record["recovery"] = recovery
    if recovery["ok"]:
        record["after"] = snapshot_of(*_state_and_health(fm))
    if recovery["ok"] is False:
        recovery["recovery_s"] = None
        raise ActionFailed(
            f"{m.action}: no recovery within {m.recovery_timeout_s:g} target s "
            f"(health ok after {recovery['health_ok_s']} s, probe {recovery['probe']})"
        )


def _cpu(fm: Bench) -> float | None:
    for name in ("calculet_process_cpu_seconds_total", "calculet_process_cpu_seconds",
                 "process_cpu_seconds_total"):  # fmt: skip
        value = fm.api.metric(name)
        if value is not None:
            return value
    return None


def arm(fm: Bench, run: Run, spec: dict[str, Any]) -> None:
    if run.broken and spec.get("scenario") == run.sc.target_fault:
        spec["broken"] = True
    status, answer = admin(fm, run, "POST", "/admin/faults", spec, None)
    if status != 200:
        raise ActionFailed(f"arm {spec}: HTTP {status}: {answer}")


def _do_send(fm: Bench, run: Run, s: Send) -> None:
    n = s.n
    if s.n_from is not None:
        value = get_path(fm.api.state(), s.n_from)
        if not isinstance(value, int):
            raise ActionFailed(f"n_from {s.n_from}: not a number in /admin/state")
        n = value + s.plus
    items = []
    for i in range(n):
        sample = s.sample + (i if s.distinct else 0)
        items.append((fm.prompt(s.prompt_tokens, sample), (s.prompt_tokens, sample)))

    def one(prompt: Prompt, key: tuple[int, int]) -> None:
        ref = (*key, s.max_tokens) if s.reference else None
        send_one(
            fm, run, s.group, prompt, s.max_tokens, key=ref, stream=s.stream, timeout_s=s.timeout_s
        )

    if s.sequential:

        def all_in_turn() -> None:
            for prompt, key in items:
                one(prompt, key)

        jobs = [spawn(run, s.group, all_in_turn)]
    else:
        jobs = [spawn(run, s.group, functools.partial(one, p, k)) for p, k in items]
    gevent.sleep(0)  # every request is on its way before the next action
    if not s.background:
        gevent.joinall(jobs)


def _illegal_prompt(fm: Bench, n: int) -> Prompt:
    """A prompt of exactly n tokens (0 and over the context included)."""
    if n <= 0:
        return Prompt("illegal:empty", 0, "" if fm.client.factory.mode == "chat" else [])
    if fm.client.factory.mode == "chat":
        from calculet_load.measure.prompts import sample_words

        return Prompt("illegal:over", n, " ".join(sample_words(0, 0, n)))
    base = fm.prompt(min(n, 4096), 0).payload
    assert isinstance(base, list)
    ids = (base * (n // len(base) + 1))[:n]
    return Prompt(f"illegal:{n}", n, ids)


def _do_illegal(fm: Bench, run: Run, s: Illegal) -> None:
    m = fm.max_context
    cases: dict[str, tuple[int, int]] = {
        "empty_prompt": (0, 4),
        "zero_output": (8, 0),
        "max_plus_1": (m - 4, 5),
        "prompt_over": (m + 1, 1),
        "uint32_overflow": (8, 2**32 + 8),
        "uint32_max": (8, UINT32_MAX),
        "negative_output": (8, -1),
    }
    for case in s.cases:
        p, n = cases[case]
        prompt = _illegal_prompt(fm, p)
        send = functools.partial(
            send_one, fm, run, s.group, prompt, n, key=None, stream=False,
            timeout_s=s.timeout_s, case=case,
        )  # fmt: skip
        g = spawn(run, s.group, send)
        g.join()


def _do_cancel(fm: Bench, run: Run, group: str) -> None:
    jobs = [g for g in run.background.get(group, []) if not g.dead]
    if not jobs:
        raise ActionFailed(f"nothing of group {group!r} in flight to cancel")
    for g in jobs:
        req = getattr(g, "fault_req", None)
        if isinstance(req, ReqObs):
            req.cancelled = True
            req.cancel_wall_ns = time.time_ns()
        g.kill(block=False)
    gevent.joinall(jobs, timeout=10)


def _wait_state(fm: Bench, run: Run, w: WaitState) -> None:
    before = run.obs.state_before
    last: dict[str, Any] = {}

    def holds() -> bool:
        nonlocal last
        last = fm.api.state()
        v = get_path(last, w.path)
        if w.eq is not None and v != w.eq:
            return False
        if w.ne is not None and v == w.ne:
            return False
        num = v if isinstance(v, int | float) and not isinstance(v, bool) else None
        if w.ge is not None and (num is None or num < w.ge):
            return False
        if w.le is not None and (num is None or num > w.le):
            return False
        if w.ge_path is not None:
            other = get_path(last, w.ge_path)
            if num is None or not isinstance(other, int | float) or num < other:
                return False
        if w.delta_ge is not None:
            b = get_path(before, w.path)
            if num is None or not isinstance(b, int | float) or num - b < w.delta_ge:
                return False
        return True

    if not fm.api.wait_until(holds, fm.real(w.timeout_s) + 2.0):
        cond = w.model_dump(exclude_none=True, exclude={"timeout_s"})
        raise ActionFailed(
            f"state {cond} not reached within {w.timeout_s:g} target s; "
            f"{w.path} = {get_path(last, w.path)!r}, state {last.get('state')!r}"
        )


def window_rows(fm: Bench, run: Run) -> list[dict[str, Any]]:
    run.obs.events += fm.api.trace_rows("server_events")
    return run.obs.events


def _wait_event(fm: Bench, run: Run, w: WaitEvent) -> None:
    from calculet_drivers.faults.check import detail_matches

    def found() -> bool:
        rids = None
        if w.group is not None:
            rids = {r.rid for r in run.obs.requests if r.group == w.group and r.rid}
        return any(
            r["event"] == w.event
            and detail_matches(r, w.detail)
            and (rids is None or r.get("request_id") in rids)
            for r in window_rows(fm, run)
        )

    if not fm.api.wait_until(found, fm.real(w.timeout_s) + 2.0, 0.05):
        raise ActionFailed(f"no {w.event} event within {w.timeout_s:g} target s")


HANDLERS: dict[str, Handler] = {
    "arm": lambda fm, run, spec: arm(fm, run, dict(spec)),
    "clear": _clear,
    "send": _do_send,
    "illegal": _do_illegal,
    "cancel": _do_cancel,
    "wait": _wait_group,
    "wait_state": _wait_state,
    "wait_event": _wait_event,
    "wait_admin": _wait_admin,
    "sleep": lambda fm, run, s: gevent.sleep(s * fm.scale),
    "admin": _admin_action,
    "health": _health,
    "cpu_start": _cpu_start,
    "cpu_stop": _cpu_stop,
    "maintenance": _maintenance,
}


def _substitute(body: dict[str, Any] | None, calbin: str | None) -> dict[str, Any] | None:
    if body is None:
        return None
    return {k: (calbin if v == "$served_calbin" else v) for k, v in body.items()}
