# size: one concept, the acceptance run: its §8 steps (drive.steps) and what each records
"""`calculet-load accept`: the automated acceptance run of spec §15 in the order of §8.

Steps, each logged to `events.jsonl` in the run folder as it starts and ends:

  1 release    manifest valid; calbin sha256 and versions match the target (exit 2)
  2 idle       sample the device until temperature/power/frequency are stable
  3 golden     the fixed golden set; any mismatch stops the run (exit 1)
    crosstalk  its greedy cases under concurrency vs the same requests alone (§14.1)
  4 warmup     `warmup_requests` per new request shape, recorded as warmup
  5 matrix     the cells in a seeded random order, each with its repetitions, an idle
               gap between cells; `plan.json` holds the order, seeds and progress
  6 golden     the golden set again
  7 resources  KV, buffer leases and sequences back to their idle values
  8 traces     the server's traces copied into `server/`
  9 analysis   `analysis` judges the folder (and a baseline run): verdict.json
 10 report     the HTML report; 11 sign: the signed bundle

An interrupted run resumes from `plan.json` (`--resume RUN_DIR`): finished cells are not
repeated; the records of a cell that was cut are kept and excluded with their reason.
The matrix's cells are split into shares (calculet_load.workload.dispatch) sent from this process
on its own gevent loop, or with `--workers N`/`--master` by Locust workers with this
process as their master (calculet_load.locust.cells). `--interleave-with TARGET` runs a
baseline target's cells between the candidate's (calculet_drivers.accept.interleave).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import yaml

from analysis.errors import AnalysisError
from analysis.judge.idle import IdleCheck, IdleCriterion, idle_criterion
from analysis.report import write_report
from analysis.sign import sign_run
from calculet_drivers.accept.crosstalk import run_crosstalk
from calculet_drivers.accept.faultstep import run_fault_step
from calculet_drivers.skeleton.runclient import RunClient
from calculet_drivers.skeleton.runtarget import RunTarget
from calculet_drivers.skeleton.steps import (
    EventLog,
    Step,
    StepOutcome,
    StepResult,
    analyze,
    run_steps,
)
from calculet_load.clock import clock_provenance
from calculet_load.errors import (
    EXIT_FAIL,
    EXIT_INFRA,
    EXIT_INVALID,
    EXIT_OK,
    RunStop,
)
from calculet_load.measure.client import run_in_greenlet
from calculet_load.measure.prompts import Prompt, WorkloadError
from calculet_load.measure.session import RequestSpec, golden_spec
from calculet_load.schema.manifest import ManifestError, RunManifest, load_manifest
from calculet_load.schema.prometheus import chip_gauges, device_sample
from calculet_load.schema.runfolder import ClientIndex, IndexWorker
from calculet_load.target.api import TargetAPI, off_loop
from calculet_load.target.describe import describe_target
from calculet_load.target.netprobe import RttRounds
from calculet_load.target.traces import collect_traces
from calculet_load.workload.dispatch import (
    BURST_GAP_S,
    BURST_LEAD_S,
    OPEN_LEAD_S,
    CellRunner,
    FleetError,
    Share,
    split,
)
from calculet_load.workload.matrix import (
    Cell,
    GoldenSet,
    Matrix,
    MatrixError,
    load_golden,
    load_matrix,
    minimum_repetitions,
)
from calculet_load.workload.mixes import load_mix, single

PLAN_SCHEMA = "calculet-plan/v1"
# what stays in place when a cut attempt is set aside: an interleaved run's baseline
# folder (it sets its own attempts aside) and the baseline manifest made from a URL
SET_ASIDE_KEEPS = {"aborted", "baseline", "manifest.given.yaml"}
GOLDEN_RECORDED = "golden.recorded.yaml"  # accept --record-golden: the set with this run's hashes


@dataclass
class Options:
    manifest: str
    matrix: str
    golden: str | None = None
    run_dir: str | None = None
    url: str | None = None
    seed: int = 0
    baseline_run: str | None = None
    rules: str | None = None
    calbin: str | None = None
    admin_token: str | None = None
    idle_window_s: float | None = None  # None: the rules file's idle.window_s (§8.2)
    idle_timeout_s: float | None = None  # None: the rules file's idle.timeout_s
    idle_gap_s: float = 2.0
    min_repetitions: int | None = None  # a cap: below §8's 30/100 in a rehearsal only
    record_golden: bool = False
    resume: bool = False
    skip_report: bool = False
    crosstalk_concurrency: int = 4  # spec §14.1 cross-talk step; 0: not run
    progress: bool = True
    workers: int = 0  # start this many local Locust worker processes
    master: bool = False  # wait for `expect_workers` remote Locust workers
    expect_workers: int = 1
    master_bind_host: str = "*"
    master_bind_port: int = 5557
    workers_timeout_s: float = 120.0
    # the target's resources sampled this often through the matrix (the leak rules bin
    # them: a short run needs samples often enough for their 20 bins)
    resource_interval_s: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)


class InProcess:
    """The pipeline's own process as the run's one client."""

    processes = 1

    def __init__(self, runner: CellRunner) -> None:
        self.runner = runner

    def run_step(
        self, step: list[Share | None], job: dict[str, Any], lead_s: float, run_dir: Path
    ) -> int:
        share = step[0]
        assert share is not None
        self.runner.prepare(share)
        share = dataclasses.replace(share, start_wall_ns=time.time_ns() + int(lead_s * 1e9))
        return run_in_greenlet(lambda: self.runner.run(share))


class Pipeline:
    def __init__(self, opts: Options) -> None:
        self.o = opts
        try:
            self.manifest: RunManifest = load_manifest(opts.manifest)
            self.matrix: Matrix = load_matrix(opts.matrix)
            self.golden: GoldenSet | None = load_golden(opts.golden) if opts.golden else None
            self.golden_file = opts.golden  # --record-golden: golden.recorded.yaml once recorded
        except (ManifestError, MatrixError) as exc:
            raise RunStop(EXIT_INVALID, str(exc)) from None
        t = self.target = RunTarget.of(self.manifest, opts.url, lambda m: RunStop(EXIT_INVALID, m))
        self.url, self.protocol, self.model = t.url, t.protocol, t.model
        self.access = t.access  # TLS, base path, headers, API key (schema.access)
        # issue 15: RTT and jitter from this process (§5), on the profile's health path
        self.rtt = RttRounds(self.access, path=t.profile.health_probe_path)
        self.idle = self._idle_criterion()  # §8.2, from the rules file (exit 2 if invalid)
        self.run_dir = Path(opts.run_dir or Path("runs") / self.manifest.run_id)
        self.cells = self.matrix.expanded()
        if not self.manifest.rehearsal:
            self._check_repetitions()
        self.plan: dict[str, Any] = {}
        self.code = EXIT_OK
        self.notes: list[str] = []
        self.sampler: Any = None
        self.fleet: Any = None  # calculet_load.locust.cells.Fleet in a distributed run
        self.label = ""  # " (baseline)" / " (candidate)" in an interleaved run
        self.owns_fleet = True  # False: the fleet is the interleaved candidate's

    # --------------------------------------------------------------- §8.2, §8.6
    def _idle_criterion(self) -> IdleCriterion:
        """The rules file's idle criterion, its durations overridden by
        `--idle-window-s`/`--idle-timeout-s`."""
        o = self.o
        try:
            crit = idle_criterion(o.rules, window_s=o.idle_window_s, timeout_s=o.idle_timeout_s)
        except AnalysisError as exc:  # the rules file is invalid (exit 2): one line
            raise RunStop(int(exc.exit_code), str(exc)) from None
        if crit.timeout_s < crit.window_s:
            raise RunStop(
                EXIT_INVALID,
                f"idle: the time limit ({crit.timeout_s:g} s) is shorter than the window "
                f"({crit.window_s:g} s): the device could never be found stable",
            )
        return crit

    def _repetitions(self, cell: Cell) -> int:
        """What the plan gives the cell: the matrix's repetitions, capped by
        `--min-repetitions` (a burst cell sends size × rounds whatever the cap)."""
        reps = self.matrix.repetitions_for(cell)
        if self.o.min_repetitions is not None and cell.kind != "burst":
            reps = min(reps, self.o.min_repetitions)
        return reps

    def _below_minimum(self, cell: Cell) -> bool:
        need = minimum_repetitions(cell)
        return need is not None and self._repetitions(cell) < need

    def _check_repetitions(self) -> None:
        """Spec §8.6 enforced: an acceptance (the manifest's purpose does not say
        rehearsal) refuses, before anything runs, a cell below 30 repetitions (100 for a
        short case); boundary cells are policy tests, not measurements (exit 2)."""
        short = [c for c in self.cells if self._below_minimum(c)]
        if not short:
            return
        cell = short[0]
        reps, need = self._repetitions(cell), minimum_repetitions(cell)
        what = "a short case (prompt <= 512, output <= 32 tokens)" if cell.short else "a case"
        more = f" (and {len(short) - 1} other cell(s) below §8)" if len(short) > 1 else ""
        raise RunStop(
            EXIT_INVALID,
            f"§8: cell {cell.name} has {reps} repetitions, fewer than the {need} an acceptance "
            f"needs for {what}{more}; raise the matrix's repetitions, or say rehearsal in "
            f"the manifest's purpose ({self.manifest.purpose!r})",
        )

    # --------------------------------------------------------------- helpers
    def say(self, text: str) -> None:
        if self.o.progress:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def _get(self, path: str, admin: bool = False) -> bytes:
        """GET a server path through the target's access (base path, TLS, headers); the
        admin token replaces the API key on admin calls. OSError unless it answers 200."""
        token = self.o.admin_token if admin else None
        headers = {"Authorization": f"Bearer {token}"} if token else None
        status, raw, _ = off_loop(lambda: self.access.call("GET", path, None, headers, 30.0))
        if status != 200:
            raise OSError(f"{path}: HTTP {status}")
        return raw

    def _get_json(self, path: str, admin: bool = False) -> Any:
        return json.loads(self._get(path, admin))

    def _save_plan(self) -> None:
        tmp = self.run_dir / "plan.json.tmp"
        tmp.write_text(json.dumps(self.plan, indent=1))
        tmp.replace(self.run_dir / "plan.json")

    # --------------------------------------------------------------- the run
    def run(self) -> int:
        resumed = self.open()
        try:
            self.before_matrix(resumed)
            self._matrix()
            self.after_matrix()
        except RunStop as stop:
            self.stopped(stop)
        finally:
            self.close()
        return self.end()

    def open(self) -> bool:
        """The run folder, its event log, the plan (resumed?), the session and sink."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        plan = self.run_dir / "plan.json"
        if self.o.resume and not plan.exists() and (self.run_dir / "events.jsonl").exists():
            self._set_aside()
        self.log = EventLog(self.run_dir / "events.jsonl")
        resumed = self.o.resume and plan.exists()
        attempt = 1
        if resumed:
            self.plan = json.loads(plan.read_text())
            attempt = int(self.plan.get("attempts", 1)) + 1
            self.plan["attempts"] = attempt
        self.worker = "w00" if attempt == 1 else f"w00-r{attempt - 1}"
        self.client = RunClient.open(
            self.manifest, self.target, self.run_dir, self.worker, max_in_flight=1024
        )
        self.sink, self.session = self.client.sink, self.client.session
        self.client.watch.start()
        self.clients: Any = InProcess(CellRunner(self.session, self._prompt, self.client.prompts))
        return resumed

    def _set_aside(self) -> None:
        """An attempt cut before its plan existed (in release, idle, golden or warmup):
        its files move to `aborted/attempt-N/`, kept and signed with the run but outside
        what the analysis reads, and the run starts over."""
        aborted = self.run_dir / "aborted"
        n = len(list(aborted.glob("attempt-*"))) + 1 if aborted.exists() else 1
        dest = aborted / f"attempt-{n}"
        dest.mkdir(parents=True)
        for path in list(self.run_dir.iterdir()):
            if path.name not in SET_ASIDE_KEEPS:
                path.rename(dest / path.name)
        self.say(f"the attempt cut before its plan existed is kept in {dest}; starting over")

    def stopped(self, stop: RunStop) -> None:
        self.log.write("run", "stopped", code=stop.code, reason=str(stop))
        self.say(f"STOP (exit {stop.code}): {stop}")
        self.code = stop.code

    def close(self) -> None:
        """RunStop sending: samplers, workers, self-watch, session; the sink's last part."""
        if self.sampler is not None:
            self.sampler.stop()
        if self.fleet is not None:
            self._close_fleet()
        self.client.close()  # the self-watch, the session, the sink's last part

    def end(self) -> int:
        if self.code in (EXIT_OK, EXIT_FAIL):
            self._finish()  # ends with the signature: nothing is written after it
        else:
            self.log.write("run", "end", code=self.code)
        return self.code

    def before_matrix(self, resumed: bool) -> None:
        if not resumed:
            self.log.write("run", "start", run_id=self.manifest.run_id, target=self.url)
            (self.run_dir / "manifest.yaml").write_text(Path(self.o.manifest).read_text())
            run_steps(BEFORE_MATRIX, self, self.log)
        else:
            self.log.write("run", "resume", attempt=self.plan["attempts"])
            pinned = self.run_dir / GOLDEN_RECORDED
            if self.o.record_golden and pinned.exists():  # golden before recorded it
                self.golden, self.golden_file = load_golden(pinned), str(pinned)
            self.say(f"resuming {self.run_dir} (attempt {self.plan['attempts']})")
            run_steps(ON_RESUME, self, self.log)

    def golden_and_resources(self) -> None:
        run_steps(CHECKS_AFTER, self, self.log)

    def after_matrix(self) -> None:
        run_steps(AFTER_MATRIX, self, self.log)

    def _faults(self) -> None:
        """Issue 8: the fault matrix of §12 (calculet_drivers/faults/matrix.py), with --faults."""
        if self.o.extra.get("faults"):
            run_fault_step(self)

    # --------------------------------------------------------------- 1 release
    def _release(self) -> StepResult:
        m = self.manifest.model
        checked = []
        if self.o.calbin:
            digest = _sha256_file(self.o.calbin)
            if digest != m.calbin_sha256:
                raise RunStop(
                    EXIT_INVALID,
                    f"release: calbin {self.o.calbin} sha256 {digest[:12]}… != manifest "
                    f"model.calbin_sha256 {m.calbin_sha256[:12]}…",
                )
            checked.append("calbin file")
        profile = self.target.profile
        problem = self.target.check()
        if problem is not None:
            raise RunStop(EXIT_INFRA, f"release: {problem}")
        health = "ok"
        # what the target says of itself (model list, /props or version, Server header)
        described = off_loop(lambda: describe_target(self.access, profile))
        state: Any = None
        if self.o.admin_token:
            try:
                state = self._get_json("/admin/state", admin=True)
            except (OSError, ValueError) as exc:
                raise RunStop(EXIT_INVALID, f"release: /admin/state: {exc}") from None
            served = state.get("calbin_sha256")
            if served != m.calbin_sha256:
                raise RunStop(
                    EXIT_INVALID,
                    f"release: the target serves calbin {str(served)[:12]}… but the manifest "
                    f"says model.calbin_sha256 {m.calbin_sha256[:12]}…",
                )
            if state.get("generation") is not None and state["generation"] != m.generation:
                raise RunStop(
                    EXIT_INVALID,
                    f"release: the target is at generation {state['generation']}, the "
                    f"manifest says model.generation {m.generation}",
                )
            checked.append("served calbin and generation")
        else:
            self.notes.append("release: no admin token, the served calbin was not checked")
        batch = _release_batch(self.matrix, self.manifest, state)
        if batch is not None and batch["served_compiled_batch"] is not None:
            checked.append("served compiled batch")
        self.say(f"release verified ({', '.join(checked) or 'manifest only'})")
        self.rtt.take("before")
        return StepResult.ok(checked=checked, health=health, batch=batch, target=described)

    # --------------------------------------------------------------- workers
    def _start_fleet(self) -> None:
        """A distributed run: become the Locust master of the client processes."""
        o = self.o
        if not (o.workers or o.master):
            return
        from calculet_load.locust.cells import Fleet

        expect = o.workers or o.expect_workers
        self.fleet = Fleet(
            self.run_dir,
            expect=expect,
            local=o.workers,
            bind_host="127.0.0.1" if o.workers else o.master_bind_host,
            bind_port=_free_port() if o.workers else o.master_bind_port,
            suffix=self.worker[len("w00") :],
            say=self.say,
        )
        self.log.write(
            "workers", "start", expect=expect, local=o.workers, port=self.fleet.bind_port
        )
        try:
            self.fleet.start(o.workers_timeout_s)
        except FleetError as exc:
            raise RunStop(EXIT_INFRA, f"workers: {exc}") from None
        self.clients = self.fleet
        self.log.write("workers", "end", workers=list(self.fleet.names.values()))

    def _close_fleet(self) -> None:
        reports = self.fleet.finish(self.manifest.run_id, self.run_dir)
        if self.owns_fleet:
            self.fleet.close()
        missing = [r["worker"] for r in reports if r.get("status") == "missing"]
        self.log.write("workers", "closed", missing=missing)
        if missing:
            self.notes.append(f"workers {', '.join(missing)} did not report at the end")

    # --------------------------------------------------------------- 2 idle
    def _idle(self) -> StepResult:
        """Spec §8.2: wait until the device's temperature, power and frequency are stable.

        Samples the target's `/metrics` (spec §10.3 gauges `calculet_chip_temperature_c`,
        `calculet_chip_power_w`, `calculet_chip_frequency_mhz`: the hottest chip, the
        chips summed, the slowest chip) until, over the last window, each series holds
        the rules file's `idle` limits on its range and slope (analysis.judge.idle).
        Still not stable at the time limit: exit 3, naming the series that did not hold."""
        if (lacking := self._lacks("device telemetry")) is not None:
            return lacking
        crit = self.idle
        window, limit = crit.window_s, crit.timeout_s
        self.say(f"idle sampling: waiting for a stable {window:g} s window (at most {limit:g} s)")
        names = ("temperature_c", "power_w", "frequency_mhz")  # device_sample's order
        t: list[float] = []
        series: dict[str, list[float]] = {k: [] for k in names}
        started = time.monotonic()
        check: IdleCheck | None = None
        while True:
            try:
                sample = device_sample(self._get("/metrics").decode())
            except (OSError, ValueError) as exc:
                self.notes.append(f"idle: no device telemetry from /metrics ({exc}); skipped")
                return StepResult.not_available(str(exc), stable=None, window_s=window)
            if sample is None:
                self.notes.append("idle: /metrics has no chip gauges; idle sampling skipped")
                return StepResult.not_available("no chip gauges", stable=None, window_s=window)
            t.append(time.monotonic() - started)
            for name, value in zip(names, sample, strict=True):
                series[name].append(value)
            if t[-1] >= window:
                check = crit.check(t, series)
                if check.stable or t[-1] >= limit:
                    break
            gevent.sleep(min(1.0, max(window / 10, 0.1)))
        assert check is not None
        detail = {"samples": len(t), "waited_s": round(t[-1], 3), "criterion": crit.describe(),
                  "last": [t[-1], *sample], "window_s": window, **check.record()}  # fmt: skip
        self.say(f"idle sampling: {'stable' if check.stable else 'NOT stable'} ({len(t)} samples)")
        if not check.stable:
            reason = (
                f"idle: the device was not stable within {limit:g} s (spec §8.2, rules file "
                f"idle): {'; '.join(check.failing)} over the last {window:g} s"
            )
            self.log.end("idle", StepResult.failed(reason, **detail))
            raise RunStop(EXIT_INFRA, reason)
        return StepResult.ok(**detail)

    def _device_now(self) -> dict[str, Any] | None:
        """The device as a cell starts or ends (§8: temperature and throttling per
        round): hottest chip, total power, lowest frequency, throttled chips; None when
        the target has no chip gauges."""
        if not self.target.profile.device_telemetry:
            return None
        try:
            v = chip_gauges(self._get("/metrics").decode())
        except (OSError, ValueError):
            return None
        if not v["temperature_c"]:
            return None
        return {
            "temperature_c": max(v["temperature_c"]),
            "power_w": sum(v["power_w"]) if v["power_w"] else None,
            "frequency_mhz": min(v["frequency_mhz"]) if v["frequency_mhz"] else None,
            "throttled_chips": int(sum(v["throttled"])),
        }

    # --------------------------------------------------------------- 3/6 golden
    def _golden(self, step: str) -> None:
        """The golden set: any error or hash mismatch stops the run (exit 1). A case
        without a hash is recorded; with `--record-golden`, golden before records every
        case (compares none) and the recorded set is what the rest of the run checks."""
        if self.golden is None:
            self.log.write(step, "skipped", reason="no golden set given")
            return
        record = self.o.record_golden and step == "golden_before"
        self.log.write(step, "start", cases=len(self.golden.cases), record=record)
        self._write_golden_json()
        failures = []
        recorded = []
        for case in self.golden.cases:
            prompt = self._prompt(case.prompt_tokens, case.sample)
            spec = golden_spec(case, prompt, f"{step}:{case.name}")
            record_, _ = run_in_greenlet(functools.partial(self.session.send, spec))
            got = record_.result.token_hash
            if record_.ext.error_class is not None:
                failures.append(f"{case.name}: {record_.ext.error_class}")
            elif record or case.token_hash is None:
                recorded.append({"name": case.name, "token_hash": got})
            elif got != case.token_hash:
                failures.append(
                    f"{case.name}: token hash {str(got)[:12]}… != {case.token_hash[:12]}…"
                )
        if recorded:
            self.log.write(step, "recorded", hashes=recorded)
            if record and not failures:
                self._pin_golden(recorded)
            elif step == "golden_before":
                self.notes.append(
                    f"golden: {len(recorded)} case(s) had no expected hash: recorded in "
                    "events.jsonl (compared with this run's majority by the analysis)"
                )
        self.log.write(step, "end", failures=failures)
        self.say(f"{step}: {len(self.golden.cases) - len(failures)}/{len(self.golden.cases)} match")
        if failures:
            raise RunStop(EXIT_FAIL, f"{step} failed: {'; '.join(failures[:3])}")

    def _write_golden_json(self) -> None:
        """`golden.json`: the expected hash of each golden cell, which the analysis judges
        golden records against (not a majority)."""
        assert self.golden is not None
        expected = [
            {"cell": f"{prefix}:{c.name}", "token_hash": c.token_hash}
            for prefix in ("golden_before", "golden_after")
            for c in self.golden.cases
            if c.token_hash is not None
        ]
        if expected:
            (self.run_dir / "golden.json").write_text(json.dumps({"cases": expected}, indent=1))

    def _pin_golden(self, recorded: list[dict[str, Any]]) -> None:
        """`--record-golden`: the golden set with this run's hashes becomes the run's
        reference (golden after, the fault matrix, the analysis) and is written to
        `golden.recorded.yaml` in the run folder, the file to pin."""
        assert self.golden is not None
        got = {r["name"]: r["token_hash"] for r in recorded}
        given = {c.name: c.token_hash for c in self.golden.cases}
        changed = sorted(n for n, h in got.items() if given.get(n) not in (None, h))
        pinned = self.golden.model_copy(
            update={"cases": [c.model_copy(update={"token_hash": got[c.name]})
                              for c in self.golden.cases]}
        )  # fmt: skip
        path = self.run_dir / GOLDEN_RECORDED
        head = (f"# recorded by calculet-load accept --record-golden, run "
                f"{self.manifest.run_id}, target {self.url}, from {self.o.golden}\n")  # fmt: skip
        doc = pinned.model_dump(by_alias=True, exclude_none=True)
        path.write_text(head + yaml.safe_dump(doc, sort_keys=False, width=200))
        self.golden, self.golden_file = pinned, str(path)
        self._write_golden_json()
        self.log.write("golden_before", "pinned", file=GOLDEN_RECORDED, cases=len(got),
                       changed=changed)  # fmt: skip
        self.notes.append(
            f"golden: --record-golden: {len(got)} hash(es) recorded, not checked, in "
            f"{path}; golden after was checked against them"
            + (f"; differ from {self.o.golden}: {', '.join(changed)}" if changed else "")
        )

    # --------------------------------------------------------------- 3b cross-talk
    def _crosstalk(self) -> StepResult:
        """Spec §14.1: the golden set's greedy cases under concurrency against the same
        requests sent alone (calculet_drivers.accept.crosstalk). A difference makes the run a
        correctness failure (exit 1) and the run goes on: the analysis shows it."""
        if self.golden is None:
            return StepResult.not_available("no golden set given: nothing to compare")
        n = self.o.crosstalk_concurrency
        result = run_in_greenlet(
            functools.partial(
                run_crosstalk, self.session, self._prompt, self.golden.cases, n,
                self.manifest.run_id,
            )
        )  # fmt: skip
        d = result.detail
        if d.get("differences"):
            self.code = EXIT_FAIL
            self.notes.append(f"crosstalk: {result.reason}")
        self.say(
            f"crosstalk at concurrency {n}: {d.get('different', 0)} of "
            f"{d.get('compared', 0)} copies differ from their reference sent alone"
        )
        return result

    # --------------------------------------------------------------- 4 warmup
    def _warmup(self) -> StepResult:
        n = self.manifest.warmup_requests
        shapes = sorted({(c.prompt_tokens, c.max_tokens) for c in self.cells if not c.mix})
        for c in self.cells:
            if c.mix:
                shapes += [(e.prompt_tokens, e.max_tokens) for e in load_mix(c.mix).entries]
        shapes = sorted(set(shapes))
        for p, o in shapes:
            for i in range(n):
                spec = RequestSpec(
                    prompt=self._prompt(p, i % 4), max_tokens=o, cell=f"warmup:p{p}-o{o}",
                    concurrency=1, arrival="single", warmup=True,
                )  # fmt: skip
                run_in_greenlet(functools.partial(self.session.send, spec))
        self.say(f"warmup: {n} request(s) for each of {len(shapes)} shape(s)")
        return StepResult.ok(shapes=shapes, per_shape=n)

    # --------------------------------------------------------------- 5 matrix
    def _make_plan(self) -> None:
        order = list(range(len(self.cells)))
        random.Random(f"calculet-plan:{self.o.seed}").shuffle(order)
        cells = []
        for i in order:
            c = self.cells[i]
            reps = self._repetitions(c)
            cells.append(
                {"name": c.name, "index": i, "repetitions": reps, "status": "pending",
                 "seed": self.o.seed * 1_000_003 + i}
            )  # fmt: skip
        self.plan = {
            "schema": PLAN_SCHEMA,
            "run_id": self.manifest.run_id,
            "seed": self.o.seed,
            "attempts": 1,
            "options": {k: v for k, v in vars(self.o).items() if k != "admin_token"},
            "below_minimum_repetitions": any(self._below_minimum(c) for c in self.cells),
            "rehearsal": self.manifest.rehearsal,
            "cells": cells,
            "excluded": [],
        }
        self._save_plan()

    def _matrix(self) -> None:
        todo = self.matrix_start()
        for n, entry in enumerate(todo, 1):
            self.run_entry(entry, f"{n}/{len(todo)}")
        self.log.write("matrix", "end")

    def matrix_start(self) -> list[dict[str, Any]]:
        """The resource sampler on; cut cell attempts excluded; the cells still to run."""
        if self.o.admin_token:
            # the target's RSS, FDs, threads, KV and leases through the run (leak analysis)
            from calculet_load.target.resources import ResourceSampler

            self.sampler = ResourceSampler(
                self.url, self.run_dir / "server" / "resources.jsonl",
                admin_token=self.o.admin_token, interval_s=self.o.resource_interval_s,
            ).start()  # fmt: skip
        todo = [c for c in self.plan["cells"] if c["status"] != "done"]
        self.log.write("matrix", "start", cells=len(self.plan["cells"]), todo=len(todo))
        for entry in self.plan["cells"]:
            if entry["status"] == "running":  # cut by a crash: its records are excluded
                self.plan["excluded"].append(
                    {"cell": entry["name"], "worker": entry.get("worker"),
                     "reason": "interrupted cell attempt (the cell was run again)"}
                )  # fmt: skip
        return todo

    def run_entry(self, entry: dict[str, Any], progress: str) -> None:
        """One cell of the plan, with its repetitions; then the idle gap."""
        cell = self.cells[entry["index"]]
        entry["status"], entry["worker"] = "running", self.worker
        entry["started_wall_ns"] = time.time_ns()
        self._save_plan()
        self.log.write("cell", "start", cell=cell.name, device=self._device_now())
        self.say(f"cell {progress} {cell.name}: {entry['repetitions']} request(s){self.label}")
        try:
            sent = self._run_cell(cell, entry["repetitions"], int(entry["seed"]))
        except FleetError as exc:  # the cell stays "running": a resume runs it again
            code = EXIT_INFRA if exc.infra else EXIT_INVALID
            raise RunStop(code, f"{cell.name}: {exc}") from None
        self.sink.flush_polling(gevent.sleep)  # the cell's records are on disk: it is done
        entry["status"], entry["requests"] = "done", sent
        entry["ended_wall_ns"] = time.time_ns()
        self._save_plan()
        self.log.write("cell", "end", cell=cell.name, requests=sent, device=self._device_now())
        if self.o.idle_gap_s:
            gevent.sleep(self.o.idle_gap_s)

    def _run_cell(self, cell: Cell, reps: int, seed: int) -> int:
        self.rtt.take("during")  # between cells, at most once a minute
        mix = load_mix(cell.mix) if cell.mix else single(cell.prompt_tokens, cell.max_tokens)
        steps = split(cell, mix, reps, seed, self.clients.processes)
        lead = OPEN_LEAD_S if cell.kind == "open" else BURST_LEAD_S
        sent = 0
        for r, step in enumerate(steps):
            if cell.kind == "burst":
                if r:
                    gevent.sleep(BURST_GAP_S)
                burst_id = f"{self.manifest.run_id}.{cell.name}.{r:03d}"
                step = [s and dataclasses.replace(s, burst_id=burst_id) for s in step]
            sent += self.clients.run_step(step, self._job(), lead, self.run_dir)
        return sent

    def _job(self) -> dict[str, Any]:
        """What a worker of a distributed run needs to send on this run's behalf."""
        ctx = dataclasses.asdict(self.client.ctx)
        t = self.manifest.target
        target = {"url": self.url, "protocol": self.protocol, "model": self.model,
                  "timeout_s": self.manifest.timeout_s,
                  "profile": t.profile if t else "calculet",
                  "tokenizer": t.tokenizer if t else None,
                  "prompt_reuse": self.client.prompt_reuse,
                  # how it was reached: secrets redacted, the key by its source only
                  "access": self.access.describe()}  # fmt: skip
        return {"run_id": self.manifest.run_id, "context": ctx, "target": target}

    # --------------------------------------------------------------- 7 resources
    def _lacks(self, what: str) -> StepResult | None:
        """`not_available` when the target's profile says it has no `what`."""
        p = self.target.profile
        has = {"admin API": p.admin_api, "traces": p.traces, "device telemetry": p.device_telemetry}
        if has[what]:
            return None
        self.notes.append(f"{what}: the {p.name} target has none")
        return StepResult.not_available(f"the {p.name} target has no {what}")

    def _resources(self) -> StepResult:
        if (lacking := self._lacks("admin API")) is not None:
            return lacking
        if not self.o.admin_token:
            return StepResult.not_available("no admin token", checked=False)
        deadline = time.monotonic() + 30
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            state = self._get_json("/admin/state", admin=True)
            busy = (
                state["kv"]["allocated_tokens"],
                state["buffer_pool"]["leased"],
                state["sequences_active"],
            )
            if busy == (0, 0, 0):
                break
            gevent.sleep(0.5)
        back = (
            state.get("kv", {}).get("allocated_tokens") == 0
            and state.get("buffer_pool", {}).get("leased") == 0
            and state.get("sequences_active") == 0
        )
        detail = {"checked": True, "back_to_baseline": back,
                  "kv_allocated": state.get("kv", {}).get("allocated_tokens"),
                  "leased": state.get("buffer_pool", {}).get("leased")}  # fmt: skip
        self.say(f"resources back to baseline: {back}")
        if not back:
            self.log.end("resources", StepResult.failed("did not return to idle", **detail))
            raise RunStop(EXIT_FAIL, "resources: KV/leases/sequences did not return to idle")
        return StepResult.ok(**detail)

    # --------------------------------------------------------------- 8-11
    def _finish(self) -> None:
        """Index, traces, analysis, report; the run's end row; the signature last."""
        self._write_index()
        run_steps(FINISH, self, self.log)
        self.log.write("run", "end", code=self.code)
        self._sign()

    def _write_index(self) -> None:
        """`client/index.json`: every worker folder with its parts, host and clock (a
        Locust worker's from its `worker.json`; this process's own otherwise)."""
        client = self.run_dir / "client"
        workers = []
        for folder in sorted(p for p in client.glob("*") if p.is_dir()):
            parts = sorted(p.name for p in folder.glob("part-*.parquet"))
            info = folder / "worker.json"
            if info.exists():
                entry = json.loads(info.read_text())
            else:
                entry = {"host": socket.gethostname(), "pid": os.getpid(), **clock_provenance(),
                         "target_rtt": self.rtt.record()}  # fmt: skip
            if folder.name == self.worker:
                entry["sink"] = dataclasses.asdict(self.sink.stats)
            workers.append(
                IndexWorker(
                    **{**entry, "worker": folder.name, "status": "reported", "parts": parts}
                )
            )
        index = ClientIndex(
            run_id=self.manifest.run_id, status="complete", source="calculet-load accept",
            target=self.url, workers=workers,
        )  # fmt: skip
        index.check_sinks()  # rows not in the parts: the run says so (exit 3)
        index.write(str(self.run_dir))

    def _collect_traces(self) -> StepResult:
        if (lacking := self._lacks("traces")) is not None:
            return lacking
        # every row the target holds (the join picks this run's requests out)
        got = collect_traces(TargetAPI(self.access), str(self.run_dir))
        outcome = {"fetched": StepOutcome.OK, "not_available": StepOutcome.NOT_AVAILABLE}
        return StepResult(
            outcome.get(got["status"], StepOutcome.FAILED),
            got["reason"],
            {"fetched": got["status"], "files": got["kinds"]},
        )

    def _analyze(self) -> StepResult:
        """The analysis decides the exit code, unless a stop for correctness came first."""
        result = analyze(self.run_dir, baseline=self.o.baseline_run, rules=self.o.rules)
        self.code = self.code if self.code == EXIT_FAIL else int(result.detail["code"])
        return result

    def _report(self) -> StepResult:
        path = write_report(str(self.run_dir), baseline=self.o.baseline_run)
        self.say(f"report: {path}")
        return StepResult.ok(path=path)

    def _sign(self) -> None:
        """The last write to the run folder: the bundle lists every file as it is now."""
        try:
            result = sign_run(str(self.run_dir))
        except AnalysisError as exc:  # a bad key (SigningKeyError, exit 2): one line, unsigned
            self.notes.append(f"sign: {exc}")
            self.code = EXIT_INVALID
            return
        self.say(
            f"signed bundle: {self.run_dir / 'bundle.intoto.json'} "
            f"({'signed' if result.signed else 'UNSIGNED: no key'})"
        )

    # --------------------------------------------------------------- prompts
    def _prompt(self, tokens: int, sample: int) -> Prompt:
        try:
            return self.client.prompt(tokens, sample)
        except WorkloadError as exc:
            raise RunStop(EXIT_INVALID, f"prompt: {exc}") from None
        except OSError as exc:
            raise RunStop(EXIT_INFRA, f"prompt: /tokenize unreachable: {exc}") from None


