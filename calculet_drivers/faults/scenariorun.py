"""A fault scenario while it runs (`Run`) and its requests: one sent and observed
(`send_one`), background groups (`spawn`) and the scenario's closed-loop load
(`start_load`).

The actions (`faults.actions`) and the matrix's loop (`faults.matrix`) both act on a
running scenario through the matrix; they see it as a `Bench`, the part of the fault
matrix they use, so neither module imports the other's class.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import gevent

from calculet_drivers.faults.observe import Observation, ReqObs
from calculet_drivers.faults.spec import FaultScenario
from calculet_drivers.skeleton.runclient import RunClient
from calculet_load.measure.outcome import Outcome
from calculet_load.measure.prompts import Prompt
from calculet_load.measure.session import RequestSpec, Session
from calculet_load.schema.manifest import RunManifest
from calculet_load.target.api import TargetAPI

__all__ = [
    "ERROR",
    "FAIL",
    "NOT_AVAILABLE",
    "NOT_RUN",
    "PASS",
    "SKIPPED",
    "VERDICTS",
    "Bench",
    "FaultOptions",
    "Run",
    "send_one",
    "spawn",
    "start_load",
]

PASS, FAIL, ERROR, SKIPPED = "PASS", "FAIL", "ERROR", "SKIPPED"
# Not run because the manifest does not authorize its maintenance actions (spec §12.4):
# never a pass, so the matrix exits 1 (see docs/faults.md).
NOT_RUN = "NOT_RUN"
# the target is not one that can be fault-injected (its profile has no admin API):
# nothing was run, and nothing failed
NOT_AVAILABLE = "NOT_AVAILABLE"
VERDICTS = (PASS, FAIL, ERROR, SKIPPED, NOT_RUN, NOT_AVAILABLE)


@dataclasses.dataclass
class FaultOptions:
    manifest: str
    scenarios: str = "configs/faults"
    url: str | None = None
    run_dir: str | None = None
    golden: str | None = None
    admin_token: str | None = None
    only: list[str] | None = None
    broken: list[str] | None = None  # rehearsal: arm these scenarios' faults broken ("all")
    allow_stop: bool = False  # run scenarios that stop the target (shutdown)
    time_scale: float | None = None  # default: /admin/state `time_scale`, else 1
    slack_s: float = 0.5  # real seconds on top of every scaled time bound
    settle_s: float = 0.5  # real seconds for the target to flush its traces
    progress: bool = True
    worker: str = "faults"
    # the run's start, for a maintenance window given as a duration (default: now)
    run_started_wall_ns: int | None = None


class Bench(Protocol):
    """What a scenario's actions use of the fault matrix running it."""

    manifest: RunManifest
    api: TargetAPI
    client: RunClient
    references: dict[tuple[int, int, int], str | None]
    scale: float
    max_context: int

    def session(self, timeout_s: float | None) -> Session: ...

    def prompt(self, tokens: int, sample: int) -> Prompt: ...

    def real(self, target_s: float) -> float: ...

    def refusal(self, actions: Iterable[str]) -> str | None: ...

    def authorization(self) -> dict[str, Any] | None: ...


@dataclasses.dataclass
class Run:
    """One scenario while it runs."""

    sc: FaultScenario
    broken: bool
    obs: Observation
    served_calbin: str | None = None
    background: dict[str, list[gevent.Greenlet]] = dataclasses.field(default_factory=dict)
    admin_bg: dict[str, gevent.Greenlet] = dataclasses.field(default_factory=dict)
    cpu_marks: dict[str, tuple[float | None, float]] = dataclasses.field(default_factory=dict)
    admin_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    load_stop: bool = False


def send_one(
    fm: Bench,
    run: Run,
    group: str,
    prompt: Prompt,
    max_tokens: int,
    *,
    key: tuple[int, int, int] | None,
    stream: bool = True,
    timeout_s: float | None = None,
    case: str = "",
    user: str = "",
) -> ReqObs:
    req = ReqObs(group=group, key=key, case=case, max_tokens=max_tokens, user=user or group)
    run.obs.requests.append(req)
    me = gevent.getcurrent()
    me.fault_req = req
    spec = RequestSpec(
        prompt=prompt,
        max_tokens=max_tokens,
        stream=stream,
        cell=f"fault:{run.sc.name}:{group}",
        arrival="fault",
        reuse=key is not None,  # compared with the reference output of the same prompt
    )
    session = fm.session(None if timeout_s is None else fm.real(timeout_s))
    t0 = time.monotonic()
    req.start_wall_ns = time.time_ns()
    out: Outcome | None
    try:
        _, out = session.send(spec)
    except gevent.GreenletExit as exc:  # the driver cut it: a client going away
        out = getattr(exc, "outcome", None)
    req.elapsed_s = time.monotonic() - t0
    req.end_wall_ns = time.time_ns()
    req.rid = getattr(me, "fault_request_id", None)
    if out is not None:
        req.rid = out.request_id
        req.status = out.http_status
        req.error_type = out.error_code
        req.error_class = out.error_class
        req.tokens = out.output_tokens
        req.token_hash = out.token_hash
        req.nonfinite = out.nonfinite
    return req


def spawn(run: Run, group: str, fn: Callable[[], Any]) -> gevent.Greenlet:
    g = gevent.spawn(fn)
    run.background.setdefault(group, []).append(g)
    return g


def start_load(fm: Bench, run: Run) -> None:
    spec = run.sc.load
    if spec is None or spec.concurrency == 0:
        return
    pause = max(spec.pause_after_error_s * fm.scale, 0.005)

    def user(u: int) -> None:
        for k in itertools.count(u):
            if run.load_stop:
                return
            sample = 100 + k % spec.samples
            key = (spec.prompt_tokens, sample, spec.max_tokens)
            prompt = fm.prompt(spec.prompt_tokens, sample)
            req = send_one(
                fm, run, "load", prompt, spec.max_tokens, key=key, stream=spec.stream,
                user=f"load-{u}",
            )  # fmt: skip
            if not req.ok:
                gevent.sleep(pause)

    for u in range(spec.concurrency):
        spawn(run, "load", functools.partial(user, u))
