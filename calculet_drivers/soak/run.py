# size: the soak driver; its plumbing is to become shared steps (issue 16)
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

This module runs the stage (load, bursts, sampling, golden, signals) and holds the CLI;
the resumable state and the gaps are calculet_drivers/soak/state.py, the conditions
calculet_drivers/soak/judge.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import gevent
import gevent.pool
import psutil

from calculet_drivers.skeleton.runclient import RunClient
from calculet_drivers.skeleton.runtarget import RunTarget
from calculet_drivers.skeleton.steps import EventLog, Step, run_steps
from calculet_drivers.soak import state as soakstate
from calculet_drivers.soak.judge import (
    Judgement,
    StageResult,
    disk_counts,
    judge,
)
from calculet_drivers.soak.stage import (
    SoakStage,
    StageError,
    load_stage,
)
from calculet_drivers.soak.state import STATE_FILE, TRACE_KINDS, JsonLines
from calculet_load.clock import wall_iso
from calculet_load.errors import EXIT_INFRA, EXIT_INVALID, EXIT_OK, RunStop
from calculet_load.measure.client import run_in_greenlet
from calculet_load.measure.session import RequestSpec, golden_spec
from calculet_load.schema.manifest import ManifestError, load_manifest
from calculet_load.target.api import TargetAPI, time_scale
from calculet_load.workload.arrivals import RateClock, Schedule
from calculet_load.workload.dispatch import LATE_AFTER_MS, OpenLoop, Sender
from calculet_load.workload.matrix import MatrixError, load_golden
from calculet_load.workload.mixes import MixError, load_mix, single

__all__ = ["Soak", "run"]

