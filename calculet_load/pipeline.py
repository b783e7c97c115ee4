"""`calculet-load accept`: the automated acceptance run of spec §15 in the order of §8.

Steps, each logged to `events.jsonl` in the run folder as it starts and ends:

  1 release    manifest valid; calbin sha256 and versions match the target (exit 2)
  2 idle       sample the device until temperature/power/frequency are stable
  3 golden     the fixed golden set; any mismatch stops the run (exit 1)
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
Requests are sent from this process on its own gevent loop (one client host); the
matrix's load shapes are those of the Locust users (closed, open loop, burst).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import json
import os
import random
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import gevent.pool

from calculet_load.arrivals import RateClock, Schedule
from calculet_load.client import Timeouts, run_in_greenlet
from calculet_load.clock import clock_provenance
from calculet_load.matrix import Cell, GoldenSet, Matrix, MatrixError, load_golden, load_matrix
from calculet_load.mixes import MixError, load_mix, single
from calculet_load.schema.manifest import ManifestError, RunManifest, load_manifest
from calculet_load.selfwatch import TIMER_SLACK_S, SelfWatch
from calculet_load.session import RequestSpec, RunContext, Session, golden_spec
from calculet_load.sink import PartSink
from calculet_load.workload import Prompt, PromptFactory, WorkloadError, http_tokenizer

PLAN_SCHEMA = "calculet-plan/v1"
EXIT_OK, EXIT_FAIL, EXIT_INVALID, EXIT_INFRA, EXIT_REGRESSION = 0, 1, 2, 3, 4


class Stop(Exception):
    """A step ended the run early with an exit code and a one-line reason."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


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
    idle_window_s: float = 300.0
    idle_timeout_s: float = 1800.0
    idle_gap_s: float = 2.0
    min_repetitions: int | None = None  # rehearsals only: below §8's 30/100, flagged
    record_golden: bool = False
    resume: bool = False
    skip_report: bool = False
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


class EventLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, step: str, status: str, **detail: Any) -> None:
        row = {"wall_ns": time.time_ns(), "step": step, "status": status, **detail}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")


