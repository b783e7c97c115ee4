# size: a Locust process's share of a run (closed, open-loop slot, bursts) is one object
"""A Locust worker process's share of a run: session, sink, dispatcher, bursts, live stats.

`Worker` is what each process (a Locust worker, or the one local process) runs: the
closed-loop requests of its users, its slot of the global open-loop schedule
(calculet_load.workload.arrivals), its part of each burst, and the records of them all. `Plan`
is what the master fixes at test start and every process follows. The wiring that
creates them from Locust's events is calculet_load.locust.plugin.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

import gevent
import gevent.event
import gevent.pool
from locust.env import Environment
from locust.runners import WorkerRunner

from calculet_load.clock import ClockAnchor, SystemClock, clock_provenance
from calculet_load.locust import clocksync as locust_clocksync
from calculet_load.locust.accuracy import Accuracy
from calculet_load.locust.livestats import LiveStats
from calculet_load.locust.llmstats import LLMTable, cell_name, failure_name, itl_histogram
from calculet_load.measure.client import Outcome, Timeouts
from calculet_load.measure.engine import DEFAULT_IO_ENGINE
from calculet_load.measure.heap import PACER
from calculet_load.measure.prompts import (
    Prompt,
    PromptBook,
    PromptFactory,
    WorkloadError,
    target_prompts,
)
from calculet_load.measure.selfwatch import TIMER_SLACK_S, SelfWatch, sleep_until
from calculet_load.measure.session import RequestSpec, RunContext, Session
from calculet_load.measure.sink import PartSink
from calculet_load.schema.access import TargetAccess, access_from
from calculet_load.schema.manifest import load_manifest
from calculet_load.schema.profiles import profile_named
from calculet_load.schema.records import RequestRecord
from calculet_load.target.api import off_loop
from calculet_load.target.describe import model_for
from calculet_load.target.netprobe import measure_round, rounds_record
from calculet_load.workload.arrivals import RateClock, Schedule, load_replay
from calculet_load.workload.calls import Caller, Labels
from calculet_load.workload.conversation import Sessions, SessionStart
from calculet_load.workload.dispatch import FailPause, OpenLoop, Sender
from calculet_load.workload.mixes import Mix, MixChooser, load_mix, single

log = logging.getLogger("calculet_load")

OPEN_LOOP = ("poisson", "constant", "gamma", "replay")  # calculet_load.locust.options
RTT_ROUNDS_KEEP = 60  # during-run RTT rounds kept for the index (a 72-hour run: the last)
RTT_READY_WAIT_S = 30.0  # the first RTT round waits this long at most for start-up to end
RTT_SETTLE_S = 0.5  # ... and then this long


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


class Tasks(Protocol):
    """Programmed users' tasks an open loop runs (calculet_load.locust.llmuser): arrival
    k's task on a user the dispatcher lends it, its first call labelled `labels`."""

    def run(self, k: int, labels: Labels) -> None: ...

    def cell_of(self, k: int) -> str: ...

    def stop(self) -> None: ...


# an arrival of the process's mix: a request, or a conversation's session
Arrival = RequestSpec | SessionStart


@dataclass(frozen=True, slots=True)
class TaskArrival:
    """Arrival k of an open loop of programmed users, and the labels of its first call."""

    k: int
    labels: Labels


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