# The driver as steps (calculet_drivers.skeleton.steps): each logged with its outcome, except
# the ones whose own rows say more (the workers' port, golden's recorded hashes, faults).
BEFORE_MATRIX: tuple[Step[Pipeline], ...] = (
    Step("release", Pipeline._release),
    Step("workers", Pipeline._start_fleet, logged=False),
    Step("idle", Pipeline._idle),
    Step("golden_before", lambda p: p._golden("golden_before"), logged=False),
    Step("crosstalk", Pipeline._crosstalk, when=lambda p: p.o.crosstalk_concurrency >= 2),
    Step("warmup", Pipeline._warmup),
    Step("plan", Pipeline._make_plan, logged=False),
)
ON_RESUME: tuple[Step[Pipeline], ...] = BEFORE_MATRIX[:2]  # release, workers
CHECKS_AFTER: tuple[Step[Pipeline], ...] = (
    Step("golden_after", lambda p: p._golden("golden_after"), logged=False),
    Step("resources", Pipeline._resources),
)
AFTER_MATRIX: tuple[Step[Pipeline], ...] = (
    Step("faults", Pipeline._faults, logged=False),
    *CHECKS_AFTER,
)
TRACES: Step[Pipeline] = Step("traces", Pipeline._collect_traces)
FINISH: tuple[Step[Pipeline], ...] = (
    TRACES,
    Step("analysis", Pipeline._analyze),
    Step("report", Pipeline._report, when=lambda p: not p.o.skip_report),
)


