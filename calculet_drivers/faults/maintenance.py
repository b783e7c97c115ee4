"""Spec §12.4, the hardware maintenance window: device resets (and reloads, shutdowns) only
when the run manifest explicitly authorizes them; every such action recorded (operator,
time, in-flight jobs, versions and health before and after, affected users and requests,
recovery); the target's audit log never cleaned. Pure functions: no I/O.

The authorization is the manifest's `maintenance` section (calculet_load/schema/manifest.py):
who, when (a wall-time window, or a duration from the run's start) and which actions.
The audit log is read with the admin token from `GET /traces/audit` (the simulator's
`audit.jsonl`, one JSON row per admin call: `operator`, `action`, `http_status`, ...).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import time
from collections.abc import Iterable
from typing import Any

from calculet_drivers.faults.observe import Check, Observation, ReqObs
from calculet_drivers.faults.spec import FaultScenario
from calculet_load.schema.manifest import Maintenance

# The audit action the simulator logs for each admin call (DESIGN §3.3): a client call
# with no entry here is not looked for.
AUDIT_ACTION: dict[tuple[str, str], str] = {
    ("GET", "/admin/state"): "state",
    ("GET", "/admin/faults"): "list_faults",
    ("POST", "/admin/faults"): "arm_fault",
    ("DELETE", "/admin/faults"): "clear_faults",
    ("POST", "/admin/knobs"): "set_knobs",
    ("POST", "/admin/reset"): "reset",
    ("POST", "/admin/load"): "load",
    ("POST", "/admin/shutdown"): "shutdown",
    ("GET", "/traces/audit"): "read_audit",
}
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


# -------------------------------------------------------------------------- audit log
@dataclasses.dataclass
class AuditObs:
    """The audit log read before and after a scenario, and the client's admin calls in
    between (`TargetAPI.journal`)."""

    operator: str
    before_status: int | None
    before: bytes
    after_status: int | None = None
    after: bytes = b""
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    token: str | None = dataclasses.field(default=None, repr=False)  # looked for, never shown


def parse_rows(data: bytes) -> list[dict[str, Any]]:
    rows = []
    for line in data.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _row_brief(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("wall_ns", "operator", "action", "http_status", "outcome")
    return {k: row.get(k) for k in keys}


def audit_checks(a: AuditObs) -> list[Check]:
    """Only appended to (the earlier read is a prefix of the later one), every admin call
    of the client recorded with its operator, and no token anywhere in it."""
    if a.before_status != 200 or a.after_status != 200:
        return [
            Check(
                "audit log: readable",
                False,
                "GET /traces/audit answers 200 (with the admin token) before and after",
                {"before": a.before_status, "after": a.after_status},
            )
        ]
    out = []
    appended = a.after.startswith(a.before)
    observed: dict[str, Any] = {"bytes_before": len(a.before), "bytes_after": len(a.after)}
    if not appended:
        old, new = a.before.splitlines(), a.after.splitlines()
        first = next(
            (i for i, (x, y) in enumerate(zip(old, new, strict=False)) if x != y),
            min(len(old), len(new)),
        )
        kept = set(new)
        gone = [line for line in old if line not in kept]
        observed.update(
            rows_before=len(old),
            rows_after=len(new),
            first_differing_row=first,
            rows_gone=len(gone),
            examples_gone=[_row_brief(r) for r in parse_rows(b"\n".join(gone[:5]))],
        )
    out.append(
        Check(
            "audit log: only appended to (never cleaned)",
            appended,
            "the log read before the scenario is a prefix of the log read after it",
            observed,
        )
    )
    rows = parse_rows(a.after[len(a.before) :] if appended else a.after)
    used = [False] * len(rows)
    missing = []
    checked = 0
    for call in a.calls:
        action = AUDIT_ACTION.get((call["method"], call["path"].split("?")[0]))
        if action is None:
            continue
        checked += 1
        for i, row in enumerate(rows):
            if (
                not used[i]
                and row.get("action") == action
                and row.get("operator") == a.operator
                and row.get("http_status") == call["status"]
            ):
                used[i] = True
                break
        else:
            missing.append({**call, "action": action})
    out.append(
        Check(
            "audit log: every admin call recorded with its operator",
            not missing,
            f"each of the client's admin calls has a row with operator {a.operator!r}",
            {
                "client_calls": checked,
                "recorded": checked - len(missing),
                "missing": missing[:6],
            },
        )
    )
    leaked = 0
    if a.token:
        secret = a.token.encode()
        leaked = sum(secret in line for line in a.after.splitlines())
    out.append(
        Check(
            "audit log: no token in it",
            leaked == 0 and bool(a.token),
            "the admin token appears in no row",
            "absent"
            if a.token and not leaked
            else f"present in {leaked} row(s)"
            if a.token
            else "no token to look for",
        )
    )
    return out


def maintenance_checks(sc: FaultScenario, obs: Observation) -> list[Check]:
    checks = []
    if sc.invariants.maintenance_logged:
        checks += record_checks(obs.maintenance)
    if sc.invariants.audit_log and isinstance(obs.audit, AuditObs):
        checks += audit_checks(obs.audit)
    return checks


def match_audit_rows(records: list[dict[str, Any]], audit: AuditObs | None) -> None:
    """Each record gets the target's own audit row for it (the first unused row of its
    action by its operator at or after its time)."""
    if audit is None or audit.after_status != 200:
        return
    rows = (
        parse_rows(audit.after[len(audit.before) :])
        if audit.after.startswith(audit.before)
        else parse_rows(audit.after)
    )
    used: set[int] = set()
    for rec in records:
        action = AUDIT_ACTION.get(("POST", rec["path"].split("?")[0]))
        for i, row in enumerate(rows):
            if (
                i not in used
                and row.get("action") == action
                and row.get("operator") == rec["operator"]
                and int(row.get("wall_ns") or 0) >= int(rec["wall_ns"]) - 5_000_000_000
            ):
                used.add(i)
                rec["audit_row"] = row
                break
