"""Locust integration: users, open-loop dispatch, bursts, live stats, the web UI tab.

Import this module from a locustfile (`locustfiles/calculet.py` does); importing it
registers the command-line options and the event listeners. Only this module and the
locustfiles import Locust: Locust monkey-patches the standard library on import, and
the rest of calculet_load must stay importable without that.

How a run is organised:

* **The master (or a single local process) owns the plan.** At `test_start`, before
  Locust sends its first spawn message, it fixes the run id, the run folder, the
  schedule origin (a wall time a moment ahead) and the list of worker processes, and
  puts them into `parsed_options.calculet_plan`; Locust forwards custom options to the
  workers with the spawn message. Every second it re-broadcasts the current target
  (users, rate) for labels and late joiners, trims Locust's history, and writes
  `client/index.json`.
* **Each worker process is one dispatcher slot.** Open loop (`--arrival poisson |
  constant | gamma | replay`): one greenlet per process computes the one global
  schedule (calculet_load.arrivals) and fires the arrivals of its slot at their
  intended time, whatever the server does; an arrival that finds `--max-in-flight`
  requests running is recorded as dropped. Locust's users are idle placeholders
  then: their number does not change the load. Closed loop (`--arrival closed`):
  each Locust user sends its next request when the last one ends.
* **Bursts** (`--arrival burst`): the master sends a fire-at wall time ahead; each
  worker opens its connections in advance, waits on its monotonic clock and fires its
  share at once. Every request of a burst carries the burst id.
* **Records** go to the worker's own Parquet parts in the run folder; the Locust
  `request` event gets one row per request for TTFT, TPOT and E2E (web UI only).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import gevent.pool
from locust import User, events, task
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from calculet_load.arrivals import ArrivalError, RateClock, Schedule, load_replay, unit_gaps
from calculet_load.client import Outcome, Timeouts
from calculet_load.clock import clock_provenance
from calculet_load.events import events as cl_events
from calculet_load.livestats import LiveStats
from calculet_load.mixes import Mix, MixChooser, MixError, load_mix, single
from calculet_load.schema.manifest import ManifestError, load_manifest
from calculet_load.schema.records import RequestRecord
from calculet_load.scrape import ServerSampler, sampler_for_run
from calculet_load.selfwatch import TIMER_SLACK_S, SelfWatch
from calculet_load.session import RequestSpec, RunContext, Session
from calculet_load.sink import PartSink
from calculet_load.workload import Prompt, PromptFactory, WorkloadError, http_tokenizer

log = logging.getLogger("calculet_load")

OPEN_LOOP = ("poisson", "constant", "gamma", "replay")
ARRIVALS = ("closed", *OPEN_LOOP, "burst")
PROTOCOLS = ("llama", "openai-chat", "openai-completions")
INDEX_SCHEMA = "calculet-client-index/v1"
HISTORY_KEEP = 3600  # Locust appends a history row per second forever: keep an hour
SPIN_S = TIMER_SLACK_S  # wake this early, then yield until the intended instant
UI_OPTIONS: set[str] = set()  # our options in the web UI's start form (their dest names)


# ------------------------------------------------------------------ options
@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    def opt(*names: str, **kw: Any) -> None:
        ui = kw.pop("ui", True)
        action = parser.add_argument(*names, include_in_web_ui=ui, **kw)
        if ui:
            UI_OPTIONS.add(action.dest)

    opt("--protocol", choices=PROTOCOLS, default="llama", help="target protocol")
    opt("--model", default="", help="model name sent to OpenAI-style targets")
    opt(
        "--arrival",
        choices=ARRIVALS,
        default="closed",
        help="closed: each user waits for its response; poisson/constant/gamma/replay: "
        "open loop at --rate, independent of responses; burst: --burst-size at once",
    )
    opt("--rate", type=float, default=1.0, help="open loop: arrivals per second (all workers)")
    opt("--burstiness", type=float, default=1.0, help="gamma: shape k (CV = 1/sqrt(k))")
    opt("--replay-file", default="", help="replay: arrival timestamps (s), one per line")
    opt("--mix", default="", help="workload mix: a file or a name in configs/mixes/")
    opt("--prompt-tokens", type=int, default=128, help="prompt length (without --mix)")
    opt("--max-tokens", type=int, default=32, help="output tokens (without --mix)")
    opt("--max-in-flight", type=int, default=256, help="open loop: in-flight cap per process")
    opt("--late-ms", type=float, default=5.0, help="an arrival sent later than this is late")
    opt("--burst-size", type=int, default=8, help="burst: requests fired at one instant")
    opt("--burst-every", type=float, default=0.0, help="burst: period in s (0: one burst)")
    opt("--burst-lead", type=float, default=1.0, help="burst: announce this many s ahead")
    opt("--seed", type=int, default=0, help="seed of the schedule and the mix choices")
    opt("--run-id", default="", help="run id (default: the manifest's, else generated)")
    opt("--run-dir", default="", help="run folder, path or URI (default: runs/<run id>)")
    opt("--manifest", default="", help="run manifest YAML (provenance of every record)")
    opt("--request-timeout", type=float, default=900.0, help="total timeout per request, s")
    opt("--start-delay", type=float, default=2.0, help="open loop: schedule starts after, s")
    opt("--no-stream", action="store_true", default=False, help="ask for whole responses")
    opt(
        "--stages",
        default="",
        ui=False,
        help="with locustfiles/stages.py: DURATION_S@RATE[@BURST_SIZE/EVERY_S],... or a YAML file",
    )
    # issue 9: Prometheus exposition (calculet_load.prom) and server sampling (.scrape)
    opt("--metrics-port", type=int, default=0, ui=False, help="serve Prometheus /metrics (0: off)")
    opt("--metrics-host", default="", ui=False, help="--metrics-port's address (default: all)")
    opt(
        "--scrape-interval",
        type=float,
        default=5.0,
        ui=False,
        help="master: sample the target's /metrics and process into server/ every N s (0: off)",
    )
    opt("--server-metrics-url", default="", ui=False, help="default: TARGET/metrics")
    opt(
        "--server-pid",
        type=int,
        default=0,
        ui=False,
        help="target process to sample (0: by the target's port on this host; -1: off)",
    )


# ------------------------------------------------------------------ the plan
@dataclass
class Plan:
    """What the master fixes at test start and every process follows."""

    run_id: str
    run_dir: str
    arrival: str
    rate: float
    seed: int
    origin_wall_ns: int  # schedule time 0, as a wall time
    slots: dict[str, int]  # worker index -> dispatcher slot
    users: int = 0  # Locust's target user count at the start (closed loop: concurrency)
    rate_changes: list[tuple[int, float]] = field(default_factory=list)  # (schedule ns, rate)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        data["rate_changes"] = [tuple(x) for x in data.get("rate_changes", [])]
        return cls(**data)


def options(env: Environment) -> Any:
    """Locust's parsed options (with ours); None only before Locust parses its arguments."""
    opts = env.parsed_options
    if opts is None:
        raise RuntimeError("calculet-load runs from a locustfile started by `locust`")
    return opts


