"""One worker's measuring session: send a request, turn its outcome into a record, sink it.

`Session.send(spec)` is the single path every caller uses (probe, Locust users, the
acceptance pipeline): build the body from an exact-length prompt, run the timed client,
compute the §2.2 durations, and append the record and its token events to the sink.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import socket
from collections.abc import Callable
from typing import Any

import gevent

from calculet_load.clock import Clock, SystemClock
from calculet_load.events import events
from calculet_load.measure.connections import Endpoint
from calculet_load.measure.durations import durations
from calculet_load.measure.io_engines import DEFAULT_IO_ENGINE, IOEngine, open_engine
from calculet_load.measure.outcome import OUTPUT_SLACK_TOKENS, CancelAt, OnToken, Outcome, Timeouts
from calculet_load.measure.prompts import Prompt, nonce_salt
from calculet_load.measure.protocols import adapter_for
from calculet_load.measure.sink import PartSink
from calculet_load.schema.access import TargetAccess
from calculet_load.schema.manifest import RunManifest
from calculet_load.schema.records import (
    ClientNs,
    Ext,
    Hardware,
    Quality,
    RequestRecord,
    Result,
    Software,
    TokenEvent,
    Workload,
)


@dataclasses.dataclass(frozen=True, slots=True)
class RunContext:
    """What every record of a run shares (from the manifest, or defaults for a probe)."""

    run_id: str
    worker: str
    host: str = dataclasses.field(default_factory=socket.gethostname)
    model_alias: str | None = None
    model_generation: int | None = None
    calbin_sha256: str | None = None
    software: Software = dataclasses.field(default_factory=Software)
    hardware: Hardware = dataclasses.field(default_factory=Hardware)

    @classmethod
    def from_manifest(cls, m: RunManifest, worker: str) -> RunContext:
        return cls(
            run_id=m.run_id,
            worker=worker,
            host=m.client.host,
            model_alias=m.model.alias,
            model_generation=m.model.generation,
            calbin_sha256=m.model.calbin_sha256,
            software=Software(
                server_commit=m.software.server_commit,
                image_digest=m.software.image_digest,
                calrt=m.software.calrt,
                driver=m.software.driver,
                firmware=m.software.firmware,
            ),
            hardware=Hardware(
                board_serial_hash=hashlib.sha256(m.hardware.board.encode()).hexdigest()[:16],
                chips=m.hardware.chips,
                power_mode=m.hardware.power_mode,
            ),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class RequestSpec:
    """What to send and how it is labelled."""

    prompt: Prompt
    max_tokens: int
    stream: bool = True
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = True
    cell: str | None = None
    concurrency: int | None = None
    arrival: str | None = None
    intended_start_ns: int | None = None  # open loop: the schedule's monotonic time
    late_after_ms: float | None = None  # sent later than this after intended: `late`
    burst_id: str | None = None
    warmup: bool = False
    cancel: CancelAt = None
    # send the prompt as built (golden and reference requests, whose outputs are
    # compared): no per-request nonce
    reuse: bool = False
    # What a programmed user (calculet_load.locust.llmuser) adds: the protocol of this
    # request (None: the session's), chat messages sent in place of the prompt's text,
    # fields merged into the body, the generated text kept in the outcome (memory only),
    # a listener of its token events as they arrive, and its conversation and turn.
    protocol: str | None = None
    messages: list[dict[str, Any]] | None = None
    extra_body: dict[str, Any] | None = None
    keep_text: bool = False
    on_token: OnToken | None = None
    session_id: str | None = None
    turn: int | None = None

    @property
    def sampling(self) -> str:
        return "greedy" if self.temperature == 0 else "seeded"


def golden_spec(case: Any, prompt: Prompt, cell: str, **over: Any) -> RequestSpec:
    """The request of one golden case (a `calculet_load.workload.matrix.GoldenCase`);
    `over`: fields a driver sends otherwise (the fault matrix: unstreamed)."""
    fields: dict[str, Any] = {"concurrency": 1, "arrival": "single"} | over
    return RequestSpec(
        prompt=prompt,
        max_tokens=case.max_tokens,
        temperature=case.temperature,
        seed=case.seed,
        cell=cell,
        reuse=True,
        **fields,
    )


def clock_complete(ns: ClientNs, tokens: int, ok: bool, wall_anchor: int | None) -> bool:
    """Every stamp the request's outcome requires is present and in order: t0 <= t2 <=
    t3 <= t4 <= t5 <= t6, and t1 after t0. t1 is not ordered against t2: a t1 taken when
    the send returned can come after the kernel's receive time of the headers (the
    record's `ext.sent_stamp_late`), and a server may answer before a request's last byte
    left; neither makes the response's stamps wrong."""
    if wall_anchor is None or not ok:
        return False
    need = [ns.request_start, ns.response_headers, ns.first_event]
    if tokens:
        need.append(ns.first_token)
        if ns.last_token is not None:
            need.append(ns.last_token)
    need.append(ns.response_end)
    t0, t1 = ns.request_start, ns.headers_sent
    if any(v is None for v in need) or t0 is None or t1 is None or t1 < t0:
        return False
    return all(a <= b for a, b in itertools.pairwise(need))  # type: ignore[operator]