def _release_batch(matrix: Matrix, manifest: RunManifest, state: Any) -> dict[str, Any] | None:
    """Spec §7 at release: a batch matrix (`compiled_batch: B`) needs the vendor's
    statement of how lanes that are not filled are handled (manifest `batch`) for the same
    B, served by the target when its /admin/state says (exit 2 otherwise). Returns what
    the release `end` event records (None: neither the matrix nor the manifest has one)."""
    want, stated = matrix.compiled_batch, manifest.batch
    if want is not None and stated is None:
        raise RunStop(
            EXIT_INVALID,
            f"release: manifest batch.partial_lanes missing: matrix {matrix.name} measures "
            f"compiled batch B{want}, and spec §7 requires the vendor to state how lanes "
            "that are not filled are handled (masked/padded) in the manifest's batch section",
        )
    if stated is None:
        return None
    if want is not None and stated.compiled_batch != want:
        raise RunStop(
            EXIT_INVALID,
            f"release: manifest batch.compiled_batch {stated.compiled_batch} != matrix "
            f"{matrix.name} compiled_batch {want}",
        )
    block = state.get("batch") if isinstance(state, dict) else None
    served = block.get("compiled_batch") if isinstance(block, dict) else None
    if served is not None and served != stated.compiled_batch:
        raise RunStop(
            EXIT_INVALID,
            f"release: the target serves compiled batch {served} (/admin/state batch."
            f"compiled_batch) but the manifest says batch.compiled_batch "
            f"{stated.compiled_batch}",
        )
    return {
        **stated.model_dump(),
        "matrix_compiled_batch": want,
        "served_compiled_batch": served,
        "served_partial_lanes": block.get("partial_lanes") if isinstance(block, dict) else None,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        raise RunStop(EXIT_INVALID, f"release: calbin {path}: {exc.strerror}") from None
    return h.hexdigest()


# ------------------------------------------------------------------ CLI