def _run_id(opts: Any) -> str:
    if opts.run_id:
        return str(opts.run_id)
    if opts.manifest:
        return load_manifest(opts.manifest).run_id
    return "locust-" + time.strftime("%Y%m%dT%H%M%S")


def _mix(opts: Any) -> Mix:
    if opts.mix:
        return load_mix(opts.mix)
    return single(opts.prompt_tokens, opts.max_tokens, stream=not opts.no_stream)


# ------------------------------------------------------------------ a worker process
class Worker:
    """This process's share of the run: session, sink, dispatcher, live stats."""

    def __init__(self, env: Environment, plan: Plan, index: int) -> None:
        self.env = env
        self.opts = options(env)
        self.plan = plan
        self.index = index
        self.name = f"w{index:02d}"
        self.slot = plan.slots.get(str(index))
        self.stats = LiveStats()
        self.wire_pending = LiveStats()  # what changed since the last report to the master
        self.mix = _mix(self.opts)
        self.chooser = MixChooser(self.mix, plan.seed)
        self.closed_seq = 0
        self.target_users = plan.users
        self.stopping = False
        self._prompts: dict[tuple[int, int], Prompt] = {}
        self._factory: PromptFactory | None = None
        manifest = load_manifest(self.opts.manifest) if self.opts.manifest else None
        ctx = (
            dataclasses.replace(RunContext.from_manifest(manifest, self.name), run_id=plan.run_id)
            if manifest is not None
            else RunContext(plan.run_id, self.name)
        )
        self.sink = PartSink(plan.run_dir, self.name)
        timeout = float(self.opts.request_timeout)
        host = env.host or ""
        self.session = Session(
            ctx,
            host.rstrip("/"),
            self.opts.protocol,
            model=self.opts.model or None,
            max_in_flight=max(int(self.opts.max_in_flight), 1) + 64,
            timeouts=Timeouts(connect_s=min(10.0, timeout), total_s=timeout, first_byte_s=timeout),
            sink=self.sink,
        )
        self.session.hooks.append(self._on_record)
        self.pool = gevent.pool.Pool(max(int(self.opts.max_in_flight), 1))
        self.rate_clock = RateClock(plan.rate, max(len(plan.slots), 1))
        for at_ns, rate in plan.rate_changes:
            self.rate_clock.change(at_ns, rate)
        self.plan_changed = gevent.event.Event()
        # the schedule's origin on this process's monotonic clock
        self.origin_mono = time.monotonic_ns() + (plan.origin_wall_ns - time.time_ns())
        self.token_events_seen = 0
        cl_events.token_event.add_listener(self._on_token_event)
        self.watch = SelfWatch(
            self.sink,
            self.name,
            in_flight=lambda: self.session.in_flight,
            token_events=lambda: self.token_events_seen,
            on_sample=self._on_selfwatch,
        )
        self.watch.start()
        self.dispatcher: gevent.Greenlet[..., Any] | None = None
        self.bursts: list[dict[str, Any]] = []
        self.cpu_percent = 0.0
        self.abandoned = 0

    # --- prompts ------------------------------------------------------------------
    def prompt(self, tokens: int, sample: int) -> Prompt:
        key = (tokens, sample)
        p = self._prompts.get(key)
        if p is None:
            if self._factory is None:
                mode = "chat" if self.opts.protocol == "openai-chat" else "ids"
                self._factory = PromptFactory(
                    http_tokenizer(self.session.pool.endpoint.url), mode=mode
                )
            p = self._prompts[key] = self._factory.prompt(tokens, sample)
        return p

    def prepare_prompts(self) -> None:
        for entry in self.mix.entries:
            for sample in range(entry.samples):
                self.prompt(entry.prompt_tokens, sample)

    def spec_for(self, k: int, **kw: Any) -> RequestSpec:
        entry, sample = self.chooser.entry_for(k)
        return RequestSpec(
            prompt=self.prompt(entry.prompt_tokens, sample),
            max_tokens=entry.max_tokens,
            stream=entry.stream and not self.opts.no_stream,
            temperature=entry.temperature,
            seed=self.plan.seed if entry.temperature > 0 else None,
            cell=entry.name,
            **kw,
        )

    # --- records → live stats and Locust's request event ---------------------------
    def _on_record(self, record: RequestRecord, out: Outcome) -> None:
        for s in (self.stats, self.wire_pending):
            _count(s, record, self.opts.model)
        if out.cancelled_at == "run_stop":
            return  # cut by the end of the run: in the records, not a server failure
        d = record.durations_ms
        kind = self.opts.protocol
        fire = self.env.events.request.fire
        tokens = record.ext.client_output_tokens or 0
        if d.ttft is not None:
            fire(
                request_type=kind,
                name="TTFT",
                response_time=d.ttft,
                response_length=0,
                exception=None,
                context={},
            )
        if d.tpot is not None:
            fire(
                request_type=kind,
                name="TPOT",
                response_time=d.tpot,
                response_length=0,
                exception=None,
                context={},
            )
        if record.ext.ttft_from_intended_ms is not None:
            fire(
                request_type=kind,
                name="TTFT from intended",
                response_time=record.ext.ttft_from_intended_ms,
                response_length=0,
                exception=None,
                context={},
            )
        exc = (
            None
            if out.error_class is None
            else RequestFailed(f"{out.error_class}: {(out.error_detail or '')[:120]}")
        )
        fire(
            request_type=kind,
            name="E2E",
            response_time=d.e2e if d.e2e is not None else _elapsed_ms(record),
            response_length=tokens,
            exception=exc,
            context={},
        )

    def _on_token_event(self, **_kw: Any) -> None:
        self.token_events_seen += 1

    def _on_selfwatch(self, row: Any) -> None:
        for s in (self.stats, self.wire_pending):
            s.observe("loop_lag", row.loop_lag_ms)
        self.cpu_percent = row.cpu_percent
        self.stats.in_flight[self.name] = row.in_flight or 0  # issue 9: a local run's gauges
        self.stats.cpu_percent[self.name] = row.cpu_percent

    # --- closed loop ----------------------------------------------------------------
    def closed_request(self) -> None:
        slots = max(len(self.plan.slots), 1)
        k = self.closed_seq * slots + (self.slot or 0)
        self.closed_seq += 1
        spec = self.spec_for(k, concurrency=self.target_users or None, arrival="closed")
        self.session.send(spec)

    # --- open loop --------------------------------------------------------------------
    def start_dispatcher(self) -> None:
        if self.slot is None:
            log.warning("%s has no dispatcher slot in this run's plan: it sends nothing", self.name)
            return
        self.dispatcher = gevent.spawn(self._dispatch)

    def _dispatch(self) -> None:
        opts = self.opts
        try:
            self.prepare_prompts()
        except (WorkloadError, OSError) as exc:
            log.error("%s: cannot prepare prompts: %s", self.name, exc)
            return
        replay = load_replay(opts.replay_file) if opts.arrival == "replay" else ()
        sched = Schedule(
            opts.arrival,
            self.plan.seed,
            self.rate_clock,
            burstiness=float(opts.burstiness),
            replay=replay,
        )
        assert self.slot is not None
        while not self.stopping:
            nxt = sched.next_for(self.slot)
            if nxt is None:
                log.info("%s: the arrival log is exhausted", self.name)
                return
            k, unit = nxt
            due = self._wait_for(unit)
            if due is None:
                return
            self._fire(k, due)

    def _wait_for(self, unit: float) -> int | None:
        """Sleep until the arrival at unit time `unit` is due; its monotonic ns."""
        while not self.stopping:
            t = self.rate_clock.time_of(unit)
            if t is None:  # rate 0 from here on: wait for a plan change
                self.plan_changed.clear()
                self.plan_changed.wait(1.0)
                continue
            due = self.origin_mono + t
            remaining = (due - time.monotonic_ns()) / 1e9
            if remaining > SPIN_S:
                self.plan_changed.clear()
                if self.plan_changed.wait(remaining - SPIN_S):
                    continue  # the rate changed: recompute the time
                continue
            while time.monotonic_ns() < due:
                gevent.sleep(0)
            return due
        return None

    def _fire(self, k: int, due: int, burst_id: str | None = None) -> None:
        arrival = "burst" if burst_id else self.opts.arrival
        spec = self.spec_for(
            k,
            arrival=arrival,
            intended_start_ns=due,
            late_after_ms=float(self.opts.late_ms),
            burst_id=burst_id,
        )
        if self.pool.full():
            record = self.session.record_dropped(
                spec, f"in-flight cap {self.pool.size} full at the intended time"
            )
            for s in (self.stats, self.wire_pending):
                _count(s, record, self.opts.model)
            return
        self.pool.spawn(self._send, spec)

    def _send(self, spec: RequestSpec) -> None:
        try:
            self.session.send(spec)
        except Exception:  # a bug, not a server's behaviour: keep the dispatcher alive
            log.exception("%s: request failed inside the client", self.name)

    def change_rate(self, at_ns: int, rate: float) -> None:
        self.rate_clock.change(at_ns, rate)
        self.plan_changed.set()

    # --- bursts ---------------------------------------------------------------------
    def burst(self, burst_id: str, fire_at_wall_ns: int, n: int, first_k: int) -> None:
        if n <= 0:
            return
        deadline = time.monotonic_ns() + (fire_at_wall_ns - time.time_ns())
        try:
            specs_k = [first_k + i for i in range(n)]
            for k in specs_k:
                self.spec_for(k)  # prompts ready before the instant
            self.session.pool.prewarm(n)
        except (WorkloadError, OSError) as exc:
            log.error("%s: burst %s: cannot prepare: %s", self.name, burst_id, exc)
        while (remaining := (deadline - time.monotonic_ns()) / 1e9) > SPIN_S:
            gevent.sleep(remaining - SPIN_S)
        while time.monotonic_ns() < deadline:
            gevent.sleep(0)
        sent_wall = time.time_ns()
        for k in specs_k:
            self._fire(k, deadline, burst_id=burst_id)
        self.bursts.append(
            {
                "id": burst_id,
                "n": n,
                "fired_wall_ns": sent_wall,
                "late_ms": (time.monotonic_ns() - deadline) / 1e6,
            }
        )

    # --- end ------------------------------------------------------------------------
    def stop(self, timeout_s: float) -> None:
        self.stopping = True
        self.plan_changed.set()
        if self.dispatcher is not None:
            self.dispatcher.join(timeout=5)
            self.dispatcher.kill()
        self.pool.join(timeout=timeout_s)
        # still running after the stop timeout: cut, and recorded as cancelled at run stop
        self.abandoned = len(self.pool)
        self.pool.kill(block=True, timeout=5)
        self.watch.stop()
        cl_events.token_event.remove_listener(self._on_token_event)
        self.sink.close()
        self.session.close()

    def parts(self) -> list[str]:
        return sorted(
            info.path.rsplit("/", 1)[-1]
            for info in self.sink.fs.get_file_info(_selector(self.sink.dir))
            if info.path.endswith(".parquet")
        )

    def report(self) -> dict[str, Any]:
        return {
            "worker": self.name,
            "index": self.index,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "parts": self.parts(),
            "requests": self.stats.counters["requests"],
            "dropped": self.stats.counters["dropped"],
            "late": self.stats.counters["late"],
            "cut_at_stop": self.abandoned,
            **clock_provenance(),
            "bursts": self.bursts,
            "sink": dataclasses.asdict(self.sink.stats),
        }


