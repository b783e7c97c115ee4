"""Judging one fault scenario from what was observed: the client's view of each request,
the server events of the scenario's window, `/admin/state` before and after, the admin
answers and the facts computed from the traces (faults.facts). Pure functions: no I/O.

Every expectation becomes a `Check` with what was expected and what was observed; a
scenario passes when every check does. Times are compared in the target's seconds: an
observed real duration d is judged as d <= bound * time_scale + slack.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from calculet_drivers.faults.facts import check_fact, compute_facts, event_rows, shared_leases
from calculet_drivers.faults.maintenance import maintenance_checks
from calculet_drivers.faults.observe import Check, Observation, ReqObs
from calculet_drivers.faults.spec import (
    Bound,
    Count,
    EventCheck,
    EventRef,
    FaultScenario,
    Match,
    RequestCheck,
)


def get_path(tree: Any, path: str) -> Any:
    node = tree
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _as_bound(count: Count) -> Bound:
    return Bound(min=count, max=count) if isinstance(count, int) else count


def _describe(count: Count) -> str:
    return str(count) if isinstance(count, int) else count.describe()


def _one_of(value: Any, allowed: Any) -> bool:
    if isinstance(allowed, list):
        return value in allowed
    return bool(value == allowed)


def detail_matches(row: dict[str, Any], detail: dict[str, Any] | None) -> bool:
    if not detail:
        return True
    got = row.get("detail") or {}
    return all(k in got and _one_of(got[k], v) for k, v in detail.items())


def _groups(spec: str | list[str] | None) -> set[str] | None:
    if spec is None or spec == "*":
        return None
    return {spec} if isinstance(spec, str) else set(spec)


def _in_groups(req: ReqObs, groups: set[str] | None) -> bool:
    return groups is None or req.group in groups


# --------------------------------------------------------------------------- requests
def admitted_ids(events: Iterable[dict[str, Any]]) -> set[str]:
    return {e["request_id"] for e in events if e["event"] == "admitted" and e.get("request_id")}


def _match_failures(req: ReqObs, m: Match, obs: Observation) -> list[str]:
    """Why a request does not pass the filters (empty: it passes)."""
    why = []
    if m.status is not None and not _one_of(req.status, m.status):
        why.append(f"status {req.status}")
    if m.error_type is not None and not _one_of(req.error_type, m.error_type):
        why.append(f"error {req.error_type}")
    if m.latency_s is not None:
        b = m.latency_s
        lo = None if b.min is None else b.min * obs.scale - obs.slack_s
        hi = None if b.max is None else b.max * obs.scale + obs.slack_s
        if (lo is not None and req.elapsed_s < lo) or (hi is not None and req.elapsed_s > hi):
            why.append(f"latency {req.elapsed_s:.3f} s real ({req.elapsed_s / obs.scale:.3g} s)")
    if m.matches_reference is not None:
        same = req.reference is not None and req.token_hash == req.reference
        if same != m.matches_reference:
            why.append("output differs from the reference" if m.matches_reference else "same")
    if m.complete is not None:
        full = req.ok and req.tokens == req.max_tokens
        if full != m.complete:
            why.append(f"{req.tokens}/{req.max_tokens} tokens")
    return why


def _expected_text(m: Match, obs: Observation) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in ("status", "error_type", "matches_reference", "complete"):
        value = getattr(m, field)
        if value is not None:
            out[field] = value
    if m.latency_s is not None:
        out["latency_s"] = (
            f"{m.latency_s.describe()} target s (x{obs.scale:g} + {obs.slack_s:g} s slack real)"
        )
    return out


def check_requests(rc: RequestCheck, obs: Observation) -> Check:
    groups = _groups(rc.group)
    admitted = admitted_ids(obs.events)
    sel = [r for r in obs.requests if _in_groups(r, groups)]
    if rc.admitted is not None:
        sel = [r for r in sel if (r.rid in admitted) == rc.admitted]
    if rc.cancelled is not None:
        sel = [r for r in sel if r.cancelled == rc.cancelled]
    if rc.where is not None:
        where = rc.where
        sel = [r for r in sel if not _match_failures(r, where, obs)]
    name = f"requests[{rc.group if isinstance(rc.group, str) else ','.join(rc.group)}]"
    if rc.admitted is not None:
        name += " admitted" if rc.admitted else " not admitted"
    if rc.where is not None:
        name += f" where {_expected_text(rc.where, obs)}"
    expected = _expected_text(rc, obs)
    if rc.note:
        expected["note"] = rc.note
    if rc.count is not None:
        passing = [r for r in sel if not _match_failures(r, rc, obs)]
        ok = _as_bound(rc.count).holds(len(passing))
        expected["count"] = _describe(rc.count)
        observed: Any = {"count": len(passing), "of_selected": len(sel)}
        if not ok:
            observed["selected"] = [r.brief() for r in sel[:12]]
        return Check(name, ok, expected, observed)
    bad = [(r, _match_failures(r, rc, obs)) for r in sel]
    bad = [(r, why) for r, why in bad if why]
    if not sel:
        # with `where`, the check is about every request it selects: none is vacuous
        if rc.where is not None:
            return Check(name, True, expected, "no request selected")
        return Check(name, False, expected, "no such request")
    observed = {"requests": len(sel), "failing": len(bad)}
    if bad:
        observed["examples"] = [{**r.brief(), "why": "; ".join(why)} for r, why in bad[:8]]
    return Check(name, not bad, expected, observed)


# ----------------------------------------------------------------------------- events
def _first(rows: Sequence[dict[str, Any]], ref: EventRef, after_ns: int | None) -> int | None:
    for r in rows:
        if (
            r["event"] == ref.event
            and detail_matches(r, ref.detail)
            and (after_ns is None or r["mono_ns"] > after_ns)
        ):
            return int(r["mono_ns"])
    return None


def _request_ids(obs: Observation, groups: str | list[str] | None) -> set[str] | None:
    if groups is None:
        return None
    g = _groups(groups)
    return {r.rid for r in obs.requests if r.rid is not None and _in_groups(r, g)}


def select_events(ec: EventCheck, obs: Observation) -> tuple[list[dict[str, Any]], str | None]:
    """The matching rows, or a reason the window could not be placed."""
    rows = obs.events
    lo = hi = None
    if ec.after is not None:
        lo = _first(rows, ec.after, None)
        if lo is None:
            return [], f"no {ec.after.event} event to start the window"
    if ec.before is not None:
        hi = _first(rows, ec.before, lo)
    rids = _request_ids(obs, ec.group)
    jobs = None
    if ec.same_job_as is not None:
        ref = ec.same_job_as
        jobs = {
            r.get("job_id")
            for r in rows
            if r["event"] == ref.event and detail_matches(r, ref.detail) and r.get("job_id")
        }
    out = []
    for r in rows:
        if r["event"] != ec.event or not detail_matches(r, ec.detail):
            continue
        if lo is not None and r["mono_ns"] <= lo:
            continue
        if hi is not None and r["mono_ns"] >= hi:
            continue
        if rids is not None and r.get("request_id") not in rids:
            continue
        if jobs is not None and r.get("job_id") not in jobs:
            continue
        out.append(r)
    return out, None


def check_events(ec: EventCheck, obs: Observation) -> Check:
    name = f"events[{ec.event}]"
    parts = []
    if ec.detail:
        parts.append(f"detail {ec.detail}")
    if ec.group is not None:
        parts.append(f"of {ec.group}")
    if ec.after is not None:
        parts.append(f"after {ec.after.event}")
    if ec.before is not None:
        parts.append(f"before {ec.before.event}")
    if ec.same_job_as is not None:
        parts.append(f"same job as {ec.same_job_as.event}")
    if parts:
        name += " " + ", ".join(parts)
    rows, problem = select_events(ec, obs)
    expected: dict[str, Any] = {"count": _describe(ec.count)}
    if ec.note:
        expected["note"] = ec.note
    if problem is not None and not _as_bound(ec.count).holds(0):
        return Check(name, False, expected, problem)
    ok = _as_bound(ec.count).holds(len(rows))
    observed: dict[str, Any] = {"count": len(rows)}
    if not ok and rows:
        observed["rows"] = [
            {k: r.get(k) for k in ("event", "request_id", "job_id", "detail")} for r in rows[:6]
        ]
    return Check(name, ok, expected, observed)


# ----------------------------------------------------------------------------- judge
def _state_checks(sc: FaultScenario, obs: Observation) -> list[Check]:
    out = []
    for s in sc.expect.state:
        after = get_path(obs.state_after, s.path)
        if s.equals is not None:
            out.append(Check(f"state {s.path}", after == s.equals, s.equals, after))
        if s.delta is not None:
            before = get_path(obs.state_before, s.path)
            if before is None and isinstance(after, int | float):
                before = 0  # a counter not yet created counts as 0
            if after is None and isinstance(before, int | float):
                after = 0
            if not isinstance(before, int | float) or not isinstance(after, int | float):
                out.append(
                    Check(f"state {s.path} change", False, _describe(s.delta), (before, after))
                )
                continue
            delta = after - before
            ok = _as_bound(s.delta).holds(delta)
            observed = {"before": before, "after": after, "change": delta}
            out.append(Check(f"state {s.path} change", ok, _describe(s.delta), observed))
    return out


def _transitions(expected: list[str], obs: Observation) -> Check:
    seen = [(r.get("detail") or {}).get("to") for r in event_rows(obs, "state_change")]
    it = iter(seen)
    ok = all(any(s == want for s in it) for want in expected)
    return Check("state transitions", ok, " -> ".join(expected), " -> ".join(map(str, seen)))


def _admin_check(label: str, status: Any, body: dict[str, Any] | None, obs: Observation) -> Check:
    got = obs.admin.get(label)
    if got is None:
        return Check(f"admin {label}", False, {"status": status}, "not called")
    code, answer = got
    ok = _one_of(code, status)
    if ok and body:
        ok = isinstance(answer, dict) and all(
            k in answer and _one_of(answer[k], v) for k, v in body.items()
        )
    expected: dict[str, Any] = {"status": status}
    if body:
        expected["body"] = body
    return Check(f"admin {label}", ok, expected, {"status": code, "body": answer})


def _none_found(name: str, expected: str, found: Sequence[Any], key: str = "count") -> Check:
    """An invariant that nothing is found: how many were, and the first five."""
    examples = [x.brief() if isinstance(x, ReqObs) else x for x in found[:5]]
    return Check(name, not found, expected, {key: len(found), "examples": examples})


def _invariants(sc: FaultScenario, obs: Observation, facts: dict[str, Any]) -> list[Check]:
    inv = sc.invariants
    out = []
    if inv.outputs_match_reference:
        wrong = [
            r
            for r in obs.requests
            if r.ok
            and r.reference is not None
            and r.tokens == r.max_tokens
            and r.token_hash != r.reference
        ]
        out.append(
            _none_found("invariant: every success carries its reference output",
                        "0 wrong outputs", wrong, key="wrong")
        )  # fmt: skip
    if inv.no_nonfinite:
        bad = [r for r in obs.requests if r.nonfinite]
        out.append(_none_found("invariant: no NaN/Inf in a response", "0", bad))
    if inv.no_shared_leases:
        shared = shared_leases(obs.events)
        out.append(
            _none_found("invariant: no OutputBuf lease shared by live requests", "0", shared)
        )
    if inv.recovered and not sc.stops_target:
        state = obs.state_after.get("state")
        out.append(Check("invariant: ready after recovery", state == "ready", "ready", state))
        if obs.golden_after is not None:
            passed, detail = obs.golden_after
            out.append(Check("invariant: golden passes after recovery", passed, "pass", detail))
    return out


def judge(sc: FaultScenario, obs: Observation) -> tuple[list[Check], dict[str, Any]]:
    """Every check of the scenario, and the facts computed from the observation."""
    facts = compute_facts(obs)
    checks = [
        Check(f"action: {e}", False, "the scenario's actions complete", e)
        for e in obs.action_errors
    ]
    checks += [check_requests(rc, obs) for rc in sc.expect.requests]
    checks += [check_events(ec, obs) for ec in sc.expect.events]
    checks += _state_checks(sc, obs)
    if sc.expect.transitions:
        checks.append(_transitions(sc.expect.transitions, obs))
    checks += [_admin_check(a.label, a.status, a.body, obs) for a in sc.expect.admin]
    checks += [check_fact(k, v, facts, obs) for k, v in sc.expect.facts.items()]
    checks += _invariants(sc, obs, facts)
    if sc.maintenance_actions():
        checks += maintenance_checks(sc, obs)
    return checks, facts