def target_access(opts: Any, host: str) -> TargetAccess:
    """The target's access (calculet_load.schema.access) from Locust's `-H` and the access
    options, over the manifest's `target` section; AccessError when unusable."""
    target = load_manifest(opts.manifest).target if opts.manifest else None
    return access_from(opts, host, target)


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
        self.llm = LLMTable()  # the LLM tab's per-cell figures (Locust's reset resets it)
        self.llm_pending = LLMTable()  # its changes since the last report to the master
        # A local run is its own master: nothing to report, so the pending twins stay
        # empty (counting every record twice cost 70 µs a request at 320 req/s).
        self.reports = isinstance(env.runner, WorkerRunner)
        self.mix = _mix(self.opts)
        self.chooser = MixChooser(self.mix, plan.seed)
        self.closed_seq = 0
        self.target_users = plan.users
        self.stopping = False
        self.paced = False  # this run started the process's heap pacer (measure.heap)
        self._book: PromptBook | None = None
        # programmed users' tasks, which an open loop runs in place of the mix (the
        # plugin sets them at the start when the locustfile has such users)
        self.tasks: Tasks | None = None
        manifest = load_manifest(self.opts.manifest) if self.opts.manifest else None
        ctx = (
            dataclasses.replace(RunContext.from_manifest(manifest, self.name), run_id=plan.run_id)
            if manifest is not None
            else RunContext(plan.run_id, self.name)
        )
        self.sink = PartSink(plan.run_dir, self.name)
        timeout = float(self.opts.request_timeout)
        host = env.host or ""
        # the target's TLS settings, base path, headers and key (calculet_load.schema.access)
        self.access = target_access(self.opts, host)
        self.session = Session(
            ctx,
            self.access,
            self.opts.protocol,
            model=model_for(
                self.access,
                profile_named(self.opts.target_profile),
                self.opts.protocol,
                self.opts.model or None,
            ),
            max_in_flight=max(int(self.opts.max_in_flight), 1) + 64,
            timeouts=Timeouts.within(timeout),
            sink=self.sink,
            prompt_reuse=bool(self.opts.prompt_reuse),
            io_engine=str(getattr(self.opts, "io_engine", DEFAULT_IO_ENGINE)),
            # the workers' prompts never share a first token (measure.prompts.Nonce)
            lane=(self.slot, len(plan.slots)) if self.slot is not None else (0, 1),
        )
        self.session.hooks.append(self._on_record)
        self.caller = Caller(self.session, self.prompt_for)  # programmed users' calls
        # the conversation entries' sessions, and programmed conversations' ids
        self.sessions = Sessions(self.caller, plan.seed, stopped=lambda: self.stopping)
        self.pool = gevent.pool.Pool(max(int(self.opts.max_in_flight), 1))
        self.streams = gevent.pool.Group()  # programmed users' streams being read
        self.sender: Sender[Arrival] = Sender(self.pool, self._send, self._dropped)
        self.task_sender: Sender[TaskArrival] = Sender(self.pool, self._run_task, self._drop)
        self.rate_clock = RateClock(plan.rate, max(len(plan.slots), 1))
        for at_ns, rate in plan.rate_changes:
            self.rate_clock.change(at_ns, rate)
        self.plan_changed = gevent.event.Event()
        # the schedule's origin on this process's monotonic clock: the master's wall
        # instant, moved onto this worker's wall clock by the measured offset
        self.clock = SystemClock()
        self.offset = locust_clocksync.LOCAL
        self.origin_mono = self.offset.mono_at(plan.origin_wall_ns)
        self._anchor = ClockAnchor.take(self.clock)
        self.burst_sends: dict[str, list[int]] = {}  # burst id -> [first t0, last t0, sent]
        self.session.hooks.append(self._note_burst_send)
        self.rtt_rounds: list[dict[str, Any]] = []
        self._rtt = gevent.spawn(self._rtt_loop)
        # counted per finished request (a listener on every token event would make the
        # session fire an event per token: measured, 2 % of a worker's CPU)
        self.token_events_seen = 0
        self.accuracy = Accuracy()  # the self-check: did this process keep up, per cell
        self.watch = SelfWatch(
            self.sink,
            self.name,
            in_flight=lambda: self.session.in_flight,
            token_events=lambda: self.token_events_seen,
            on_sample=self._on_selfwatch,
        )
        self.watch.start(warmup=True)
        self.dispatcher: gevent.Greenlet[..., Any] | None = None
        self.bursts: list[dict[str, Any]] = []
        self.cpu_percent = 0.0
        self.abandoned = 0
        # Start-up is not load. Nothing is sent before prompts, tokenization
        # and connections are ready; the self-watch marks the time before as warm-up.
        self.ready = gevent.event.Event()
        self._prep = gevent.spawn(self._prepare)

    # --- prompts ------------------------------------------------------------------
    def prompt(self, tokens: int, sample: int) -> Prompt:
        """The run's prompt of `tokens` tokens (corpus sample `sample`), for its protocol."""
        return self.prompt_for(self.opts.protocol, tokens, sample)

    @property
    def prompt_for(self) -> PromptBook:
        """Exact-length prompts for any protocol (text for chat, token ids otherwise),
        sized as the target's profile or tokenizer says; built once, then cached."""
        if self._book is None:
            self._book = PromptBook(self._factory)
        return self._book

    def _factory(self, protocol: str) -> PromptFactory:
        sizing = SimpleNamespace(profile=self.opts.target_profile, tokenizer=self.opts.tokenizer)
        factory = target_prompts(self.session.pool.endpoint.access, protocol, sizing)
        # a local tokenizer also counts the events that carry no count from the server
        self.session.count_text = factory.count_text
        return factory

    def prepare_prompts(self) -> None:
        for entry in self.mix.entries:
            if entry.kind == "conversation":
                self.sessions.prepare(entry)
                continue
            for sample in range(entry.samples):
                self.prompt(entry.prompt_tokens, sample)

    def _prepare(self) -> None:
        """Every prompt of the mix built and tokenized, and a connection open per user
        of this process (closed loop) or a few (open loop), before the first request."""
        try:
            self.prepare_prompts()
            slots = max(len(self.plan.slots), 1)
            if self.plan.arrival == "closed":
                n = -(-max(self.target_users, 1) // slots)
            else:
                n = 4
            self.session.pool.prewarm(min(n, max(int(self.opts.max_in_flight), 1)))
        except (WorkloadError, OSError) as exc:  # the first request reports it as data
            log.error("%s: cannot prepare the load: %s", self.name, exc)
        finally:
            PACER.start()  # start-up's objects frozen, collections paced (measure.heap)
            self.paced = True
            self.watch.end_warmup()
            self.ready.set()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether this process's load is prepared (waiting up to `timeout_s`)."""
        return bool(self.ready.wait(timeout_s))

    def spec_for(self, k: int, **kw: Any) -> Arrival:
        """Arrival k: its request, or the session it starts (a conversation entry);
        `kw`: its labels."""
        entry, sample = self.chooser.entry_for(k)
        if entry.kind == "conversation":
            return SessionStart(k, entry, Labels(**kw), entry.name)
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
    def _live_tables(self) -> tuple[LiveStats, ...]:
        """The live stats a record counts in: this process's, and (reporting to a master)
        what it has not reported yet."""
        return (self.stats, self.wire_pending) if self.reports else (self.stats,)

    def _llm_tables(self) -> tuple[LLMTable, ...]:
        """The LLM tables a record counts in, as `_live_tables`."""
        return (self.llm, self.llm_pending) if self.reports else (self.llm,)

    def _on_record(self, record: RequestRecord, out: Outcome) -> None:
        """One Locust `request` event per request: named by its cell, its E2E time (or
        the time a failure took), its output tokens as the length, its failure class.
        The token-level figures go to the LLM table (calculet_load.locust.llmstats)."""
        for s in self._live_tables():
            _count(s, record, self.opts.model)
        self.token_events_seen += record.ext.token_events or 0
        self.accuracy.observe(record)
        itl = itl_histogram(out.token_events) if out.ok else None
        for t in self._llm_tables():
            t.observe(record, itl=itl)
        if out.cancelled_at == "run_stop":
            return  # cut by the end of the run: counted cancelled, no Locust request
        d = record.durations_ms
        exc = (
            None
            if out.error_class is None or out.cancelled_at is not None  # cancelled on purpose
            else RequestFailed(failure_name(out.error_class, out.error_code))
        )
        self.env.events.request.fire(
            request_type=record.ext.protocol or self.opts.protocol,
            name=cell_name(record),
            response_time=d.e2e if d.e2e is not None else _elapsed_ms(record),
            response_length=record.workload.actual_output_tokens or 0,
            exception=exc,
            context={},
        )

    def _note_burst_send(self, record: RequestRecord, out: Outcome) -> None:
        """Each burst's first and last actual send (t0), for its spread across workers."""
        t0 = record.client_ns.request_start
        if record.ext.burst_id is None or t0 is None:
            return
        s = self.burst_sends.setdefault(record.ext.burst_id, [t0, t0, 0])
        s[0], s[1], s[2] = min(s[0], t0), max(s[1], t0), s[2] + 1

    def _rtt_loop(self) -> None:
        """RTT and jitter to the target (§5): one round before the schedule starts, then
        one every --rtt-every s while the run goes on (0: the first only)."""
        samples = int(getattr(self.opts, "rtt_samples", 0) or 0)
        every_s = float(getattr(self.opts, "rtt_every", 0.0) or 0.0)
        phase = "before"
        path = profile_named(self.opts.target_profile).health_probe_path
        # The worker's own start-up (imports, Locust's spawn, and its prompts, tokenization
        # and connections, which load the target too) would stretch the round trips:
        # measured, by 25-60 ms. The first round waits for it to end.
        self.ready.wait(RTT_READY_WAIT_S)
        gevent.sleep(RTT_SETTLE_S)
        while samples > 0 and not self.stopping:
            try:  # a native thread: the round trips are not stretched by this loop's lag
                row = off_loop(
                    lambda: measure_round(self.access, samples, path=path, clock=self.clock)
                )
            except ValueError as exc:
                log.warning("%s: no RTT measurement: %s", self.name, exc)
                return
            self.rtt_rounds.append({"phase": phase, **row})
            del self.rtt_rounds[1:-RTT_ROUNDS_KEEP]  # the first ("before") and the latest
            if every_s <= 0:
                return
            phase = "during"
            gevent.sleep(every_s)  # stop() kills this greenlet

    def target_rtt(self) -> dict[str, Any]:
        """The rounds measured, and the first round's figures as the run's "before"."""
        return rounds_record(self.rtt_rounds)

    def _on_selfwatch(self, row: Any) -> None:
        self.accuracy.observe_sample(row.mono_ns, row.loop_lag_ms, bool(row.warmup))
        for s in self._live_tables():
            s.observe("loop_lag", row.loop_lag_ms)
        if not row.warmup:
            for t in self._llm_tables():
                t.observe_loop_lag(row.loop_lag_ms)
        self.cpu_percent = row.cpu_percent
        self.stats.in_flight[self.name] = row.in_flight or 0  # a local run's gauges
        self.stats.cpu_percent[self.name] = row.cpu_percent

    # --- closed loop ----------------------------------------------------------------
    def closed_request(self, pause: FailPause) -> None:
        """One closed-loop request of a user; `pause` is that user's (see FailPause)."""
        slots = max(len(self.plan.slots), 1)
        k = self.closed_seq * slots + (self.slot or 0)
        self.closed_seq += 1
        spec = self.spec_for(k, concurrency=self.target_users or None, arrival="closed")
        if isinstance(spec, SessionStart):
            turns = self.sessions.run(spec)
            if turns:
                pause.wait(turns[-1].error_class, turns[-1].unanswered)
            return
        pause.after(self.session.send(spec)[1])

    # --- open loop --------------------------------------------------------------------
    def start_dispatcher(self) -> None:
        if self.slot is None:
            log.warning("%s has no dispatcher slot in this run's plan: it sends nothing", self.name)
            return
        self.dispatcher = gevent.spawn(self._dispatch)

    def _dispatch(self) -> None:
        opts = self.opts
        self.ready.wait()
        try:
            self.prepare_prompts()  # built by _prepare: this only finds its failure
        except (WorkloadError, OSError) as exc:
            log.error("%s: cannot prepare prompts: %s", self.name, exc)
            return
        replay = load_replay(opts.replay_file) if self.plan.arrival == "replay" else ()
        sched = Schedule(
            self.plan.arrival,
            self.plan.seed,
            self.rate_clock,
            burstiness=float(opts.burstiness),
            replay=replay,
        )
        assert self.slot is not None
        loop: OpenLoop[Any] = OpenLoop(
            schedule=sched,
            clock=self.rate_clock,
            origin_ns=self.origin_mono,
            sender=self.sender if self.tasks is None else self.task_sender,
            spec=self._spec if self.tasks is None else self._arrival,
            slot=self.slot,
            stopped=lambda: self.stopping,
            wake=self.plan_changed,
            late_after_ms=float(opts.late_ms),
            why_full=" at the intended time",
            early=self.session.io_engine == "thread",
        )
        loop.run()
        if not self.stopping:
            log.info("%s: the arrival log is exhausted", self.name)

    def _spec(self, k: int, due: int, burst_id: str | None = None) -> Arrival:
        return self.spec_for(
            k,
            arrival="burst" if burst_id else self.plan.arrival,
            intended_start_ns=due,
            late_after_ms=float(self.opts.late_ms),
            burst_id=burst_id,
        )

    def _labels(self, due: int, burst_id: str | None) -> Labels:
        """An arrival's labels: its kind, intended instant, lateness bound, burst."""
        return Labels(
            arrival="burst" if burst_id else self.plan.arrival,
            intended_start_ns=due,
            late_after_ms=float(self.opts.late_ms),
            burst_id=burst_id,
        )

    def _arrival(self, k: int, due: int, burst_id: str | None = None) -> TaskArrival:
        return TaskArrival(k, self._labels(due, burst_id))

    def _run_task(self, arrival: TaskArrival) -> None:
        assert self.tasks is not None
        self.tasks.run(arrival.k, arrival.labels)

    def _drop(self, arrival: TaskArrival, reason: str) -> None:
        """A programmed user's arrival that found the in-flight cap full: a dropped
        record under its task's name (its calls were never made)."""
        assert self.tasks is not None
        lb = arrival.labels
        spec = RequestSpec(
            prompt=Prompt.written(),
            max_tokens=0,
            cell=self.tasks.cell_of(arrival.k),
            arrival=lb.arrival,
            intended_start_ns=lb.intended_start_ns,
            late_after_ms=lb.late_after_ms,
            burst_id=lb.burst_id,
        )
        self._dropped(spec, reason)

    def _dropped(self, spec: Arrival, reason: str) -> None:
        if isinstance(spec, SessionStart):
            spec = self.sessions.dropped_spec(spec)
        record = self.session.record_dropped(spec, reason)
        for s in self._live_tables():
            _count(s, record, self.opts.model)
        for t in self._llm_tables():
            t.observe(record)

    def _send(self, spec: Arrival) -> None:
        try:
            if isinstance(spec, SessionStart):
                self.sessions.run(spec)
            else:
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
        deadline = self.offset.mono_at(fire_at_wall_ns)  # the master's instant, our clock
        specs_k = [first_k + i for i in range(n)]
        try:
            if self.tasks is None:
                for k in specs_k:
                    self.spec_for(k)  # prompts ready before the instant
            self.session.pool.prewarm(n)
        except (WorkloadError, OSError) as exc:
            log.error("%s: burst %s: cannot prepare: %s", self.name, burst_id, exc)
        if self.tasks is not None and self.session.io_engine == "thread":
            # the tasks start a timer's slack early; the engine sends at the instant
            sleep_until(deadline - int(TIMER_SLACK_S * 1e9))
        else:
            sleep_until(deadline)
        sent_wall = self.clock.wall_ns()
        for k in specs_k:
            if self.tasks is None:
                self.sender.fire(self._spec(k, deadline, burst_id), " at the intended time")
            else:
                self.task_sender.fire(self._arrival(k, deadline, burst_id), " at the instant")
        self.bursts.append(
            {
                "id": burst_id,
                "n": n,
                "fired_wall_ns": sent_wall,
                "fired_master_ns": self.offset.to_master_ns(sent_wall),
                "master_offset_ns": self.offset.offset_ns,
                "late_ms": (self.clock.mono_ns() - deadline) / 1e6,
            }
        )

    # --- end ------------------------------------------------------------------------
    def stop(self, timeout_s: float) -> None:
        self.stopping = True
        self.plan_changed.set()
        self._rtt.kill(block=False)
        self._prep.kill(block=False)
        if self.dispatcher is not None:
            self.dispatcher.join(timeout=5)
            self.dispatcher.kill()
        self.pool.join(timeout=timeout_s)
        self.streams.join(timeout=1.0)  # their users are stopped: none reads them now
        # still running after the stop timeout: cut, and recorded as cancelled at run stop
        self.abandoned = len(self.pool) + len(self.streams)
        self.pool.kill(block=True, timeout=5)
        self.streams.kill(block=True, timeout=5)
        if self.tasks is not None:
            self.tasks.stop()
        self.watch.stop()
        self.sink.close()
        self.session.close()
        if self.paced:
            self.paced = False
            PACER.stop()

    def parts(self) -> list[str]:
        return sorted(
            info.path.rsplit("/", 1)[-1]
            for info in self.sink.fs.get_file_info(_selector(self.sink.dir))
            if info.path.endswith(".parquet")
        )

    def take_llm_pending(self) -> dict[str, Any]:
        """The LLM figures not yet reported to the master (then none are pending)."""
        wire = self.llm_pending.to_wire()
        self.llm_pending = LLMTable()
        return wire

    def reset_llm(self) -> None:
        """Locust's "Reset stats": the LLM figures start again (the records do not)."""
        self.llm.reset()
        self.llm_pending = LLMTable()

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
            "master_clock": self.offset.snapshot(),
            "target_rtt": self.target_rtt(),
            "bursts": [{**b, **self._burst_sent(b["id"])} for b in self.bursts],
            "sink": dataclasses.asdict(self.sink.stats),
            "accuracy": self.accuracy.to_wire(),
        }

    def _burst_sent(self, burst_id: str) -> dict[str, Any]:
        """A burst's actual first and last send on the master's wall clock (through this
        worker's anchor and measured offset), and how many were sent."""
        s = self.burst_sends.get(burst_id)
        if s is None:
            return {"sent": 0}
        first, last = (self.offset.to_master_ns(self._anchor.wall_ns_at(t)) for t in s[:2])
        return {"sent": s[2], "first_send_master_ns": first, "last_send_master_ns": last}