class RequestFailed(Exception):
    """The exception Locust's request event carries for a failed request (its error class)."""


def _selector(path: str) -> Any:
    from pyarrow.fs import FileSelector

    return FileSelector(path, allow_not_found=True)


def _elapsed_ms(record: RequestRecord) -> float:
    ns = record.client_ns
    if ns.request_start is None:
        return 0.0
    last = max((v for v in vars_ns(ns) if v is not None), default=ns.request_start)
    return (last - ns.request_start) / 1e6


def vars_ns(ns: Any) -> list[int | None]:
    return [getattr(ns, f) for f in ns.__dataclass_fields__]


def _count(s: LiveStats, record: RequestRecord, model: str = "") -> None:
    e = record.ext
    c = s.counters
    if e.dropped:
        c["dropped"] += 1
        return
    s.observe_series(record, model)  # issue 9: labelled series for Prometheus
    c["requests"] += 1
    if e.error_class is None:
        c["ok"] += 1
    else:
        c["failed"] += 1
        s.errors[e.error_class] += 1
    if e.late:
        c["late"] += 1
    if e.token_count_mismatch:
        c["count_mismatch"] += 1
    c["output_tokens"] += e.client_output_tokens or 0
    c["token_events"] += e.token_events or 0
    c["prompt_tokens"] += record.workload.prompt_tokens or 0
    d = record.durations_ms
    s.observe("ttft", d.ttft)
    s.observe("tpot", d.tpot)
    s.observe("e2e", d.e2e)
    s.observe("ttft_sched", e.ttft_from_intended_ms)
    if e.send_lag_ms is not None:
        s.observe("send_lag", max(e.send_lag_ms, 0.0))


