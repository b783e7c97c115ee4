"""What one fault scenario observed (the client's view of each request, the server's
events, the admin answers) and the `Check` each expectation becomes: the types the
judging (calculet_drivers.faults.check) and the maintenance checks share."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["TERMINAL_EVENTS", "Check", "Observation", "ReqObs"]

TERMINAL_EVENTS = ("finished", "failed", "rejected", "cancelled")


@dataclasses.dataclass(slots=True)
class ReqObs:
    """One request as the client saw it."""

    group: str
    key: tuple[int, int, int] | None  # (prompt tokens, sample, max tokens): its reference
    case: str = ""  # an illegal-length case
    rid: str | None = None
    status: int | None = None
    error_type: str | None = None
    error_class: str | None = None
    elapsed_s: float = 0.0
    tokens: int = 0
    max_tokens: int = 0
    token_hash: str | None = None
    nonfinite: bool = False
    cancelled: bool = False  # cut by the driver (a client going away)
    cancel_wall_ns: int | None = None
    reference: str | None = None
    user: str = ""  # the client user that sent it (`load-N`, else the group)
    start_wall_ns: int | None = None
    end_wall_ns: int | None = None  # None while in flight

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_class is None

    def brief(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "group": self.group,
            "request_id": self.rid,
            "status": self.status,
            "error": self.error_type,
            "latency_s": round(self.elapsed_s, 4),
        }
        if self.case:
            out["case"] = self.case
        if self.tokens or self.status == 200:
            out["tokens"] = f"{self.tokens}/{self.max_tokens}"
        if self.reference is not None and self.token_hash is not None:
            out["matches_reference"] = self.token_hash == self.reference
        if self.nonfinite:
            out["nonfinite"] = True
        if self.cancelled:
            out["cancelled"] = True
        return out


@dataclasses.dataclass(slots=True)
class Observation:
    scale: float  # real seconds per target second
    slack_s: float  # real seconds allowed on top of every scaled bound
    requests: list[ReqObs] = dataclasses.field(default_factory=list)
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    state_before: dict[str, Any] = dataclasses.field(default_factory=dict)
    state_after: dict[str, Any] = dataclasses.field(default_factory=dict)
    admin: dict[str, tuple[int | None, Any]] = dataclasses.field(default_factory=dict)
    cpu_share: dict[str, float | None] = dataclasses.field(default_factory=dict)
    action_errors: list[str] = dataclasses.field(default_factory=list)
    golden_after: tuple[bool, str] | None = None  # (passed, detail); None: not run
    # spec §12.4: one record per maintenance action, and the audit log before and after
    maintenance: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    audit: Any = None  # calculet_drivers.faults.audit.AuditObs when the scenario has actions


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    expected: Any
    observed: Any

    def public(self) -> dict[str, Any]:
        return {
            "check": self.name,
            "ok": self.ok,
            "expected": self.expected,
            "observed": self.observed,
        }


# ------------------------------------------------------------------------------ helpers
