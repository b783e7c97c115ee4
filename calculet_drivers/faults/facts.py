"""Facts computed from a fault scenario's server events and observations (shared
buffer leases, leases released in flight, resets, recovery, cancellation), and a fact
checked against what the scenario expects. Pure functions: no I/O."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from calculet_drivers.faults.maintenance import maintenance_facts
from calculet_drivers.faults.observe import TERMINAL_EVENTS, Check, Observation
from calculet_drivers.faults.spec import Bound

__all__ = ["check_fact", "compute_facts", "event_rows", "released_in_flight", "shared_leases"]


def event_rows(obs: Observation, name: str) -> list[dict[str, Any]]:
    return [r for r in obs.events if r["event"] == name]


def shared_leases(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Admissions that got a lease another live request held (cross-talk risk)."""
    holders: dict[Any, list[str]] = {}  # lease -> live request ids holding it
    lease_of: dict[str, Any] = {}
    shared = []
    for r in events:
        rid = r.get("request_id")
        if r["event"] == "admitted" and rid:
            lease = (r.get("detail") or {}).get("lease")
            if lease is None:
                continue
            live = holders.setdefault(lease, [])
            if live:
                shared.append({"request_id": rid, "lease": lease, "holder": live[0]})
            live.append(rid)
            lease_of[rid] = lease
        elif r["event"] in TERMINAL_EVENTS and rid in lease_of:
            detail = r.get("detail") or {}
            if r["event"] == "cancelled" and detail.get("drained") == "pending":
                continue  # still on the device: released when the Wait drains
            holders[lease_of.pop(rid)].remove(rid)
    return shared