# ------------------------------------------------------------------ process state
@dataclass
class _State:
    worker: Worker | None = None
    plan: Plan | None = None
    master: Coordinator | None = None


STATE = _State()


# ------------------------------------------------------------------ the master side
class Coordinator:
    """Master (or local) side: plan, broadcasts, bursts, index, merged live stats."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.stats = LiveStats()
        self.reports: dict[str, dict[str, Any]] = {}
        self.worker_state: dict[str, dict[str, Any]] = {}
        self.plan: Plan | None = None
        self.started_wall_ns = 0
        self.ended_wall_ns: int | None = None
        self.bursts: list[dict[str, Any]] = []
        self._loop: gevent.Greenlet[..., Any] | None = None
        self._burster: gevent.Greenlet[..., Any] | None = None
        self._burst_seq = 0
        self._sampler: ServerSampler | None = None  # issue 9

    @property
    def distributed(self) -> bool:
        return isinstance(self.env.runner, MasterRunner)

    def workers(self) -> list[int]:
        runner = self.env.runner
        if isinstance(runner, MasterRunner):
            ids = [c.id for c in runner.clients.values() if c.state != "missing"]
            return sorted(runner.get_worker_index(i) for i in ids)
        return [0]

    def start(self) -> Plan:
        opts = options(self.env)
        run_id = _run_id(opts)
        run_dir = opts.run_dir or str(Path("runs") / run_id)
        indexes = self.workers()
        delay = max(float(opts.start_delay), 0.2)
        self.stats = LiveStats()
        self.reports = {}
        self.bursts = []
        self.started_wall_ns = time.time_ns()
        self.ended_wall_ns = None
        self.plan = Plan(
            run_id=run_id,
            run_dir=run_dir,
            arrival=opts.arrival,
            rate=float(opts.rate),
            seed=int(opts.seed),
            origin_wall_ns=time.time_ns() + int(delay * 1e9),
            slots={str(i): slot for slot, i in enumerate(indexes)},
            users=int(getattr(self.env.runner, "target_user_count", 0) or 0),
        )
        opts.calculet_plan = self.plan.to_json()
        self.write_index("running")
        # issue 9: the target's /metrics and process into server/ while the run goes on
        if self._sampler is not None:
            self._sampler.stop()
        self._sampler = sampler_for_run(
            run_dir,
            self.env.host,
            interval_s=float(opts.scrape_interval),
            metrics_url=opts.server_metrics_url,
            server_pid=int(opts.server_pid),
        )
        if self._loop is None:
            self._loop = gevent.spawn(self._tick_loop)
        if opts.arrival == "burst":
            self._burster = gevent.spawn(self._burst_loop, delay)
        log.info(
            "calculet run %s: %s arrivals, %d dispatcher(s), run folder %s",
            run_id,
            opts.arrival,
            len(indexes),
            run_dir,
        )
        return self.plan

    def stop(self) -> None:
        if self._burster is not None:
            self._burster.kill()
            self._burster = None
        if self._sampler is not None:  # issue 9
            self._sampler.stop()
            self._sampler = None
        self.ended_wall_ns = time.time_ns()

    # --- periodic work ----------------------------------------------------------------
    def _tick_loop(self) -> None:
        while True:
            gevent.sleep(1.0)
            try:
                self.tick()
            except Exception:
                log.exception("calculet master tick failed")

    def tick(self) -> None:
        runner = self.env.runner
        if runner is None:
            return
        history = runner.stats.history
        if len(history) > HISTORY_KEEP:
            del history[: len(history) - HISTORY_KEEP]
        if isinstance(runner, MasterRunner):
            now = time.time_ns()
            for c in runner.clients.values():
                name = f"w{runner.get_worker_index(c.id):02d}"
                st = self.worker_state.setdefault(name, {"status": c.state})
                if c.state == "missing" and st.get("status") != "missing":
                    st["missing_since_wall_ns"] = now
                    log.warning("calculet: worker %s went missing", name)
                st["status"] = c.state
            if self.plan is not None:
                runner.send_message(
                    "calculet_target",
                    {"users": runner.target_user_count or 0, "run_id": self.plan.run_id},
                )
        elif STATE.worker is not None:
            STATE.worker.target_users = runner.target_user_count or 0
        if self.plan is not None and self.ended_wall_ns is None:
            self.write_index("running")

    # --- rate changes (web UI, load shape) ----------------------------------------------
    def change_rate(self, rate: float, lead_s: float = 0.5) -> None:
        plan = self.plan
        if plan is None or plan.arrival not in OPEN_LOOP:
            raise ValueError("the rate applies to an open-loop run that is running")
        at_ns = max(time.time_ns() + int(lead_s * 1e9) - plan.origin_wall_ns, 0)
        plan.rate_changes.append((at_ns, rate))
        options(self.env).rate = rate
        options(self.env).calculet_plan = plan.to_json()
        msg = {"at_ns": at_ns, "rate": rate}
        if isinstance(self.env.runner, MasterRunner):
            self.env.runner.send_message("calculet_rate", msg)
        elif STATE.worker is not None:
            STATE.worker.change_rate(at_ns, rate)
        log.info("calculet: rate %.3f/s from schedule time %.3f s", rate, at_ns / 1e9)

    # --- bursts ---------------------------------------------------------------------------
    def _burst_loop(self, delay: float) -> None:
        opts = options(self.env)
        gevent.sleep(delay)
        while True:
            self.fire_burst(int(opts.burst_size), float(opts.burst_lead))
            if float(opts.burst_every) <= 0:
                return
            gevent.sleep(float(opts.burst_every))

    def fire_burst(self, size: int, lead_s: float) -> dict[str, Any]:
        plan = self.plan
        if plan is None:
            raise ValueError("no run is running")
        self._burst_seq += 1
        burst_id = f"{plan.run_id}.b{self._burst_seq:04d}"
        indexes = sorted(plan.slots, key=int)
        counts = {
            i: size // len(indexes) + (1 if n < size % len(indexes) else 0)
            for n, i in enumerate(indexes)
        }
        first_k: dict[str, int] = {}
        k = self._burst_seq * 1_000_000
        for i in indexes:
            first_k[i] = k
            k += counts[i]
        fire_at = time.time_ns() + int(lead_s * 1e9)
        msg = {"id": burst_id, "fire_at_wall_ns": fire_at, "counts": counts, "first_k": first_k}
        self.bursts.append(
            {"id": burst_id, "size": size, "fire_at_wall_ns": fire_at, "counts": counts}
        )
        if isinstance(self.env.runner, MasterRunner):
            self.env.runner.send_message("calculet_burst", msg)
        elif STATE.worker is not None:
            gevent.spawn(STATE.worker.burst, burst_id, fire_at, counts["0"], first_k["0"])
        return msg

    def expected_workers(self) -> set[str]:
        """Workers of the plan that are not known to be gone."""
        names = {f"w{int(i):02d}" for i in self.plan.slots} if self.plan else set()
        gone = {n for n, st in self.worker_state.items() if st.get("status") == "missing"}
        return names - gone

    # --- worker reports ---------------------------------------------------------------------
    def on_worker_stats(self, client_id: str, data: dict[str, Any]) -> None:
        wire = data.get("calculet")
        if wire:
            self.stats.merge_wire(wire, process=wire.get("worker", client_id))

    def on_parts(self, report: dict[str, Any]) -> None:
        self.reports[report["worker"]] = report
        self.write_index("running" if self.ended_wall_ns is None else "stopping")

    # --- the run's index ----------------------------------------------------------------------
    def write_index(self, status: str) -> dict[str, Any] | None:
        plan = self.plan
        if plan is None:
            return None
        workers = []
        names = sorted(
            set(self.reports) | {f"w{int(i):02d}" for i in plan.slots} | set(self.worker_state)
        )
        incomplete = False
        for name in names:
            entry: dict[str, Any] = {"worker": name}
            entry.update(self.worker_state.get(name, {}))
            rep = self.reports.get(name)
            if rep is not None:
                entry.update(rep)
                entry["status"] = "reported"
            elif status == "complete":
                entry.setdefault("status", "missing")
                entry["status"] = "missing" if entry["status"] != "reported" else "reported"
                incomplete = True
            workers.append(entry)
        index = {
            "schema": INDEX_SCHEMA,
            "run_id": plan.run_id,
            "status": "incomplete" if incomplete else status,
            "started_wall_ns": self.started_wall_ns,
            "ended_wall_ns": self.ended_wall_ns,
            "plan": json.loads(plan.to_json()),
            "options": _options_snapshot(options(self.env)),
            "target": self.env.host,
            "workers": workers,
            "bursts": self.bursts,
        }
        _write_json(plan.run_dir, "client/index.json", index)
        return index


def _options_snapshot(opts: Any) -> dict[str, Any]:
    keys = (
        "protocol",
        "model",
        "arrival",
        "rate",
        "burstiness",
        "replay_file",
        "mix",
        "prompt_tokens",
        "max_tokens",
        "max_in_flight",
        "late_ms",
        "burst_size",
        "burst_every",
        "seed",
        "request_timeout",
        "num_users",
        "no_stream",
    )
    return {k: getattr(opts, k, None) for k in keys}


def _write_json(run_dir: str, rel: str, obj: Any) -> None:
    from calculet_load.sink import resolve_fs

    fs, root = resolve_fs(run_dir)
    path = f"{root.rstrip('/')}/{rel}"
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    tmp = path + ".tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(json.dumps(obj, indent=1, default=str).encode())
    fs.move(tmp, path)


# ------------------------------------------------------------------ Locust wiring
@events.init.add_listener
def _on_init(environment: Environment, **_kw: Any) -> None:
    if environment.parsed_options is None:
        return
    _validate(environment.parsed_options)
    # The sink's writer thread converts rows to Arrow while holding the GIL; with the
    # default 5 ms switch interval the event loop could wait that long for the GIL, and
    # every timestamp with it. 0.5 ms bounds that wait at a small cost in throughput.
    sys.setswitchinterval(0.0005)
    runner = environment.runner
    if not isinstance(runner, WorkerRunner):
        STATE.master = Coordinator(environment)
    if isinstance(runner, WorkerRunner):
        runner.register_message("calculet_rate", _on_rate_msg)
        runner.register_message("calculet_burst", _on_burst_msg)
        runner.register_message("calculet_target", _on_target_msg)
        runner.register_message("calculet_stop", _on_stop_msg)
        from calculet_load import locust_cells

        locust_cells.install_worker(runner)  # the shares of a distributed `accept`
    if isinstance(runner, MasterRunner):
        runner.register_message("calculet_parts", _on_parts_msg)
    if environment.web_ui is not None:
        from calculet_load import locust_webui

        locust_webui.install(environment, lambda: STATE.master)
    if int(environment.parsed_options.metrics_port) > 0:  # issue 9
        from calculet_load import prom

        prom.install(environment)


def _validate(opts: Any) -> None:
    """Bad options fail at start with one line naming the option."""
    problems = option_problems(opts)
    if problems:
        raise SystemExit("calculet-load: " + "; ".join(problems))


def option_problems(opts: Any) -> list[str]:
    """What is wrong with these options, one phrase naming the option each (none: [])."""
    problems = []
    if not math.isfinite(opts.rate) or opts.rate < 0:
        problems.append(f"--rate must be a finite number >= 0, got {opts.rate}")
    if opts.arrival == "replay" and not opts.replay_file:
        problems.append("--replay-file is required with --arrival replay")
    elif opts.arrival == "replay":
        try:
            next(unit_gaps("replay", 0, replay=load_replay(opts.replay_file)))
        except (ArrivalError, OSError) as exc:
            problems.append(f"--replay-file: {exc}")
    if opts.burstiness <= 0:
        problems.append(f"--burstiness must be > 0, got {opts.burstiness}")
    if opts.max_in_flight < 1:
        problems.append(f"--max-in-flight must be >= 1, got {opts.max_in_flight}")
    try:
        _mix(opts)
        if opts.manifest:
            load_manifest(opts.manifest)
    except (MixError, ManifestError) as exc:
        problems.append(str(exc))
    return problems


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_kw: Any) -> None:
    runner = environment.runner
    opts = options(environment)
    if isinstance(runner, MasterRunner):
        assert STATE.master is not None
        STATE.plan = STATE.master.start()
        return
    if isinstance(runner, WorkerRunner):
        plan = Plan.from_json(opts.calculet_plan)
        index = runner.worker_index
    else:  # one local process: it is its own master
        assert STATE.master is not None
        plan = STATE.master.start()
        index = 0
    if STATE.worker is not None:
        STATE.worker.stop(timeout_s=1.0)
    STATE.plan = plan
    STATE.worker = Worker(environment, plan, index)
    if plan.arrival in OPEN_LOOP:
        STATE.worker.start_dispatcher()


@events.test_stopping.add_listener
def _on_test_stopping(environment: Environment, **_kw: Any) -> None:
    if STATE.worker is not None:
        STATE.worker.stopping = True  # no new arrivals; in-flight requests finish
        STATE.worker.plan_changed.set()


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_kw: Any) -> None:
    runner = environment.runner
    w = STATE.worker
    if w is not None:
        STATE.worker = None
        w.stop(timeout_s=max(environment.stop_timeout or 0.0, 10.0))
        report = w.report()
        if isinstance(runner, WorkerRunner):
            runner.send_message("calculet_parts", report)
        elif STATE.master is not None:
            STATE.master.on_parts(report)
    master = STATE.master
    if master is None or master.plan is None or master.ended_wall_ns is not None:
        return
    master.stop()
    if isinstance(runner, MasterRunner):
        # Locust's own quit (--run-time, Ctrl-C) does not wait for workers to stop:
        # ask them to stop now and wait for their part lists before the index closes.
        runner.send_message("calculet_stop", None)
        deadline = time.monotonic() + (environment.stop_timeout or 0.0) + 20.0
        expected = master.expected_workers()
        while time.monotonic() < deadline and not expected <= set(master.reports):
            gevent.sleep(0.2)
    index = master.write_index("complete")
    if index is not None and index["status"] != "complete":
        log.warning(
            "calculet run %s is incomplete: see %s/client/index.json",
            master.plan.run_id,
            master.plan.run_dir,
        )


def _on_stop_msg(environment: Environment, msg: Any, **_kw: Any) -> None:
    """The master is stopping the run: stop this worker's users, then report (test_stop)."""
    runner = environment.runner
    if STATE.worker is not None and runner is not None:
        runner.stop()