class Pipeline:
    def __init__(self, opts: Options) -> None:
        self.o = opts
        try:
            self.manifest: RunManifest = load_manifest(opts.manifest)
            self.matrix: Matrix = load_matrix(opts.matrix)
            self.golden: GoldenSet | None = load_golden(opts.golden) if opts.golden else None
        except (ManifestError, MatrixError) as exc:
            raise Stop(EXIT_INVALID, str(exc)) from None
        target = self.manifest.target
        self.url = (opts.url or (target.url if target else "")).rstrip("/")
        if not self.url:
            raise Stop(EXIT_INVALID, "target: no --url and no target.url in the manifest")
        self.protocol = target.protocol if target else "llama"
        self.model = target.model if target else None
        self.run_dir = Path(opts.run_dir or Path("runs") / self.manifest.run_id)
        self.cells = self.matrix.expanded()
        self.plan: dict[str, Any] = {}
        self.code = EXIT_OK
        self.notes: list[str] = []
        self.sampler: Any = None

    # --------------------------------------------------------------- helpers
    def say(self, text: str) -> None:
        if self.o.progress:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def _get_json(self, path: str, admin: bool = False) -> Any:
        req = urllib.request.Request(self.url + path)
        if admin and self.o.admin_token:
            req.add_header("Authorization", f"Bearer {self.o.admin_token}")
        return json.loads(_off_loop(lambda: _read_url(req)))

    def _save_plan(self) -> None:
        tmp = self.run_dir / "plan.json.tmp"
        tmp.write_text(json.dumps(self.plan, indent=1))
        tmp.replace(self.run_dir / "plan.json")

    # --------------------------------------------------------------- the run
    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = EventLog(self.run_dir / "events.jsonl")
        resumed = self.o.resume and (self.run_dir / "plan.json").exists()
        attempt = 1
        if resumed:
            self.plan = json.loads((self.run_dir / "plan.json").read_text())
            attempt = int(self.plan.get("attempts", 1)) + 1
            self.plan["attempts"] = attempt
        self.worker = "w00" if attempt == 1 else f"w00-r{attempt - 1}"
        ctx = RunContext.from_manifest(self.manifest, self.worker)
        self.sink = PartSink(str(self.run_dir), self.worker)
        timeout = self.manifest.timeout_s
        self.session = Session(
            ctx,
            self.url,
            self.protocol,
            model=self.model,
            max_in_flight=1024,
            timeouts=Timeouts(connect_s=min(10.0, timeout), total_s=timeout, first_byte_s=timeout),
            sink=self.sink,
        )
        self.watch = SelfWatch(self.sink, self.worker, in_flight=lambda: self.session.in_flight)
        self.watch.start()
        self.prompts: dict[tuple[int, int], Prompt] = {}
        tokenize = http_tokenizer(self.url)
        self.factory = PromptFactory(
            lambda body: _off_loop(lambda: tokenize(body)),
            mode="chat" if self.protocol == "openai-chat" else "ids",
        )
        try:
            self._steps(resumed)
        except Stop as stop:
            self.log.write("run", "stopped", code=stop.code, reason=str(stop))
            self.say(f"STOP (exit {stop.code}): {stop}")
            self.code = stop.code
        finally:
            if self.sampler is not None:
                self.sampler.stop()
            self.watch.stop()
            self.session.close()
            self.sink.close()
        if self.code in (EXIT_OK, EXIT_FAIL):
            self._finish()  # ends with the signature: nothing is written after it
        else:
            self.log.write("run", "end", code=self.code)
        return self.code

    def _steps(self, resumed: bool) -> None:
        if not resumed:
            self.log.write("run", "start", run_id=self.manifest.run_id, target=self.url)
            (self.run_dir / "manifest.yaml").write_text(Path(self.o.manifest).read_text())
            self._release()
            self._idle()
            self._golden("golden_before")
            self._warmup()
            self._make_plan()
        else:
            self.log.write("run", "resume", attempt=self.plan["attempts"])
            self.say(f"resuming {self.run_dir} (attempt {self.plan['attempts']})")
            self._release()
        self._matrix()
        # --- issue 8: the fault matrix of §12 (calculet_load/faults.py), with --faults ---
        if self.o.extra.get("faults"):
            from calculet_load.faults import run_accept_step

            run_accept_step(self)
        # --- end of the fault matrix step ----------------------------------------------
        self._golden("golden_after")
        self._resources()

    # --------------------------------------------------------------- 1 release
    def _release(self) -> None:
        self.log.write("release", "start")
        m = self.manifest.model
        checked = []
        if self.o.calbin:
            digest = _sha256_file(self.o.calbin)
            if digest != m.calbin_sha256:
                raise Stop(
                    EXIT_INVALID,
                    f"release: calbin {self.o.calbin} sha256 {digest[:12]}… != manifest "
                    f"model.calbin_sha256 {m.calbin_sha256[:12]}…",
                )
            checked.append("calbin file")
        try:
            health = self._get_json("/health")
        except (OSError, ValueError) as exc:
            raise Stop(EXIT_INFRA, f"release: target {self.url} unreachable: {exc}") from None
        if self.o.admin_token:
            try:
                state = self._get_json("/admin/state", admin=True)
            except (OSError, ValueError) as exc:
                raise Stop(EXIT_INVALID, f"release: /admin/state: {exc}") from None
            served = state.get("calbin_sha256")
            if served != m.calbin_sha256:
                raise Stop(
                    EXIT_INVALID,
                    f"release: the target serves calbin {str(served)[:12]}… but the manifest "
                    f"says model.calbin_sha256 {m.calbin_sha256[:12]}…",
                )
            if state.get("generation") is not None and state["generation"] != m.generation:
                raise Stop(
                    EXIT_INVALID,
                    f"release: the target is at generation {state['generation']}, the "
                    f"manifest says model.generation {m.generation}",
                )
            checked.append("served calbin and generation")
        else:
            self.notes.append("release: no admin token, the served calbin was not checked")
        self.log.write("release", "end", checked=checked, health=health.get("status"))
        self.say(f"release verified ({', '.join(checked) or 'manifest only'})")

    # --------------------------------------------------------------- 2 idle
    def _idle(self) -> None:
        """Wait until the device's temperature, power and frequency are stable.

        Samples the target's `/metrics` (spec §10.3 gauges `calculet_chip_temperature_c`,
        `calculet_chip_power_w`, `calculet_chip_frequency_mhz`) until, over the last
        `--idle-window-s`, the hottest chip moved <= 0.5 C, total power <= 1 W and the
        lowest frequency did not change."""
        window = self.o.idle_window_s
        self.log.write("idle", "start", window_s=window)
        self.say(f"idle sampling: waiting for a stable {window:g} s window")
        rows: list[tuple[float, float, float, float]] = []
        started = time.monotonic()
        stable = False
        while time.monotonic() - started < self.o.idle_timeout_s:
            try:
                sample = _device_sample(_get_bytes(f"{self.url}/metrics").decode())
            except (OSError, ValueError) as exc:
                self.notes.append(f"idle: no device telemetry from /metrics ({exc}); skipped")
                self.log.write("idle", "end", stable=None, reason=str(exc))
                return
            if sample is None:
                self.notes.append("idle: /metrics has no chip gauges; idle sampling skipped")
                self.log.write("idle", "end", stable=None, reason="no chip gauges")
                return
            now = time.monotonic()
            rows.append((now, *sample))
            if now - rows[0][0] >= window:
                recent = [r for r in rows if r[0] >= now - window]
                spread = [max(x) - min(x) for x in list(zip(*recent, strict=True))[1:]]
                if spread[0] <= 0.5 and spread[1] <= 1.0 and spread[2] <= 0.0:
                    stable = True
                    break
            gevent.sleep(min(1.0, max(window / 10, 0.1)))
        last = rows[-1] if rows else None
        self.log.write("idle", "end", stable=stable, samples=len(rows), last=last)
        if not stable:
            self.notes.append("idle: the device did not become stable within the timeout")
        self.say(f"idle sampling: {'stable' if stable else 'NOT stable'} ({len(rows)} samples)")

    # --------------------------------------------------------------- 3/6 golden
    def _golden(self, step: str) -> None:
        if self.golden is None:
            self.log.write(step, "skipped", reason="no golden set given")
            return
        self.log.write(step, "start", cases=len(self.golden.cases))
        expected = [
            {"cell": f"{prefix}:{c.name}", "token_hash": c.token_hash}
            for prefix in ("golden_before", "golden_after")
            for c in self.golden.cases
            if c.token_hash is not None
        ]
        if expected:  # the analysis judges golden records against these, not a majority
            (self.run_dir / "golden.json").write_text(json.dumps({"cases": expected}, indent=1))
        failures = []
        recorded = []
        for case in self.golden.cases:
            prompt = self._prompt(case.prompt_tokens, case.sample)
            spec = golden_spec(case, prompt, f"{step}:{case.name}")
            record, _ = run_in_greenlet(functools.partial(self.session.send, spec))
            got = record.result.token_hash
            if record.ext.error_class is not None:
                failures.append(f"{case.name}: {record.ext.error_class}")
            elif case.token_hash is None:
                recorded.append({"name": case.name, "token_hash": got})
            elif got != case.token_hash:
                failures.append(
                    f"{case.name}: token hash {str(got)[:12]}… != {case.token_hash[:12]}…"
                )
        if recorded:
            self.log.write(step, "recorded", hashes=recorded)
            if step == "golden_before":
                self.notes.append(
                    f"golden: {len(recorded)} case(s) had no expected hash: recorded in "
                    "events.jsonl (compared with this run's majority by the analysis)"
                )
        self.log.write(step, "end", failures=failures)
        self.say(f"{step}: {len(self.golden.cases) - len(failures)}/{len(self.golden.cases)} match")
        if failures:
            raise Stop(EXIT_FAIL, f"{step} failed: {'; '.join(failures[:3])}")

    # --------------------------------------------------------------- 4 warmup
    def _warmup(self) -> None:
        n = self.manifest.warmup_requests
        shapes = sorted({(c.prompt_tokens, c.max_tokens) for c in self.cells if not c.mix})
        for c in self.cells:
            if c.mix:
                shapes += [(e.prompt_tokens, e.max_tokens) for e in load_mix(c.mix).entries]
        shapes = sorted(set(shapes))
        self.log.write("warmup", "start", shapes=shapes, per_shape=n)
        for p, o in shapes:
            for i in range(n):
                spec = RequestSpec(
                    prompt=self._prompt(p, i % 4), max_tokens=o, cell=f"warmup:p{p}-o{o}",
                    concurrency=1, arrival="single", warmup=True,
                )  # fmt: skip
                run_in_greenlet(functools.partial(self.session.send, spec))
        self.log.write("warmup", "end")
        self.say(f"warmup: {n} request(s) for each of {len(shapes)} shape(s)")

    # --------------------------------------------------------------- 5 matrix
    def _make_plan(self) -> None:
        order = list(range(len(self.cells)))
        random.Random(f"calculet-plan:{self.o.seed}").shuffle(order)
        cells = []
        for i in order:
            c = self.cells[i]
            reps = self.matrix.repetitions_for(c)
            if self.o.min_repetitions is not None:
                reps = min(reps, self.o.min_repetitions)
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
            "below_minimum_repetitions": self.o.min_repetitions is not None,
            "cells": cells,
            "excluded": [],
        }
        self._save_plan()

    def _matrix(self) -> None:
        if self.o.admin_token:
            # the target's RSS, FDs, threads, KV and leases through the run (leak analysis)
            from calculet_load.resources import ResourceSampler

            self.sampler = ResourceSampler(
                self.url, self.run_dir / "server" / "resources.jsonl",
                admin_token=self.o.admin_token, interval_s=1.0,
            ).start()  # fmt: skip
        todo = [c for c in self.plan["cells"] if c["status"] != "done"]
        self.log.write("matrix", "start", cells=len(self.plan["cells"]), todo=len(todo))
        for entry in self.plan["cells"]:
            if entry["status"] == "running":  # cut by a crash: its records are excluded
                self.plan["excluded"].append(
                    {"cell": entry["name"], "worker": entry.get("worker"),
                     "reason": "interrupted cell attempt (the cell was run again)"}
                )  # fmt: skip
        for n, entry in enumerate(todo, 1):
            cell = self.cells[entry["index"]]
            entry["status"], entry["worker"] = "running", self.worker
            entry["started_wall_ns"] = time.time_ns()
            self._save_plan()
            self.log.write("cell", "start", cell=cell.name)
            self.say(f"cell {n}/{len(todo)} {cell.name}: {entry['repetitions']} request(s)")
            sent = self._run_cell(cell, entry["repetitions"], int(entry["seed"]))
            self.sink.flush()  # the cell's records are on disk before it counts as done
            entry["status"], entry["requests"] = "done", sent
            entry["ended_wall_ns"] = time.time_ns()
            self._save_plan()
            self.log.write("cell", "end", cell=cell.name, requests=sent)
            if self.o.idle_gap_s:
                gevent.sleep(self.o.idle_gap_s)
        self.log.write("matrix", "end")

    def _run_cell(self, cell: Cell, reps: int, seed: int) -> int:
        mix = load_mix(cell.mix) if cell.mix else single(cell.prompt_tokens, cell.max_tokens)
        chooser = mix.chooser(seed)

        def spec(k: int, **kw: Any) -> RequestSpec:
            entry, sample = chooser.entry_for(k)
            return RequestSpec(
                prompt=self._prompt(entry.prompt_tokens, sample),
                max_tokens=entry.max_tokens,
                stream=cell.stream and entry.stream,
                temperature=cell.temperature,
                seed=seed if cell.temperature > 0 else None,
                cell=cell.name,
                **kw,
            )

        # Every prompt the cell will use, built before its first request: a /tokenize
        # round trip inside the schedule would make the arrivals after it late.
        count = cell.rounds * cell.size if cell.kind == "burst" else reps
        for k in range(count):
            entry, sample = chooser.entry_for(k)
            self._prompt(entry.prompt_tokens, sample)
        if cell.kind in ("single", "boundary"):
            for k in range(reps):
                s = spec(k, concurrency=1, arrival="single")
                run_in_greenlet(functools.partial(self.session.send, s))
            return reps
        # Concurrent shapes: every prompt is built before the first send. Tokenizing
        # runs on a thread; meanwhile it holds the GIL from the loop, which would delay
        # the sends and stamps of the requests in flight (seen as send lag).
        arrivals = cell.rounds * cell.size if cell.kind == "burst" else reps
        for entry in mix.entries:
            for sample in range(min(entry.samples, arrivals)):
                self._prompt(entry.prompt_tokens, sample)
        if cell.kind == "closed":
            return run_in_greenlet(lambda: self._closed(cell, reps, spec))
        if cell.kind == "open":
            return run_in_greenlet(lambda: self._open(cell, reps, seed, spec))
        return run_in_greenlet(lambda: self._burst(cell, spec))

    def _closed(self, cell: Cell, reps: int, spec: Any) -> int:
        counter = iter(range(reps))

        def user() -> None:
            for k in counter:
                self.session.send(spec(k, concurrency=cell.concurrency, arrival="closed"))

        gevent.joinall([gevent.spawn(user) for _ in range(cell.concurrency)])
        return reps

    def _open(self, cell: Cell, reps: int, seed: int, spec: Any) -> int:
        clock = RateClock(cell.rate, 1)
        sched = Schedule(cell.arrival, seed, clock, burstiness=cell.burstiness)
        pool = gevent.pool.Pool(cell.max_in_flight)
        origin = time.monotonic_ns() + 200_000_000
        for _ in range(reps):
            nxt = sched.next_for(0)
            if nxt is None:
                break
            k, unit = nxt
            t = clock.time_of(unit)
            assert t is not None
            due = origin + t
            s = spec(k, arrival=cell.arrival, intended_start_ns=due, late_after_ms=5.0)
            remaining = (due - time.monotonic_ns()) / 1e9
            if remaining > TIMER_SLACK_S:
                gevent.sleep(remaining - TIMER_SLACK_S)
            while time.monotonic_ns() < due:
                gevent.sleep(0)
            if pool.full():
                self.session.record_dropped(s, f"in-flight cap {cell.max_in_flight} full")
            else:
                pool.spawn(self.session.send, s)
        pool.join()
        return reps

    def _burst(self, cell: Cell, spec: Any) -> int:
        sent = 0
        for r in range(cell.rounds):
            self.session.pool.prewarm(cell.size)
            specs = [spec(r * cell.size + i) for i in range(cell.size)]
            due = time.monotonic_ns() + 100_000_000
            while (left := (due - time.monotonic_ns()) / 1e9) > TIMER_SLACK_S:
                gevent.sleep(left - TIMER_SLACK_S)
            while time.monotonic_ns() < due:
                gevent.sleep(0)
            burst_id = f"{self.manifest.run_id}.{cell.name}.{r:03d}"
            jobs = []
            for s in specs:
                fields = {**_spec_fields(s), "arrival": "burst", "burst_id": burst_id}
                fields.update(intended_start_ns=due, concurrency=cell.size)
                jobs.append(gevent.spawn(self.session.send, RequestSpec(**fields)))
            gevent.joinall(jobs)
            sent += len(jobs)
            gevent.sleep(0.2)
        return sent

    # --------------------------------------------------------------- 7 resources
    def _resources(self) -> None:
        self.log.write("resources", "start")
        if not self.o.admin_token:
            self.log.write("resources", "end", checked=False, reason="no admin token")
            return
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
        self.log.write("resources", "end", checked=True, back_to_baseline=back,
                       kv_allocated=state.get("kv", {}).get("allocated_tokens"),
                       leased=state.get("buffer_pool", {}).get("leased"))  # fmt: skip
        self.say(f"resources back to baseline: {back}")
        if not back:
            raise Stop(EXIT_FAIL, "resources: KV/leases/sequences did not return to idle")

    # --------------------------------------------------------------- 8-11
    def _finish(self) -> None:
        self._write_index()
        self._collect_traces()
        self.log.write("analysis", "start")
        code = self._analyze()
        self.log.write("analysis", "end", code=code)
        # a stop for correctness wins; otherwise the analysis decides
        self.code = self.code if self.code == EXIT_FAIL else code
        if not self.o.skip_report:
            self._report()
        self.log.write("run", "end", code=self.code)
        self._sign()

    def _write_index(self) -> None:
        """`client/index.json`: this process as the run's one worker, with its clock."""
        parts = sorted(
            f"{p.parent.name}/{p.name}" for p in (self.run_dir / "client").glob("*/part-*.parquet")
        )
        index = {
            "schema": "calculet-client-index/v1",
            "run_id": self.manifest.run_id,
            "status": "complete",
            "source": "calculet-load accept",
            "target": self.url,
            "workers": [
                {"worker": w, "host": socket.gethostname(), "pid": os.getpid(),
                 "status": "reported",
                 "parts": [p.split("/", 1)[1] for p in parts if p.startswith(w + "/")],
                 **clock_provenance()}
                for w in sorted({p.split("/")[0] for p in parts})
            ],
        }  # fmt: skip
        (self.run_dir / "client" / "index.json").write_text(json.dumps(index, indent=1))

    def _collect_traces(self) -> None:
        self.log.write("traces", "start")
        gevent.sleep(1.0)  # the target flushes its trace files periodically
        out = self.run_dir / "server"
        out.mkdir(exist_ok=True)
        got: dict[str, Any] = {}
        for kind in ("server_events", "steps", "device"):
            try:
                data = _get_bytes(f"{self.url}/traces/{kind}?offset=0")
            except OSError as exc:
                got[kind] = f"not available: {exc}"
                continue
            (out / f"{kind}.jsonl").write_bytes(data[: data.rfind(b"\n") + 1])
            got[kind] = len(data)
        self.log.write("traces", "end", files=got)

    def _analyze(self) -> int:
        analyze_run = _optional("analysis.cli", "analyze_run")
        if analyze_run is None:
            self.notes.append("analysis: not available in this build")
            return self.code
        return int(analyze_run(str(self.run_dir), baseline=self.o.baseline_run, rules=self.o.rules))

    def _report(self) -> None:
        self.log.write("report", "start")
        write_report = _optional("analysis.report", "write_report")
        if write_report is None:
            self.log.write("report", "skipped", reason="the report is not available in this build")
            return
        path = write_report(str(self.run_dir), baseline=self.o.baseline_run)
        self.log.write("report", "end", path=path)
        self.say(f"report: {path}")

    def _sign(self) -> None:
        """The last write to the run folder: the bundle lists every file as it is now."""
        sign_run = _optional("analysis.sign", "sign_run")
        if sign_run is None:
            self.notes.append("sign: signing is not available in this build")
            return
        try:
            result = sign_run(str(self.run_dir))
        except Exception as exc:  # a bad key (SigningKeyError, exit 2): one line, unsigned
            if getattr(exc, "exit_code", None) is None:
                raise
            self.notes.append(f"sign: {exc}")
            self.code = EXIT_INVALID
            return
        self.say(
            f"signed bundle: {self.run_dir / 'bundle.intoto.json'} "
            f"({'signed' if getattr(result, 'signed', False) else 'UNSIGNED: no key'})"
        )

    # --------------------------------------------------------------- prompts
    def _prompt(self, tokens: int, sample: int) -> Prompt:
        key = (tokens, sample)
        if key not in self.prompts:
            try:
                self.prompts[key] = self.factory.prompt(tokens, sample)
            except WorkloadError as exc:
                raise Stop(EXIT_INVALID, f"prompt: {exc}") from None
            except OSError as exc:
                raise Stop(EXIT_INFRA, f"prompt: /tokenize unreachable: {exc}") from None
        return self.prompts[key]