def released_in_flight(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Requests whose buffers were released (a `cancelled` event that frees them) while a
    job of theirs was submitted and its Wait had not returned: use-after-free risk."""
    out = []
    submitted: dict[str, set[Any]] = {}
    for r in events:
        rid = r.get("request_id")
        if not rid:
            continue
        job = r.get("job_id")
        if r["event"] == "submit_ok" and job is not None:
            submitted.setdefault(rid, set()).add(job)
        elif r["event"] == "wait_done" and job is not None:
            submitted.get(rid, set()).discard(job)
        elif r["event"] == "cancelled":
            detail = r.get("detail") or {}
            if detail.get("drained") == "pending":
                continue
            if submitted.get(rid):
                out.append(
                    {"request_id": rid, "jobs_in_flight": sorted(submitted[rid]), "detail": detail}
                )
    return out


def _reset_facts(obs: Observation) -> dict[str, Any]:
    resets = [r for r in event_rows(obs, "reset")]
    backoffs = [r for r in event_rows(obs, "backoff") if "level_ms" in (r.get("detail") or {})]
    levels = [float(r["detail"]["level_ms"]) for r in backoffs]
    gaps_s = [
        (b["mono_ns"] - a["mono_ns"]) / 1e9 / obs.scale for a, b in itertools.pairwise(resets)
    ]
    doubling = None
    if len(levels) >= 2:
        doubling = all(b == 2 * a or b == a for a, b in itertools.pairwise(levels)) and any(
            b == 2 * a for a, b in itertools.pairwise(levels)
        )
    respect = True
    for b in backoffs:
        before = [r for r in resets if r["mono_ns"] < b["mono_ns"]]
        after = [r for r in resets if r["mono_ns"] > b["mono_ns"]]
        if before and after:
            gap_ms = (after[0]["mono_ns"] - before[-1]["mono_ns"]) / 1e6 / obs.scale
            if gap_ms < float(b["detail"]["backoff_ms"]) * 0.95:
                respect = False
    return {
        "resets": len(resets),
        "reset_backoffs": len(backoffs),
        "backoff_levels_ms": levels,
        "backoff_levels_doubling": doubling,
        "resets_respect_backoff": respect if backoffs else None,
        "min_reset_gap_s": round(min(gaps_s), 4) if gaps_s else None,
    }


def _generation_after_drain(obs: Observation) -> bool | None:
    """Every load's generation switch came after the requests running at the load ended."""
    switches = [
        r
        for r in event_rows(obs, "generation_change")
        if (r.get("detail") or {}).get("why") == "load"
    ]
    if not switches:
        return None
    ends = {}
    for r in obs.events:
        if r["event"] in ("finished", "failed", "cancelled") and r.get("request_id"):
            ends[r["request_id"]] = r["mono_ns"]
    for sw in switches:
        for r in event_rows(obs, "admitted"):
            rid = r.get("request_id")
            end = ends.get(rid) if rid else None
            if r["mono_ns"] < sw["mono_ns"] and (end is None or end > sw["mono_ns"]):
                return False
    return True


def _recovery_s(obs: Observation) -> float | None:
    """From the first state change away from ready to the last return to ready."""
    changes = event_rows(obs, "state_change")
    away = [r for r in changes if (r.get("detail") or {}).get("from") == "ready"]
    back = [r for r in changes if (r.get("detail") or {}).get("to") == "ready"]
    if not away or not back or back[-1]["mono_ns"] < away[0]["mono_ns"]:
        return None
    return round(float(back[-1]["mono_ns"] - away[0]["mono_ns"]) / 1e9 / obs.scale, 4)


def _admitted_while_recovering(obs: Observation) -> int:
    n = 0
    state = "ready"
    for r in obs.events:
        if r["event"] == "state_change":
            state = (r.get("detail") or {}).get("to", state)
        elif r["event"] == "admitted" and state in ("recovering", "resetting", "failed"):
            n += 1
    return n


def _cancel_to_event_s(obs: Observation) -> float | None:
    """Longest time from a client's cancel to the server's `cancelled` event for it
    (wall clocks of both hosts: meaningful when they are synchronised or the same)."""
    first_cancel: dict[str, int] = {}
    for r in event_rows(obs, "cancelled"):
        rid = r.get("request_id")
        if rid and rid not in first_cancel:
            first_cancel[rid] = int(r["wall_ns"])
    worst = None
    for req in obs.requests:
        if req.cancelled and req.cancel_wall_ns is not None and req.rid in first_cancel:
            d = max(0.0, (first_cancel[req.rid] - req.cancel_wall_ns) / 1e9) / obs.scale
            worst = d if worst is None else max(worst, d)
    return None if worst is None else round(float(worst), 4)


def compute_facts(obs: Observation) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "shared_leases": len(shared_leases(obs.events)),
        "released_in_flight": len(released_in_flight(obs.events)),
        "generation_switch_after_drain": _generation_after_drain(obs),
        "recovery_s": _recovery_s(obs),
        "admitted_while_recovering": _admitted_while_recovering(obs),
        "cancel_to_event_s": _cancel_to_event_s(obs),
        **_reset_facts(obs),
    }
    for name, share in obs.cpu_share.items():
        facts[f"cpu_share.{name}"] = None if share is None else round(share, 4)
    if obs.maintenance:
        facts.update(maintenance_facts(obs))
    return facts


def check_fact(name: str, expected: Any, facts: dict[str, Any], obs: Observation) -> Check:
    """A fact against a value or a {min, max}; a duration (a name ending in `_s`, target
    seconds) gets the real-time slack too, converted to target seconds."""
    value = facts.get(name)
    if isinstance(expected, dict):
        bound = Bound.model_validate(expected)
        described = bound.describe()
        if name.endswith("_s"):
            pad = obs.slack_s / obs.scale
            bound = Bound(
                min=None if bound.min is None else bound.min - pad,
                max=None if bound.max is None else bound.max + pad,
            )
            described += f" target s (+ {obs.slack_s:g} s slack real)"
        ok = isinstance(value, int | float) and not isinstance(value, bool) and bound.holds(value)
        return Check(f"fact {name}", ok, described, value)
    return Check(f"fact {name}", value == expected, expected, value)