@events.report_to_master.add_listener
def _on_report_to_master(client_id: str, data: dict[str, Any], **_kw: Any) -> None:
    w = STATE.worker
    if w is None:
        return
    wire = w.wire_pending.to_wire()
    wire["worker"] = w.name
    wire["in_flight"] = w.session.in_flight
    wire["cpu_percent"] = w.cpu_percent
    w.wire_pending = LiveStats()
    data["calculet"] = wire


@events.worker_report.add_listener
def _on_worker_report(client_id: str, data: dict[str, Any], **_kw: Any) -> None:
    if STATE.master is not None:
        STATE.master.on_worker_stats(client_id, data)


def _on_rate_msg(environment: Environment, msg: Any, **_kw: Any) -> None:
    if STATE.worker is not None:
        STATE.worker.change_rate(int(msg.data["at_ns"]), float(msg.data["rate"]))


def _on_burst_msg(environment: Environment, msg: Any, **_kw: Any) -> None:
    w = STATE.worker
    if w is None:
        return
    me = str(w.index)
    n = int(msg.data["counts"].get(me, 0))
    if n:
        gevent.spawn(
            w.burst,
            msg.data["id"],
            int(msg.data["fire_at_wall_ns"]),
            n,
            int(msg.data["first_k"][me]),
        )