def make_record(
    ctx: RunContext,
    spec: RequestSpec,
    out: Outcome,
    protocol: str,
    unique_from: int | None = None,
    turnaround_ns: int | None = None,
) -> RequestRecord:
    ns = out.client_ns
    t0 = ns.request_start
    late_ms = (
        (t0 - spec.intended_start_ns) / 1e6
        if spec.intended_start_ns is not None and t0 is not None
        else None
    )
    prompt_tokens, prompt_source = spec.prompt.tokens, spec.prompt.count_source
    if prompt_tokens is None and out.prompt_tokens_server is not None:
        # a prompt the caller wrote (messages, text): its length as the server counted it
        prompt_tokens, prompt_source = out.prompt_tokens_server, "server"
    first_answer = out.first_answer_ns
    from_intended: dict[str, float | None] = {"e2e": None, "ttft": None}
    if spec.intended_start_ns is not None:
        for key, stamp in (("e2e", ns.response_end), ("ttft", ns.first_token)):
            if stamp is not None:
                from_intended[key] = (stamp - spec.intended_start_ns) / 1e6
    return RequestRecord(
        run_id=ctx.run_id,
        request_id=out.request_id,
        model_alias=ctx.model_alias,
        model_generation=ctx.model_generation,
        calbin_sha256=ctx.calbin_sha256,
        software=ctx.software,
        hardware=ctx.hardware,
        workload=Workload(
            prompt_tokens=prompt_tokens,
            requested_output_tokens=spec.max_tokens or None,  # 0: a dropped task's
            actual_output_tokens=(
                out.output_tokens if out.events and out.count_source != "missing" else None
            ),
            concurrency=spec.concurrency,
            stream=spec.stream,
            seed=spec.seed,
        ),
        client_ns=ns,
        durations_ms=durations(ns, out.output_tokens) if out.ok else _partial(out),
        result=Result(
            http_status=out.http_status,
            finish_reason=out.finish_reason,
            token_hash=out.token_hash,
            error_code=out.error_code,
        ),
        quality=Quality(
            clock_complete=clock_complete(ns, out.output_tokens, out.ok, out.wall_anchor_ns),
            warmup=spec.warmup,
        ),
        ext=Ext(
            wall_anchor_ns=out.wall_anchor_ns,
            worker=ctx.worker,
            host=ctx.host,
            cell=spec.cell,
            protocol=spec.protocol or protocol,
            arrival=spec.arrival,
            intended_start_ns=spec.intended_start_ns,
            send_lag_ms=late_ms,
            late=(
                late_ms is not None
                and spec.late_after_ms is not None
                and late_ms > spec.late_after_ms
            ),
            dropped=out.error_class == "dropped",
            burst_id=spec.burst_id,
            e2e_from_intended_ms=from_intended["e2e"] if out.ok else None,
            ttft_from_intended_ms=from_intended["ttft"],
            error_class=out.error_class,
            error_detail=out.error_detail,
            events=out.events,
            token_events=len(out.token_events),
            client_output_tokens=out.event_tokens,
            server_output_tokens=out.server_total,
            server_prompt_tokens=out.prompt_tokens_server,
            token_count_source=out.count_source,
            token_total_source=out.total_source,
            token_count_mismatch=out.token_count_mismatch,
            connection_reused=out.connection_reused,
            connect_ms=out.connect_ns / 1e6 if out.connect_ns is not None else None,
            cancelled_at=out.cancelled_at,
            corpus_sample_id=spec.prompt.sample_id or None,
            sampling=spec.sampling,
            temperature=spec.temperature,
            nonfinite_field=out.nonfinite,
            error_output_chars=out.error_output_chars or None,
            invalid_value=out.invalid_value,
            count_anomaly=out.count_anomaly,
            prompt_count_source=prompt_source,
            prompt_unique_from=unique_from,
            cached_prompt_tokens=out.cached_tokens,
            stale_retry=out.stale_retry,
            stamp_source=out.stamp_source,
            sent_stamp_source=out.sent_stamp_source,
            sent_stamp_late=out.sent_stamp_late,
            read_wait_ms=out.read_wait_ns / 1e6 if out.read_wait_ns is not None else None,
            stamp_late_bound_ms=(
                out.late_bound_ns / 1e6 if out.late_bound_ns is not None else None
            ),
            event_reads=out.event_reads if out.events else None,
            max_events_per_read=out.max_events_per_read if out.events else None,
            turnaround_ms=turnaround_ns / 1e6 if turnaround_ns is not None else None,
            session_id=spec.session_id,
            turn=spec.turn,
            first_answer_ns=first_answer,
            ttft_answer_ms=(
                (first_answer - t0) / 1e6 if first_answer is not None and t0 is not None else None
            ),
            reasoning_tokens=out.reasoning_tokens,
            answer_tokens=out.answer_tokens,
        ),
    )


