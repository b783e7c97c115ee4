"""`calculet-load soak --stage NAME`: the stability stages of spec §13 as data.

A stage (`configs/soak/<name>.yaml`, schema in calculet_drivers/soak/stage.py) says how long
it runs, what load (open loop at a fraction of the target rate, or closed loop; a mix or
one shape), the periodic bursts, how often the server is sampled, and its pass
conditions. Durations and rates are the *target's* seconds: against a simulator started
with `--time-scale F` the stage runs F times as long in real time at 1/F times the rate
(`--time-scale-hint`, or the `time_scale` of `/admin/state`). `--duration-scale D`
shortens a stage for a rehearsal (D < 1); it is recorded in `soak.json` and flagged.

During the run (not only at the end):
  - server resources every `sampling.resources_every_s` into `server/resources.jsonl`
    (calculet_load.target.resources: /metrics and /admin/state);
  - the server's traces every `sampling.traces_every_s` appended to `server/*.jsonl`
    (through `/traces/{kind}?offset=N`, so nothing is read twice);
  - `/health` with each resource sample (an abort is a target that stops answering);
  - this client's RSS every `sampling.client_every_s` into `client/resources.jsonl`, and
    the self-watch (loop lag, CPU, RSS) into the Parquet parts.
Then `calculet-load analyze` judges the folder (the leak rule reads
`server/resources.jsonl`) and the stage's conditions are checked: no leak, no hang (no
request over `max_request_s`, none left in flight), no abort, error rate, golden before
and after, client memory flat, client continuity. `soak.json` holds every condition with
what was seen.

Resuming (`--resume RUN_DIR`): `soak/state.json` holds the stage's plan and its planned
end on the wall clock, and each client process (attempt) that ran it. A process killed
mid-stage (SIGKILL, OOM, host reboot) leaves its closed Parquet parts and samples; the
part open at the kill is lost. Re-running with `--resume` continues the same folder under
a new worker name (w00, then w00-r1, w00-r2, ...) until the planned end, and records the
gap: from the last record or sample of the dead process to the resume, with its reason,
in `soak.json` (`gaps`) and `events.jsonl`. SIGTERM/SIGINT stop the load, flush the
sink and the samples, and leave a resumable state (exit 143/130). A run with a gap is
not a clean pass: the target's conditions are judged from its own samples (the leak per
segment between gaps, and over the joined series where the clocks are comparable), and
the condition `client continuity` fails as an infrastructure problem.

Exit codes: 0 pass; 1 a condition on the target failed (correctness/reliability); 2
invalid stage, manifest or resume; 3 infrastructure (the client saturated or restarted
mid-stage, the target unreachable at the start); 143/130 stopped by SIGTERM/SIGINT
(resumable).

This module runs the stage as its steps and handles the signals; what the run holds is
soak/soakrun.py, its samplers soak/sampling.py, its load soak/load.py, its golden set,
index and verdict soak/verdict.py, the resumable state and the gaps soak/state.py, the
conditions soak/judge.py, the command line commands/soak.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import gevent
import gevent.pool

from calculet_drivers.skeleton.runclient import RunClient
from calculet_drivers.skeleton.steps import EventLog, Step, run_steps
from calculet_drivers.skeleton.tracecopy import TraceAppender
from calculet_drivers.soak import state as soakstate
from calculet_drivers.soak.stage import (
    SoakStage,
)
from calculet_drivers.soak.verdict import SoakJudged
from calculet_load.clock import wall_iso
from calculet_load.errors import EXIT_INFRA, EXIT_OK, RunStop
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.target.api import time_scale

__all__ = ["SOAK_STEPS", "Soak"]

TERM_DRAIN_S = 15.0  # after SIGTERM: real seconds the requests in flight get to finish


class Soak(SoakJudged):
    """The stage as its steps (SOAK_STEPS), with signals handled and state kept so that a
    killed or stopped run resumes."""

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        repaired = soakstate.repair_files(self.run_dir) if self.state is not None else {}
        attempts = self.state["attempts"] if self.state is not None else []
        self.worker = "w00" if not attempts else f"w00-r{len(attempts)}"
        self.events = EventLog(self.run_dir / "events.jsonl", worker=self.worker)
        if repaired:
            self.notes.append(f"cut half-written lines left by the killed process: {repaired}")
        if self.state is None:
            (self.run_dir / "manifest.yaml").write_text(Path(self.args.manifest).read_text())
        self.attempt = soakstate.new_attempt(self.worker)
        self.client = RunClient.open(
            self.manifest, self.target, self.run_dir, self.worker, max_in_flight=4096
        )
        self.sink, self.session = self.client.sink, self.client.session
        self.session.hooks.append(self._count)
        code = EXIT_OK
        try:
            code = run_in_greenlet(self._run)
        finally:
            self.client.close()
        return code

    def _on_signal(self, signum: int) -> None:
        """SIGTERM/SIGINT: end the load now, give the requests in flight TERM_DRAIN_S,
        then flush and leave a resumable state (in _run)."""
        if self.terminating is not None:
            return
        self.terminating = signum
        name = signal.Signals(signum).name
        self.say(f"soak: {name}: stopping the load; the run stays resumable")
        self.t_end = min(self.t_end, time.monotonic())
        for g in getattr(self, "_stoppable", []):
            g.kill(block=False)
        gevent.spawn_later(TERM_DRAIN_S, self._cut_senders)

    def _cut_senders(self) -> None:
        self.senders.kill(block=False)
        if self.open_pool is not None:
            self.open_pool.kill(block=False)

    def _run(self) -> int:
        st = self.stage
        watchers = [gevent.signal_handler(s, self._on_signal, s)
                    for s in (signal.SIGTERM, signal.SIGINT)]  # fmt: skip
        try:
            return self._run_stage(st)
        finally:
            for w in watchers:
                w.cancel()

    def _run_stage(self, st: SoakStage) -> int:
        """The stage as its steps (SOAK_STEPS); a stop (the target unreachable, a signal)
        ends them with its exit code."""
        try:
            run_steps(SOAK_STEPS, self, self.events)
        except RunStop as stop:
            return stop.code
        return self.code

    def _if_stopped(self) -> None:
        """After SIGTERM/SIGINT: a resumable state (`_stop`), and the steps end."""
        if self.terminating is not None:
            raise RunStop(self._stop(), "stopped by a signal")

    def _open_stage(self) -> None:
        """The target's health; a new plan and state, or the resumed ones and their gap."""
        st = self.stage
        problem = self.target.check()
        if problem is None:
            try:  # what it said, for the plan
                status, health = self.api.health()
            except OSError as exc:
                problem = f"target {self.url} unreachable: {exc}"
        if problem is not None:
            self.say(f"soak: {problem}")
            raise RunStop(EXIT_INFRA, problem)
        self.dscale = float(self.opts["duration_scale"])
        self.rate_target = float(self.opts["target_rate"])
        gap = None
        if self.state is None:
            self.scale = time_scale(self.api, self.opts["time_scale_hint"])
            duration_real = st.duration_s * self.dscale * self.scale
            self.plan = {
                "schema": "calculet-soak/v1",
                "stage": st.name,
                "title": st.title,
                "spec": st.spec,
                "run_id": self.manifest.run_id,
                "target": self.url,
                "time_scale": self.scale,
                "duration_scale": self.dscale,
                "rehearsal": self.dscale < 1.0 or self.scale != 1.0,
                "stage_duration_s": st.duration_s,
                "run_duration_target_s": st.duration_s * self.dscale,
                "run_duration_real_s": duration_real,
                "target_rate_qps": self.rate_target,
                "offered_rate_target_qps": self.rate_target * st.load.rate_fraction,
                "offered_rate_real_qps": self.rate_target * st.load.rate_fraction / self.scale,
                "load": st.load.model_dump(),
                "bursts": st.bursts.model_dump() if st.bursts else None,
                "started_wall_ns": time.time_ns(),
                "health_at_start": {"status": status, "body": health},
            }
            self.state = soakstate.new_state(st.name, self.manifest.run_id, self.opts, self.scale)
        else:
            self.scale = float(self.state["time_scale"])
            self.plan = self.state["plan"]
            self.notes = list(self.state.get("notes") or []) + self.notes
            gap = self._resume_gap()
            self.plan.setdefault("health_at_resume", []).append(
                {"worker": self.worker, "status": status, "body": health}
            )
        duration_real = float(self.plan["run_duration_real_s"])
        self.state["attempts"].append(self.attempt)
        self._save_state()
        self.traces = TraceAppender(self.api, self.run_dir)  # goes on where the last stopped
        if gap is not None:
            self._event("gap", **gap)
            self.say(
                f"soak {st.name}: resuming {self.run_dir} as {self.worker}; gap {gap['index']}: "
                f"{gap['start']} .. {gap['end']} ({gap['duration_s']:.1f} s): {gap['reason']}"
            )
        self._event("resume" if len(self.state["attempts"]) > 1 else "start",
                    attempt=len(self.state["attempts"]), pid=os.getpid())  # fmt: skip
        # a part per ~1/30 of a short rehearsal (10 s at most): the client's memory then
        # reaches its steady sawtooth early, as in a long stage
        self.sink.rotate_s = min(10.0, max(1.0, duration_real / 30))
        rate_real = self.rate_target * st.load.rate_fraction / self.scale
        if len(self.state["attempts"]) == 1:
            self.say(
                f"soak {st.name}: {st.duration_s * self.dscale:g} target s "
                f"(x{self.dscale:g} of {st.duration_s:g}) = {duration_real:.1f} s real at time "
                f"scale {self.scale:g}; {st.load.kind} loop"
                + (f" at {rate_real:.3g} req/s real" if st.load.kind == "open" else "")
            )

    def _golden_before(self) -> None:
        assert self.state is not None
        if self.golden and "golden_before" not in self.state:
            self.state["golden_before"] = self._golden("before")
            self._save_state()
        self._if_stopped()

    def _load_stage(self) -> None:
        """The load to the planned end, with the samplers around it."""
        st = self.stage
        assert self.state is not None
        duration_real = float(self.plan["run_duration_real_s"])
        warm = st.load.prewarm_connections + (st.bursts.size if st.bursts else 0)
        prewarmed = self.session.pool.prewarm(
            min(warm, st.load.max_in_flight + (st.bursts.size if st.bursts else 0))
        )
        self.plan.setdefault("prewarmed_connections", prewarmed)
        self.plan["prompts_prebuilt"] = self._prebuild_prompts()
        self.client.watch.start()
        from calculet_load.target.resources import ResourceSampler

        sampler = ResourceSampler(
            self.url,
            self.run_dir / "server" / "resources.jsonl",
            admin_token=self.token,
            interval_s=self._every(st.sampling.resources_every_s),
        ).start()
        background = [
            gevent.spawn(self._traces_loop),
            gevent.spawn(self._client_loop),
            gevent.spawn(self._health_loop),
        ]
        if "planned_end_wall_ns" not in self.state:
            now = time.time_ns()
            self.state["planned_start_wall_ns"] = now
            self.state["planned_end_wall_ns"] = now + int(duration_real * 1e9)
            self.plan["planned_end"] = wall_iso(self.state["planned_end_wall_ns"])
        self.state["status"] = "running"
        self._save_state()
        # the stage's clock is the wall clock: a resumed attempt runs to the planned end
        now_wall, now_mono = time.time_ns(), time.monotonic()
        remaining = (int(self.state["planned_end_wall_ns"]) - now_wall) / 1e9
        self.t_start = now_mono - (now_wall - int(self.state["planned_start_wall_ns"])) / 1e9
        self.t_end = now_mono + max(0.0, remaining)
        if self.terminating is not None:
            self.t_end = now_mono
        if remaining <= 0:
            self.notes.append(f"{self.worker}: resumed after the planned end: no load left")
        t0 = time.monotonic()
        try:
            jobs = [gevent.spawn(self._load)]
            if st.bursts is not None:
                jobs.append(gevent.spawn(self._bursts))
            self._stoppable = jobs[1:]
            gevent.joinall(jobs)
            for g in jobs:
                if g.exception is not None:
                    raise g.exception
        finally:
            self.attempt["loaded_real_s"] = round(time.monotonic() - t0, 3)
            gevent.killall(background)
            self.client.watch.stop()
            sampler.stop()
            self._collect_traces(final=True)
            self._client_sample()
        self._if_stopped()

    def _judge_stage(self) -> None:
        """Golden after, the index, plan.json and the verdict (self.code)."""
        assert self.state is not None
        self.state["status"] = "judging"
        self.attempt["load_ended_wall_ns"] = time.time_ns()
        self._save_state()
        golden_after = self._golden("after") if self.golden else None
        self.sink.flush()
        self.attempt["status"] = "finished"
        self.attempt["ended_wall_ns"] = time.time_ns()
        self._write_index("complete")
        self.plan["ended_wall_ns"] = time.time_ns()
        self.plan["elapsed_real_s"] = round(
            (self.plan["ended_wall_ns"] - self.plan["started_wall_ns"]) / 1e9, 3
        )
        (self.run_dir / "plan.json").write_text(json.dumps(self.plan, indent=1, default=str))
        self.code = self._verdict(self.state.get("golden_before"), golden_after)
        self.state["status"] = "done"
        self._save_state()
        self._event("end", code=self.code)

    def _stop(self) -> int:
        """After SIGTERM/SIGINT: every record and sample on disk, a resumable state."""
        assert self.terminating is not None
        name = signal.Signals(self.terminating).name
        self.sink.flush()
        self.attempt.update(status="terminated", signal=name, ended_wall_ns=time.time_ns())
        assert self.state is not None
        self.state["status"] = "interrupted" if "planned_end_wall_ns" in self.state else "starting"
        self._write_index("interrupted")
        self._save_state()
        self._event("interrupted", signal=name)
        self.say(f"soak: stopped by {name}; continue with --resume {self.run_dir}")
        return 128 + self.terminating


# The stage as steps (calculet_drivers.skeleton.steps); each writes its own `soak` rows.
SOAK_STEPS: tuple[Step[Soak], ...] = (
    Step("open", Soak._open_stage, logged=False),
    Step("golden_before", Soak._golden_before, logged=False),
    Step("load", Soak._load_stage, logged=False),
    Step("judge", Soak._judge_stage, logged=False),
)
