"""The target's audit log around a fault scenario with maintenance actions (spec §12.4):
read before and after with the admin token (`GET /traces/audit`, one JSON row per admin
call), it must only grow, hold a row for each of the client's admin calls, and never show
the token; each maintenance record gets its own audit row. Pure functions: no I/O."""

from __future__ import annotations

import dataclasses
from typing import Any

from calculet_drivers.faults.observe import Check
from calculet_drivers.skeleton.jsonl import parse_rows

__all__ = ["AUDIT_ACTION", "AuditObs", "audit_checks", "match_audit_rows"]

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