def turnaround(spec: RequestSpec, out: Outcome, called_ns: int, back_ns: int) -> int | None:
    """The client's own time around a request (ns): from the driver's `send` at
    `called_ns` (or the schedule's instant, when the send was handed over before it) to
    its start stamp t0, and from its response's end t6 to the outcome back in the
    driver's hands at `back_ns`. A closed-loop user's next request waits for it: at 256
    streams in waves, p50 4.7-7.6 ms and p99 about 100 ms (docs/measurement.md). None
    without a start or a response end (a failure's end is its timeout's or its error's,
    not the client's)."""
    ns = out.client_ns
    t0, t6 = ns.request_start, ns.response_end
    if t0 is None or t6 is None:
        return None
    due = spec.intended_start_ns
    start = called_ns if due is None else max(called_ns, due)
    return max(t0 - start, 0) + max(back_ns - t6, 0)


def _partial(out: Outcome) -> Any:
    """A failed request keeps the durations it reached (TTFT of a request cut mid-stream
    is real), but E2E and TPOT describe a normal end only and stay null."""
    d = durations(out.client_ns, out.output_tokens)
    return dataclasses.replace(d, e2e=None, tpot=None)


RecordHook = Callable[[RequestRecord, Outcome], None]

# The nonce's sequence number is drawn per process, not per session: sessions that share
# a run context (one per timeout in the fault matrix, one per test) never send the same
# nonce. The salt adds this process's randomness, so neither do two runs of one run id.
_SENDS = itertools.count(0)
_PROCESS_SALT = os.urandom(8).hex()


def _token_hook(also: OnToken | None) -> OnToken:
    """Fires `events.first_token` once and `events.token_event` for each token event (when
    anyone listens), then calls the request's own listener `also`."""
    first = True
    fire = bool(events.token_event or events.first_token)

    def on_token(ev: TokenEvent, text: str, reasoning: str) -> None:
        nonlocal first
        if fire:
            if first:
                first = False
                events.first_token.fire(request_id=ev.request_id, arrival_ns=ev.arrival_ns)
            events.token_event.fire(event=ev)
        if also is not None:
            also(ev, text, reasoning)

    return on_token