def _optional(module: str, name: str) -> Any:
    """A function of a part that may not be in this build (None then)."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _spec_fields(s: RequestSpec) -> dict[str, Any]:
    return {f: getattr(s, f) for f in s.__dataclass_fields__}


def _device_sample(text: str) -> tuple[float, float, float] | None:
    """(hottest chip C, total power W, lowest frequency MHz) from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[float]] = {"temperature_c": [], "power_w": [], "frequency_mhz": []}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, bucket in values.items():
                if sample.name == f"calculet_chip_{key}":
                    bucket.append(float(sample.value))
    if not all(values.values()):
        return None
    return max(values["temperature_c"]), sum(values["power_w"]), min(values["frequency_mhz"])


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        raise Stop(EXIT_INVALID, f"release: calbin {path}: {exc.strerror}") from None
    return h.hexdigest()


def _read_url(req: urllib.request.Request | str) -> bytes:
    with urllib.request.urlopen(req, timeout=30) as resp:
        return bytes(resp.read())


def _off_loop(fn: Any) -> Any:
    """Run a blocking call in gevent's thread pool: the loop (and the self-watch, which
    would otherwise see a stalled client) keeps running meanwhile."""
    return gevent.get_hub().threadpool.apply(fn)


def _get_bytes(url: str) -> bytes:
    return bytes(_off_loop(lambda: _read_url(url)))


