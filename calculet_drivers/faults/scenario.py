"""One scenario of the fault matrix, from start to verdict: faults cleared and the target
idle, reference outputs, the load and the actions (`faults.actions`), the wind-down
(background work joined or cut, traces read until every accepted request ended,
references and the golden set again), the maintenance records completed, and the
judgement (`faults.check.judge`) with the scenario's requests and events as evidence.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import gevent

from calculet_drivers.faults.actions import (
    PROBE_KEY,
    ActionFailed,
    NotAuthorized,
    act,
    arm,
    window_rows,
)
from calculet_drivers.faults.audit import AuditObs, match_audit_rows
from calculet_drivers.faults.check import judge
from calculet_drivers.faults.maintenance import finish_records, snapshot_of
from calculet_drivers.faults.observe import TERMINAL_EVENTS, Observation, ReqObs
from calculet_drivers.faults.scenariorun import (
    ERROR,
    FAIL,
    NOT_RUN,
    PASS,
    Bench,
    FaultOptions,
    Run,
    start_load,
)
from calculet_drivers.faults.spec import FaultScenario
from calculet_load.measure.outcome import Outcome
from calculet_load.measure.prompts import WorkloadError
from calculet_load.measure.session import RequestSpec, golden_spec
from calculet_load.workload.matrix import GoldenSet

__all__ = ["Matrix", "run_scenario", "scenario_keys"]


class Matrix(Bench, Protocol):
    """What running a scenario uses of the fault matrix, besides what its actions do."""

    o: FaultOptions
    golden: GoldenSet | None
    events_path: Path
    maintenance_path: Path


def run_scenario(fm: Matrix, sc: FaultScenario, broken: bool) -> dict[str, Any]:
    """Prepare, load and act, wind down, judge: the scenario's result in faults.json
    (`broken`: its fault armed in its broken mode, a rehearsal)."""
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "name": sc.name,
        "section": sc.section,
        "title": sc.title,
        "target_fault": sc.target_fault,
        "broken_rehearsal": broken,
        "maintenance_actions": sc.maintenance_actions(),
        "started_wall_ns": time.time_ns(),
    }
    run = Run(sc, broken, Observation(scale=fm.scale, slack_s=fm.o.slack_s))
    try:
        _prepare(fm, run)
    except (OSError, ActionFailed, WorkloadError) as exc:
        result.update(
            verdict=ERROR,
            reason=f"before the scenario: {exc}",
            checks=[],
            evidence=[],
            duration_s=time.monotonic() - t0,
        )
        fm.api.journal = None
        fm.api.json("DELETE", "/admin/faults")
        return result
    start_load(fm, run)
    not_run = None
    try:
        for i, action in enumerate(sc.actions):
            try:
                act(fm, run, action)
            except NotAuthorized as exc:  # the window closed meanwhile: nothing sent
                not_run = f"action #{i + 1} {action.kind}: {exc}"
                break
            except ActionFailed as exc:
                run.obs.action_errors.append(f"#{i + 1} {action.kind}: {exc}")
                break
            except (OSError, WorkloadError) as exc:
                run.obs.action_errors.append(f"#{i + 1} {action.kind}: {exc}")
                break
    finally:
        _wind_down(fm, run)
    obs = run.obs
    for r in obs.requests:
        if r.key is not None:
            r.reference = fm.references.get(r.key)
    checks, facts = judge(sc, obs)
    verdict = PASS if all(c.ok for c in checks) else FAIL
    if not_run is not None:
        verdict = NOT_RUN
        result["reason"] = not_run
    with fm.events_path.open("a", encoding="utf-8") as f:
        for row in obs.events:
            f.write(json.dumps({"scenario": sc.name, **row}) + "\n")
    if obs.maintenance:
        with fm.maintenance_path.open("a", encoding="utf-8") as f:
            for rec in obs.maintenance:
                f.write(json.dumps(rec, default=str) + "\n")
    result.update(
        verdict=verdict,
        maintenance=obs.maintenance,
        checks=[c.public() for c in checks],
        evidence=[c.public() for c in checks if not c.ok],
        facts=facts,
        requests=[r.brief() for r in obs.requests],
        request_summary=_summary(obs.requests),
        admin_calls=run.admin_calls,
        state_before=_state_brief(obs.state_before),
        state_after=_state_brief(obs.state_after),
        events=len(obs.events),
        golden_after=(
            None
            if obs.golden_after is None
            else {"passed": obs.golden_after[0], "detail": obs.golden_after[1]}
        ),
        duration_s=round(time.monotonic() - t0, 3),
    )
    return result


def _prepare(fm: Matrix, run: Run) -> None:
    """Faults cleared, the target ready and idle, references, the window opened."""
    sc = run.sc
    status, body = fm.api.json("DELETE", "/admin/faults")
    if status != 200:
        raise ActionFailed(f"DELETE /admin/faults: HTTP {status}: {body}")
    st = _wait_idle(fm, 30.0)
    if st is None or st.get("state") != "ready":
        state = st.get("state") if st else "unknown"
        raise ActionFailed(f"the target is not ready and idle (state {state})")
    keys = set(scenario_keys(sc))
    _references(fm, keys)
    if sc.maintenance_actions() and sc.invariants.audit_log:
        status, log = fm.api.audit_log()
        run.obs.audit = AuditObs(fm.api.operator, status, log, token=fm.o.admin_token)
        fm.api.journal = []
    fm.api.skip_to_end("server_events")
    run.obs.state_before = fm.api.state()
    run.served_calbin = run.obs.state_before.get("calbin_sha256")
    if run.broken and not any(
        a.arm is not None and a.arm.get("scenario") == sc.target_fault for a in sc.actions
    ):
        arm(fm, run, {"scenario": sc.target_fault})


def _wait_idle(fm: Matrix, timeout_real_s: float) -> dict[str, Any] | None:
    last: dict[str, Any] = {}

    def idle() -> dict[str, Any] | None:
        nonlocal last
        last = fm.api.state()
        busy = (
            last.get("queue", {}).get("waiting"),
            last.get("sequences_active"),
            last.get("jobs", {}).get("in_flight"),
        )
        return last if last.get("state") == "ready" and busy == (0, 0, 0) else None

    got: dict[str, Any] | None = fm.api.wait_until(idle, timeout_real_s, 0.02)
    return got or last


def _references(fm: Matrix, keys: set[tuple[int, int, int]]) -> None:
    todo = sorted(k for k in keys if k not in fm.references)
    if not todo:
        return
    jobs = [gevent.spawn(_reference, fm, k) for k in todo]
    gevent.joinall(jobs)
    for g in jobs:
        if g.exception is not None:
            raise g.exception


def _send_reference(fm: Matrix, key: tuple[int, int, int], cell: str) -> Outcome:
    """The reference request of `key` (prompt tokens, sample, output tokens): its
    prompt as built, unstreamed, so that its output hash is comparable."""
    p, sample, n = key
    spec = RequestSpec(
        prompt=fm.prompt(p, sample),
        max_tokens=n,
        stream=False,
        cell=cell,
        arrival="fault",
        reuse=True,
    )
    return fm.session(None).send(spec)[1]


def _reference(fm: Matrix, key: tuple[int, int, int]) -> None:
    p, sample, n = key
    out = _send_reference(fm, key, "fault:reference")
    if out.ok and out.output_tokens == n:
        fm.references[key] = out.token_hash
    else:
        raise ActionFailed(
            f"reference request p{p}-s{sample}-o{n} failed: {out.http_status} {out.error_code}"
        )


def _wind_down(fm: Matrix, run: Run) -> None:
    run.load_stop = True
    pending = [g for jobs in run.background.values() for g in jobs]
    gevent.joinall(pending, timeout=max(fm.real(60.0), 5.0))
    for g in pending:
        if not g.dead:  # still running: cut (recorded as cancelled by the client)
            req = getattr(g, "fault_req", None)
            if isinstance(req, ReqObs):
                req.cancelled = True
                req.cancel_wall_ns = time.time_ns()
            g.kill(block=True, timeout=10)
    for g in run.admin_bg.values():
        g.join(timeout=max(fm.real(60.0), 5.0))
    try:
        fm.api.json("DELETE", "/admin/faults")
        if not run.sc.stops_target:
            _wait_idle(fm, max(fm.real(120.0), 5.0))
        gevent.sleep(fm.o.settle_s)
        run.obs.state_after = fm.api.state()
        _collect(fm, run)
        if run.sc.invariants.recovered and not run.sc.stops_target:
            run.obs.golden_after = _golden_after(fm, run)
    except OSError as exc:
        run.obs.action_errors.append(f"after the scenario: target unreachable: {exc}")
    finally:
        _maintenance_end(fm, run)


def _maintenance_end(fm: Matrix, run: Run) -> None:
    """The audit log read again (the client's admin calls in between known), and each
    maintenance record completed: after, affected requests, recovery, its audit row."""
    audit, calls = run.obs.audit, fm.api.journal
    fm.api.journal = None
    if isinstance(audit, AuditObs):
        audit.calls = calls or []
        try:
            audit.after_status, audit.after = fm.api.audit_log()
        except OSError as exc:
            audit.after_status, audit.after = None, str(exc).encode()
    if not run.obs.maintenance:
        return
    state: dict[str, Any] = run.obs.state_after or {"error": "target unreachable"}
    try:
        health: tuple[int | None, Any] = fm.api.health()
    except OSError as exc:
        health = (None, str(exc))
    end = {"wall_ns": time.time_ns(), **snapshot_of(state, health)}
    finish_records(run.obs.maintenance, run.obs.requests, end, fm.scale,
                   run.obs.golden_after)  # fmt: skip
    match_audit_rows(run.obs.maintenance, audit if isinstance(audit, AuditObs) else None)


def _collect(fm: Matrix, run: Run) -> None:
    """Read events until every request the server accepted has a terminal event."""

    def complete() -> bool:
        rows = window_rows(fm, run)
        accepted = {r["request_id"] for r in rows if r["event"] == "accepted"}
        ended = {r["request_id"] for r in rows if r["event"] in TERMINAL_EVENTS}
        return accepted <= ended

    fm.api.wait_until(complete, 5.0, 0.1)


def _golden_after(fm: Matrix, run: Run) -> tuple[bool, str]:
    """The scenario's references again, and the golden set: all must match."""
    failures = []
    checked = 0
    keys = sorted(
        {r.key for r in run.obs.requests if r.key is not None} | set(scenario_keys(run.sc))
    )
    for key in keys:
        p, sample, n = key
        out = _send_reference(fm, key, "fault:golden_after")
        checked += 1
        if not out.ok:
            failures.append(f"p{p}-s{sample}-o{n}: {out.http_status} {out.error_code}")
        elif out.token_hash != fm.references.get(key):
            failures.append(f"p{p}-s{sample}-o{n}: output differs from the reference")
    for case in fm.golden.cases if fm.golden else []:
        prompt = fm.prompt(case.prompt_tokens, case.sample)
        over = {"stream": False, "arrival": "fault", "concurrency": None}
        spec = golden_spec(case, prompt, f"fault:golden:{case.name}", **over)
        _, out = fm.session(None).send(spec)
        checked += 1
        if not out.ok:
            failures.append(f"golden {case.name}: {out.http_status} {out.error_code}")
        elif case.token_hash is not None and out.token_hash != case.token_hash:
            failures.append(f"golden {case.name}: token hash {str(out.token_hash)[:12]}…")
    if failures:
        return False, f"{len(failures)}/{checked} failed: " + "; ".join(failures[:4])
    return True, f"{checked} request(s) matched"


def scenario_keys(sc: FaultScenario) -> Iterator[tuple[int, int, int]]:
    """The (prompt tokens, sample, max tokens) of every send of the scenario (not the
    illegal ones): each gets a reference output."""
    for a in sc.actions:
        s = a.send
        if s is not None and s.reference:
            # a burst sized from the target's state gets one reference per distinct sample
            n = s.n if s.n_from is None else 1
            for i in range(n if s.distinct else 1):
                yield (s.prompt_tokens, s.sample + i, s.max_tokens)
    if sc.load is not None and sc.load.concurrency:
        for i in range(sc.load.samples):
            yield (sc.load.prompt_tokens, 100 + i, sc.load.max_tokens)
    if any(a.maintenance is not None for a in sc.actions):
        yield PROBE_KEY


def _summary(reqs: list[ReqObs]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in reqs:
        label = "ok" if r.ok else f"{r.status}:{r.error_type}"
        if r.cancelled:
            label = "cancelled"
        g = out.setdefault(r.group, {})
        g[label] = g.get(label, 0) + 1
    return out


def _state_brief(st: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "state",
        "generation",
        "calbin_sha256",
        "reset_count",
        "slots",
        "queue",
        "kv",
        "buffer_pool",
        "jobs",
        "isolated_shapes",
    )
    return {k: st.get(k) for k in keys if k in st}
