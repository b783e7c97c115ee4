# size: the fault-matrix driver; its plumbing is to become shared steps (issue 16)
"""`calculet-load faults`: the fault matrix of spec §12.1–§12.4 against a target.

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

The actions themselves are calculet_drivers/faults/actions.py's.

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

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import gevent

from calculet_drivers.faults.actions import (
    PROBE_KEY,
    ActionFailed,
    NotAuthorized,
    act,
    arm,
    window_rows,
)
from calculet_drivers.faults.check import judge
from calculet_drivers.faults.maintenance import (
    AuditObs,
    authorization_public,
    finish_records,
    match_audit_rows,
    refusal,
    snapshot_of,
)
from calculet_drivers.faults.observe import TERMINAL_EVENTS, Observation, ReqObs
from calculet_drivers.faults.scenariorun import Run, start_load
from calculet_drivers.faults.spec import FaultScenario, FaultSpecError, load_scenarios
from calculet_drivers.skeleton.runclient import RunClient
from calculet_drivers.skeleton.runtarget import RunTarget
from calculet_drivers.skeleton.steps import Step, run_steps
from calculet_load.errors import EXIT_FAIL, EXIT_INFRA, EXIT_INVALID, EXIT_OK, RunStop
from calculet_load.measure.client import Outcome, run_in_greenlet
from calculet_load.measure.prompts import Prompt, WorkloadError
from calculet_load.measure.session import RequestSpec, Session, golden_spec
from calculet_load.ranges import SCALE, SECONDS
from calculet_load.schema.manifest import ManifestError, RunManifest, load_manifest
from calculet_load.schema.profiles import profile_named
from calculet_load.target.api import TargetAPI
from calculet_load.workload.matrix import GoldenSet, MatrixError, load_golden

FAULTS_SCHEMA = "calculet-faults/v1"
PASS, FAIL, ERROR, SKIPPED = "PASS", "FAIL", "ERROR", "SKIPPED"
# Not run because the manifest does not authorize its maintenance actions (spec §12.4):
# never a pass, so the matrix exits 1 (see docs/faults.md).
NOT_RUN = "NOT_RUN"
# the target is not one that can be fault-injected (its profile has no admin API):
# nothing was run, and nothing failed
NOT_AVAILABLE = "NOT_AVAILABLE"
VERDICTS = (PASS, FAIL, ERROR, SKIPPED, NOT_RUN, NOT_AVAILABLE)


class _Infra(Exception):
    pass


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
    def say(self, text: str) -> None:
        if self.o.progress:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

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
            result = self._scenario(sc)
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

    # ------------------------------------------------------------------ a scenario
    def _scenario(self, sc: FaultScenario) -> dict[str, Any]:
        t0 = time.monotonic()
        broken = self._broken(sc)
        result: dict[str, Any] = {
            "name": sc.name,
            "section": sc.section,
            "title": sc.title,
            "target_fault": sc.target_fault,
            "broken_rehearsal": broken,
            "maintenance_actions": sc.maintenance_actions(),
            "started_wall_ns": time.time_ns(),
        }
        run = Run(sc, broken, Observation(scale=self.scale, slack_s=self.o.slack_s))
        try:
            self._prepare(run)
        except (OSError, ActionFailed, WorkloadError) as exc:
            result.update(
                verdict=ERROR,
                reason=f"before the scenario: {exc}",
                checks=[],
                evidence=[],
                duration_s=time.monotonic() - t0,
            )
            self.api.journal = None
            self.api.json("DELETE", "/admin/faults")
            return result
        start_load(self, run)
        not_run = None
        try:
            for i, action in enumerate(sc.actions):
                try:
                    act(self, run, action)
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
            self._wind_down(run)
        obs = run.obs
        for r in obs.requests:
            if r.key is not None:
                r.reference = self.references.get(r.key)
        checks, facts = judge(sc, obs)
        verdict = PASS if all(c.ok for c in checks) else FAIL
        if not_run is not None:
            verdict = NOT_RUN
            result["reason"] = not_run
        with self.events_path.open("a", encoding="utf-8") as f:
            for row in obs.events:
                f.write(json.dumps({"scenario": sc.name, **row}) + "\n")
        if obs.maintenance:
            with self.maintenance_path.open("a", encoding="utf-8") as f:
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

    def _prepare(self, run: Run) -> None:
        """Faults cleared, the target ready and idle, references, the window opened."""
        sc = run.sc
        status, body = self.api.json("DELETE", "/admin/faults")
        if status != 200:
            raise ActionFailed(f"DELETE /admin/faults: HTTP {status}: {body}")
        st = self._wait_idle(30.0)
        if st is None or st.get("state") != "ready":
            state = st.get("state") if st else "unknown"
            raise ActionFailed(f"the target is not ready and idle (state {state})")
        keys = set(_keys(sc))
        self._references(keys)
        if sc.maintenance_actions() and sc.invariants.audit_log:
            status, log = self.api.audit_log()
            run.obs.audit = AuditObs(self.api.operator, status, log, token=self.o.admin_token)
            self.api.journal = []
        self.api.skip_to_end("server_events")
        run.obs.state_before = self.api.state()
        run.served_calbin = run.obs.state_before.get("calbin_sha256")
        if run.broken and not any(
            a.arm is not None and a.arm.get("scenario") == sc.target_fault for a in sc.actions
        ):
            arm(self, run, {"scenario": sc.target_fault})

    def _wait_idle(self, timeout_real_s: float) -> dict[str, Any] | None:
        last: dict[str, Any] = {}

        def idle() -> dict[str, Any] | None:
            nonlocal last
            last = self.api.state()
            busy = (
                last.get("queue", {}).get("waiting"),
                last.get("sequences_active"),
                last.get("jobs", {}).get("in_flight"),
            )
            return last if last.get("state") == "ready" and busy == (0, 0, 0) else None

        got: dict[str, Any] | None = self.api.wait_until(idle, timeout_real_s, 0.02)
        return got or last

    def _references(self, keys: set[tuple[int, int, int]]) -> None:
        todo = sorted(k for k in keys if k not in self.references)
        if not todo:
            return
        jobs = [gevent.spawn(self._reference, k) for k in todo]
        gevent.joinall(jobs)
        for g in jobs:
            if g.exception is not None:
                raise g.exception

    def _send_reference(self, key: tuple[int, int, int], cell: str) -> Outcome:
        """The reference request of `key` (prompt tokens, sample, output tokens): its
        prompt as built, unstreamed, so that its output hash is comparable."""
        p, sample, n = key
        spec = RequestSpec(
            prompt=self.prompt(p, sample),
            max_tokens=n,
            stream=False,
            cell=cell,
            arrival="fault",
            reuse=True,
        )
        return self.session(None).send(spec)[1]

    def _reference(self, key: tuple[int, int, int]) -> None:
        p, sample, n = key
        out = self._send_reference(key, "fault:reference")
        if out.ok and out.output_tokens == n:
            self.references[key] = out.token_hash
        else:
            raise ActionFailed(
                f"reference request p{p}-s{sample}-o{n} failed: {out.http_status} {out.error_code}"
            )

    # ------------------------------------------------------------------ the end
    def _wind_down(self, run: Run) -> None:
        run.load_stop = True
        pending = [g for jobs in run.background.values() for g in jobs]
        gevent.joinall(pending, timeout=max(self.real(60.0), 5.0))
        for g in pending:
            if not g.dead:  # still running: cut (recorded as cancelled by the client)
                req = getattr(g, "fault_req", None)
                if isinstance(req, ReqObs):
                    req.cancelled = True
                    req.cancel_wall_ns = time.time_ns()
                g.kill(block=True, timeout=10)
        for g in run.admin_bg.values():
            g.join(timeout=max(self.real(60.0), 5.0))
        try:
            self.api.json("DELETE", "/admin/faults")
            if not run.sc.stops_target:
                self._wait_idle(max(self.real(120.0), 5.0))
            gevent.sleep(self.o.settle_s)
            run.obs.state_after = self.api.state()
            self._collect(run)
            if run.sc.invariants.recovered and not run.sc.stops_target:
                run.obs.golden_after = self._golden_after(run)
        except OSError as exc:
            run.obs.action_errors.append(f"after the scenario: target unreachable: {exc}")
        finally:
            self._maintenance_end(run)

    def _maintenance_end(self, run: Run) -> None:
        """The audit log read again (the client's admin calls in between known), and each
        maintenance record completed: after, affected requests, recovery, its audit row."""
        audit, calls = run.obs.audit, self.api.journal
        self.api.journal = None
        if isinstance(audit, AuditObs):
            audit.calls = calls or []
            try:
                audit.after_status, audit.after = self.api.audit_log()
            except OSError as exc:
                audit.after_status, audit.after = None, str(exc).encode()
        if not run.obs.maintenance:
            return
        state: dict[str, Any] = run.obs.state_after or {"error": "target unreachable"}
        try:
            health: tuple[int | None, Any] = self.api.health()
        except OSError as exc:
            health = (None, str(exc))
        end = {"wall_ns": time.time_ns(), **snapshot_of(state, health)}
        finish_records(run.obs.maintenance, run.obs.requests, end, self.scale,
                       run.obs.golden_after)  # fmt: skip
        match_audit_rows(run.obs.maintenance, audit if isinstance(audit, AuditObs) else None)

    def _collect(self, run: Run) -> None:
        """Read events until every request the server accepted has a terminal event."""

        def complete() -> bool:
            rows = window_rows(self, run)
            accepted = {r["request_id"] for r in rows if r["event"] == "accepted"}
            ended = {r["request_id"] for r in rows if r["event"] in TERMINAL_EVENTS}
            return accepted <= ended

        self.api.wait_until(complete, 5.0, 0.1)

    def _golden_after(self, run: Run) -> tuple[bool, str]:
        """The scenario's references again, and the golden set: all must match."""
        failures = []
        checked = 0
        keys = sorted({r.key for r in run.obs.requests if r.key is not None} | set(_keys(run.sc)))
        for key in keys:
            p, sample, n = key
            out = self._send_reference(key, "fault:golden_after")
            checked += 1
            if not out.ok:
                failures.append(f"p{p}-s{sample}-o{n}: {out.http_status} {out.error_code}")
            elif out.token_hash != self.references.get(key):
                failures.append(f"p{p}-s{sample}-o{n}: output differs from the reference")
        for case in self.golden.cases if self.golden else []:
            prompt = self.prompt(case.prompt_tokens, case.sample)
            over = {"stream": False, "arrival": "fault", "concurrency": None}
            spec = golden_spec(case, prompt, f"fault:golden:{case.name}", **over)
            _, out = self.session(None).send(spec)
            checked += 1
            if not out.ok:
                failures.append(f"golden {case.name}: {out.http_status} {out.error_code}")
            elif case.token_hash is not None and out.token_hash != case.token_hash:
                failures.append(f"golden {case.name}: token hash {str(out.token_hash)[:12]}…")
        if failures:
            return False, f"{len(failures)}/{checked} failed: " + "; ".join(failures[:4])
        return True, f"{checked} request(s) matched"

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


def _keys(sc: FaultScenario) -> Iterator[tuple[int, int, int]]:
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


# ---------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", required=True, help="run manifest YAML")
    p.add_argument(
        "--scenarios",
        default="configs/faults",
        help="a scenario file or a folder of them (default configs/faults)",
    )
    p.add_argument("--url", help="target URL (default: the manifest's target.url)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run_id>)")
    p.add_argument("--golden", help="golden set YAML: run after each scenario's recovery")
    p.add_argument("--only", help="comma-separated scenario names to run")
    p.add_argument(
        "--broken",
        help="rehearsal against the simulator: arm these scenarios' faults in their broken "
        "mode (comma-separated names or 'all'); their verdicts must be FAIL",
    )
    p.add_argument(
        "--allow-stop",
        action="store_true",
        help="also run scenarios that stop the target (shutdown), last",
    )
    p.add_argument(
        "--time-scale",
        type=SCALE,
        help="real seconds per target second (default: /admin/state time_scale)",
    )
    p.add_argument(
        "--slack-s",
        type=SECONDS,
        default=0.5,
        help="real seconds allowed on top of every scaled time bound",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _has_admin_api(manifest_path: str) -> bool:
    """Whether the manifest's target has an admin API (its profile; a manifest that does
    not load is judged later, with its own message)."""
    try:
        target = load_manifest(manifest_path).target
    except (ManifestError, OSError):
        return True
    return profile_named(target.profile if target else "calculet").admin_api


def run(args: argparse.Namespace) -> int:
    token = os.environ.get("CALCULET_ADMIN_TOKEN")
    if not token and _has_admin_api(args.manifest):
        print("faults: CALCULET_ADMIN_TOKEN is not set: the admin API needs it", file=sys.stderr)
        return EXIT_INFRA
    opts = FaultOptions(
        manifest=args.manifest,
        scenarios=args.scenarios,
        url=args.url,
        run_dir=args.run_dir,
        golden=args.golden,
        admin_token=token,
        only=[s for s in (args.only or "").split(",") if s] or None,
        broken=[s for s in (args.broken or "").split(",") if s] or None,
        allow_stop=args.allow_stop,
        time_scale=args.time_scale,
        slack_s=args.slack_s,
        progress=not args.quiet,
    )
    try:
        fm = FaultMatrix(opts)
    except RunStop as stop:  # the scenarios or the manifest cannot be run
        print(f"faults: {stop}", file=sys.stderr)
        return stop.code
    code = fm.run()
    doc = fm.document()
    s = doc["summary"]
    print(
        f"faults: {s[PASS]} pass, {s[FAIL]} fail, {s[ERROR]} error, {s[SKIPPED]} skipped, "
        f"{s[NOT_RUN]} NOT RUN (not authorized by the manifest); "
        + (f"{s[NOT_AVAILABLE]} not available on this target; " if s[NOT_AVAILABLE] else "")
        + f"exit {code}; {fm.run_dir / 'faults.json'}"
    )
    return code
