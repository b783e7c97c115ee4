"""`calculet-load accept`: the automated acceptance run of spec §15 in the order of §8.

Steps, each logged to `events.jsonl` in the run folder as it starts and ends:

  1 release    manifest valid; calbin sha256 and versions match the target (exit 2)
  2 idle       sample the device until temperature/power/frequency are stable
  3 golden     the fixed golden set; any mismatch stops the run (exit 1)
    crosstalk  its greedy cases under concurrency vs the same requests alone (§14.1)
  4 warmup     `warmup_requests` per new request shape, recorded as warmup
  5 matrix     the cells in a seeded random order, each with its repetitions, an idle
               gap between cells; `plan.json` holds the order, seeds and progress
    faults     with `--faults`, the fault matrix of §12
  6 golden     the golden set again
  7 resources  KV, buffer leases and sequences back to their idle values
  8 traces     the server's traces copied into `server/`
  9 analysis   `analysis` judges the folder (and a baseline run): verdict.json
 10 report     the HTML report; 11 sign: the signed bundle

An interrupted run resumes from `plan.json` (`--resume RUN_DIR`): finished cells are not
repeated; the records of a cell that was cut are kept and excluded with their reason.
The matrix's cells are sent from this process on its own gevent loop, or with
`--workers N`/`--master` by Locust workers with this process as their master
(accept.fleet). `--interleave-with TARGET` runs a baseline target's cells between the
candidate's (accept.interleave). The steps are in the modules named in the tables below.
"""

from __future__ import annotations

import dataclasses
import json

from calculet_drivers.accept.acceptrun import GOLDEN_RECORDED, AcceptRun, InProcess
from calculet_drivers.accept.crosstalkstep import crosstalk
from calculet_drivers.accept.faultstep import fault_step
from calculet_drivers.accept.fleet import close_fleet, start_fleet
from calculet_drivers.accept.goldensteps import golden
from calculet_drivers.accept.plan import make_plan, matrix_start, run_entry, warmup
from calculet_drivers.accept.release import release
from calculet_drivers.accept.targetstate import idle, resources
from calculet_drivers.skeleton import finish, tracecopy
from calculet_drivers.skeleton.clientindex import this_process, worker_folders, write_index
from calculet_drivers.skeleton.folder import attempt_worker, copy_manifest, set_aside
from calculet_drivers.skeleton.steps import EventLog, Step, StepResult, run_steps
from calculet_load.errors import EXIT_FAIL, EXIT_INVALID, EXIT_OK, RunStop
from calculet_load.workload.dispatch import CellRunner
from calculet_load.workload.matrix import load_golden

__all__ = ["AFTER_MATRIX", "BEFORE_MATRIX", "FINISH", "TRACES", "Pipeline"]

# what stays in place when a cut attempt is set aside: an interleaved run's baseline
# folder (it sets its own attempts aside) and the baseline manifest made from a URL
SET_ASIDE_KEEPS = {"baseline", "manifest.given.yaml"}


