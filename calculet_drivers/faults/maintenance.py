"""Spec §12.4, the hardware maintenance window: device resets (and reloads, shutdowns) only
when the run manifest explicitly authorizes them; every such action recorded (operator,
time, in-flight jobs, versions and health before and after, affected users and requests,
recovery); the target's audit log never cleaned. Pure functions: no I/O.

The authorization is the manifest's `maintenance` section (calculet_load/schema/manifest.py):
who, when (a wall-time window, or a duration from the run's start) and which actions.
The target's audit log, read before and after, is checked in faults/audit.py.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable
from typing import Any

from calculet_drivers.faults.audit import AuditObs, audit_checks
from calculet_drivers.faults.observe import Check, Observation, ReqObs
from calculet_drivers.faults.spec import FaultScenario
from calculet_load.schema.manifest import Maintenance

# What a complete record holds (spec §12.4), as dotted paths that must not be null.
RECORD_FIELDS = (
    "operator",
    "wall_ns",
    "in_flight.target",
    "in_flight.client",
    "before.versions",
    "before.health",
    "after.versions",
    "after.health",
    "affected",
    "recovery",
)


# --------------------------------------------------------------------- authorization
def iso(wall_ns: int) -> str:
    t = dt.datetime.fromtimestamp(wall_ns / 1e9, tz=dt.UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def refusal(
    auth: Maintenance | None, needed: Iterable[str], now_wall_ns: int, run_start_wall_ns: int
) -> str | None:
    """Why the manifest does not authorize these maintenance actions now (None: it does)."""
    want = sorted(set(needed))
    if not want:
        return None
    if auth is None:
        return (
            f"not authorized by the manifest: performs {', '.join(want)} (spec §12.4); "
            "authorize it in the manifest's `maintenance` section (operator, window, actions)"
        )
    missing = [a for a in want if a not in auth.actions]
    if missing:
        return f"not authorized by the manifest: maintenance.actions lacks {', '.join(missing)}"
    lo, hi = auth.window.bounds_ns(run_start_wall_ns)
    if not lo <= now_wall_ns < hi:
        return (
            f"not authorized by the manifest: {iso(now_wall_ns)} is outside the maintenance "
            f"window {iso(lo)} .. {iso(hi)}"
        )
    return None


def authorization_public(auth: Maintenance | None, run_start_wall_ns: int) -> dict[str, Any] | None:
    if auth is None:
        return None
    lo, hi = auth.window.bounds_ns(run_start_wall_ns)
    return {
        "operator": auth.operator,
        "actions": list(auth.actions),
        "ticket": auth.ticket,
        "window": {"start": iso(lo), "end": iso(hi)},
    }


# ---------------------------------------------------------------------------- records
def snapshot_of(state: dict[str, Any], health: tuple[int | None, Any]) -> dict[str, Any]:
    """Versions and health of the target at one moment. A target whose state has no
    `versions` is described by its generation and calbin."""
    versions = state.get("versions")
    if not isinstance(versions, dict) and "generation" in state:
        versions = {"calbin_sha256": state.get("calbin_sha256")}
    if isinstance(versions, dict):
        versions = {**versions, "generation": state.get("generation")}
    return {
        "state": state.get("state"),
        "versions": versions,
        "reset_count": state.get("reset_count"),
        "health": {"status": health[0], "body": health[1]},
        "error": state.get("error"),
    }


def record_base(
    scenario: str,
    action: str,
    method: str,
    path: str,
    label: str | None,
    authorization: dict[str, Any] | None,
    state: dict[str, Any],
    health: tuple[int | None, Any],
    requests: list[ReqObs],
) -> dict[str, Any]:
    """A maintenance record as the action is about to be sent: who, when, what was in
    flight (the target's view and the client's), versions and health before."""
    wall_ns = time.time_ns()
    in_flight = [r for r in requests if r.start_wall_ns is not None and r.end_wall_ns is None]
    jobs = state.get("jobs") or {}
    return {
        "schema": "calculet-maintenance/v1",
        "scenario": scenario,
        "action": action,
        "method": method,
        "path": path,
        "label": label,
        "operator": (authorization or {}).get("operator"),
        "ticket": (authorization or {}).get("ticket"),
        "window": (authorization or {}).get("window"),
        "wall_ns": wall_ns,
        "wall_time": iso(wall_ns),
        "in_flight": {
            "target": None
            if "error" in state
            else {
                "jobs_in_flight": jobs.get("in_flight"),
                "jobs_pending": jobs.get("pending"),
                "sequences_active": state.get("sequences_active"),
                "queued": (state.get("queue") or {}).get("waiting"),
            },
            "client": {
                "count": len(in_flight),
                "requests": [r.rid for r in in_flight],
                "users": sorted({r.user for r in in_flight}),
            },
        },
        "before": snapshot_of(state, health),
        "answer": None,
        "after_call": None,
        "after": None,
        "affected": None,
        "recovery": None,
        "audit_row": None,
    }


def finish_records(
    records: list[dict[str, Any]],
    requests: list[ReqObs],
    end: dict[str, Any],
    scale: float,
    golden_after: tuple[bool, str] | None,
) -> None:
    """When the scenario ends: `after` (the target once the scenario wound down, unless
    the action measured it), the recovery of actions that did not measure their own (the
    first request that succeeded after the action answered), and the affected requests:
    those in flight during the action or its recovery that failed or were cut."""
    for rec in records:
        t0 = int(rec["wall_ns"])
        if rec["recovery"] is None:
            answered = t0 + int(((rec.get("answer") or {}).get("seconds") or 0) * 1e9)
            later = [
                r
                for r in requests
                if r.ok and r.start_wall_ns is not None and r.start_wall_ns >= answered
            ]
            first = min(later, key=lambda r: r.end_wall_ns or 0, default=None)
            if rec["action"] == "shutdown":
                rec["recovery"] = {"ok": None, "note": "the target stays stopped after a shutdown"}
            elif first is not None and first.end_wall_ns is not None:
                rec["recovery"] = {
                    "ok": True,
                    "how": "the first request succeeding after the action",
                    "request_id": first.rid,
                    "end_wall_ns": first.end_wall_ns,
                    "recovery_s": round((first.end_wall_ns - t0) / 1e9 / scale, 4),
                }
            else:
                passed = None if golden_after is None else golden_after[0]
                rec["recovery"] = {"ok": passed, "how": "golden after the scenario",
                                   "recovery_s": None}  # fmt: skip
        if rec["after"] is None:
            rec["after"] = end
        until = rec["recovery"].get("end_wall_ns") or end.get("wall_ns") or t0
        hit = [
            r
            for r in requests
            if r.start_wall_ns is not None
            and r.start_wall_ns <= until
            and (r.end_wall_ns is None or r.end_wall_ns >= t0)
            and (not r.ok or r.cancelled)
        ]
        rec["affected"] = {
            "count": len(hit),
            "users": sorted({r.user for r in hit}),
            "requests": [{**r.brief(), "user": r.user} for r in hit[:50]],
        }


def _get(tree: Any, path: str) -> Any:
    for part in path.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def record_checks(records: list[dict[str, Any]]) -> list[Check]:
    out = []
    for rec in records:
        name = f"maintenance {rec.get('label') or rec['action']}"
        missing = [f for f in RECORD_FIELDS if _get(rec, f) is None]
        out.append(
            Check(
                f"{name}: recorded",
                not missing,
                "operator, time, in-flight jobs, versions/health before and after, affected "
                "requests, recovery (spec §12.4)",
                {"missing": missing, "record": rec} if missing else _brief_record(rec),
            )
        )
    return out


def _brief_record(rec: dict[str, Any]) -> dict[str, Any]:
    return {
        "operator": rec["operator"],
        "wall_time": rec["wall_time"],
        "in_flight": rec["in_flight"],
        "versions_before": rec["before"]["versions"],
        "versions_after": rec["after"]["versions"],
        "health_before": rec["before"]["health"]["status"],
        "health_after": rec["after"]["health"]["status"],
        "affected": rec["affected"]["count"],
        "affected_users": rec["affected"]["users"],
        "recovery": {k: v for k, v in rec["recovery"].items() if k != "end_wall_ns"},
    }


def maintenance_facts(obs: Observation) -> dict[str, Any]:
    recov = [
        float(r["recovery"]["recovery_s"])
        for r in obs.maintenance
        if isinstance(r.get("recovery"), dict)
        and isinstance(r["recovery"].get("recovery_s"), int | float)
    ]
    return {
        "maintenance_actions": len(obs.maintenance),
        "maintenance_recovery_s": max(recov) if recov else None,
        "maintenance_affected_requests": sum(
            (r.get("affected") or {}).get("count", 0) for r in obs.maintenance
        ),
    }


def maintenance_checks(sc: FaultScenario, obs: Observation) -> list[Check]:
    checks = []
    if sc.invariants.maintenance_logged:
        checks += record_checks(obs.maintenance)
    if sc.invariants.audit_log and isinstance(obs.audit, AuditObs):
        checks += audit_checks(obs.audit)
    return checks
