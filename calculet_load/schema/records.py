"""Client-side records: the request record `calculet-perf-request/v1` (spec §3) and the
token-event table.

The request record has exactly the groups and fields of spec §3, in that order, plus one
trailing group `ext` holding what the harness needs beyond §3 (wall anchor, open-loop
intended time, error class, token reconciliation, provenance of the sample). The strict
§3 JSONL export drops `ext`. Times in `client_ns` are integer nanoseconds of the client's
monotonic clock; `ext.wall_anchor_ns` pairs one of them with the wall clock and is the
only wall time (for joining across hosts, never for durations). "No data" is None.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
from pydantic import TypeAdapter

REQUEST_SCHEMA = "calculet-perf-request/v1"
TOKEN_EVENT_SCHEMA = "calculet-token-event/v1"


@dataclasses.dataclass(frozen=True, slots=True)
class Software:
    server_commit: str | None = None
    image_digest: str | None = None
    calrt: str | None = None
    driver: str | None = None
    firmware: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Hardware:
    board_serial_hash: str | None = None
    chips: int | None = None
    power_mode: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    prompt_tokens: int | None = None
    requested_output_tokens: int | None = None
    actual_output_tokens: int | None = None
    concurrency: int | None = None
    stream: bool | None = None
    seed: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ClientNs:
    """t0..t6 of spec §2.1, monotonic ns; None when the point was never reached."""

    request_start: int | None = None
    headers_sent: int | None = None
    response_headers: int | None = None
    first_event: int | None = None
    first_token: int | None = None
    last_token: int | None = None
    response_end: int | None = None

    def last_stamp(self) -> int | None:
        """The latest point reached (the request's span ends there; None: none was)."""
        stamps = (
            self.request_start,
            self.headers_sent,
            self.response_headers,
            self.first_event,
            self.first_token,
            self.last_token,
            self.response_end,
        )
        return max((t for t in stamps if t is not None), default=None)


@dataclasses.dataclass(frozen=True, slots=True)
class DurationsMs:
    """Spec §2.2: TTFH=t2-t0, TTFE=t3-t0, TTFT=t4-t0, TPOT=(t5-t4)/(n-1), E2E=t6-t0."""

    ttfh: float | None = None
    ttfe: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ServerMs:
    queue: float | None = None
    prefill: float | None = None
    decode_total: float | None = None
    postprocess: float | None = None
    sampling: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RuntimeMs:
    h2d_prefill: float | None = None
    infer_prefill: float | None = None
    d2h_prefill: float | None = None
    h2d_decode: float | None = None
    infer_decode: float | None = None
    d2h_decode: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    http_status: int | None = None
    finish_reason: str | None = None
    token_hash: str | None = None
    error_code: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Quality:
    clock_complete: bool = False
    server_trace_joined: bool = False
    warmup: bool = False
    throttled: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Ext:
    """What the harness records beyond spec §3."""

    wall_anchor_ns: int | None = None  # wall clock read together with client_ns.request_start
    worker: str | None = None
    host: str | None = None
    cell: str | None = None
    protocol: str | None = None
    arrival: str | None = None  # closed | poisson | constant | gamma | replay | burst | single
    intended_start_ns: int | None = None  # open loop: the schedule's time (monotonic)
    send_lag_ms: float | None = None  # actual send minus intended
    late: bool = False  # sent more than the run's late threshold after its intended time
    dropped: bool = False  # an open-loop arrival that found the in-flight cap full: not sent
    burst_id: str | None = None  # the burst this request belongs to (fired at one instant)
    e2e_from_intended_ms: float | None = None
    ttft_from_intended_ms: float | None = None
    error_class: str | None = None
    error_detail: str | None = None
    events: int | None = None  # SSE events received
    token_events: int | None = None  # events that carried >= 1 generated token
    client_output_tokens: int | None = None  # the client's own count: its events' sum
    server_output_tokens: int | None = None  # the server's final total
    server_prompt_tokens: int | None = None  # the prompt length the server reported
    # the per-event counts' source: usage | tokens_predicted | tokenizer | chunks
    # (fallback), "+usage_total" when the server's total differs from their sum
    token_count_source: str | None = None
    # whose count workload.actual_output_tokens is: "server" (its final usage or count)
    # or "events" (the per-event counts' sum: no total came); null: no count
    token_total_source: str | None = None
    # the per-event counts disagree with the server's total beyond the declared slack
    # (its reason in count_anomaly), or another count anomaly
    token_count_mismatch: bool = False
    connection_reused: bool | None = None
    # a new connection's connect and TLS handshake (and a process's first name lookup),
    # ms (null: a kept-alive connection)
    connect_ms: float | None = None
    cancelled_at: str | None = None
    corpus_sample_id: str | None = None
    sampling: str | None = None  # greedy | seeded
    temperature: float | None = None
    nonfinite_field: bool = False
    invalid_value: str | None = None  # a failure's offending raw value, bounded text
    count_anomaly: str | None = None  # why the token count was flagged (mismatch)
    prompt_count_source: str | None = None  # who counted the prompt's tokens (tokenizer)
    prompt_unique_from: int | None = None  # first token that differs per request; null: reused
    # prompt tokens the server served from its prefix cache, where it says
    # (`usage.prompt_tokens_details.cached_tokens`, llama.cpp `timings.cache_n`); null
    # where it does not say, never 0
    cached_prompt_tokens: int | None = None
    # sent again on a new connection: the kept-alive one closed before any response byte
    stale_retry: bool = False
    event_reads: int | None = None  # reads that delivered the events (few: coalesced)
    max_events_per_read: int | None = None  # the most events one read delivered
    # spec §14.1 "error responses carry no uninitialized output": an error body or final
    # error event carried generated text (its characters; null: none, or not an error)
    error_output_chars: int | None = None
    # where the client's stamps t2..t6 and its token events came from: "kernel" (the
    # kernel's receive time of each read's last bytes) or "read" (when the read
    # returned); null: no bytes came. t0 is always the client's clock before the send
    stamp_source: str | None = None
    # where t1 came from: "kernel" (the kernel's transmit time of the request's last
    # byte) or "send" (when the client's last send call returned); null: not sent
    sent_stamp_source: str | None = None
    # t1 from "send" is after t2 from the kernel: the headers arrived while the send call
    # returned, so t1 <= t2 is broken by t1's lateness alone (t2 and the durations hold)
    sent_stamp_late: bool = False
    # kernel stamps: the longest any read's bytes waited in the kernel for the client
    # (its loop busy; not in the stamps: null with read stamps)
    read_wait_ms: float | None = None
    # kernel stamps: the most its first token's stamp can be late (token events that came
    # in one read share the stamp of its last bytes): the self-check (null: read stamps)
    stamp_late_bound_ms: float | None = None
    # the client's own time around the request: from the driver's send (or the schedule's
    # instant, when the send was handed over before it) to t0, and from the response's end
    # t6 to the outcome back in the driver's hands; a closed-loop user's next request
    # waits for it (null: no response end)
    turnaround_ms: float | None = None
    # a conversation's turns (`LLMUser.llm.conversation`, the `conversation` workload):
    # the session a turn belongs to and the turn's index in it, from 0; the context the
    # turn sent is `workload.prompt_tokens` (the whole history and this turn's message)
    session_id: str | None = None
    turn: int | None = None
    # reasoning models, where the stream carried reasoning apart from the answer
    # (`reasoning_content` deltas, or `<think>...</think>` leading the text): the first
    # token event carrying answer text that is not only whitespace (monotonic ns) and its
    # time from t0, and the generated tokens of each phase (null: no reasoning was seen)
    first_answer_ns: int | None = None
    ttft_answer_ms: float | None = None
    reasoning_tokens: int | None = None
    answer_tokens: int | None = None


# Columns added to `calculet-perf-request/v1` after its first release, each optional: a
# reader fills them with nulls in parts written before them (never a different meaning).
ADDED_REQUEST_COLUMNS = (
    "ext.invalid_value",
    "ext.count_anomaly",
    "ext.prompt_count_source",
    "ext.prompt_unique_from",
    "ext.cached_prompt_tokens",
    "ext.event_reads",
    "ext.max_events_per_read",
    "ext.stale_retry",
    "ext.error_output_chars",
    "ext.stamp_source",
    "ext.read_wait_ms",
    "ext.stamp_late_bound_ms",
    "ext.connect_ms",
    "ext.turnaround_ms",
    "ext.session_id",
    "ext.turn",
    "ext.first_answer_ns",
    "ext.ttft_answer_ms",
    "ext.reasoning_tokens",
    "ext.answer_tokens",
    "ext.sent_stamp_source",
    "ext.sent_stamp_late",
    "ext.token_total_source",
)
# Columns renamed within v1: a reader takes an older part's column under its new name.
RENAMED_REQUEST_COLUMNS = {"ext.cached_tokens": "ext.cached_prompt_tokens"}


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request: spec §3 groups in §3 order, then `ext`."""

    run_id: str
    request_id: str
    model_alias: str | None = None
    model_generation: int | None = None
    calbin_sha256: str | None = None
    software: Software = dataclasses.field(default_factory=Software)
    hardware: Hardware = dataclasses.field(default_factory=Hardware)
    workload: Workload = dataclasses.field(default_factory=Workload)
    client_ns: ClientNs = dataclasses.field(default_factory=ClientNs)
    durations_ms: DurationsMs = dataclasses.field(default_factory=DurationsMs)
    server_ms: ServerMs = dataclasses.field(default_factory=ServerMs)
    runtime_ms: RuntimeMs = dataclasses.field(default_factory=RuntimeMs)
    result: Result = dataclasses.field(default_factory=Result)
    quality: Quality = dataclasses.field(default_factory=Quality)
    ext: Ext = dataclasses.field(default_factory=Ext)
    schema: str = REQUEST_SCHEMA


class TokenEvent(msgspec.Struct, gc=False):
    """One SSE event that carried generated tokens (or the first event of any kind).

    A msgspec Struct the garbage collector does not track (`gc=False`: it holds no
    containers, so it can be in no cycle). One is made per token event on the engine's
    loop and lives until its part is written: as a tracked object (a slots dataclass)
    the in-flight requests' events were 40 % of what each young collection scanned, at
    320 req/s pauses of 6-15 ms that held the engine's reads (docs/measurement.md,
    "Pauses that hold the engine").
    0.09 µs to make against the dataclass's 0.26. Treat it as read-only."""

    request_id: str
    event_index: int  # index among all events of the request, from 0
    arrival_ns: int  # client monotonic ns when the read that completed it returned
    tokens: int  # generated tokens this event carried (0 for role/usage-only events)
    server_cumulative: int | None  # the server's cumulative count after it, if given


