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
and after, client memory flat. `soak.json` holds every condition with what was seen.
Exit codes: 0 pass; 1 a condition failed (correctness/reliability); 2 invalid stage or
manifest; 3 infrastructure (the client saturated, the target unreachable at the start).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
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
from calculet_load.targetapi import TargetAPI, off_loop
from calculet_load.workload import Prompt, PromptFactory, http_tokenizer

SOAK_SCHEMA = "calculet-soak-stage/v1"
STAGE_DIR = Path(__file__).resolve().parents[1] / "configs" / "soak"
EXIT_OK, EXIT_FAIL, EXIT_INVALID, EXIT_INFRA = 0, 1, 2, 3
MIN_SAMPLE_S = 0.5  # real seconds between two samples of one kind, at the least
MIN_CLIENT_SAMPLES = 20  # client RSS samples needed to judge its slope


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


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stage = load_stage(args.stage)
        self.manifest = load_manifest(args.manifest)
        self.golden = load_golden(args.golden) if args.golden else None
        target = self.manifest.target
        self.url = (args.url or (target.url if target else "")).rstrip("/")
        if not self.url:
            raise StageError("target: no --url and no target.url in the manifest")
        self.protocol = target.protocol if target else "llama"
        self.model = target.model if target else None
        self.token = os.environ.get("CALCULET_ADMIN_TOKEN")
        default_dir = Path("runs") / f"{self.manifest.run_id}-soak-{self.stage.name}"
        self.run_dir = Path(args.run_dir or default_dir)
        self.api = TargetAPI(self.url, self.token, operator="calculet-load-soak")
        st = self.stage
        if st.pass_.golden and self.golden is None:
            raise StageError(f"stage {st.name}: pass.golden needs --golden FILE")
        self.mix = load_mix(st.load.mix) if st.load.mix else None
        self.counts: dict[str, int] = {"sent": 0, "ok": 0, "errors": 0, "dropped": 0}
        self.errors_by: dict[str, int] = {}
        self.longest_s = 0.0
        self.health_failures: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def say(self, text: str) -> None:
        if not self.args.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "manifest.yaml").write_text(Path(self.args.manifest).read_text())
        self.ctx = RunContext.from_manifest(self.manifest, "w00")
        self.sink = PartSink(str(self.run_dir), "w00")
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
        self.watch = SelfWatch(self.sink, "w00", in_flight=lambda: self.session.in_flight)
        code = EXIT_OK
        try:
            code = run_in_greenlet(self._run)
        finally:
            self.session.close()
            self.sink.close()
        return code

    def _run(self) -> int:
        st = self.stage
        try:
            status, health = self.api.health()
        except OSError as exc:
            self.say(f"soak: target {self.url} unreachable: {exc}")
            return EXIT_INFRA
        scale = self.args.time_scale_hint
        if scale is None and self.token:
            try:
                scale = float(self.api.state().get("time_scale") or 1.0)
            except OSError:
                scale = None
        self.scale = float(scale or 1.0)
        self.dscale = float(self.args.duration_scale)
        self.rate_target = float(self.args.target_rate or st.target_rate_qps)
        duration_real = st.duration_s * self.dscale * self.scale
        # a part per ~1/30 of a short rehearsal (10 s at most): the client's memory then
        # reaches its steady sawtooth early, as in a long stage
        self.sink.rotate_s = min(10.0, max(1.0, duration_real / 30))
        rate_real = self.rate_target * st.load.rate_fraction / self.scale
        self.plan: dict[str, Any] = {
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
            "offered_rate_real_qps": rate_real,
            "load": st.load.model_dump(),
            "bursts": st.bursts.model_dump() if st.bursts else None,
            "started_wall_ns": time.time_ns(),
            "health_at_start": {"status": status, "body": health},
        }
        self.say(
            f"soak {st.name}: {st.duration_s * self.dscale:g} target s "
            f"(x{self.dscale:g} of {st.duration_s:g}) = {duration_real:.1f} s real at time "
            f"scale {self.scale:g}; {st.load.kind} loop"
            + (f" at {rate_real:.3g} req/s real" if st.load.kind == "open" else "")
        )
        golden_before = self._golden("before") if self.golden else None
        warm = st.load.prewarm_connections + (st.bursts.size if st.bursts else 0)
        self.plan["prewarmed_connections"] = self.session.pool.prewarm(
            min(warm, st.load.max_in_flight + (st.bursts.size if st.bursts else 0))
        )
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
        self.t_end = time.monotonic() + duration_real
        t0 = time.monotonic()
        try:
            jobs = [gevent.spawn(self._load)]
            if st.bursts is not None:
                jobs.append(gevent.spawn(self._bursts))
            gevent.joinall(jobs)
            for g in jobs:
                if g.exception is not None:
                    raise g.exception
        finally:
            elapsed = time.monotonic() - t0
            gevent.killall(background)
            self.watch.stop()
            sampler.stop()
            self._collect_traces(final=True)
            self._client_sample()
        golden_after = self._golden("after") if self.golden else None
        self.sink.flush()
        self._write_index()
        self.plan["ended_wall_ns"] = time.time_ns()
        self.plan["elapsed_real_s"] = round(elapsed, 3)
        (self.run_dir / "plan.json").write_text(json.dumps(self.plan, indent=1, default=str))
        return self._judge(golden_before, golden_after, sampler.samples)

    def _every(self, target_s: float) -> float:
        """A sampling period in real seconds: scaled, but at least MIN_SAMPLE_S (sampling
        itself costs the client and the target CPU)."""
        return max(target_s * self.scale, MIN_SAMPLE_S)

    def _count(self, record: Any, out: Any) -> None:
        self.counts["sent"] += 1
        if out.error_class is None:
            self.counts["ok"] += 1
        elif out.error_class == "dropped":
            self.counts["dropped"] += 1
        else:
            self.counts["errors"] += 1
            key = f"{out.http_status}:{out.error_code}"
            self.errors_by[key] = self.errors_by.get(key, 0) + 1
        ns = out.client_ns
        end = ns.response_end or ns.last_token or ns.first_event
        if ns.request_start is not None and end is not None:
            self.longest_s = max(self.longest_s, (end - ns.request_start) / 1e9)

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

    def _load(self) -> None:
        ld = self.stage.load
        mix = self.mix or single(ld.prompt_tokens, ld.max_tokens, stream=ld.stream)
        chooser = mix.chooser(self.args.seed)
        if ld.kind == "closed":
            counter = itertools.count()

            def user() -> None:
                while time.monotonic() < self.t_end:
                    spec = self._spec(
                        next(counter), chooser, concurrency=ld.concurrency, arrival="closed"
                    )
                    self.session.send(spec)

            gevent.joinall([gevent.spawn(user) for _ in range(ld.concurrency)])
            return
        rate = self.rate_target * ld.rate_fraction / self.scale
        clock = RateClock(rate, 1)
        sched = Schedule(ld.arrival, self.args.seed, clock)
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
            if pool.full():
                self.session.record_dropped(spec, f"in-flight cap {ld.max_in_flight} full")
            else:
                pool.spawn(self.session.send, spec)
        self._drain(pool)

    def _drain(self, pool: gevent.pool.Pool) -> None:
        """Wait for the requests in flight; what is still running after the hang limit
        is cut and counted as a hang."""
        limit = self.stage.pass_.max_request_s * self.scale + 5.0
        pool.join(timeout=limit)
        left = len(pool)
        if left:
            self.notes.append(f"{left} request(s) still in flight {limit:.1f} s after the end")
            self.plan["hung_at_end"] = left
            pool.kill(block=True, timeout=10)

    def _bursts(self) -> None:
        b = self.stage.bursts
        assert b is not None
        chooser = single(b.prompt_tokens, b.max_tokens).chooser(self.args.seed + 1)
        every = b.every_s * self.scale
        n = 0
        while time.monotonic() + every < self.t_end:
            gevent.sleep(every)
            specs = [
                self._spec(n * b.size + i, chooser, arrival="burst",
                           burst_id=f"{self.manifest.run_id}.burst.{n:05d}",
                           concurrency=b.size, intended_start_ns=time.monotonic_ns())
                for i in range(b.size)
            ]  # fmt: skip
            jobs = [gevent.spawn(self.session.send, s) for s in specs]
            n += 1
            self.plan["bursts_sent"] = n
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
        for kind in ("server_events", "steps", "device"):
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
            rows.write({"wall_ns": wall, "status": status, "body": body})
            if status != 200:
                self.health_failures.append({"wall_ns": wall, "status": status, "body": body})
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

    def _write_index(self) -> None:
        from calculet_load.clock import clock_provenance

        client = self.run_dir / "client"
        parts = sorted(p.name for p in (client / "w00").glob("part-*.parquet"))
        index = {
            "schema": "calculet-client-index/v1",
            "run_id": self.manifest.run_id,
            "status": "complete",
            "source": f"calculet-load soak --stage {self.stage.name}",
            "target": self.url,
            "workers": [{"worker": "w00", "host": socket.gethostname(), "pid": os.getpid(),
                         "status": "reported", "parts": parts, **clock_provenance()}],
        }  # fmt: skip
        (client / "index.json").write_text(json.dumps(index, indent=1, default=str))

    # ------------------------------------------------------------------ verdict
    def _judge(
        self,
        golden_before: dict[str, Any] | None,
        golden_after: dict[str, Any] | None,
        resource_samples: int,
    ) -> int:
        st = self.stage
        p = st.pass_
        conditions: list[dict[str, Any]] = []

        def cond(name: str, ok: bool | None, expected: Any, observed: Any) -> None:
            conditions.append(
                {"condition": name, "ok": ok, "expected": expected, "observed": observed}
            )

        sent = self.counts["sent"] - self.counts["dropped"]
        rate = self.counts["errors"] / sent if sent else 0.0
        cond(
            "error rate",
            rate <= p.max_error_rate,
            f"<= {p.max_error_rate:g}",
            {"rate": round(rate, 6), "errors": self.errors_by, **self.counts},
        )
        hang_limit = p.max_request_s * self.scale
        hung = int(self.plan.get("hung_at_end", 0))
        cond(
            "no hang",
            self.longest_s <= hang_limit + 1.0 and hung == 0,
            f"every request ends within {p.max_request_s:g} target s, none left in flight",
            {"longest_real_s": round(self.longest_s, 3), "in_flight_at_end": hung},
        )
        if p.no_abort:
            cond(
                "no abort",
                not self.health_failures,
                "/health 200 at every sample",
                {"failures": len(self.health_failures), "first": self.health_failures[:3]},
            )
        if p.golden:
            fails = (golden_before or {}).get("failures", []) + (golden_after or {}).get(
                "failures", []
            )
            cond("golden before and after", not fails, "every case matches", fails or "all match")
        client = _client_slope(self.run_dir / "client" / "resources.jsonl")
        if p.client_rss_max_slope_mib_per_h is not None:
            slope = client.get("slope_mib_per_h")
            ok = slope is None or slope <= p.client_rss_max_slope_mib_per_h
            cond(
                "client memory flat",
                ok if slope is not None else None,
                f"RSS slope <= {p.client_rss_max_slope_mib_per_h:g} MiB/h",
                client,
            )
        analysis_code, leaks = self._analysis()
        if p.no_leak:
            leak_rows = [
                {"series": k, "status": v.get("status"), "slope_per_h": v.get("slope_per_h"),
                 "reason": v.get("reason")}
                for k, v in (leaks or {}).get("series", {}).items()
                if v.get("status") not in (None, "not_configured", "no_data")
            ]  # fmt: skip
            leaking = [r for r in leak_rows if r["status"] == "leak"]
            ok_leak: bool | None = not leaking if leak_rows else None
            cond(
                "no leak",
                ok_leak,
                "no resource series with a significant growth above its gate",
                {"resource_samples": resource_samples, "leaking": leaking, "series": leak_rows},
            )
        if p.analysis:
            cond(
                "analysis",
                analysis_code == 0,
                "calculet-load analyze exits 0",
                {"exit_code": analysis_code},
            )
        code = EXIT_OK
        if any(c["ok"] is False for c in conditions):
            code = EXIT_FAIL
        if analysis_code == EXIT_INFRA and code == EXIT_OK:
            code = EXIT_INFRA
        if any(c["ok"] is None for c in conditions) and code == EXIT_OK:
            self.notes.append("some conditions could not be evaluated (see soak.json)")
        doc = {**self.plan, "conditions": conditions, "notes": self.notes,
               "verdict": "PASS" if code == EXIT_OK else "FAIL", "exit_code": code}  # fmt: skip
        (self.run_dir / "soak.json").write_text(json.dumps(doc, indent=1, default=str))
        self.say(f"soak {st.name}: {doc['verdict']} (exit {code})")
        for c in conditions:
            mark = {True: "ok  ", False: "FAIL", None: "n/a "}[c["ok"]]
            self.say(f"  {mark} {c['condition']}: {json.dumps(c['observed'], default=str)[:240]}")
        return code

    def _analysis(self) -> tuple[int | None, dict[str, Any] | None]:
        try:
            from analysis.cli import analyze_run
        except ImportError:
            self.notes.append("analysis: not available in this build")
            return None, None
        rules = self.args.rules or self.stage.rules
        run = functools.partial(analyze_run, str(self.run_dir), rules=rules, quiet=True)
        code = int(off_loop(run))
        verdict = self.run_dir / "verdict.json"
        leaks = None
        if verdict.exists():
            doc = json.loads(verdict.read_text())
            leaks = doc.get("leaks")
        return code, leaks


