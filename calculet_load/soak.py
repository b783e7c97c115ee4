"""`calculet-load soak --stage NAME`: the stability stages of spec §13 as data.

A stage (`configs/soak/<name>.yaml`, schema below) says how long it runs, what load
(open loop at a fraction of the target rate, or closed loop; a mix or one shape), the
periodic bursts, how often the server is sampled, and its pass conditions. Durations and
rates are the *target's* seconds: against a simulator started with `--time-scale F` the
stage runs F times as long in real time at 1/F times the rate (`--time-scale-hint`, or
the `time_scale` of `/admin/state`). `--duration-scale D` shortens a stage for a
rehearsal (D < 1); it is recorded in `soak.json` and flagged.

During the run (not only at the end):
  - server resources every `sampling.resources_every_s` into `server/resources.jsonl`
    (calculet_load.resources: /metrics and /admin/state);
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
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Literal

import gevent
import gevent.pool
import psutil
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from calculet_load.arrivals import RateClock, Schedule
from calculet_load.client import Timeouts, run_in_greenlet
from calculet_load.matrix import MatrixError, load_golden
from calculet_load.mixes import MixError, load_mix, single
from calculet_load.schema.manifest import ManifestError, load_manifest
from calculet_load.selfwatch import TIMER_SLACK_S, SelfWatch
from calculet_load.session import RequestSpec, RunContext, Session, golden_spec
from calculet_load.sink import PartSink
from calculet_load.targetapi import TargetAPI, off_loop, time_scale
from calculet_load.workload import Prompt, PromptFactory, http_tokenizer

SOAK_SCHEMA = "calculet-soak-stage/v1"
STAGE_DIR = Path(__file__).resolve().parents[1] / "configs" / "soak"
EXIT_OK, EXIT_FAIL, EXIT_INVALID, EXIT_INFRA = 0, 1, 2, 3
MIN_SAMPLE_S = 0.5  # real seconds between two samples of one kind, at the least
MIN_CLIENT_SAMPLES = 20  # client RSS samples needed to judge its slope
# ... and the real seconds they must span after the warmup: a process' own warmup
# (imports, connection pool, Parquet writer, allocator arenas) takes seconds of real time
# whatever the stage, and a per-hour slope over less is that warmup, not a trend
MIN_CLIENT_SPAN_S = 30.0
STATE_SCHEMA = "calculet-soak-state/v1"
STATE_FILE = "soak/state.json"
TERM_DRAIN_S = 15.0  # after SIGTERM: real seconds the requests in flight get to finish
EXIT_TERM = 128 + signal.SIGTERM
TRACE_KINDS = ("server_events", "steps", "device")


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SoakLoad(_M):
    kind: Literal["open", "closed"] = "open"
    arrival: Literal["poisson", "constant", "gamma"] = "poisson"
    rate_fraction: float = Field(default=1.0, gt=0)  # of the stage's target rate
    concurrency: int = Field(default=1, ge=1)  # closed loop
    mix: str | None = None  # a mix (configs/mixes) instead of one shape
    prompt_tokens: int = Field(default=128, ge=1, le=40959)
    max_tokens: int = Field(default=32, ge=1)
    stream: bool = True
    max_in_flight: int = Field(default=256, ge=1)
    # connections opened before the load starts: the server's FD count then measures
    # the server, not the client's connection pool filling up
    prewarm_connections: int = Field(default=32, ge=0)


class Bursts(_M):
    every_s: float = Field(gt=0)  # target seconds between bursts
    size: int = Field(ge=1)
    prompt_tokens: int = Field(default=128, ge=1, le=40959)
    max_tokens: int = Field(default=32, ge=1)


class Sampling(_M):
    resources_every_s: float = Field(default=10.0, gt=0)  # target seconds
    traces_every_s: float = Field(default=60.0, gt=0)
    client_every_s: float = Field(default=10.0, gt=0)


class PassConditions(_M):
    max_error_rate: float = Field(default=0.0, ge=0, le=1)
    no_leak: bool = True  # the analysis' leak rule (server/resources.jsonl) passes
    max_request_s: float = Field(default=900.0, gt=0)  # target seconds: longer is a hang
    no_abort: bool = True  # /health answers 200 at every sample
    golden: bool = False  # the golden set before and after (needs --golden)
    # client RSS growth above this (MiB per hour of real time, Theil–Sen) fails
    client_rss_max_slope_mib_per_h: float | None = Field(default=256.0, ge=0)
    analysis: bool = True  # `calculet-load analyze` must exit 0


class SoakStage(_M):
    schema_: Literal["calculet-soak-stage/v1"] = Field(alias="schema")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    title: str = Field(min_length=1)
    spec: str = ""  # what spec §13 asks of the stage
    duration_s: float = Field(gt=0)  # target seconds
    target_rate_qps: float = Field(default=1.0, gt=0)  # the target load; --target-rate
    load: SoakLoad = Field(default_factory=SoakLoad)
    bursts: Bursts | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    pass_: PassConditions = Field(default_factory=PassConditions, alias="pass")
    rules: str | None = None  # acceptance rules for the analysis (default: the default)


class StageError(ValueError):
    pass


def load_stage(name_or_path: str) -> SoakStage:
    p = Path(name_or_path)
    if not p.exists():
        p = STAGE_DIR / f"{name_or_path}.yaml"
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError:
        known = sorted(x.stem for x in STAGE_DIR.glob("*.yaml"))
        raise StageError(f"stage {name_or_path!r}: no such file; known stages {known}") from None
    except yaml.YAMLError:
        raise StageError(f"{p}: invalid YAML") from None
    try:
        return SoakStage.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise StageError(f"{p}: {where}: {err['msg']}") from None


def stage_json_schema() -> dict[str, Any]:
    return SoakStage.model_json_schema(by_alias=True)


class _JsonLines:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, separators=(",", ":"), default=str) + "\n")


def _boot_id() -> str | None:
    """This boot of the host (a monotonic clock is only comparable within one boot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Is `pid` a running calculet-load soak (not a reused pid)?"""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and "soak" in proc.cmdline()
    except (psutil.Error, OSError):
        return False


def _repair_tail(path: Path) -> int:
    """Cut a line left half-written by a killed process (appending after it would make a
    line that is not JSON); the bytes dropped."""
    try:
        with path.open("rb+") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return 0
            pos = size
            while pos > 0:
                step = min(65536, pos)
                f.seek(pos - step)
                chunk = f.read(step)
                nl = chunk.rfind(b"\n")
                if nl != -1:
                    keep = pos - step + nl + 1
                    break
                pos -= step
            else:
                keep = 0
            if keep < size:
                f.truncate(keep)
            return size - keep
    except FileNotFoundError:
        return 0


def _last_row(path: Path, worker: str | None = None) -> dict[str, Any] | None:
    """The last JSON row of a JSONL file (of `worker`, when rows name one)."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and (worker is None or row.get("worker", "w00") == worker):
            return row
    return None


def _iso(wall_ns: int | None) -> str | None:
    if wall_ns is None:
        return None
    t = wall_ns / 1e9
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stage = load_stage(args.stage)
        self.manifest = load_manifest(args.manifest)
        target = self.manifest.target
        self.url = (args.url or (target.url if target else "")).rstrip("/")
        if not self.url:
            raise StageError("target: no --url and no target.url in the manifest")
        self.protocol = target.protocol if target else "llama"
        self.model = target.model if target else None
        self.token = os.environ.get("CALCULET_ADMIN_TOKEN")
        self.state: dict[str, Any] | None = None
        if args.resume:
            if args.run_dir and Path(args.run_dir).resolve() != Path(args.resume).resolve():
                raise StageError("--run-dir and --resume name different folders")
            self.run_dir = Path(args.resume)
            self.state = self._resumable_state()
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
        self.api = TargetAPI(self.url, self.token, operator="calculet-load-soak")
        st = self.stage
        if st.pass_.golden and self.golden is None:
            raise StageError(f"stage {st.name}: pass.golden needs --golden FILE")
        self.mix = load_mix(st.load.mix) if st.load.mix else None
        self.counts: dict[str, int] = {"sent": 0, "ok": 0, "errors": 0, "dropped": 0}
        self.notes: list[str] = []
        self.terminating: int | None = None  # the signal that stopped the run
        self.senders = gevent.pool.Group()  # every greenlet that sends requests
        self.plan: dict[str, Any] = {}
        self.t_start = self.t_end = float("inf")  # monotonic s: the stage's planned start, end

    def say(self, text: str) -> None:
        if not self.args.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    # ------------------------------------------------------------------ resuming
    def _resumable_state(self) -> dict[str, Any]:
        path = self.run_dir / STATE_FILE
        try:
            state: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError:
            raise StageError(f"--resume {self.run_dir}: no {STATE_FILE}: not a soak run") from None
        except ValueError:
            raise StageError(f"--resume: {path}: invalid JSON") from None
        if state.get("schema") != STATE_SCHEMA:
            raise StageError(
                f"--resume: {path}: schema {state.get('schema')!r}, not {STATE_SCHEMA}"
            )
        if state.get("stage") != self.stage.name:
            raise StageError(
                f"--resume: {self.run_dir} runs stage {state.get('stage')!r}, not "
                f"{self.stage.name!r}"
            )
        if state.get("run_id") != self.manifest.run_id:
            raise StageError(
                f"--resume: {self.run_dir} is run {state.get('run_id')!r}; the manifest says "
                f"{self.manifest.run_id!r}"
            )
        if state.get("status") == "done":
            raise StageError(f"--resume: {self.run_dir} has finished already (soak.json)")
        prev = (state.get("attempts") or [None])[-1]
        if (
            prev is not None
            and prev.get("boot_id") == _boot_id()
            and prev.get("host") == socket.gethostname()
            and prev.get("pid") != os.getpid()
            and _alive(int(prev["pid"]))
        ):
            raise StageError(
                f"--resume: the soak of {self.run_dir} is still running (pid {prev['pid']})"
            )
        return state

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
        path = self.run_dir / STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.write(json.dumps(self.state, indent=1, default=str))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)

    def _event(self, status: str, **detail: Any) -> None:
        """A row of the run's `events.jsonl` (the format of `accept`'s event log)."""
        self.events.write({"wall_ns": time.time_ns(), "step": "soak", "status": status,
                           "worker": self.worker, **detail})  # fmt: skip

    def _repair_files(self) -> dict[str, int]:
        """Cut lines half-written at the kill, in every file this run appends to."""
        cut = {}
        names = ["events.jsonl", "soak/health.jsonl", "client/resources.jsonl",
                 "server/resources.jsonl"] + [f"server/{k}.jsonl" for k in TRACE_KINDS]  # fmt: skip
        for name in names:
            n = _repair_tail(self.run_dir / name)
            if n:
                cut[name] = n
        return cut

    def _gap(self, prev: dict[str, Any]) -> dict[str, Any] | None:
        """The gap the previous attempt left: from its last record or sample to now."""
        assert self.state is not None
        if prev.get("status") == "running":  # it never wrote its end: it died
            prev["status"] = "killed"
        if "planned_end_wall_ns" not in self.state:
            self.notes.append(
                f"attempt {prev['worker']} stopped before the load started: the stage started over"
            )
            return None
        if self.state.get("status") == "judging":
            self.notes.append(f"attempt {prev['worker']} stopped after the load: judged again")
            return None
        w = prev["worker"]
        evidence: dict[str, int] = {"attempt start": int(prev["started_wall_ns"])}
        for label, path, worker in (
            ("client sample", self.run_dir / "client" / "resources.jsonl", w),
            ("health sample", self.run_dir / "soak" / "health.jsonl", None),
            ("server resource sample", self.run_dir / "server" / "resources.jsonl", None),
        ):
            row = _last_row(path, worker)
            if row is not None and isinstance(row.get("wall_ns"), int):
                evidence[label] = row["wall_ns"]
        if prev.get("ended_wall_ns"):
            evidence["clean stop"] = int(prev["ended_wall_ns"])
        start_by, start = max(evidence.items(), key=lambda kv: kv[1])
        resumed = time.time_ns()
        planned_end = int(self.state["planned_end_wall_ns"])
        end = max(start, min(resumed, planned_end))
        on_disk = self._disk_counts(workers={w})
        last = _last_row(self.run_dir / "client" / "resources.jsonl", w) or {}
        if prev.get("status") == "terminated":
            reason = f"client stopped by {prev.get('signal', 'a signal')} (flushed, resumable)"
            lost: dict[str, Any] = {"open_part_lost": False, "requests_on_disk": on_disk["records"]}
        else:
            if prev.get("boot_id") not in (None, _boot_id()):
                reason = "host rebooted: the client process died with it (no clean stop)"
            else:
                reason = "client process died without a clean stop (SIGKILL, OOM kill or crash)"
            sent_last = int(last.get("sent", 0))
            lost = {
                "open_part_lost": True,
                "lost_requests": "unknown",
                "requests_on_disk": on_disk["records"],
                "sent_at_last_sample": sent_last,
                "lost_requests_at_least": max(0, sent_last - on_disk["sent"]),
                "in_flight_at_last_sample": int(last.get("in_flight", 0)),
            }
        prev.setdefault("ended_wall_ns", start)
        gap = {
            "index": len(self.state["gaps"]) + 1,
            "start_wall_ns": start,
            "end_wall_ns": end,
            "resumed_wall_ns": resumed,
            "start": _iso(start),
            "end": _iso(end),
            "duration_s": round((end - start) / 1e9, 3),
            "duration_target_s": round((end - start) / 1e9 / self.scale, 3),
            "start_evidence": start_by,
            "reason": reason,
            "before_worker": w,
            "after_worker": self.worker,
            **lost,
        }
        if resumed > planned_end:
            gap["note"] = "resumed after the stage's planned end: the rest of the stage is lost"
        return gap

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        repaired = self._repair_files() if self.state is not None else {}
        attempts = self.state["attempts"] if self.state is not None else []
        self.worker = "w00" if not attempts else f"w00-r{len(attempts)}"
        self.events = _JsonLines(self.run_dir / "events.jsonl")
        if repaired:
            self.notes.append(f"cut half-written lines left by the killed process: {repaired}")
        if self.state is None:
            (self.run_dir / "manifest.yaml").write_text(Path(self.args.manifest).read_text())
        from calculet_load.clock import clock_provenance

        self.attempt: dict[str, Any] = {
            "worker": self.worker,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "started_wall_ns": time.time_ns(),
            "status": "running",
            **clock_provenance(),
        }
        self.ctx = RunContext.from_manifest(self.manifest, self.worker)
        self.sink = PartSink(str(self.run_dir), self.worker)
        timeout = self.manifest.timeout_s
        self.session = Session(
            self.ctx,
            self.url,
            self.protocol,
            model=self.model,
            max_in_flight=4096,
            timeouts=Timeouts(connect_s=min(10.0, timeout), total_s=timeout, first_byte_s=timeout),
            sink=self.sink,
        )
        self.session.hooks.append(self._count)
        tokenize = http_tokenizer(self.url)
        self.factory = PromptFactory(
            lambda body: off_loop(lambda: tokenize(body)),
            mode="chat" if self.protocol == "openai-chat" else "ids",
        )
        self.prompts: dict[tuple[int, int], Prompt] = {}
        self.watch = SelfWatch(self.sink, self.worker, in_flight=lambda: self.session.in_flight)
        code = EXIT_OK
        try:
            code = run_in_greenlet(self._run)
        finally:
            self.session.close()
            self.sink.close()
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
        gevent.spawn_later(TERM_DRAIN_S, self.senders.kill, block=False)

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
        try:
            status, health = self.api.health()
        except OSError as exc:
            self.say(f"soak: target {self.url} unreachable: {exc}")
            return EXIT_INFRA
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
            self.state = {"schema": STATE_SCHEMA, "stage": st.name, "run_id": self.manifest.run_id,
                          "options": self.opts, "time_scale": self.scale, "status": "starting",
                          "attempts": [], "gaps": []}  # fmt: skip
        else:
            self.scale = float(self.state["time_scale"])
            self.plan = self.state["plan"]
            self.notes = list(self.state.get("notes") or []) + self.notes
            prev = self.state["attempts"][-1] if self.state["attempts"] else None
            gap = self._gap(prev) if prev is not None else None
            if gap is not None:
                self.state["gaps"].append(gap)
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
        if self.golden and "golden_before" not in self.state:
            self.state["golden_before"] = self._golden("before")
            self._save_state()
        if self.terminating is not None:
            return self._stop()
        warm = st.load.prewarm_connections + (st.bursts.size if st.bursts else 0)
        prewarmed = self.session.pool.prewarm(
            min(warm, st.load.max_in_flight + (st.bursts.size if st.bursts else 0))
        )
        self.plan.setdefault("prewarmed_connections", prewarmed)
        self.plan["prompts_prebuilt"] = self._prebuild_prompts()
        self.watch.start()
        from calculet_load.resources import ResourceSampler

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
            self.plan["planned_end"] = _iso(self.state["planned_end_wall_ns"])
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
            self.watch.stop()
            sampler.stop()
            self._collect_traces(final=True)
            self._client_sample()
        if self.terminating is not None:
            return self._stop()
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
        code = self._judge(self.state.get("golden_before"), golden_after)
        self.state["status"] = "done"
        self._save_state()
        self._event("end", code=code)
        return code

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
    def _prompt(self, tokens: int, sample: int) -> Prompt:
        key = (tokens, sample)
        if key not in self.prompts:
            self.prompts[key] = self.factory.prompt(tokens, sample)
        return self.prompts[key]

    def _spec(self, k: int, chooser: Any, **kw: Any) -> RequestSpec:
        entry, sample = chooser.entry_for(k)
        return RequestSpec(
            prompt=self._prompt(entry.prompt_tokens, sample),
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
                    self._prompt(entry.prompt_tokens, sample)
        return len(self.prompts)

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
        sched = Schedule(ld.arrival, self._seed(), clock)
        pool = gevent.pool.Pool(ld.max_in_flight)
        origin = time.monotonic_ns() + 200_000_000
        while True:
            nxt = sched.next_for(0)
            if nxt is None:
                break
            k, unit = nxt
            t = clock.time_of(unit)
            assert t is not None
            due = origin + t
            if due / 1e9 >= self.t_end:
                break
            spec = self._spec(
                k, chooser, arrival=ld.arrival, intended_start_ns=due, late_after_ms=5.0
            )
            remaining = (due - time.monotonic_ns()) / 1e9
            if remaining > TIMER_SLACK_S:
                gevent.sleep(remaining - TIMER_SLACK_S)
            while time.monotonic_ns() < due:
                gevent.sleep(0)
            if due / 1e9 >= self.t_end:  # stopped (SIGTERM) while waiting
                break
            if pool.full():
                self.session.record_dropped(spec, f"in-flight cap {ld.max_in_flight} full")
            else:
                self.senders.add(pool.spawn(self.session.send, spec))
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
            self._client_rows = _JsonLines(self.run_dir / "client" / "resources.jsonl")
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
        rows = _JsonLines(self.run_dir / "soak" / "health.jsonl")
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
            prompt = self._prompt(case.prompt_tokens, case.sample)
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

    def _write_index(self, status: str) -> None:
        """`client/index.json`: every attempt is a worker. A killed one's part open at the
        kill is lost (`open_part_lost`); the gap is in soak.json."""
        assert self.state is not None
        client = self.run_dir / "client"
        workers = []
        keys = ("ntp_offset_ns", "ntp_source", "ntp_synchronized", "ntp_detail", "clock_anchor")
        for a in self.state["attempts"]:
            w = a["worker"]
            entry = {
                "worker": w,
                "host": a.get("host"),
                "pid": a.get("pid"),
                "status": "reported" if a.get("status") == "finished" else "interrupted",
                "attempt_status": a.get("status"),
                "parts": sorted(p.name for p in (client / w).glob("part-*.parquet")),
                **{k: a[k] for k in keys if k in a},
            }
            if a.get("status") == "killed":
                entry["open_part_lost"] = True
            workers.append(entry)
        index = {
            "schema": "calculet-client-index/v1",
            "run_id": self.manifest.run_id,
            "status": status,
            "source": f"calculet-load soak --stage {self.stage.name}",
            "target": self.url,
            "workers": workers,
            "gaps": self.state["gaps"],
        }
        (client / "index.json").write_text(json.dumps(index, indent=1, default=str))

    def _disk_counts(self, workers: set[str] | None = None) -> dict[str, Any]:
        """Counts of the records on disk (every attempt's closed parts)."""
        import numpy as np
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        cols = ["ext.worker", "ext.dropped", "ext.error_class", "result.http_status",
                "result.error_code", "client_ns.request_start", "client_ns.response_end",
                "client_ns.last_token", "client_ns.first_event"]  # fmt: skip
        out: dict[str, Any] = {"records": 0, "sent": 0, "ok": 0, "errors": 0, "dropped": 0,
                               "cut_at_stop": 0, "errors_by": {}, "longest_real_s": 0.0,
                               "by_worker": {}}  # fmt: skip
        for part in sorted((self.run_dir / "client").glob("*/part-*.requests.parquet")):
            if workers is not None and part.parent.name not in workers:
                continue
            t = pq.read_table(part, columns=cols)
            n = t.num_rows
            dropped = np.asarray(pc.fill_null(t.column("ext.dropped"), False), dtype=bool)
            cls = t.column("ext.error_class").to_pylist()
            ok = np.array([c is None for c in cls], dtype=bool)
            cut = np.array([c == "cancelled" for c in cls], dtype=bool)
            err = ~ok & ~dropped & ~cut
            out["records"] += n
            out["dropped"] += int(dropped.sum())
            out["sent"] += int((~dropped).sum())
            out["ok"] += int(ok.sum())
            out["cut_at_stop"] += int(cut.sum())
            out["errors"] += int(err.sum())
            if err.any():
                st_, code = (
                    t.column("result.http_status").to_pylist(),
                    t.column("result.error_code").to_pylist(),
                )
                for i in np.flatnonzero(err):
                    key = f"{st_[i]}:{code[i]}"
                    out["errors_by"][key] = out["errors_by"].get(key, 0) + 1
            start = t.column("client_ns.request_start").to_numpy(zero_copy_only=False)
            end = None
            for name in ("client_ns.response_end", "client_ns.last_token",
                         "client_ns.first_event"):  # fmt: skip
                col = t.column(name).to_numpy(zero_copy_only=False)
                end = col if end is None else np.where(np.isnan(end.astype(float)), col, end)
            if end is not None and n:
                d = (end.astype(float) - start.astype(float)) / 1e9
                d = d[~np.isnan(d)]
                if d.size:
                    out["longest_real_s"] = max(out["longest_real_s"], float(d.max()))
            w = part.parent.name
            out["by_worker"][w] = out["by_worker"].get(w, 0) + n
        out["longest_real_s"] = round(out["longest_real_s"], 3)
        return out

    # ------------------------------------------------------------------ verdict
    def _judge(
        self, golden_before: dict[str, Any] | None, golden_after: dict[str, Any] | None
    ) -> int:
        """The stage's conditions. Each has a class: `target` (the service under test,
        exit 1), `client` (this load generator's own flatness, exit 1, as the stage asks
        for it) or `infrastructure` (the measurement itself: exit 3 when nothing else
        failed)."""
        assert self.state is not None
        st = self.stage
        p = st.pass_
        gaps: list[dict[str, Any]] = self.state["gaps"]
        attempts: list[dict[str, Any]] = self.state["attempts"]
        conditions: list[dict[str, Any]] = []

        def cond(name: str, cls: str, ok: bool | None, expected: Any, observed: Any) -> None:
            conditions.append({"condition": name, "class": cls, "ok": ok,
                               "expected": expected, "observed": observed})  # fmt: skip

        counts = self._disk_counts()
        unknown = [
            {"worker": g["before_worker"], "lost_requests_at_least": g["lost_requests_at_least"],
             "in_flight_at_last_sample": g["in_flight_at_last_sample"]}
            for g in gaps if g.get("open_part_lost")
        ]  # fmt: skip
        sent = counts["sent"]
        rate = counts["errors"] / sent if sent else 0.0
        observed: dict[str, Any] = {"rate": round(rate, 6), "errors": counts["errors_by"],
                                    **{k: counts[k] for k in ("sent", "ok", "errors", "dropped",
                                                              "cut_at_stop")}}  # fmt: skip
        if unknown:
            observed["not_on_disk"] = unknown  # lost with a killed attempt's open part
        cond("error rate", "target", rate <= p.max_error_rate, f"<= {p.max_error_rate:g}",
             observed)  # fmt: skip
        hang_limit = p.max_request_s * self.scale
        hung = int(self.plan.get("hung_at_end", 0))
        observed = {"longest_real_s": counts["longest_real_s"], "in_flight_at_end": hung}
        if unknown:
            observed["outcome_unknown"] = unknown
        cond(
            "no hang",
            "target",
            counts["longest_real_s"] <= hang_limit + 1.0 and hung == 0,
            f"every request ends within {p.max_request_s:g} target s, none left in flight",
            observed,
        )
        if p.no_abort:
            health = _jsonl(self.run_dir / "soak" / "health.jsonl")
            failures = [r for r in health if r.get("status") != 200]
            observed = {"samples": len(health), "failures": len(failures), "first": failures[:3]}
            if gaps:
                observed["unsampled"] = [
                    {"from": g["start"], "to": g["end"], "duration_s": g["duration_s"]}
                    for g in gaps
                ]
            cond("no abort", "target", not failures,
                 "/health 200 at every sample (the target's own samples; none in a gap)",
                 observed)  # fmt: skip
        if p.golden:
            fails = (golden_before or {}).get("failures", []) + (golden_after or {}).get(
                "failures", []
            )
            cond("golden before and after", "target", not fails, "every case matches",
                 fails or "all match")  # fmt: skip
        if p.client_rss_max_slope_mib_per_h is not None:
            gate = p.client_rss_max_slope_mib_per_h
            client = _client_slopes(self.run_dir / "client" / "resources.jsonl")
            slopes = [s["slope_mib_per_h"] for s in client["segments"]
                      if s.get("slope_mib_per_h") is not None]  # fmt: skip
            observed = client["segments"][0] if len(client["segments"]) == 1 else client
            cond("client memory flat", "client", all(s <= gate for s in slopes) if slopes else None,
                 f"RSS slope <= {gate:g} MiB/h"
                 + (" in each client process (not joined across a restart)" if gaps else ""),
                 observed)  # fmt: skip
        analysis_code, leaks = self._analysis()
        if p.no_leak:
            cond("no leak", "target", *self._leak_condition(leaks, attempts, gaps))
        if p.analysis:
            cls = "infrastructure" if analysis_code in (EXIT_INVALID, EXIT_INFRA) else "target"
            cond("analysis", cls, analysis_code == 0 if analysis_code is not None else None,
                 "calculet-load analyze exits 0", {"exit_code": analysis_code})  # fmt: skip
        planned = float(self.plan["run_duration_real_s"])
        gap_s = sum(g["duration_s"] for g in gaps)
        cond(
            "client continuity",
            "infrastructure",
            not gaps,
            "one client process ran the whole stage (no restart, no gap)",
            {"attempts": [a["worker"] for a in attempts], "gaps": len(gaps),
             "gap_real_s": round(gap_s, 3), "coverage": round(max(0.0, 1 - gap_s / planned), 4),
             "detail": [{k: g[k] for k in ("start", "end", "duration_s", "reason")}
                        for g in gaps]},
        )  # fmt: skip
        failed = {c["class"] for c in conditions if c["ok"] is False}
        if failed & {"target", "client"}:
            code, verdict = EXIT_FAIL, "FAIL"
        elif "infrastructure" in failed:
            code, verdict = EXIT_INFRA, "INCOMPLETE" if gaps else "INVALID"
        else:
            code, verdict = EXIT_OK, "PASS"
        if any(c["ok"] is None for c in conditions) and code == EXIT_OK:
            self.notes.append("some conditions could not be evaluated (see soak.json)")
        if gaps:
            self.notes.append(
                f"{len(gaps)} gap(s) in the stage ({gap_s:.1f} s real, "
                f"{gap_s / planned:.1%} of it): the client restarted; the target's conditions "
                "are judged from its own samples, the run is not a clean pass"
            )
        doc = {**self.plan, "verdict": verdict, "exit_code": code, "conditions": conditions,
               "gaps": gaps, "attempts": [{k: a.get(k) for k in (
                   "worker", "pid", "host", "status", "started_wall_ns", "ended_wall_ns",
                   "load_ended_wall_ns", "loaded_real_s", "signal")} for a in attempts],
               "planned_start_wall_ns": self.state.get("planned_start_wall_ns"),
               "planned_end_wall_ns": self.state.get("planned_end_wall_ns"),
               "notes": self.notes}  # fmt: skip
        (self.run_dir / "soak.json").write_text(json.dumps(doc, indent=1, default=str))
        self.say(f"soak {st.name}: {verdict} (exit {code})")
        for g in gaps:
            self.say(
                f"  GAP  {g['index']}: {g['start']} .. {g['end']} ({g['duration_s']:.1f} s real, "
                f"{g['duration_target_s']:.0f} target s): {g['reason']}"
            )
        for c in conditions:
            mark = {True: "ok  ", False: "FAIL", None: "n/a "}[c["ok"]]
            self.say(f"  {mark} {c['condition']}: {json.dumps(c['observed'], default=str)[:240]}")
        return code

    def _leak_condition(
        self,
        leaks: dict[str, Any] | None,
        attempts: list[dict[str, Any]],
        gaps: list[dict[str, Any]],
    ) -> tuple[bool | None, str, dict[str, Any]]:
        """No leak: the analysis' leak section over the whole series; with gaps, also per
        segment (each client process' stretch of samples), and the whole series only
        where the samples' monotonic clocks are comparable (one boot of the host)."""
        rows = [
            {"series": k, "status": v.get("status"), "slope_per_h": v.get("slope_per_h"),
             "reason": v.get("reason")}
            for k, v in (leaks or {}).get("series", {}).items()
            if v.get("status") not in (None, "not_configured", "no_data")
        ]  # fmt: skip
        expected = "no resource series with a significant growth above its gate"
        observed: dict[str, Any] = {"resource_samples": (leaks or {}).get("samples", 0)}
        if not gaps:
            leaking = [r for r in rows if r["status"] == "leak"]
            observed.update(leaking=leaking, series=rows)
            return (not leaking if rows else None), expected, observed
        boots = {a.get("boot_id") for a in attempts}
        comparable = len(boots) == 1 and None not in boots
        joined = [r for r in rows if r["status"] == "leak"] if comparable else []
        segments = self._leak_segments(attempts)
        seg_leaks = [
            {"worker": s["worker"], **r} for s in segments for r in s["series"]
            if r["status"] == "leak"
        ]  # fmt: skip
        judged = (comparable and bool(rows)) or any(
            r["status"] in ("leak", "no_leak") for s in segments for r in s["series"]
        )
        observed.update(
            leaking=joined + seg_leaks,
            joined={
                "series": rows if comparable else [],
                "note": f"joined across {len(gaps)} gap(s): no samples in a gap, and no load"
                if comparable
                else "not judged: the host rebooted, the samples' clocks are not comparable",
            },
            segments=segments,
        )
        expected += " (per segment between gaps, and over the joined series)"
        ok = not (joined or seg_leaks) if judged else None
        return ok, expected, observed

    def _leak_segments(self, attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The leak rule on each attempt's stretch of server/resources.jsonl."""
        try:
            import numpy as np
            import pyarrow as pa

            from analysis.leaks import detect_leak
            from analysis.resources import LEAK_SERIES, resource_series
            from analysis.rules import load_rules
        except ImportError:
            return []
        rules, _ = load_rules(self.opts["rules"] or self.stage.rules)
        rule = next((r for r in rules.rules if r.kind == "leaks" and r.enabled), None)
        if rule is None:
            return []
        rows = _jsonl(self.run_dir / "server" / "resources.jsonl")
        starts = [int(a["started_wall_ns"]) for a in attempts] + [2**63]
        out = []
        for i, a in enumerate(attempts):
            seg = [r for r in rows if starts[i] <= int(r.get("wall_ns", 0)) < starts[i + 1]]
            if not seg:
                continue
            t_s, series, _ = resource_series(pa.Table.from_pylist(seg))
            entry: dict[str, Any] = {
                "worker": a["worker"],
                "from": _iso(int(seg[0]["wall_ns"])),
                "to": _iso(int(seg[-1]["wall_ns"])),
                "samples": len(seg),
                "span_server_s": round(float(t_s[-1]), 1) if len(t_s) else 0.0,
                "series": [],
            }
            for name, gate in rule.min_slope_per_h.items():
                y = series.get(name)
                if y is None or not (~np.isnan(y)).any():
                    continue
                ok = ~np.isnan(y)
                res = detect_leak(t_s[ok], y[ok], min_slope_per_h=gate, warmup_s=rule.warmup_s,
                                  bin_s=rule.bin_s, alpha=rule.alpha, unit=LEAK_SERIES[name],
                                  resource=name)  # fmt: skip
                entry["series"].append(
                    {"series": name, "status": str(res.status),
                     "slope_per_h": res.slope_per_h, "reason": res.reason}
                )  # fmt: skip
            out.append(entry)
        return out

    def _analysis(self) -> tuple[int | None, dict[str, Any] | None]:
        try:
            from analysis.cli import analyze_run
        except ImportError:
            self.notes.append("analysis: not available in this build")
            return None, None
        rules = self.opts["rules"] or self.stage.rules
        run = functools.partial(analyze_run, str(self.run_dir), rules=rules, quiet=True)
        code = int(off_loop(run))
        verdict = self.run_dir / "verdict.json"
        leaks = None
        if verdict.exists():
            doc = json.loads(verdict.read_text())
            leaks = doc.get("leaks")
        return code, leaks


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def _client_slope(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Theil–Sen slope of one client process' RSS (MiB per real hour), after a 10%
    warmup."""
    if len(rows) < MIN_CLIENT_SAMPLES:
        return {"samples": len(rows), "slope_mib_per_h": None,
                "reason": f"fewer than {MIN_CLIENT_SAMPLES} samples: not judged"}  # fmt: skip
    from scipy import stats

    t = [(r["mono_ns"] - rows[0]["mono_ns"]) / 1e9 for r in rows]
    y = [r["rss_bytes"] / 2**20 for r in rows]
    keep = [i for i, ti in enumerate(t) if ti >= 0.1 * t[-1]]
    out: dict[str, Any] = {
        "samples": len(rows),
        "span_real_s": round(t[-1], 1),
        "first_mib": round(y[0], 1),
        "last_mib": round(y[-1], 1),
        "max_mib": round(max(y), 1),
    }
    if t[-1] - t[keep[0]] < MIN_CLIENT_SPAN_S:
        out["slope_mib_per_h"] = None
        out["reason"] = (
            f"{t[-1] - t[keep[0]]:.1f} s after the warmup, under {MIN_CLIENT_SPAN_S:g} s of "
            "real time: not judged (the process' own warmup would be taken for a trend)"
        )
        return out
    fit = stats.theilslopes([y[i] for i in keep], [t[i] for i in keep])
    out["slope_mib_per_h"] = round(float(fit.slope) * 3600.0, 3)
    return out


def _client_slopes(path: Path) -> dict[str, Any]:
    """The RSS slope of each client process (attempt) separately: a restarted process
    starts small, and joining it to the killed one would fake a drop or a rise."""
    rows = _jsonl(path)
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(str(r.get("worker", "w00")), []).append(r)
    segments = [{"worker": w, **_client_slope(rs)} for w, rs in by.items()]
    if not segments:
        segments = [{"worker": None, **_client_slope([])}]
    return {"samples": len(rows), "segments": segments}


# ---------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stage",
        required=True,
        help="stage name (configs/soak/NAME.yaml: smoke, dev, candidate, release, "
        "endurance) or a stage file",
    )
    p.add_argument("--manifest", required=True, help="run manifest YAML")
    p.add_argument("--url", help="target URL (default: the manifest's target.url)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run_id>-soak-<stage>)")
    p.add_argument("--golden", help="golden set YAML (before and after the stage)")
    p.add_argument(
        "--target-rate",
        type=float,
        help="the target load in requests per target second (default: the stage's)",
    )
    p.add_argument(
        "--time-scale-hint",
        type=float,
        help="real seconds per target second (default: /admin/state time_scale, else 1)",
    )
    p.add_argument(
        "--duration-scale",
        type=float,
        help="shorten (< 1) the stage for a rehearsal; recorded in soak.json (default 1)",
    )
    p.add_argument(
        "--rules", help="acceptance rules for the analysis (default: the stage's, else the default)"
    )
    p.add_argument("--seed", type=int, help="seed of the arrival schedule (default 0)")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the unfinished soak of RUN_DIR (soak/state.json) to its planned end, "
        "under a new worker name; the gap is recorded",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    if args.duration_scale is not None and not 0 < args.duration_scale <= 1:
        print("soak: --duration-scale must be within (0, 1]", file=sys.stderr)
        return EXIT_INVALID
    try:
        soak = Soak(args)
    except (StageError, ManifestError, MatrixError, MixError) as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return EXIT_INVALID
    code = soak.run()
    print(f"soak: exit {code}; {soak.run_dir / 'soak.json'}")
    return code