MIN_SAMPLE_S = 0.5  # real seconds between two samples of one kind, at the least
TERM_DRAIN_S = 15.0  # after SIGTERM: real seconds the requests in flight get to finish


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
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

    def say(self, text: str) -> None:
        if not self.args.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

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

    # ------------------------------------------------------------------ the run
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
        # trace offsets: the local copies hold exactly the bytes read so far
        for kind in TRACE_KINDS:
            path = self.run_dir / "server" / f"{kind}.jsonl"
            self.api.offsets[kind] = path.stat().st_size if path.exists() else 0
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

    def _every(self, target_s: float) -> float:
        """A sampling period in real seconds: scaled, but at least MIN_SAMPLE_S (sampling
        itself costs the client and the target CPU)."""
        return max(target_s * self.scale, MIN_SAMPLE_S)

    def _count(self, record: Any, out: Any) -> None:
        """Records sent by this process (client samples carry the count: what a killed
        process had sent, against what reached its Parquet parts)."""
        self.counts["sent"] += 1

    # ------------------------------------------------------------------ load
    def _spec(self, k: int, chooser: Any, **kw: Any) -> RequestSpec:
        entry, sample = chooser.entry_for(k)
        return RequestSpec(
            prompt=self.client.prompt(entry.prompt_tokens, sample),
            max_tokens=entry.max_tokens,
            stream=entry.stream,
            temperature=entry.temperature,
            cell=f"soak:{self.stage.name}:{entry.name}",
            **kw,
        )

    def _prebuild_prompts(self) -> int:
        """Build (tokenize) every prompt the load and the bursts will use before the load
        starts: built on first use, each would hold its arrival back by a tokenizer round
        trip (a send lag of 100+ ms in the first seconds of every attempt)."""
        ld, b = self.stage.load, self.stage.bursts
        mixes = [self.mix or single(ld.prompt_tokens, ld.max_tokens, stream=ld.stream)]
        if b is not None:
            mixes.append(single(b.prompt_tokens, b.max_tokens))
        for mix in mixes:
            for entry in mix.entries:
                for sample in range(entry.samples):
                    self.client.prompt(entry.prompt_tokens, sample)
        return len(self.client.prompts)

    def _seed(self) -> int:
        """The arrival seed of this attempt (a resumed attempt draws new arrivals)."""
        assert self.state is not None
        return int(self.opts["seed"]) + 1_000_003 * (len(self.state["attempts"]) - 1)

    def _load(self) -> None:
        ld = self.stage.load
        mix = self.mix or single(ld.prompt_tokens, ld.max_tokens, stream=ld.stream)
        chooser = mix.chooser(self._seed())
        if ld.kind == "closed":
            counter = itertools.count()

            def user() -> None:
                while time.monotonic() < self.t_end:
                    spec = self._spec(
                        next(counter), chooser, concurrency=ld.concurrency, arrival="closed"
                    )
                    self.session.send(spec)

            users = [self.senders.spawn(user) for _ in range(ld.concurrency)]
            gevent.joinall(users)
            return
        rate = self.rate_target * ld.rate_fraction / self.scale
        clock = RateClock(rate, 1)
        pool = self.open_pool = gevent.pool.Pool(ld.max_in_flight)
        OpenLoop(
            schedule=Schedule(ld.arrival, self._seed(), clock),
            clock=clock,
            origin_ns=time.monotonic_ns() + 200_000_000,
            sender=Sender(pool, self.session.send, self.session.record_dropped),
            spec=lambda k, due: self._spec(
                k, chooser, arrival=ld.arrival, intended_start_ns=due, late_after_ms=LATE_AFTER_MS
            ),
            end_ns=int(self.t_end * 1e9),
            stopped=lambda: self.terminating is not None,
        ).run()
        self._drain(pool)

    def _drain(self, pool: gevent.pool.Pool) -> None:
        """Wait for the requests in flight; what is still running after the hang limit
        is cut and counted as a hang (after SIGTERM: cut, not a hang)."""
        limit = self.stage.pass_.max_request_s * self.scale + 5.0
        pool.join(timeout=limit)
        left = len(pool)
        if left and self.terminating is None:
            self.notes.append(
                f"{self.worker}: {left} request(s) still in flight {limit:.1f} s after the end"
            )
            self.plan["hung_at_end"] = int(self.plan.get("hung_at_end", 0)) + left
        if left:
            pool.kill(block=True, timeout=10)

    def _bursts(self) -> None:
        """Bursts on the stage's grid (every `every_s` from the planned start), so that a
        resumed attempt keeps the grid and burst ids never repeat."""
        b = self.stage.bursts
        assert b is not None
        chooser = single(b.prompt_tokens, b.max_tokens).chooser(self._seed() + 1)
        every = b.every_s * self.scale
        k = int(max(0.0, time.monotonic() - self.t_start) // every) + 1
        while self.t_start + k * every < self.t_end:
            gevent.sleep(max(0.0, self.t_start + k * every - time.monotonic()))
            if self.terminating is not None:
                return
            specs = [
                self._spec(k * b.size + i, chooser, arrival="burst",
                           burst_id=f"{self.manifest.run_id}.burst.{k:05d}",
                           concurrency=b.size, intended_start_ns=time.monotonic_ns())
                for i in range(b.size)
            ]  # fmt: skip
            jobs = [self.senders.spawn(self.session.send, s) for s in specs]
            self.plan["bursts_sent"] = int(self.plan.get("bursts_sent", 0)) + 1
            k += 1
            gevent.joinall(jobs, timeout=self.stage.pass_.max_request_s * self.scale + 5)

    # ------------------------------------------------------------------ sampling
    def _traces_loop(self) -> None:
        every = max(self._every(self.stage.sampling.traces_every_s), 1.0)
        while True:
            gevent.sleep(every)
            self._collect_traces()

    def _collect_traces(self, final: bool = False) -> None:
        if final:
            gevent.sleep(0.5)  # the target flushes its trace files periodically
        out = self.run_dir / "server"
        out.mkdir(parents=True, exist_ok=True)
        self.plan["trace_collections"] = self.plan.get("trace_collections", 0) + 1
        for kind in TRACE_KINDS:
            try:
                data = self.api.trace_bytes(kind)
            except OSError as exc:
                if final:
                    self.notes.append(f"traces {kind}: {exc}")
                continue
            if data:
                with (out / f"{kind}.jsonl").open("ab") as f:
                    f.write(data)

    def _client_loop(self) -> None:
        every = self._every(self.stage.sampling.client_every_s)
        while True:
            self._client_sample()
            gevent.sleep(every)

    def _client_sample(self) -> None:
        if not hasattr(self, "_client_rows"):
            self._client_rows = JsonLines(self.run_dir / "client" / "resources.jsonl")
            self._proc = psutil.Process()
        mem = self._proc.memory_info()
        self._client_rows.write(
            {
                "wall_ns": time.time_ns(),
                "mono_ns": time.monotonic_ns(),
                "worker": self.worker,
                "rss_bytes": mem.rss,
                "in_flight": self.session.in_flight,
                "sent": self.counts["sent"],
            }
        )

    def _health_loop(self) -> None:
        every = self._every(self.stage.sampling.resources_every_s)
        rows = JsonLines(self.run_dir / "soak" / "health.jsonl")
        while True:
            wall = time.time_ns()
            try:
                status, body = self.api.health()
            except OSError as exc:
                status, body = None, str(exc)
            rows.write({"wall_ns": wall, "worker": self.worker, "status": status, "body": body})
            gevent.sleep(every)

    def _golden(self, when: str) -> dict[str, Any]:
        assert self.golden is not None
        failures = []
        for case in self.golden.cases:
            prompt = self.client.prompt(case.prompt_tokens, case.sample)
            spec = golden_spec(case, prompt, f"golden_{when}:{case.name}")
            _, out = self.session.send(spec)
            if out.error_class is not None:
                failures.append(f"{case.name}: {out.http_status} {out.error_code}")
            elif case.token_hash is not None and out.token_hash != case.token_hash:
                failures.append(f"{case.name}: token hash differs")
        self.say(
            f"golden {when}: {len(self.golden.cases) - len(failures)}/"
            f"{len(self.golden.cases)} match"
        )
        return {"cases": len(self.golden.cases), "failures": failures}

    # ------------------------------------------------------------------ verdict
    def _write_index(self, status: str) -> None:
        assert self.state is not None
        self.attempt["sink"] = dataclasses.asdict(self.sink.stats)
        soakstate.write_client_index(
            self.run_dir,
            self.state,
            status=status,
            run_id=self.manifest.run_id,
            source=f"calculet-load soak --stage {self.stage.name}",
            target=self.url,
        )

    def _verdict(
        self, golden_before: dict[str, Any] | None, golden_after: dict[str, Any] | None
    ) -> int:
        """Judge the stage (calculet_drivers.soak.judge), write `soak.json` and say it."""
        assert self.state is not None
        gaps: list[dict[str, Any]] = self.state["gaps"]
        attempts: list[dict[str, Any]] = self.state["attempts"]
        j: Judgement = judge(
            StageResult(
                run_dir=self.run_dir,
                conditions=self.stage.pass_,
                scale=self.scale,
                planned_real_s=float(self.plan["run_duration_real_s"]),
                hung_at_end=int(self.plan.get("hung_at_end", 0)),
                rules=self.opts["rules"] or self.stage.rules,
                attempts=attempts,
                gaps=gaps,
                golden_before=golden_before,
                golden_after=golden_after,
            )
        )
        self.notes.extend(j.notes)
        doc = {**self.plan, "verdict": j.verdict, "exit_code": j.code,
               "conditions": j.conditions, "gaps": gaps, "attempts": [{k: a.get(k) for k in (
                   "worker", "pid", "host", "status", "started_wall_ns", "ended_wall_ns",
                   "load_ended_wall_ns", "loaded_real_s", "signal")} for a in attempts],
               "planned_start_wall_ns": self.state.get("planned_start_wall_ns"),
               "planned_end_wall_ns": self.state.get("planned_end_wall_ns"),
               "notes": self.notes}  # fmt: skip
        (self.run_dir / "soak.json").write_text(json.dumps(doc, indent=1, default=str))
        self.say(f"soak {self.stage.name}: {j.verdict} (exit {j.code})")
        for g in gaps:
            self.say(
                f"  GAP  {g['index']}: {g['start']} .. {g['end']} ({g['duration_s']:.1f} s real, "
                f"{g['duration_target_s']:.0f} target s): {g['reason']}"
            )
        for c in j.conditions:
            mark = {True: "ok  ", False: "FAIL", None: "n/a "}[c["ok"]]
            self.say(f"  {mark} {c['condition']}: {json.dumps(c['observed'], default=str)[:240]}")
        return j.code


# The stage as steps (calculet_drivers.skeleton.steps); each writes its own `soak` rows.
SOAK_STEPS: tuple[Step[Soak], ...] = (
    Step("open", Soak._open_stage, logged=False),
    Step("golden_before", Soak._golden_before, logged=False),
    Step("load", Soak._load_stage, logged=False),
    Step("judge", Soak._judge_stage, logged=False),
)


# ---------------------------------------------------------------------- CLI


def run(args: argparse.Namespace) -> int:
    """`calculet-load soak`."""
    if args.duration_scale is not None and not 0 < args.duration_scale <= 1:
        print("soak: --duration-scale must be within (0, 1]", file=sys.stderr)
        return EXIT_INVALID
    try:
        soak = Soak(args)
    except (StageError, ManifestError, MatrixError, MixError) as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except RunStop as stop:
        print(f"soak: {stop}", file=sys.stderr)
        return stop.code
    code = soak.run()
    print(f"soak: exit {code}; {soak.run_dir / 'soak.json'}")
    return code