def _on_target_msg(environment: Environment, msg: Any, **_kw: Any) -> None:
    if STATE.worker is not None:
        STATE.worker.target_users = int(msg.data["users"])


def _on_parts_msg(environment: Environment, msg: Any, **_kw: Any) -> None:
    if STATE.master is not None:
        STATE.master.on_parts(msg.data)


def worker_slots() -> list[int]:
    """Worker indexes that take part (this process alone when not distributed)."""
    return STATE.master.workers() if STATE.master is not None else [0]


def live_stats() -> LiveStats | None:
    """The live figures of this process: merged (master), or its own (local run)."""
    if STATE.master is not None and STATE.master.distributed:
        return STATE.master.stats
    if STATE.worker is not None:
        return STATE.worker.stats
    return STATE.master.stats if STATE.master is not None else None


# ------------------------------------------------------------------ the user
class CalculetUser(User):
    """Closed loop: send, wait for the whole response, send again. Open loop and bursts:
    an idle placeholder (the process's dispatcher sends; users do not add load)."""

    abstract = False

    @task
    def work(self) -> None:
        w = STATE.worker
        if w is None or w.plan.arrival != "closed" or w.stopping:
            gevent.sleep(0.5)
            return
        try:
            w.closed_request()
        except (WorkloadError, OSError) as exc:
            log.error("%s: cannot build the request: %s", w.name, exc)
            gevent.sleep(1.0)
