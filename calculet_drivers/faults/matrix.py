"""The fault matrix of spec §12.1–§12.4 against a target (`calculet-load faults`,
commands.faults; a step of `calculet-load accept --faults`).

Each scenario of `configs/faults/*.yaml` (schema: calculet_drivers/faults/spec.py) runs in turn
on the same target:

  1 the target must be ready and idle (faults cleared, nothing queued or running);
  2 references: each prompt the scenario sends is run once, its output hash kept;
  3 the window opens (server events are read from here on, `/admin/state` noted);
  4 the load starts (closed loop, group `load`) and the actions run: arm faults through
    the admin API, send requests, illegal lengths, bursts, cancels, admin calls, waits;
  5 the load stops, faults are cleared, the target must return to ready and idle;
  6 the window's server events are collected (until every admitted request has ended);
  7 golden after recovery: the references again, and the golden set when given;
  8 the verdict: every expectation and invariant is a check with what was expected and
    what was observed (calculet_drivers/faults/check.py); PASS when all hold.

A scenario with maintenance actions (spec §12.4: device reset, reload, shutdown) runs only
when the manifest's `maintenance` section authorizes them at that moment; otherwise it is
NOT_RUN (never a pass: exit 1) and none of its admin calls is sent. Each such action is
recorded (calculet_drivers/faults/maintenance.py), and the target's audit log is read before and
after the scenario and checked.

One scenario, steps 1 to 8, is calculet_drivers/faults/scenario.py's; its actions
are calculet_drivers/faults/actions.py's.

`--broken NAME[,NAME]|all` is for rehearsals against the simulator: the scenario's
`target_fault` is armed in its broken mode, so the verdict must come out FAIL.

Outputs in the run folder: `faults.json` (every scenario, its verdict and evidence),
`faults/client/<worker>/part-*.parquet` (the scenario requests' records, kept out of the
performance analysis), `faults/server_events.jsonl` (each scenario's window) and
`faults/maintenance.jsonl` (one record per maintenance action).
Exit codes: 0 every scenario passed; 1 a scenario failed, could not run on a ready
target, or was not run for want of a maintenance authorization; 2 a scenario file, the
manifest or the golden set is invalid; 3 the target is unreachable or has no fault API
(infrastructure: rerun).
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import gevent

from calculet_drivers.faults.maintenance import (
    authorization_public,
    refusal,
)
from calculet_drivers.faults.observe import ReqObs
from calculet_drivers.faults.scenario import run_scenario
from calculet_drivers.faults.scenariorun import (
    ERROR,
    FAIL,
    NOT_AVAILABLE,
    NOT_RUN,
    SKIPPED,
    VERDICTS,
    FaultOptions,
)
from calculet_drivers.faults.spec import FaultScenario, FaultSpecError, load_scenarios
from calculet_drivers.skeleton.progress import Progress
from calculet_drivers.skeleton.runclient import RunClient
from calculet_drivers.skeleton.runtarget import RunTarget
from calculet_drivers.skeleton.steps import Step, run_steps
from calculet_load.errors import EXIT_FAIL, EXIT_INFRA, EXIT_INVALID, EXIT_OK, RunStop
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.prompts import Prompt
from calculet_load.measure.session import Session
from calculet_load.schema.manifest import ManifestError, RunManifest, load_manifest
from calculet_load.target.api import TargetAPI
from calculet_load.workload.matrix import GoldenSet, MatrixError, load_golden

FAULTS_SCHEMA = "calculet-faults/v1"


class _Infra(Exception):
    pass


class _FaultSession(Session):
    """A Session whose request ids come from a counter shared with its siblings (one per
    timeout), and which tells the running greenlet its request id."""

    def __init__(self, *args: Any, ids: Iterator[int], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._ids = ids

    def next_request_id(self) -> str:
        rid = f"{self.ctx.run_id}.{self.ctx.worker}.{next(self._ids):08d}"
        me = gevent.getcurrent()
        me.fault_request_id = rid
        req = getattr(me, "fault_req", None)
        if isinstance(req, ReqObs):
            req.rid = rid  # known while in flight (a maintenance record lists it)
        return rid


class FaultMatrix:
    def __init__(self, opts: FaultOptions) -> None:
        self.o = opts
        self.say = Progress(opts.progress)
        try:
            self.manifest: RunManifest = load_manifest(opts.manifest)
            self.scenarios = load_scenarios(opts.scenarios, opts.only)
            self.golden: GoldenSet | None = load_golden(opts.golden) if opts.golden else None
        except (ManifestError, FaultSpecError, MatrixError) as exc:
            raise RunStop(EXIT_INVALID, str(exc)) from None
        t = self.target = RunTarget.of(self.manifest, opts.url)
        self.url, self.protocol, self.model = t.url, t.protocol, t.model
        self.access = t.access  # TLS, base path, headers, API key (schema.access)
        self.run_dir = Path(opts.run_dir or Path("runs") / f"{self.manifest.run_id}")
        known = {s.name for s in self.scenarios}
        if opts.broken and opts.broken != ["all"]:
            unknown = sorted(set(opts.broken) - known - {"all"})
            if unknown:
                raise RunStop(EXIT_INVALID, f"--broken: unknown scenario(s) {unknown}")
        self.run_started_wall_ns = opts.run_started_wall_ns or time.time_ns()
        auth = self.manifest.maintenance
        # an authorized run's admin calls carry the accountable operator (audit log, §12.4)
        operator = auth.operator if auth is not None else "calculet-load-faults"
        self.api = TargetAPI(self.access, opts.admin_token, operator=operator)
        self.references: dict[tuple[int, int, int], str | None] = {}
        self.results: list[dict[str, Any]] = []
        self.scale: float = 1.0
        self.max_context = 40960
        self.code = EXIT_OK

    # ------------------------------------------------------------------ plumbing

    def _broken(self, sc: FaultScenario) -> bool:
        b = self.o.broken or []
        return "all" in b or sc.name in b

    def session(self, timeout_s: float | None) -> Session:
        """The session whose requests are bounded by `timeout_s` real seconds (None: the
        manifest's); all of them take their request ids from one counter."""
        return self.client.session_for(timeout_s)

    def prompt(self, tokens: int, sample: int) -> Prompt:
        return self.client.prompt(tokens, sample)

    def real(self, target_s: float) -> float:
        return target_s * self.scale + self.o.slack_s

    def refusal(self, actions: Iterable[str]) -> str | None:
        """Why these maintenance actions are not authorized now (None: they are)."""
        auth = self.manifest.maintenance
        return refusal(auth, actions, time.time_ns(), self.run_started_wall_ns)

    def authorization(self) -> dict[str, Any] | None:
        return authorization_public(self.manifest.maintenance, self.run_started_wall_ns)

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        out = self.run_dir / "faults"
        out.mkdir(parents=True, exist_ok=True)
        self.events_path = out / "server_events.jsonl"
        self.maintenance_path = out / "maintenance.jsonl"
        self.client = RunClient.open(
            self.manifest,
            self.target,
            out,
            self.o.worker,
            max_in_flight=4096,
            make_session=functools.partial(_FaultSession, ids=itertools.count(1)),
        )
        started = time.time_ns()
        try:
            run_in_greenlet(self._all)
        except _Infra as exc:
            self.say(f"faults: infrastructure: {exc}")
            self.code = EXIT_INFRA
            self.infra_error: str | None = str(exc)
        else:
            self.infra_error = None
        finally:
            self.client.close()
        self._write(started)
        return self.code

    def _all(self) -> None:
        profile = self.target.profile
        if not profile.admin_api:
            for sc in self.scenarios:
                why = f"the {profile.name} target has no admin API to inject faults through"
                self._skip(sc, why, NOT_AVAILABLE)
            self.say(f"fault matrix: not available: the {profile.name} target has no admin API")
            return
        run_steps(FAULT_STEPS, self)

    def _fault_api(self) -> None:
        """The target answers as an LLM endpoint and its fault API answers this token
        (else: infrastructure, exit 3)."""
        problem = self.target.check()
        if problem is not None:
            raise _Infra(problem)
        try:
            status, body = self.api.json("GET", "/admin/faults")
        except OSError as exc:
            raise _Infra(f"target {self.url} unreachable: {exc}") from None
        if status != 200:
            hint = {
                404: "the target has no fault API (start it with faults enabled)",
                401: "no admin token (CALCULET_ADMIN_TOKEN)",
                403: "the admin token was rejected",
            }.get(status, str(body)[:200])
            raise _Infra(f"GET /admin/faults: HTTP {status}: {hint}")

    def _target_facts(self) -> None:
        """The target's time scale and context length, which the scenarios scale by."""
        state = self.api.state()
        self.scale = self.o.time_scale or float(state.get("time_scale") or 1.0)
        try:
            _, models = self.api.json("GET", "/v1/models")
            self.max_context = int(models["data"][0].get("max_model_len") or self.max_context)
        except (OSError, KeyError, IndexError, TypeError, ValueError):
            pass
        self.say(
            f"fault matrix: {len(self.scenarios)} scenario(s) against {self.url} "
            f"(time scale {self.scale:g}, max context {self.max_context})"
        )

    def _scenarios(self) -> None:
        """Each scenario in order: skipped, not run (not authorized) or run and judged."""
        stopped = False
        for sc in self.scenarios:
            if sc.stops_target and not self.o.allow_stop:
                self._skip(sc, "stops the target: runs only with --allow-stop (the last one)")
                continue
            if stopped:
                self._skip(sc, "the target was stopped by an earlier scenario")
                continue
            refused = self.refusal(sc.maintenance_actions())
            if refused is not None:
                self._skip(sc, refused, NOT_RUN)
                self.code = self.code or EXIT_FAIL
                continue
            result = run_scenario(self, sc, self._broken(sc))
            self.results.append(result)
            stopped = stopped or sc.stops_target
            self.say(f"  {sc.name}: {result['verdict']} ({result['duration_s']:.1f} s)")
            for ev in result["evidence"][:4]:
                self.say(
                    f"    FAILED {ev['check']}: expected {ev['expected']}, "
                    f"observed {json.dumps(ev['observed'], default=str)[:300]}"
                )
            if result["verdict"] in (FAIL, ERROR, NOT_RUN):
                self.code = EXIT_FAIL

    def _skip(self, sc: FaultScenario, reason: str, verdict: str = SKIPPED) -> None:
        self.results.append(
            {
                "name": sc.name,
                "section": sc.section,
                "title": sc.title,
                "maintenance_actions": sc.maintenance_actions(),
                "verdict": verdict,
                "reason": reason,
                "checks": [],
                "evidence": [],
                "duration_s": 0.0,
            }
        )
        self.say(f"  {sc.name}: {verdict.replace('_', ' ')} ({reason})")

    # ------------------------------------------------------------------ output
    def document(self) -> dict[str, Any]:
        counts = {v: sum(r["verdict"] == v for r in self.results) for v in VERDICTS}
        return {
            "schema": FAULTS_SCHEMA,
            "run_id": self.manifest.run_id,
            "target": self.url,
            "time_scale": self.scale,
            "slack_s": self.o.slack_s,
            "broken_rehearsal": self.o.broken or [],
            "maintenance_authorization": self.authorization(),
            "infrastructure_error": getattr(self, "infra_error", None),
            "summary": counts,
            "exit_code": self.code,
            "scenarios": self.results,
        }

    def _write(self, started_wall_ns: int) -> None:
        doc = {
            "started_wall_ns": started_wall_ns,
            "ended_wall_ns": time.time_ns(),
            **self.document(),
        }
        tmp = self.run_dir / "faults.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(self.run_dir / "faults.json")


# The matrix as steps (calculet_drivers.skeleton.steps): logged by the caller's step (accept's
# `faults` rows) and in faults.json, not one by one.
FAULT_STEPS: tuple[Step[FaultMatrix], ...] = (
    Step("fault_api", FaultMatrix._fault_api, logged=False),
    Step("target", FaultMatrix._target_facts, logged=False),
    Step("scenarios", FaultMatrix._scenarios, logged=False),
)