class Pipeline(AcceptRun):
    """The acceptance run, its steps in the order of the tables below."""

    def run(self) -> int:
        resumed = self.open()
        try:
            self.before_matrix(resumed)
            self.run_matrix()
            self.after_matrix()
        except RunStop as stop:
            self.stopped(stop)
        finally:
            self.close()
        return self.end()

    def open(self) -> bool:
        """The run folder, its event log, the plan (resumed?) and the client."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        plan = self.run_dir / "plan.json"
        if self.o.resume and not plan.exists() and (self.run_dir / "events.jsonl").exists():
            dest = set_aside(self.run_dir, SET_ASIDE_KEEPS)
            self.say(f"the attempt cut before its plan existed is kept in {dest}; starting over")
        self.log = EventLog(self.run_dir / "events.jsonl")
        resumed = self.o.resume and plan.exists()
        attempt = 1
        if resumed:
            self.plan = json.loads(plan.read_text())
            attempt = int(self.plan.get("attempts", 1)) + 1
            self.plan["attempts"] = attempt
        self.worker = attempt_worker(attempt)
        client = self.open_client(self.worker, max_in_flight=1024)
        client.watch.start()
        self.clients = InProcess(CellRunner(client.session, self.prompt, client.prompts))
        return resumed

    def stopped(self, stop: RunStop) -> None:
        self.log.write("run", "stopped", code=stop.code, reason=str(stop))
        self.say(f"STOP (exit {stop.code}): {stop}")
        self.code = stop.code

    def close(self) -> None:
        """Sending stopped: samplers, workers, self-watch, session; the sink's last part."""
        if self.sampler is not None:
            self.sampler.stop()
        if self.fleet is not None:
            close_fleet(self)
        self.client.close()

    def end(self) -> int:
        if self.code in (EXIT_OK, EXIT_FAIL):
            self.finish()  # ends with the signature: nothing is written after it
        else:
            self.log.write("run", "end", code=self.code)
        return self.code

    def before_matrix(self, resumed: bool) -> None:
        if not resumed:
            self.log.write("run", "start", run_id=self.manifest.run_id, target=self.url)
            copy_manifest(self.run_dir, self.o.manifest)
            run_steps(BEFORE_MATRIX, self, self.log)
            return
        self.log.write("run", "resume", attempt=self.plan["attempts"])
        pinned = self.run_dir / GOLDEN_RECORDED
        if self.o.record_golden and pinned.exists():  # golden before recorded it
            self.golden, self.golden_file = load_golden(pinned), str(pinned)
        self.say(f"resuming {self.run_dir} (attempt {self.plan['attempts']})")
        run_steps(ON_RESUME, self, self.log)

    def run_matrix(self) -> None:
        todo = matrix_start(self)
        for n, entry in enumerate(todo, 1):
            run_entry(self, entry, f"{n}/{len(todo)}")
        self.log.write("matrix", "end")

    def golden_and_resources(self) -> None:
        run_steps(CHECKS_AFTER, self, self.log)

    def after_matrix(self) -> None:
        run_steps(AFTER_MATRIX, self, self.log)

    def finish(self) -> None:
        """Index, traces, analysis, report; the run's end row; the signature last."""
        self.write_index()
        run_steps(FINISH, self, self.log)
        self.log.write("run", "end", code=self.code)
        problem = finish.sign(self.run_dir, self.say)
        if problem is not None:
            self.notes.append(problem)
            self.code = EXIT_INVALID

    def write_index(self) -> None:
        """`client/index.json`: every worker folder with its parts, host and clock."""
        here = {**this_process(), "target_rtt": self.rtt.record()}
        sink = dataclasses.asdict(self.client.sink.stats)
        write_index(self.run_dir, worker_folders(self.run_dir, here, self.worker, sink),
                    run_id=self.manifest.run_id, status="complete",
                    source="calculet-load accept", target=self.url)  # fmt: skip


def _traces(run: AcceptRun) -> StepResult:
    if (lacking := run.lacks("traces")) is not None:
        return lacking
    return tracecopy.collect(run.target, run.run_dir)


def _analysis(run: AcceptRun) -> StepResult:
    """The analysis decides the exit code, unless a stop for correctness came first."""
    result = finish.analyze(run.run_dir, baseline=run.o.baseline_run, rules=run.o.rules)
    run.code = run.code if run.code == EXIT_FAIL else int(result.detail["code"])
    return result


# The driver as steps: each logged with its outcome, except the ones whose own rows say
# more (the workers' port, golden's recorded hashes, faults).
BEFORE_MATRIX: tuple[Step[AcceptRun], ...] = (
    Step("release", release),
    Step("workers", start_fleet, logged=False),
    Step("idle", idle),
    Step("golden_before", lambda r: golden(r, "golden_before"), logged=False),
    Step("crosstalk", crosstalk, when=lambda r: r.o.crosstalk_concurrency >= 2),
    Step("warmup", warmup),
    Step("plan", make_plan, logged=False),
)
ON_RESUME: tuple[Step[AcceptRun], ...] = BEFORE_MATRIX[:2]  # release, workers
CHECKS_AFTER: tuple[Step[AcceptRun], ...] = (
    Step("golden_after", lambda r: golden(r, "golden_after"), logged=False),
    Step("resources", resources),
)
AFTER_MATRIX: tuple[Step[AcceptRun], ...] = (
    Step("faults", fault_step, logged=False),
    *CHECKS_AFTER,
)
TRACES: Step[AcceptRun] = Step("traces", _traces)
FINISH: tuple[Step[AcceptRun], ...] = (
    TRACES,
    Step("analysis", _analysis),
    Step(
        "report",
        lambda r: finish.report(r.run_dir, r.say, baseline=r.o.baseline_run),
        when=lambda r: not r.o.skip_report,
    ),
)