def _client_slope(path: Path) -> dict[str, Any]:
    """Theil–Sen slope of this client's RSS (MiB per real hour), after a 10% warmup."""
    try:
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except OSError:
        return {"samples": 0}
    if len(rows) < MIN_CLIENT_SAMPLES:
        return {"samples": len(rows), "slope_mib_per_h": None,
                "reason": f"fewer than {MIN_CLIENT_SAMPLES} samples: not judged"}  # fmt: skip
    from scipy import stats

    t = [(r["mono_ns"] - rows[0]["mono_ns"]) / 1e9 for r in rows]
    y = [r["rss_bytes"] / 2**20 for r in rows]
    keep = [i for i, ti in enumerate(t) if ti >= 0.1 * t[-1]]
    fit = stats.theilslopes([y[i] for i in keep], [t[i] for i in keep])
    return {
        "samples": len(rows),
        "first_mib": round(y[0], 1),
        "last_mib": round(y[-1], 1),
        "max_mib": round(max(y), 1),
        "slope_mib_per_h": round(float(fit.slope) * 3600.0, 3),
    }


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
        default=1.0,
        help="shorten (< 1) the stage for a rehearsal; recorded in soak.json",
    )
    p.add_argument(
        "--rules", help="acceptance rules for the analysis (default: the stage's, else the default)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival schedule")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.duration_scale <= 1:
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