class RequestFailed(Exception):
    """The exception Locust's request event carries for a failed request: its class and
    code (llmstats.failure_name), a bounded set of names."""


def _selector(path: str) -> Any:
    from pyarrow.fs import FileSelector

    return FileSelector(path, allow_not_found=True)


def _elapsed_ms(record: RequestRecord) -> float:
    """From the request's start to its last stamp (a failed request has no E2E)."""
    ns = record.client_ns
    if ns.request_start is None:
        return 0.0
    stamps: list[int] = [v for v in dataclasses.astuple(ns) if v is not None]
    return (max(stamps) - ns.request_start) / 1e6


def _count(s: LiveStats, record: RequestRecord, model: str = "") -> None:
    e = record.ext
    c = s.counters
    if e.dropped:
        c["dropped"] += 1
        return
    s.observe_series(record, model)  # labelled series for Prometheus
    c["requests"] += 1
    if e.error_class is None:
        c["ok"] += 1
    elif e.cancelled_at is not None:  # by its user, or cut by the run's stop: no failure
        c["cancelled"] += 1
    else:
        c["failed"] += 1
        s.errors[e.error_class] += 1
    if e.late:
        c["late"] += 1
    if e.token_count_mismatch:
        c["count_mismatch"] += 1
    c["output_tokens"] += record.workload.actual_output_tokens or 0
    c["token_events"] += e.token_events or 0
    c["prompt_tokens"] += record.workload.prompt_tokens or 0
    d = record.durations_ms
    s.observe("ttft", d.ttft)
    s.observe("tpot", d.tpot)
    s.observe("e2e", d.e2e)
    s.observe("ttft_sched", e.ttft_from_intended_ms)
    if e.send_lag_ms is not None:
        s.observe("send_lag", max(e.send_lag_ms, 0.0))
