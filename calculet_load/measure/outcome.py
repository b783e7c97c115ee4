"""What a request is asked to do and what it produced, whichever I/O engine runs it: its
timeouts, a cancel and a listener of its token events, the error taxonomy
(`ERROR_CLASSES`: every failed request carries exactly one, raised inside the engines
as `Fail`), the classification of a failed connect, and the `Outcome` that becomes a
RequestRecord.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Callable
from typing import Any, Literal

from calculet_load.measure.protocols import safe_text
from calculet_load.schema.netsigns import is_unreachable
from calculet_load.schema.records import ClientNs, TokenEvent

# The error taxonomy: every failed request carries exactly one of these.
ERROR_CLASSES: dict[str, str] = {
    "connect_refused": "the target refused the TCP connection",
    "connect_timeout": "no TCP connection within the connect timeout",
    "unreachable": "no route to the target (host or network unreachable, link down)",
    "connection_reset": "the connection was reset or closed mid-request",
    "first_byte_timeout": "no response byte within the first-byte timeout",
    "idle_timeout": "no bytes between events within the idle timeout",
    "total_timeout": "the request exceeded its total timeout (manifest timeout_s)",
    "tls_verify": "the target's TLS certificate failed verification (CA, name or dates)",
    "tls_handshake": "the TLS handshake failed (protocol, cipher, or the peer is not TLS)",
    "auth": "the server answered 401 or 403 (a missing or wrong API key or header)",
    "not_found": "the server answered 404 (a wrong path or base path)",
    "http_4xx": "the server answered another 4xx",
    "http_5xx": "the server answered 5xx",
    "http_other": "the server answered with an unexpected non-2xx status",
    "server_error_event": "the stream carried an error event",
    "malformed_http": "the response is not valid HTTP/1.1",
    "malformed_sse": "the event stream breaks the SSE rules (e.g. a line over the limit)",
    "invalid_json": "an event's data is not valid JSON",
    "invalid_utf8": "the stream is not valid UTF-8",
    "truncated_stream": "the stream ended before the protocol's end marker",
    "protocol_violation": "the response breaks the target protocol",
    "nonfinite_number": "a numeric field is NaN or Infinity",
    "value_out_of_range": "a count is negative or beyond int64 (the raw value is kept as text)",
    "content_encoding": "the response has a Content-Encoding the client did not ask for",
    "cancelled": "the client cancelled the request on purpose",
    "pool_exhausted": "no connection free under the connection cap",
    "dropped": "an open-loop arrival found the in-flight cap full and was not sent",
}

# Generated tokens may exceed the request's max_tokens by this many before the count is
# flagged (token_count_mismatch with a count_anomaly): none, as OpenAI and llama.cpp
# define max_tokens/n_predict as a hard cap. A session may declare another.
OUTPUT_SLACK_TOKENS = 0
ERROR_DETAIL_CHARS = 500
ERROR_CODE_CHARS = 100


class StreamCancel:
    """A cancel its caller holds: `cancel()` ends the stream at its next event (another
    thread may call it); with `after_tokens`, the stream ends once that many generated
    tokens arrived. Either way the request is recorded `cancelled`, with its tokens so
    far."""

    __slots__ = ("after_tokens", "at_stop", "requested")

    def __init__(self, after_tokens: int | None = None) -> None:
        self.after_tokens = after_tokens
        self.requested = False
        self.at_stop = False

    def cancel(self) -> None:
        self.requested = True

    def stop_run(self) -> None:
        """The run stopped the stream's reader: end it, recorded as cut at the run's stop."""
        self.at_stop = True
        self.requested = True

    def due(self, tokens: int) -> bool:
        return self.requested or (self.after_tokens is not None and tokens >= self.after_tokens)


# When the client ends a request on purpose: before the headers, at the first token,
# after this many token events, or when a `StreamCancel` says so.
CancelAt = Literal["before_headers", "first_token"] | int | StreamCancel | None
# What a live listener of a request's token events gets, as each arrives: the event, its
# answer text and its reasoning text (in memory only, as `Run(keep_text=True)`'s).
OnToken = Callable[[TokenEvent, str, str], None]


@dataclasses.dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 10.0
    first_byte_s: float = 900.0
    idle_s: float = 300.0
    total_s: float = 900.0

    @classmethod
    def within(cls, total_s: float) -> Timeouts:
        """A request bounded by one timeout (a run's `timeout_s`): connected within it (at
        most 10 s), its first byte and its whole response within it."""
        return cls(connect_s=min(10.0, total_s), total_s=total_s, first_byte_s=total_s)


@dataclasses.dataclass(slots=True)
class Outcome:
    """What one request produced, before it becomes a RequestRecord."""

    request_id: str
    client_ns: ClientNs = dataclasses.field(default_factory=ClientNs)
    wall_anchor_ns: int | None = None
    http_status: int | None = None
    finish_reason: str | None = None
    output_tokens: int = 0
    server_total: int | None = None
    prompt_tokens_server: int | None = None
    count_source: str | None = None
    token_hash: str | None = None
    error_class: str | None = None
    error_code: str | None = None
    error_detail: str | None = None
    events: int = 0
    event_reads: int = 0  # reads that delivered at least one event (coalescing)
    max_events_per_read: int = 0
    token_events: list[TokenEvent] = dataclasses.field(default_factory=list)
    timings: dict[str, Any] | None = None
    cached_tokens: int | None = None  # prompt tokens the server served from its cache
    unanswered: bool = False  # the connection closed before a single response byte
    stale_retry: bool = False  # sent again on a new connection: the kept-alive one was closed
    connection_reused: bool | None = None
    # a new connection: its connect and TLS handshake (ns), the wait that is the
    # request's own, not the client's (the self-check leaves it out of start-to-sent)
    connect_ns: int | None = None
    cancelled_at: str | None = None
    nonfinite: bool = False
    invalid_value: str | None = None  # the offending raw value of a failure, bounded text
    count_anomaly: str | None = None  # why the token count is not to be believed as is
    # the stamps' source: "kernel" (the kernel's receive time of the read's last bytes)
    # or "read" (when the read returned: TLS, or a kernel that gives no receive time)
    stamp_source: str | None = None
    read_wait_ns: int | None = None  # kernel stamps: the longest a read's bytes waited
    # kernel stamps: the most the first token's stamp (t4, TTFT) can be late. A read that
    # completed several token events stamps them all with its last bytes' arrival; the
    # first arrived after the read before returned, so it is late by at most that gap
    # (0: it came alone in its read)
    late_bound_ns: int | None = None
    error_output_chars: int = 0  # generated text an error body or error event carried
    # the generated text, kept in memory only for a caller that asked (`Run(keep_text=
    # True)`): never written to a record, a log or a report
    text: str | None = None
    reasoning_text: str | None = None
    # a reasoning model's stream (`Run`): the first answer token's stamp, the tokens of
    # each phase; None when no reasoning was seen
    first_answer_ns: int | None = None
    reasoning_tokens: int | None = None
    answer_tokens: int | None = None
    reasoning_total: int | None = None  # the server's own count of them, where it says
    # t1's source: "kernel" (the transmit time of the request's last byte:
    # measure.txstamps) or "send" (when the last send call returned)
    sent_stamp_source: str | None = None
    # t1 from "send" came after t2 from the kernel: the order t1 <= t2 is broken only
    # because t1 was taken late (the headers arrived while the send call returned)
    sent_stamp_late: bool = False
    event_tokens: int = 0  # the sum of the per-event counts (`output_tokens` is the total)
    # where the request's total came from: "server" (its final usage or count) or
    # "events" (the sum of the per-event counts: the server sent no total)
    total_source: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_class is None

    @property
    def token_count_mismatch(self) -> bool:
        if self.count_anomaly is not None:
            return True
        return self.server_total is not None and self.server_total != self.output_tokens


class Fail(Exception):
    def __init__(
        self, error_class: str, detail: str, code: str | None = None, raw: str | None = None
    ) -> None:
        super().__init__(detail)
        self.error_class, self.detail, self.code, self.raw = error_class, detail, code, raw


class PoolExhausted(Exception):
    pass


def connect_fail(exc: BaseException, max_connections: int) -> Fail:
    """The error class of a failed connect (TCP, then TLS)."""
    if isinstance(exc, PoolExhausted):
        return Fail("pool_exhausted", f"all {max_connections} connections busy")
    if isinstance(exc, ConnectionRefusedError):
        return Fail("connect_refused", str(exc))
    if isinstance(exc, ssl.SSLCertVerificationError):
        return Fail("tls_verify", exc.verify_message or str(exc))
    if isinstance(exc, ssl.SSLError):
        return Fail("tls_handshake", str(exc) or "TLS handshake failed")
    if isinstance(exc, TimeoutError):
        return Fail("connect_timeout", str(exc) or "connect timed out")
    # no route, a link down: the network's doing (calculet_load.schema.netsigns)
    return Fail("unreachable" if is_unreachable(exc) else "connect_refused", str(exc))


def fail_into(out: Outcome, f: Fail, cancel: CancelAt) -> None:
    out.error_class = f.error_class
    out.error_detail = safe_text(f.detail[:ERROR_DETAIL_CHARS])
    out.error_code = safe_text((f.code or f.error_class)[:ERROR_CODE_CHARS])
    out.invalid_value = f.raw
    if f.error_class == "cancelled" and out.cancelled_at is None:
        out.cancelled_at = "first_token" if cancel == "first_token" else "mid_stream"


def run_stopped(out: Outcome) -> None:
    """The run stopped and cut this request: keep what it measured."""
    out.error_class = out.error_code = "cancelled"
    out.error_detail = "cut when the run stopped"
    out.cancelled_at = "run_stop"
