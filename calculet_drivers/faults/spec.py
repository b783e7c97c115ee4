"""Fault scenarios as data (spec §12.1–§12.4): the schema of `configs/faults/*.yaml`.

A scenario says how the fault is injected (a list of actions: arm a fault through the
admin API of DESIGN §3.3, send requests, illegal lengths, bursts, cancels, admin calls,
waits), what load runs meanwhile, and what must be observed (what the client saw, the
server's events and state transitions, the admin answers, facts computed from the
traces). `calculet-load faults` runs them and judges each one (calculet_drivers/faults/matrix.py).

Durations in a scenario are seconds of the *target's* time: on a simulator started with
`--time-scale F` they are multiplied by F (read from `/admin/state`), plus a fixed slack
for the client's own overhead.

    schema: calculet-fault-scenario/v1
    name: device_busy
    section: "12.2"
    title: submit DeviceBusy (rc=17) -> bounded backoff/fail, no reset
    target_fault: device_busy          # the target's catalogue name (broken rehearsal)
    load: {concurrency: 2}             # closed-loop requests meanwhile (group "load")
    actions:
      - arm: {scenario: device_busy, count: 3}
      - send: {group: retried}
    expect:
      requests:
        - {group: retried, status: 200, matches_reference: true}
      events:
        - {event: backoff, detail: {rc: 17}, count: 3}
      state:
        - {path: reset_count, delta: 0}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCENARIO_SCHEMA = "calculet-fault-scenario/v1"

# Client-side illegal lengths (spec §12.1): (prompt tokens, max tokens) as functions of the
# target's max context M. A prompt length of -1 means "empty prompt".
ILLEGAL_CASES = (
    "empty_prompt",  # prompt of 0 tokens
    "zero_output",  # max tokens 0
    "max_plus_1",  # prompt + output = M + 1
    "prompt_over",  # prompt of M + 1 tokens
    "uint32_overflow",  # max tokens 2**32 + 8 (wraps to 8 in a uint32 cast)
    "uint32_max",  # max tokens 2**32 - 1 (a legal uint32, far over the context)
    "negative_output",  # max tokens -1 (llama.cpp reads n_predict -1 as "no limit")
)
IllegalCase = Literal[
    "empty_prompt",
    "zero_output",
    "max_plus_1",
    "prompt_over",
    "uint32_overflow",
    "uint32_max",
    "negative_output",
]


class FaultSpecError(ValueError):
    """A scenario file is invalid; `str()` is one line naming the file and the field."""


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Bound(_M):
    """An inclusive range; either side may be open."""

    min: float | None = None
    max: float | None = None

    def holds(self, value: float) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def describe(self) -> str:
        if self.min is not None and self.max is not None:
            return f"{self.min:g}..{self.max:g}"
        if self.min is not None:
            return f">= {self.min:g}"
        return f"<= {self.max:g}" if self.max is not None else "any"


# ------------------------------------------------------------------------------ actions
class Send(_M):
    """Requests of one group: `n` at once (or one after another), on the loop or in the
    background (a later `wait`/`cancel` names the group)."""

    group: str = Field(min_length=1)
    n: int = Field(default=1, ge=1)
    # burst size from the target's state (e.g. `queue.max`, `slots.total`) plus `plus`
    n_from: str | None = None
    plus: int = 0
    prompt_tokens: int = Field(default=16, ge=1)
    max_tokens: int = Field(default=16, ge=1)
    sample: int = Field(default=0, ge=0)
    distinct: bool = False  # request i uses prompt sample `sample + i`
    # Not streamed by default: an error then arrives as the HTTP status. A streamed
    # request that fails after its headers keeps status 200; its error event's type is
    # the error_type.
    stream: bool = False
    sequential: bool = False  # one after another instead of all at once
    background: bool = False
    timeout_s: float | None = Field(default=None, gt=0)  # target seconds, scaled
    reference: bool = True  # compare the output with a reference run of the same prompt


class Illegal(_M):
    """Illegal lengths sent one after another (each must be refused before submit)."""

    group: str = Field(min_length=1)
    cases: list[IllegalCase] = Field(min_length=1)
    timeout_s: float = Field(default=60.0, gt=0)  # a case the target accepts is cut here


class WaitState(_M):
    """Poll `/admin/state` until `path` compares true (a number, or another path's value
    with `*_path`; `delta_ge`: grown by at least this since the scenario started)."""

    path: str
    eq: Any = None
    ne: Any = None
    ge: float | None = None
    le: float | None = None
    ge_path: str | None = None
    delta_ge: float | None = None
    timeout_s: float = Field(default=60.0, gt=0)  # target seconds, scaled


class WaitEvent(_M):
    """Poll the server events until one matches (of a group's requests, if given)."""

    event: str
    group: str | None = None
    detail: dict[str, Any] | None = None
    timeout_s: float = Field(default=60.0, gt=0)


class Admin(_M):
    """An admin call; the answer is kept under `label` for `expect.admin`. In a body,
    the string `$served_calbin` is the calbin the target served when the scenario began."""

    method: Literal["GET", "POST", "DELETE"] = "POST"
    path: str = Field(pattern=r"^/admin/")
    body: dict[str, Any] | None = None
    label: str | None = None
    background: bool = False


MaintenanceAction = Literal["device_reset", "reload", "shutdown"]
# Admin calls that act on the device or the served artifact (spec §12.4): they need the
# manifest's maintenance authorization, and each is recorded.
MAINTENANCE_PATHS: dict[str, MaintenanceAction] = {
    "/admin/reset": "device_reset",
    "/admin/load": "reload",
    "/admin/shutdown": "shutdown",
}
PATH_OF: dict[str, str] = {v: k for k, v in MAINTENANCE_PATHS.items()}


class Maintenance(_M):
    """An authorized maintenance action under load (spec §12.4), fully recorded: the
    operator, the wall time, the jobs in flight, versions and health before and after,
    the requests it affected, and the recovery: the time until `/health` answers 200 with
    the target ready and a probe request returns its reference output."""

    action: MaintenanceAction
    body: dict[str, Any] | None = None  # `$served_calbin` as in `admin`
    label: str | None = None  # the answer, for `expect.admin`
    recovery_timeout_s: float = Field(default=60.0, gt=0)  # target seconds, scaled


class Action(_M):
    """Exactly one of the fields."""

    arm: dict[str, Any] | None = None  # POST /admin/faults (scenario + parameters)
    clear: str | None = None  # DELETE /admin/faults[?scenario=NAME]; "all" for every one
    send: Send | None = None
    illegal: Illegal | None = None
    cancel: str | None = None  # the client goes away: cut the group's requests in flight
    wait: str | None = None  # the group's background requests end
    wait_state: WaitState | None = None
    wait_event: WaitEvent | None = None
    wait_admin: str | None = None  # a background admin call (by label) answers
    sleep: float | None = Field(default=None, ge=0)  # target seconds, scaled
    admin: Admin | None = None
    health: str | None = None  # GET /health, kept under this label
    cpu_start: str | None = None  # the target's CPU time from /metrics: a named window
    cpu_stop: str | None = None
    maintenance: Maintenance | None = None

    @model_validator(mode="after")
    def _one(self) -> Action:
        set_fields = [k for k in type(self).model_fields if getattr(self, k) is not None]
        if len(set_fields) != 1:
            raise ValueError(f"an action has exactly one of its keys, got {set_fields or 'none'}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in type(self).model_fields if getattr(self, k) is not None)


class Load(_M):
    """Closed-loop requests while the actions run (group `load`)."""

    concurrency: int = Field(default=2, ge=0)
    prompt_tokens: int = Field(default=16, ge=1)
    max_tokens: int = Field(default=16, ge=1)
    samples: int = Field(default=2, ge=1)  # prompts cycled over (each with a reference)
    stream: bool = False
    pause_after_error_s: float = Field(default=1.0, ge=0)  # target seconds, scaled


# --------------------------------------------------------------------------- expectations
Count = int | Bound


class Match(_M):
    """Filters on what one request showed the client."""

    status: int | list[int | None] | None = None  # None in a list: no HTTP status at all
    error_type: str | list[str | None] | None = None  # None in a list: no error
    latency_s: Bound | None = None  # target seconds, scaled (+ slack)
    matches_reference: bool | None = None  # output identical to the reference run
    complete: bool | None = None  # every requested token delivered


class RequestCheck(Match):
    """Every request selected (group, admitted, `where`) passes the filters; with `count`,
    the number of selected requests that pass is within it. Without `count`, a group that
    selects nothing fails, while a `where` that selects nothing holds (vacuously)."""

    group: str | list[str] = "*"  # "*": every request of the scenario, load included
    admitted: bool | None = None  # the server admitted it (an `admitted` event)
    cancelled: bool | None = False  # the client cut it (default: not cut)
    where: Match | None = None
    count: Count | None = None
    note: str = ""


class EventRef(_M):
    event: str
    detail: dict[str, Any] | None = None


class EventCheck(_M):
    """Server events of the scenario's window: how many match."""

    event: str
    group: str | list[str] | None = None  # only events of these requests ("*": any request)
    detail: dict[str, Any] | None = None  # subset match (a list value: one of)
    count: Count = Field(default_factory=lambda: Bound(min=1))
    after: EventRef | None = None  # only after the first event matching this
    before: EventRef | None = None  # only before the first such event (after `after`)
    same_job_as: EventRef | None = None  # only events of the jobs of those events
    note: str = ""


class StateCheck(_M):
    """A field of `/admin/state` at the end (`equals`) or its change (`delta`)."""

    path: str
    equals: Any = None
    delta: Count | None = None
    note: str = ""


class AdminCheck(_M):
    label: str
    status: int | list[int]
    body: dict[str, Any] | None = None  # subset match


class Invariants(_M):
    """Checked in every scenario unless switched off."""

    outputs_match_reference: bool = True  # no success with another request's/garbage tokens
    no_nonfinite: bool = True  # no NaN/Inf in a success
    no_shared_leases: bool = True  # no OutputBuf lease handed to two live requests
    recovered: bool = True  # ready at the end and golden passes after recovery
    # With maintenance actions: each has a complete record, and the target's audit log was
    # only appended to, holds every admin call with its operator and no token (§12.4).
    maintenance_logged: bool = True
    audit_log: bool = True


class Expect(_M):
    requests: list[RequestCheck] = Field(default_factory=list)
    events: list[EventCheck] = Field(default_factory=list)
    state: list[StateCheck] = Field(default_factory=list)
    transitions: list[str] = Field(default_factory=list)  # state_change `to`, in order
    admin: list[AdminCheck] = Field(default_factory=list)
    facts: dict[str, Any] = Field(default_factory=dict)  # name -> value or {min, max}


class FaultScenario(_M):
    schema_: Literal["calculet-fault-scenario/v1"] = Field(alias="schema")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    section: Literal["12.1", "12.2", "12.3", "12.4"]
    title: str = Field(min_length=1)
    description: str = ""
    # The fault's name in the target's catalogue: a broken rehearsal arms it `broken`.
    target_fault: str
    # The scenario stops the target (shutdown): run last, only with --allow-stop.
    stops_target: bool = False
    # Maintenance actions the target performs as its designed reaction to the fault (the
    # recovery of a device fault is a device reset): they need the authorization too.
    # Those the actions perform (`maintenance`, admin calls to /admin/reset, /admin/load,
    # /admin/shutdown) are found from the actions.
    maintenance: list[MaintenanceAction] = Field(default_factory=list)
    load: Load | None = Field(default_factory=Load)
    actions: list[Action] = Field(min_length=1)
    expect: Expect
    invariants: Invariants = Field(default_factory=Invariants)

    def maintenance_actions(self) -> list[MaintenanceAction]:
        """Every maintenance action the scenario performs or makes the target perform."""
        found: set[MaintenanceAction] = set(self.maintenance)
        for a in self.actions:
            if a.maintenance is not None:
                found.add(a.maintenance.action)
            elif a.admin is not None and a.admin.method == "POST":
                action = MAINTENANCE_PATHS.get(a.admin.path.split("?")[0])
                if action is not None:
                    found.add(action)
        return sorted(found)


def load_scenario(path: str | Path) -> FaultScenario:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FaultSpecError(f"{p}: {exc.strerror}") from None
    except yaml.YAMLError:
        raise FaultSpecError(f"{p}: invalid YAML") from None
    if not isinstance(data, dict):
        raise FaultSpecError(f"{p}: top level must be a mapping")
    try:
        return FaultScenario.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise FaultSpecError(f"{p}: {where}: {err['msg']}") from None


def load_scenarios(path: str | Path, only: list[str] | None = None) -> list[FaultScenario]:
    """A file, or every `*.yaml` of a folder in name order; `only` keeps those names.
    Scenarios that stop the target come last."""
    p = Path(path)
    files = sorted(p.glob("*.yaml")) if p.is_dir() else [p]
    if not files:
        raise FaultSpecError(f"{p}: no scenario files (*.yaml)")
    scenarios = [load_scenario(f) for f in files]
    names = [s.name for s in scenarios]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise FaultSpecError(f"{p}: scenario names repeat: {dupes}")
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise FaultSpecError(f"--only: unknown scenario(s) {unknown}; known: {names}")
        scenarios = [s for s in scenarios if s.name in only]
    return sorted(scenarios, key=lambda s: s.stops_target)


def scenario_json_schema() -> dict[str, Any]:
    return FaultScenario.model_json_schema(by_alias=True)
