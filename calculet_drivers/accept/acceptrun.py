"""What the acceptance run's steps share: its options; the manifest, matrix and golden set
it runs; its target, plan, event log and client. The steps are functions of an
`AcceptRun` (release, idle, golden, crosstalk, warmup, the plan and its cells, fleet,
resources); `pipeline.Pipeline` runs them in the order of §8."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from analysis.errors import AnalysisError
from analysis.judge.idle import IdleCriterion, idle_criterion
from calculet_drivers.skeleton.driver import Driver
from calculet_drivers.skeleton.folder import FIRST_WORKER, save_json
from calculet_drivers.skeleton.runtarget import Capability
from calculet_drivers.skeleton.steps import EventLog, StepResult
from calculet_load.errors import EXIT_INVALID, RunStop
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.prompts import Prompt
from calculet_load.target.netprobe import RttRounds
from calculet_load.workload.dispatch import CellRunner, Share
from calculet_load.workload.matrix import (
    Cell,
    GoldenSet,
    Matrix,
    MatrixError,
    load_golden,
    load_matrix,
    minimum_repetitions,
)

if TYPE_CHECKING:
    from calculet_load.locust.cells import Fleet
    from calculet_load.target.resources import ResourceSampler

__all__ = ["GOLDEN_RECORDED", "AcceptRun", "Clients", "InProcess", "Options"]

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
    faults: str | None = None  # fault scenarios: the fault matrix as a step (§12)


class Clients(Protocol):
    """Who sends the matrix's cells: this process, or the Locust workers of a fleet."""

    @property
    def processes(self) -> int: ...

    def run_step(
        self, step: list[Share | None], job: dict[str, Any], lead_s: float, run_dir: Path
    ) -> int: ...


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


class AcceptRun(Driver):
    """The acceptance run's state. Invalid options, manifest, matrix, golden set or rules
    raise RunStop (exit 2) here, before anything is sent."""

    log: EventLog  # pipeline.open's
    worker: str
    clients: Clients

    def __init__(self, opts: Options) -> None:
        super().__init__(opts.manifest, url=opts.url, run_dir=opts.run_dir,
                         progress=opts.progress)  # fmt: skip
        self.o = opts
        try:
            self.matrix: Matrix = load_matrix(opts.matrix)
            self.golden: GoldenSet | None = load_golden(opts.golden) if opts.golden else None
        except MatrixError as exc:
            raise RunStop(EXIT_INVALID, str(exc)) from None
        self.golden_file = opts.golden  # --record-golden: golden.recorded.yaml once recorded
        t = self.target
        self.api = t.api(opts.admin_token, "calculet-load-accept", timeout_s=30.0)
        # RTT and jitter from this process (§5), on the profile's health path
        self.rtt = RttRounds(t.access, path=t.profile.health_probe_path)
        self.idle = self._idle_criterion()  # §8.2, from the rules file
        self.cells = self.matrix.expanded()
        if not self.manifest.rehearsal:
            self._check_repetitions()
        self.plan: dict[str, Any] = {}
        self.sampler: ResourceSampler | None = None
        self.fleet: Fleet | None = None  # a distributed run's Locust master (locust.cells)
        self.label = ""  # " (baseline)" / " (candidate)" in an interleaved run
        self.owns_fleet = True  # False: the fleet is the interleaved candidate's

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

    def repetitions(self, cell: Cell) -> int:
        """What the plan gives the cell: the matrix's repetitions, capped by
        `--min-repetitions` (a burst cell sends size × rounds whatever the cap)."""
        reps = self.matrix.repetitions_for(cell)
        if self.o.min_repetitions is not None and cell.kind != "burst":
            reps = min(reps, self.o.min_repetitions)
        return reps

    def below_minimum(self, cell: Cell) -> bool:
        need = minimum_repetitions(cell)
        return need is not None and self.repetitions(cell) < need

    def _check_repetitions(self) -> None:
        """Spec §8.6 enforced: an acceptance (the manifest's purpose does not say
        rehearsal) refuses, before anything runs, a cell below 30 repetitions (100 for a
        short case); boundary cells are policy tests, not measurements (exit 2)."""
        short = [c for c in self.cells if self.below_minimum(c)]
        if not short:
            return
        cell = short[0]
        reps, need = self.repetitions(cell), minimum_repetitions(cell)
        what = "a short case (prompt <= 512, output <= 32 tokens)" if cell.short else "a case"
        more = f" (and {len(short) - 1} other cell(s) below §8)" if len(short) > 1 else ""
        raise RunStop(
            EXIT_INVALID,
            f"§8: cell {cell.name} has {reps} repetitions, fewer than the {need} an acceptance "
            f"needs for {what}{more}; raise the matrix's repetitions, or say rehearsal in "
            f"the manifest's purpose ({self.manifest.purpose!r})",
        )

    def lacks(self, what: Capability) -> StepResult | None:
        """`not_available` (and a note) when the target's profile says it has no `what`."""
        reason = self.target.lacks(what)
        if reason is None:
            return None
        self.notes.append(f"{what}: the {self.target.profile.name} target has none")
        return StepResult.not_available(reason)

    def prompt(self, tokens: int, sample: int) -> Prompt:
        return self.client.checked_prompt(tokens, sample)

    def suffix(self) -> str:
        """This attempt's worker suffix (`-r1`...): a fleet's workers carry it too."""
        return self.worker[len(FIRST_WORKER) :]

    def save_plan(self) -> None:
        save_json(self.run_dir / "plan.json", self.plan)