# Field order of the strict §3 JSON object.
SPEC3_ORDER = (
    "schema",
    "run_id",
    "request_id",
    "model_alias",
    "model_generation",
    "calbin_sha256",
    "software",
    "hardware",
    "workload",
    "client_ns",
    "durations_ms",
    "server_ms",
    "runtime_ms",
    "result",
    "quality",
)


def record_to_dict(rec: RequestRecord, *, strict: bool = False) -> dict[str, Any]:
    """The JSON object of a record: §3 keys in §3 order, then `ext` unless `strict`."""
    out: dict[str, Any] = {}
    keys = SPEC3_ORDER if strict else (*SPEC3_ORDER, "ext")
    for key in keys:
        value = getattr(rec, key)
        if dataclasses.is_dataclass(value):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        out[key] = value
    return out


def record_from_dict(obj: dict[str, Any]) -> RequestRecord:
    """Inverse of `record_to_dict`; refuses a newer schema version."""
    check_schema(obj.get("schema"), REQUEST_SCHEMA)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(RequestRecord):
        if f.name not in obj:
            continue
        value = obj[f.name]
        group = _GROUPS.get(f.name)
        kwargs[f.name] = group(**value) if group is not None and value is not None else value
    return RequestRecord(**kwargs)


_GROUPS: dict[str, Any] = {
    "software": Software,
    "hardware": Hardware,
    "workload": Workload,
    "client_ns": ClientNs,
    "durations_ms": DurationsMs,
    "server_ms": ServerMs,
    "runtime_ms": RuntimeMs,
    "result": Result,
    "quality": Quality,
    "ext": Ext,
}


class SchemaVersionError(ValueError):
    """An artifact declares a schema this version of calculet-load cannot read."""


def check_schema(found: Any, expected: str) -> None:
    name, _, version = expected.partition("/v")
    if not isinstance(found, str) or not found.startswith(name + "/v"):
        raise SchemaVersionError(f"schema: expected {expected}, found {found!r}")
    found_version = found.rsplit("/v", 1)[1]
    if not found_version.isdigit() or int(found_version) > int(version):
        raise SchemaVersionError(
            f"schema: {found} is newer than this calculet-load reads ({expected}); upgrade"
        )


def request_json_schema() -> dict[str, Any]:
    """JSON Schema of the full record (§3 groups and `ext`)."""
    schema: dict[str, Any] = TypeAdapter(RequestRecord).json_schema()
    return schema