# ------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", required=True, help="run manifest YAML")
    p.add_argument("--matrix", help="matrix YAML (default: the manifest's `matrix`)")
    p.add_argument("--golden", help="golden set YAML (token hashes of greedy outputs)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run_id>)")
    p.add_argument("--url", help="target URL (default: the manifest's target.url)")
    p.add_argument("--seed", type=int, default=0, help="seed of the cell order and schedules")
    p.add_argument("--baseline-run", help="a baseline run folder to compare with")
    p.add_argument(
        "--rules", help="acceptance rules YAML (default: configs/acceptance/default.yaml)"
    )
    p.add_argument("--calbin", help="the calbin file: its sha256 must match the manifest")
    p.add_argument("--idle-window-s", type=float, default=300.0, help="stable window, s")
    p.add_argument("--idle-timeout-s", type=float, default=1800.0, help="give up waiting, s")
    p.add_argument("--idle-gap-s", type=float, default=2.0, help="pause between cells, s")
    p.add_argument(
        "--min-repetitions", type=int,
        help="rehearsals only: cap repetitions per cell below §8's 30/100 (flagged in the plan)",
    )  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    p.add_argument("--skip-report", action="store_true", help="no HTML report")
    p.add_argument(  # issue 8: the fault matrix step
        "--faults",
        help="fault scenarios (a file or folder, e.g. configs/faults): run the "
        "fault matrix after the matrix, before golden after (needs CALCULET_ADMIN_TOKEN)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    matrix = args.matrix
    if matrix is None:
        try:
            matrix = load_manifest(args.manifest).matrix
        except ManifestError as exc:
            print(exc, file=sys.stderr)
            return EXIT_INVALID
    opts = Options(
        manifest=args.manifest,
        matrix=matrix,
        golden=args.golden,
        run_dir=args.run_dir,
        url=args.url,
        seed=args.seed,
        baseline_run=args.baseline_run,
        rules=args.rules,
        calbin=args.calbin,
        admin_token=os.environ.get("CALCULET_ADMIN_TOKEN"),
        idle_window_s=args.idle_window_s,
        idle_timeout_s=args.idle_timeout_s,
        idle_gap_s=args.idle_gap_s,
        min_repetitions=args.min_repetitions,
        resume=args.resume,
        skip_report=args.skip_report,
        progress=not args.quiet,
        extra={"faults": args.faults},  # issue 8: the fault matrix step
    )
    try:
        pipeline = Pipeline(opts)
    except Stop as stop:
        print(f"accept: {stop}", file=sys.stderr)
        return stop.code
    except MixError as exc:
        print(f"accept: {exc}", file=sys.stderr)
        return EXIT_INVALID
    code = pipeline.run()
    for note in pipeline.notes:
        print(f"note: {note}")
    print(f"accept: exit {code}; run folder {pipeline.run_dir}")
    return code