class Session:
    """Sends requests to one target and records them."""

    def __init__(
        self,
        ctx: RunContext,
        url: str | TargetAccess,
        protocol: str,
        *,
        model: str | None = None,
        max_in_flight: int = 1,
        timeouts: Timeouts | None = None,
        sink: PartSink | None = None,
        clock: Clock | None = None,
        output_slack_tokens: int = OUTPUT_SLACK_TOKENS,
        prompt_reuse: bool = False,
        count_text: Callable[[str], int] | None = None,
        io_engine: str = DEFAULT_IO_ENGINE,
        lane: tuple[int, int] = (0, 1),
    ) -> None:
        if not 0 <= lane[0] < lane[1]:
            raise ValueError(f"lane {lane!r}: expected (i, n) with 0 <= i < n")
        self.ctx = ctx
        # where the socket I/O runs: gevent (this greenlet) or thread (the loop thread)
        self.io_engine = io_engine
        # events with text and no count from the server: the local tokenizer counts them
        self.count_text = count_text
        # Unique prompts unless reuse is asked for (a cache study): see measure.prompts.
        self.prompt_reuse = prompt_reuse
        self._salt = nonce_salt(ctx.run_id, ctx.worker, _PROCESS_SALT)
        # this process's lane among the run's senders: their prompts' first tokens differ
        self.lane = lane
        self.output_slack_tokens = output_slack_tokens
        self.adapter = adapter_for(protocol)
        self.protocol = protocol
        self.model = model
        # the target's connections on the chosen engine, and the requests sent over them
        self.pool: IOEngine = open_engine(io_engine, Endpoint(url), max_in_flight)
        self.timeouts = timeouts or Timeouts()
        self.sink = sink
        self.clock = clock or SystemClock()
        self.hooks: list[RecordHook] = []
        self._seq = itertools.count(1)
        self.in_flight = 0

    def next_request_id(self) -> str:
        return f"{self.ctx.run_id}.{self.ctx.worker}.{next(self._seq):08d}"

    def unique(self, prompt: Prompt, reuse: bool = False) -> tuple[str | list[int], int | None]:
        """The prompt's payload as one request sends it: made unique by its nonce (a
        number no other request of this process or run draws), unless it is reused; and
        the first token where it differs from others (None: reused)."""
        seq = next(_SENDS)
        nonce = prompt.nonce
        if nonce is None or reuse or self.prompt_reuse:
            return prompt.payload, None
        return nonce.apply(prompt.payload, seq, self._salt, self.lane), prompt.unique_from

    def send(self, spec: RequestSpec) -> tuple[RequestRecord, Outcome]:
        called = self.clock.mono_ns()
        payload, unique_from = self.unique(spec.prompt, spec.reuse)
        adapter = self.adapter if spec.protocol is None else adapter_for(spec.protocol)
        body = adapter.body(
            spec.messages if spec.messages is not None else payload,
            spec.max_tokens,
            stream=spec.stream,
            model=self.model,
            temperature=spec.temperature,
            seed=spec.seed,
            ignore_eos=spec.ignore_eos,
        )
        if spec.extra_body:
            body.update(spec.extra_body)
        self.in_flight += 1
        listened = events.token_event or events.first_token or spec.on_token is not None
        on_token = _token_hook(spec.on_token) if listened else None
        kw: dict[str, Any] = dict(
            stream=spec.stream,
            timeouts=self.timeouts,
            clock=self.clock,
            cancel=spec.cancel,
            on_token=on_token,
            max_tokens=spec.max_tokens,
            output_slack_tokens=self.output_slack_tokens,
            count_text=self.count_text,
            keep_text=spec.keep_text,
        )
        try:
            # the engine sends at the intended time itself (an open loop's arrival may be
            # handed over before it is due)
            out = self.pool.execute(
                adapter, body, self.next_request_id(), send_at_ns=spec.intended_start_ns, **kw
            )
        except gevent.GreenletExit as exc:  # the run stopped mid-request: keep the record
            cut: Outcome | None = getattr(exc, "outcome", None)
            if cut is not None:
                self._finish(spec, cut, unique_from)
            raise
        finally:
            self.in_flight -= 1
        held = turnaround(spec, out, called, self.clock.mono_ns())
        return self._finish(spec, out, unique_from, held), out

    def _finish(
        self, spec: RequestSpec, out: Outcome, unique_from: int | None, held: int | None = None
    ) -> RequestRecord:
        record = make_record(self.ctx, spec, out, self.protocol, unique_from, held)
        if self.sink is not None:
            self.sink.add(record, out.token_events)
        for hook in self.hooks:
            hook(record, out)
        if events.request_done:
            events.request_done.fire(record=record, outcome=out)
        return record

    def record_dropped(self, spec: RequestSpec, reason: str) -> RequestRecord:
        """Record an arrival that was not sent (in-flight cap full): never silently lost."""
        out = Outcome(self.next_request_id())
        out.wall_anchor_ns = self.clock.wall_ns()
        out.error_class = out.error_code = "dropped"
        out.error_detail = reason
        record = make_record(self.ctx, spec, out, self.protocol)
        if self.sink is not None:
            self.sink.add(record)
        if events.arrival_dropped:
            events.arrival_dropped.fire(record=record)
        return record

    def close(self) -> None:
        self.pool.close()
