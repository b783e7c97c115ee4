"""What a soak stage's run holds (`SoakRun`): its stage, manifest, target, options
(on --resume the run's own), resumable state and plan, counters and notes."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import gevent
import gevent.pool

from calculet_drivers.skeleton.progress import Progress
from calculet_drivers.skeleton.runclient import RunClient
from calculet_drivers.skeleton.runtarget import RunTarget
from calculet_drivers.skeleton.steps import EventLog
from calculet_drivers.skeleton.tracecopy import TraceAppender
from calculet_drivers.soak import state as soakstate
from calculet_drivers.soak.judge import (
    disk_counts,
)
from calculet_drivers.soak.stage import (
    StageError,
    load_stage,
)
from calculet_drivers.soak.state import STATE_FILE
from calculet_load.errors import EXIT_OK
from calculet_load.measure.session import Session
from calculet_load.schema.manifest import load_manifest
from calculet_load.target.api import TargetAPI
from calculet_load.workload.matrix import load_golden
from calculet_load.workload.mixes import load_mix

__all__ = ["MIN_SAMPLE_S", "SoakRun"]

MIN_SAMPLE_S = 0.5  # real seconds between two samples of one kind, at the least


class SoakRun:
    """A soak stage's run: its stage, manifest, target and options, the resumable state
    and plan, the counters and notes; the loads, samplers and verdict of the classes
    built on it (sampling.SoakSampling, load.SoakLoad, verdict.SoakJudged, run.Soak)
    share these."""

    # set when the run opens (Soak.run, Soak._open_stage)
    worker: str
    events: EventLog
    attempt: dict[str, Any]
    client: RunClient
    sink: Any
    session: Session
    scale: float
    dscale: float
    rate_target: float
    _stoppable: list[gevent.Greenlet]
    traces: TraceAppender

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.say = Progress(not args.quiet)
        self.stage = load_stage(args.stage)
        self.manifest = load_manifest(args.manifest)
        t = self.target = RunTarget.of(self.manifest, args.url)
        self.url, self.protocol, self.model = t.url, t.protocol, t.model
        self.access = t.access  # TLS, base path, headers, API key (schema.access)
        self.token = os.environ.get("CALCULET_ADMIN_TOKEN")
        self.state: dict[str, Any] | None = None
        if args.resume:
            if args.run_dir and Path(args.run_dir).resolve() != Path(args.resume).resolve():
                raise StageError("--run-dir and --resume name different folders")
            self.run_dir = Path(args.resume)
            self.state = soakstate.load_state(self.run_dir, self.stage.name, self.manifest.run_id)
        else:
            default_dir = Path("runs") / f"{self.manifest.run_id}-soak-{self.stage.name}"
            self.run_dir = Path(args.run_dir or default_dir)
            if (self.run_dir / STATE_FILE).exists():
                raise StageError(
                    f"{self.run_dir} holds a soak already: continue it with --resume "
                    f"{self.run_dir}, or give another --run-dir"
                )
        self.opts = self._options()
        self.golden = load_golden(self.opts["golden"]) if self.opts["golden"] else None
        self.api = TargetAPI(self.access, self.token, operator="calculet-load-soak")
        st = self.stage
        if st.pass_.golden and self.golden is None:
            raise StageError(f"stage {st.name}: pass.golden needs --golden FILE")
        self.mix = load_mix(st.load.mix) if st.load.mix else None
        self.counts: dict[str, int] = {"sent": 0, "ok": 0, "errors": 0, "dropped": 0}
        self.notes: list[str] = []
        self.terminating: int | None = None  # the signal that stopped the run
        self.code = EXIT_OK  # the verdict's exit code
        self.senders = gevent.pool.Group()  # every greenlet that sends requests
        self.open_pool: gevent.pool.Pool | None = None  # the open loop's requests
        self.plan: dict[str, Any] = {}
        self.t_start = self.t_end = float("inf")  # monotonic s: the stage's planned start, end

    # ------------------------------------------------------------------ options, state
    def _options(self) -> dict[str, Any]:
        """The options that define the run; on --resume the run's own (an option given
        again must agree with them)."""
        a = self.args
        given: dict[str, Any] = {
            "duration_scale": a.duration_scale,
            "target_rate": a.target_rate,
            "seed": a.seed,
            "time_scale_hint": a.time_scale_hint,
            "golden": str(Path(a.golden).resolve()) if a.golden else None,
            "rules": str(Path(a.rules).resolve()) if a.rules else None,
        }
        if self.state is None:
            return {
                **given,
                "duration_scale": 1.0 if a.duration_scale is None else a.duration_scale,
                "target_rate": a.target_rate or self.stage.target_rate_qps,
                "seed": 0 if a.seed is None else a.seed,
            }
        saved: dict[str, Any] = self.state["options"]
        for key, value in given.items():
            if value is not None and value != saved.get(key):
                raise StageError(
                    f"--resume: --{key.replace('_', '-')} {value} differs from the run's "
                    f"{saved.get(key)} (soak/state.json)"
                )
        return saved

    def _save_state(self) -> None:
        assert self.state is not None
        self.state["plan"] = self.plan
        self.state["notes"] = self.notes
        soakstate.save_state(self.run_dir, self.state)

    def _event(self, status: str, **detail: Any) -> None:
        """A row of the run's `events.jsonl` (drive.steps.EventLog: accept's format)."""
        self.events.write("soak", status, **detail)

    def _resume_gap(self) -> dict[str, Any] | None:
        """The gap the previous attempt left (soakstate.gap), added to the state."""
        assert self.state is not None
        prev = self.state["attempts"][-1] if self.state["attempts"] else None
        if prev is None:
            return None
        note = soakstate.no_gap(self.state, prev)
        if note is not None:
            self.notes.append(note)
            return None
        gap = soakstate.gap(
            self.state,
            prev,
            self.run_dir,
            worker=self.worker,
            scale=self.scale,
            on_disk=lambda w: disk_counts(self.run_dir, {w}),
        )
        self.state["gaps"].append(gap)
        return gap

    def _every(self, target_s: float) -> float:
        """A sampling period in real seconds: scaled, but at least MIN_SAMPLE_S (sampling
        itself costs the client and the target CPU)."""
        return max(target_s * self.scale, MIN_SAMPLE_S)

    def _count(self, record: Any, out: Any) -> None:
        """Records sent by this process (client samples carry the count: what a killed
        process had sent, against what reached its Parquet parts)."""
        self.counts["sent"] += 1
