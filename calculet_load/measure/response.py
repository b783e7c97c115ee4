# size: the request's pure half, shared by both I/O engines: one implementation of each
"""What both I/O engines share (measure.client's gevent sockets, measure.engine's thread):
the error taxonomy, the outcome, the per-request state and its accounting, the response
read as a generator fed with each read's bytes (h11 for the head, measure.chunked for a
chunked event stream, measure.sse for the events), the stamps' bookkeeping and the
kernel's receive times, the request's wire form, the classification of connect failures
and the outcome's final checks. No waiting here: an engine reads the socket, stamps the
bytes, hands them to `Reads.took` and sends them into `respond`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import platform
import re
import socket
import ssl
import struct
import sys
from collections.abc import Callable, Generator
from typing import Any, Literal, cast

import h11
import msgspec
from mypy_extensions import mypyc_attr

from calculet_load.clock import Clock
from calculet_load.measure.biotls import BioTLS
from calculet_load.measure.chunked import ChunkedDecoder
from calculet_load.measure.protocols import (
    Adapter,
    CountState,
    EventInfo,
    ProtocolError,
    error_output_chars,
    raw_text,
    safe_text,
)
from calculet_load.measure.sse import SSELineTooLong, SSEParser
from calculet_load.measure.totals import confirmed_total, disagreement
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
FINISH_REASON_CHARS = 64


_TIMESPEC = struct.Struct("@ll")


class StreamCancel:
    """A cancel its caller holds: `cancel()` ends the stream at its next event (another
    thread may call it); with `after_tokens`, the stream ends once that many generated
    tokens arrived. Either way the request is recorded `cancelled`, with its tokens so
    far."""

    __slots__ = ("after_tokens", "requested")

    def __init__(self, after_tokens: int | None = None) -> None:
        self.after_tokens = after_tokens
        self.requested = False

    def cancel(self) -> None:
        self.requested = True

    def due(self, tokens: int) -> bool:
        return self.requested or (self.after_tokens is not None and tokens >= self.after_tokens)


# When the client ends a request on purpose: before the headers, at the first token,
# after this many token events, or when a `StreamCancel` says so.
CancelAt = Literal["before_headers", "first_token"] | int | StreamCancel | None
# What a live listener of a request's token events gets, as each arrives: the event, its
# answer text and its reasoning text (in memory only, as `Run(keep_text=True)`'s).
OnToken = Callable[[TokenEvent, str, str], None]
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


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


class Run:
    """State of one request while it runs; `execute` drives it."""

    def __init__(
        self,
        adapter: Adapter,
        out: Outcome,
        clock: Clock,
        stream: bool,
        on_token: OnToken | None = None,
        count_text: Callable[[str], int] | None = None,
        pause: Callable[[], object] | None = None,
        keep_text: bool = False,
    ) -> None:
        self.adapter = adapter
        # called every 16 events of one read (gevent: let other streams take their stamps)
        self.pause = pause
        self.on_token = on_token
        # the generated text's pieces, kept for the caller (`keep_text`), else None
        self.answer: list[str] | None = [] if keep_text else None
        self.thought: list[str] | None = [] if keep_text else None
        # Reasoning: seen at all; inside a `<think>` leading the text (inline) until its
        # close; generated tokens of reasoning events; the first answer token's stamp.
        self.texted = False  # an event with generated text came
        self.reasoning_seen = False
        self.thinking = False
        self.reasoning_tokens = 0
        self.first_answer: int | None = None
        self.out = out
        self.clock = clock
        self.stream = stream
        self.parser = SSEParser()
        self.count = CountState(count_text=count_text)
        self.hash = hashlib.sha256()
        self.done = False
        self.body = bytearray()
        # the first event, first token and last token stamps
        self.t3: int | None = None
        self.t4: int | None = None
        self.t5: int | None = None
        self.jump: str | None = None  # the first count that rose with no text to show
        self.read_t: int | None = None  # the stamp of the read the last event came in
        self.read_prev: int | None = None  # when the read before the current one returned
        self.in_read = 0  # events delivered by that read so far
        self.tokens_in_read = 0  # ... of them, events that carried tokens
        self.fast_events = 0  # events read on the fast path (`on_plain`; for the tests)

    def on_sse(self, data: bytes, t: int, cancel: CancelAt) -> bool:
        """Feed stream bytes that arrived at t; True when the client should stop now."""
        long_line: SSELineTooLong | None = None
        try:
            events = self.parser.feed(data)
        except SSELineTooLong as too_long:  # a name of its own: compiled code types it
            # the events complete before the line are the stream's, read in order first
            # (as the fast path reads them, event by event), then the line fails it
            events, long_line = too_long.events, too_long
        for i, ev in enumerate(events):
            if i & 15 == 15 and self.pause is not None:
                # A backlog read can hold hundreds of events: all are stamped at its
                # arrival already; let other streams take their stamps meanwhile.
                self.pause()
            if self.done:
                raise Fail("protocol_violation", "event after the end-of-stream marker")
            try:
                info = self.adapter.event(ev.data, self.count)
            except ProtocolError as exc:
                raise Fail(exc.error_class, str(exc), raw=exc.raw) from None
            self._account(info, t)
            if info.error is not None:
                raise Fail("server_error_event", info.error, info.error_type)
            if cancel is not None and self.cancel_due(cancel):
                return True
        if long_line is not None:
            raise Fail("malformed_sse", str(long_line))
        if self.parser.invalid_utf8:
            raise Fail("invalid_utf8", f"{self.parser.invalid_utf8} invalid UTF-8 sequence(s)")
        return False

    def cancel_due(self, cancel: CancelAt) -> bool:
        """Whether the client ends the request after the events read so far."""
        if isinstance(cancel, StreamCancel):
            return cancel.due(self.out.output_tokens)
        if cancel == "first_token":
            return self.t4 is not None
        return isinstance(cancel, int) and len(self.out.token_events) >= cancel

    def on_plain(self, data: bytes, size: int, t: int) -> bool:
        """The data of an event that is one `data:` line, `size` bytes of the stream in all
        (a plain chunk: `_chunked`), of the adapter's common shape (`Adapter.fast_event`):
        read and accounted as `on_sse` would, True. False when it is anything else;
        nothing was consumed, and `on_sse` reads it."""
        if self.done:
            return False
        if not data.isascii():
            # the SSE parser decodes the line as UTF-8 and counts what is invalid (the
            # decoder does not look inside strings of fields it does not read)
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                return False
        if t == self.read_t and self.in_read & 15 == 15 and self.pause is not None:
            self.pause()  # as on_sse: a backlog read's events, other streams meanwhile
        try:
            info = self.adapter.fast_event(data, self.count)
        except ProtocolError as exc:
            raise Fail(exc.error_class, str(exc), raw=exc.raw) from None
        if info is None:
            return False
        self.parser.skip(size)
        self.fast_events += 1
        self._account(info, t)
        return True

    def _account(self, info: EventInfo, t: int) -> None:
        out = self.out
        index = out.events
        out.events = index + 1
        if t != self.read_t:  # each read has its own stamp
            self.read_t, self.in_read, self.tokens_in_read = t, 1, 0
            out.event_reads += 1
        else:
            self.in_read += 1
        if self.in_read > out.max_events_per_read:
            out.max_events_per_read = self.in_read
        if self.t3 is None:
            self.t3 = t
        if info.nonfinite:
            out.nonfinite = True
        if info.error_output_chars:
            out.error_output_chars += info.error_output_chars
        if info.count_anomaly is not None and self.jump is None:
            self.jump = f"event {index}: {info.count_anomaly}"
        text, thought = info.text, info.reasoning
        if thought:
            # surrogatepass: a JSON escape such as "\ud800" decodes to a lone surrogate,
            # which plain .encode() refuses (it would raise out of execute).
            self.hash.update(thought.encode("utf-8", "surrogatepass"))
        if text:
            self.hash.update(text.encode("utf-8", "surrogatepass"))
            if not self.texted:
                self.texted = True
                # a reasoning model's inline thinking (llama.cpp --reasoning-format none,
                # completions): it leads the text, up to its close tag
                if not thought and text.lstrip().startswith(THINK_OPEN):
                    self.thinking = self.reasoning_seen = True
            if self.thinking:
                close = text.find(THINK_CLOSE)
                if close < 0:
                    text, thought = "", text
                else:
                    cut = close + len(THINK_CLOSE)
                    text, thought = text[cut:], text[:cut]
                    self.thinking = False
        if thought:
            self.reasoning_seen = True
        if self.answer is not None and self.thought is not None:
            self.answer.append(text)
            self.thought.append(thought)
        if info.reasoning_total is not None:
            out.reasoning_total = info.reasoning_total
        if info.tokens:
            self.tokens_in_read += 1
            if self.t4 is None:
                self.t4 = t
            elif (
                self.tokens_in_read == 2
                and self.t4 == t
                and out.late_bound_ns is not None
                and self.read_prev
            ):
                # the first token shares its read with the second: it is stamped with
                # the read's last bytes, and arrived after the read before returned
                out.late_bound_ns = t - self.read_prev
            self.t5 = t
            out.output_tokens += info.tokens
            if self.reasoning_seen:
                if thought and not text:
                    self.reasoning_tokens += info.tokens
                elif self.first_answer is None and not text.isspace() and text:
                    self.first_answer = t
            ev = TokenEvent(out.request_id, index, t, info.tokens, info.cumulative)
            out.token_events.append(ev)
            if self.on_token is not None:
                self.on_token(ev, text, thought)
        if info.finish_reason:
            out.finish_reason = safe_text(info.finish_reason[:FINISH_REASON_CHARS])
        if info.final_total is not None:
            out.server_total = info.final_total
        if info.prompt_tokens is not None:
            out.prompt_tokens_server = info.prompt_tokens
        if info.timings is not None:
            out.timings = info.timings
        if info.cached_tokens is not None:
            out.cached_tokens = info.cached_tokens
        if info.done:
            self.done = True
        out.count_source = self.count.source


# Linux: SO_TIMESTAMPNS asks the kernel for each read's receive time (CLOCK_REALTIME, of
# the last segment the read returned), delivered as an SCM_TIMESTAMPNS control message
# holding a struct timespec (two C longs). Python's socket module does not name it: 35 on
# the architectures of asm-generic/socket.h (others use other numbers: read stamps there).
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", None)
if SO_TIMESTAMPNS is None and sys.platform == "linux" and platform.machine() in (
    "x86_64", "aarch64", "arm64", "i686", "i386", "armv7l", "armv8l", "riscv64",
    "ppc64le", "ppc64", "s390x", "loongarch64",
):  # fmt: skip
    SO_TIMESTAMPNS = 35
CMSG_SPACE = (
    socket.CMSG_SPACE(_TIMESPEC.size)
    if SO_TIMESTAMPNS is not None and hasattr(socket, "CMSG_SPACE")
    else 0
)


def ask_kernel_stamps(sock: socket.socket) -> None:
    """Ask for the kernel's receive time with every read of this plain socket (where the
    kernel cannot, reads carry none and their own time is the stamp)."""
    if SO_TIMESTAMPNS is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)


# A read's time and the wall clock read with it (`clock_pair`): read again until a
# monotonic read after the wall one is within this of the one before it.
PAIR_NS = 20_000
PAIR_TRIES = 4


def clock_pair(clock: Clock) -> tuple[int, int]:
    """The monotonic and the wall clock on one instant: a read's time, and the wall time
    that moves the kernel's stamp of its bytes (CLOCK_REALTIME) onto the monotonic clock
    (`kernel_ns`). A thread preempted between the two reads would move the stamp by the
    preemption, so the pair is read again (at most PAIR_TRIES times) until a third read
    shows none; measure/reader.c reads its pairs the same way."""
    t = wall = 0
    for _ in range(PAIR_TRIES):
        t = clock.mono_ns()
        wall = clock.wall_ns()
        if clock.mono_ns() - t <= PAIR_NS:
            break
    return t, wall


def kernel_ns(
    anc: list[tuple[int, int, bytes]], read_ns: int, wall_ns: int, start: int, prev: int = 0
) -> int | None:
    """The kernel's receive time of a read's bytes on the monotonic clock, or None.

    The kernel stamps CLOCK_REALTIME; `wall_ns` was read right after `read_ns`, so
    `wall_ns - read_ns` moves it onto the monotonic clock (`kernel_wall_ns` says which
    bounds it must keep, and what they may do to it)."""
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            stamp = int(sec) * 1_000_000_000 + int(nsec)
            return kernel_wall_ns(stamp, read_ns, wall_ns, start, prev)
    return None


def kernel_wall_ns(stamp: int, read_ns: int, wall_ns: int, start: int, prev: int = 0) -> int | None:
    """`kernel_ns` of a receive time already read from its message (CLOCK_REALTIME ns).

    The bounds, each what a stamp on the monotonic clock must keep:
    - not after `read_ns`, the read that returned the bytes, nor before `start`, the
      request's start t0 (taken before its first byte was written): outside, the wall
      clock stepped between the arrival and the read, and the stamp is not used (None:
      the read's own time is taken). These reject; they never move a stamp;
    - not before `prev`, the kernel stamp of the response's read before: the same
      packet read twice (a read that took the rest of it) through two clock pairs, which
      differ by at most their jitter (`clock_pair`): raised to it.
    Nothing else bounds it: a user-space stamp (t1 when the send returned) is later than
    the bytes it stands for, and a receive stamp before it is the truth."""
    k = stamp - (wall_ns - read_ns)
    if start <= k <= read_ns:
        return max(k, prev)
    return None


def tls_drain(sock: ssl.SSLSocket, data: bytes) -> tuple[bytes, bool]:
    """The rest of what arrived with this read: the plaintext the TLS object holds
    (`pending()`) and the records already in the socket buffer, read now without waiting
    (one plain read takes all the kernel holds; a TLS read returns one record), to be
    stamped with `data`. Returns (the bytes, whether the peer closed after them)."""
    chunks = [data]
    size = len(data)
    closed = False
    timeout = sock.gettimeout()
    sock.settimeout(0.0)
    try:
        while size < 4 * 65536:
            try:
                more = sock.recv(65536)
            except (ssl.SSLWantReadError, BlockingIOError, TimeoutError):
                break  # nothing more yet
            except OSError:
                break  # the next read meets the failure and classifies it
            if not more:
                closed = True
                break
            chunks.append(more)
            size += len(more)
    finally:
        sock.settimeout(timeout)
    return (b"".join(chunks) if len(chunks) > 1 else data), closed


def _status_class(status: int) -> str:
    if status in (401, 403):
        return "auth"
    if status == 404:
        return "not_found"
    if 400 <= status < 500:
        return "http_4xx"
    return "http_5xx" if status >= 500 else "http_other"


def finish(run: Run, status: int, t_end: int) -> None:
    if not 200 <= status < 300:
        code, detail, run.out.error_output_chars = _error_body(bytes(run.body))
        raise Fail(_status_class(status), detail, code or str(status))
    if run.stream:
        run.parser.close()  # an unterminated event is discarded (WHATWG)
        if run.parser.truncated:
            raise Fail("truncated_stream", "stream ended inside an event")
        if not run.done:
            raise Fail("truncated_stream", "stream ended without the protocol's end marker")
    else:
        try:
            info = run.adapter.whole(bytes(run.body))
        except ProtocolError as exc:
            raise Fail(exc.error_class, str(exc), raw=exc.raw) from None
        # A whole response: every token arrives with the last byte, so there is a first
        # event and a first token at t6, but no decode interval (TPOT is undefined).
        run.count.source = info.count_source
        run._account(info, t_end)
        run.t5 = None
        if info.error is not None:
            raise Fail("server_error_event", info.error, info.error_type)
    if run.out.nonfinite:
        raise Fail("nonfinite_number", "a numeric field is NaN or Infinity")


def _header(headers: Any, name: bytes) -> str | None:
    """One response header's value (h11 gives lower-case names), or None."""
    for key, value in headers:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _error_body(body: bytes) -> tuple[str | None, str, int]:
    """(code, detail, characters of generated text the error body carried)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the stack
        return None, f"non-JSON error body ({len(body)} bytes)", 0
    output = error_output_chars(obj)
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        code = str(err.get("type") or err.get("code") or "")
        return code, str(err.get("message", ""))[:300], output
    return None, "error body without an error object", output


class PoolExhausted(Exception):
    pass


_ENCODE = msgspec.json.Encoder().encode  # a request's JSON body (`prepare`)


def prepare(
    endpoint: Any,
    adapter: Adapter,
    body: dict[str, Any],
    request_id: str,
    stream: bool,
    extra_headers: dict[str, str] | None,
) -> tuple[str, list[tuple[str, str]], bytes]:
    """The request's target, headers and payload (an h11 Request for either engine)."""
    # msgspec: 1.9 µs against json's 22 µs for a 128-id prompt's body, once per request on
    # the worker's main thread; the same bytes for ASCII, non-ASCII text as UTF-8 rather
    # than \u escapes (the same JSON string to the server). A lone surrogate (a corpus's
    # "\ud800") has no UTF-8: json's escape sends it as it came.
    try:
        payload = _ENCODE(body)
    except UnicodeEncodeError:
        payload = json.dumps(body, separators=(",", ":")).encode()
    # the target's own headers (--header, the API key), then the call's, replace ours
    extra = [*endpoint.headers, *(extra_headers or {}).items()]
    given = {name.lower() for name, _ in extra}
    ours = [
        ("Host", endpoint.authority),
        ("Content-Type", "application/json"),
        ("Accept", "text/event-stream" if stream else "application/json"),
        ("Content-Length", str(len(payload))),
        ("X-Request-Id", request_id),
        # Bytes are stamped as they arrive and parsed as SSE: a compressed body would be
        # neither, so it is asked for in the clear (and refused if it comes otherwise).
        ("Accept-Encoding", "identity"),
    ]
    # ours alone: the body is written after h11's head as it is (`wire`), framed by its
    # Content-Length, never by a Transfer-Encoding a --header could ask for
    fixed = ("host", "content-length", "transfer-encoding")
    headers = [(n, v) for n, v in ours if n.lower() in fixed or n.lower() not in given]
    headers += [(n, v) for n, v in extra if n.lower() not in fixed]
    return endpoint.path(adapter.path), headers, payload


def wire(request: tuple[str, list[tuple[str, str]], bytes]) -> tuple[h11.Connection, bytes]:
    """A new HTTP/1.1 client connection state and the request's bytes: h11 checks and
    writes the head; the body follows it as it is (its Content-Length is in the head).
    h11 is not told of the body (`h11.Data`, `h11.EndOfMessage`: a quarter of this call,
    25 µs against 34 in a hot loop), so its side of the connection stays
    in SEND_BODY; the caller writes every byte or fails the request, and `respond` judges
    reuse by h11's reading of the request's head and the response."""
    target, headers, payload = request
    conn = h11.Connection(h11.CLIENT)
    return conn, conn.send(h11.Request(method="POST", target=target, headers=headers)) + payload


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


def conclude(
    run: Run,
    ns: dict[str, int | None],
    max_tokens: int | None,
    output_slack_tokens: int,
) -> Outcome:
    """The outcome's stamps, hash and count checks once the request ended."""
    out = run.out
    t1, t2 = ns["t1"], ns["t2"]
    # a t1 taken when the send returned, after the kernel's time of the response's head:
    # the order is broken by t1's lateness alone, and t2 stays the truth
    out.sent_stamp_late = (
        out.sent_stamp_source == "send" and t1 is not None and t2 is not None and t1 > t2
    )
    out.client_ns = ClientNs(
        request_start=ns["t0"],
        headers_sent=ns["t1"],
        response_headers=ns["t2"],
        first_event=run.t3,
        first_token=run.t4,
        last_token=run.t5,
        response_end=ns["t6"],
    )
    if out.output_tokens or out.events:
        out.token_hash = run.hash.hexdigest()
    out.event_tokens = out.output_tokens
    out.output_tokens, out.total_source, out.count_source = confirmed_total(
        out.output_tokens, out.server_total, out.ok, out.count_source, out.events > 0
    )
    if run.answer is not None and run.thought is not None:
        out.text = "".join(run.answer)
        out.reasoning_text = "".join(run.thought)
    if run.reasoning_seen:
        # the server's count of the reasoning tokens where it gives one; the events'
        # otherwise (a reasoning event's tokens; an event carrying both is the answer's)
        thought = out.reasoning_total if out.reasoning_total is not None else run.reasoning_tokens
        out.reasoning_tokens = min(thought, out.output_tokens)
        out.answer_tokens = out.output_tokens - out.reasoning_tokens
        out.first_answer_ns = run.first_answer
    if run.jump is not None and out.ok:
        # Only a complete response: a stream cut by an error may end with tokens whose
        # bytes end inside a UTF-8 character, flushed with no text (llama.cpp holds
        # them back until the character completes, and it never did).
        out.count_anomaly = run.jump
    if out.ok and out.count_anomaly is None and out.total_source == "server":
        out.count_anomaly = disagreement(
            out.event_tokens, out.output_tokens, out.count_source, output_slack_tokens
        )
    if max_tokens is not None and out.count_anomaly is None:
        top = max(out.output_tokens, out.server_total or 0)
        if top > max_tokens + output_slack_tokens:
            out.count_anomaly = (
                f"output {top} tokens above the requested max {max_tokens}"
                f" (+{output_slack_tokens} slack)"
            )
    return out


# The thread engine's reads (measure.engine) subclass it, and stay interpreted when this
# module is compiled (measure.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Reads:
    """The bookkeeping of one response's reads, whichever engine reads: which timeout
    bounds the next read, the stamp each read gives its bytes (the kernel's receive time
    where it gives one), the read waits and the first token's late bound."""

    __slots__ = ("chunked", "deadline", "eof", "first", "last_stamp", "ns", "out", "read_at",
                 "run", "stamps", "t", "timeouts")  # fmt: skip

    def __init__(
        self, run: Run, ns: dict[str, int | None], timeouts: Timeouts, deadline: int,
        stamps: bool,
    ) -> None:  # fmt: skip
        self.ns, self.timeouts, self.deadline = ns, timeouts, deadline
        self.run = run
        self.out = run.out
        self.t = 0  # the stamp of the last read taken (`took`)
        # when the last read with bytes returned, and the last kernel stamp (`stamped_read`:
        # taken by `took` at once, or later when the thread engine's loop is late)
        self.read_at = self.last_stamp = 0
        self.first = b""  # the response's first bytes (up to 5): is it HTTP at all?
        self.eof = False
        self.stamps = stamps  # reads carry the kernel's receive time
        # `respond` reads an event stream's chunked body (`_chunked`): its end is the last
        # chunk's CRLF CRLF (the thread engine's native reads wait for it: measure.engine)
        self.chunked = False

    def limit(self, now: int) -> tuple[float, str]:
        """How long the next read may wait from `now` (s) and the error class if it does."""
        if now >= self.deadline:
            raise Fail("total_timeout", "total timeout reached")
        # Any byte ends the first-byte wait, a partial status line included.
        limit, kind = (
            (self.timeouts.idle_s, "idle_timeout")
            if self.first or self.read_at
            else (self.timeouts.first_byte_s, "first_byte_timeout")
        )
        remaining = (self.deadline - now) / 1e9
        if remaining < limit:
            limit, kind = remaining, "total_timeout"
        return limit, kind

    def receive(self, sock: socket.socket, clock: Clock, tls: bool) -> tuple[bytes, bool, bool]:
        """Read what `sock` holds, stamp it and take it (`stamped_read`, then `took`): (the bytes,
        whether the peer closed after them, whether the stamp is the read's own time)."""
        taken = self.stamped_read(sock, clock, tls)
        return taken[0], taken[1], self.took(*taken)

    def stamped_read(
        self, sock: socket.socket, clock: Clock, tls: bool
    ) -> tuple[bytes, bool, int, int | None, int]:
        """Read what `sock` holds and stamp it (the socket's errors are the caller's to
        classify): (the bytes, whether the peer closed after them, when the read returned,
        the bytes' kernel receive time or None, when the read before returned). What the
        bytes mean is `took`'s and the parser's, now or later (the thread engine parses
        after the reads waiting when its loop is late: measure.engine)."""
        prev, start, before = self._bounds()
        kernel = None
        if self.stamps and not tls:
            data, anc, _, _ = sock.recvmsg(65536, CMSG_SPACE)
            t, wall = clock_pair(clock)  # stamp at the byte, before any parsing
            kernel = kernel_ns(anc, t, wall, start, before)
        else:
            data = sock.recv(65536)
            t = clock.mono_ns()  # stamp at the byte, before any parsing
        closed = False
        if data and tls:
            data, closed = tls_drain(sock, data)  # type: ignore[arg-type]
            if self.stamps and isinstance(sock, BioTLS):
                # the TLS records' own reads carried the kernel's time: that of the last
                # one, which completed what was decrypted (the read's time is after it)
                t, wall = clock_pair(clock)
                kernel = kernel_ns(sock.take_stamp(), t, wall, start, before)
        self._took_at(data, t, kernel)
        return data, closed, t, kernel, prev

    def _bounds(self) -> tuple[int, int, int]:
        """A read's (when the read before it returned, the request's start, the kernel
        stamp of the read before: `kernel_wall_ns`'s bounds)."""
        start = self.ns["t0"] or 0
        return self.read_at or self.ns["t1"] or start, start, self.last_stamp

    def _took_at(self, data: bytes, t: int, kernel: int | None) -> None:
        if data:
            self.read_at = t
            if kernel is not None:
                self.last_stamp = kernel

    def native_read(
        self, data: bytes, t: int, wall: int, stamp: int
    ) -> tuple[bytes, bool, int, int | None, int]:
        """`stamped_read` of a read another thread made (measure.engine's native reads):
        its bytes, when it returned (`t`, monotonic; `wall`, the wall clock read right
        after) and the kernel's receive time of its bytes (`stamp`, CLOCK_REALTIME ns, or
        -1). Reads are given in the order they were made."""
        prev, start, before = self._bounds()
        kernel = (
            kernel_wall_ns(stamp, t, wall, start, before) if stamp >= 0 and self.stamps else None
        )
        self._took_at(data, t, kernel)
        return data, False, t, kernel, prev

    def took(
        self, data: bytes, closed: bool, t: int, kernel: int | None, prev: int | None = None
    ) -> bool:
        """A read returned `data` at `t` (`kernel`: its bytes' receive time, or None; `prev`:
        when the read before it returned): what `stamped_read` gives, now or later. True
        when it was stamped with the read's own time (other streams may want theirs before
        this one parses)."""
        self.run.read_prev = prev
        out = self.out
        by_read = False
        if kernel is not None:
            # The kernel's receive time: what the bytes waited for this read (the loop's
            # lag, other streams' parsing) is not in the figures; it is kept as the
            # request's read wait, the client's self-check.
            wait = t - kernel
            if out.read_wait_ns is None or wait > out.read_wait_ns:
                out.read_wait_ns = wait
            t = kernel
            out.stamp_source = "kernel"
            if out.late_bound_ns is None:
                out.late_bound_ns = 0
        elif data:
            out.stamp_source = "read"
            by_read = True
        self.t = t
        if len(self.first) < 5:
            self.first += data[: 5 - len(self.first)]
        self.eof = not data or closed
        return by_read


# what `respond` asks for (nothing) and is sent: a read's bytes and whether the peer closed
Respond = Generator[None, tuple[bytes, bool], bool]


def respond(conn: h11.Connection, rd: Reads, cancel: CancelAt) -> Respond:
    """Read the response from the bytes sent in (each after `rd.took`); returns whether
    the connection may be reused. Raises Fail for everything a server can do wrong."""
    run, ns = rd.run, rd.ns
    out = run.out
    status = 0
    is_sse = False
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            # h11 also raises when the peer closes before the message is complete (inside
            # the head, a Content-Length or a chunked body): that is a connection closed
            # mid-response, not bad HTTP, unless what did come cannot start a status line.
            if rd.eof and not rd.first:
                out.unanswered = True
                raise Fail("connection_reset", "closed before any response byte") from None
            if rd.eof and (ns["t2"] is not None or b"HTTP/".startswith(rd.first)):
                raise Fail("connection_reset", f"closed mid-response: {exc}") from None
            raise Fail("malformed_http", str(exc)) from None
        if event is h11.PAUSED:
            # a 101 to an `Upgrade` a --header asked for: not HTTP from here on
            raise Fail("malformed_http", "the server switched protocols (101)")
        if event is h11.NEED_DATA:
            data, closed = yield
            conn.receive_data(data)
            if closed:
                conn.receive_data(b"")
            continue
        t = rd.t
        if isinstance(event, h11.Response):
            ns["t2"] = t
            status = out.http_status = event.status_code
            ctype = _header(event.headers, b"content-type") or ""
            # media types are case-insensitive (RFC 9110 §8.3.1)
            is_sse = ctype.split(";", 1)[0].strip().lower() == "text/event-stream"
            encoding = _header(event.headers, b"content-encoding")
            if encoding and encoding.strip().lower() != "identity" and 200 <= status < 300:
                raise Fail(
                    "content_encoding",
                    f"Content-Encoding {encoding!r} not requested (the client sent "
                    "Accept-Encoding: identity); the body cannot be read as sent",
                    raw=raw_text(encoding),
                )
            if 200 <= status < 300 and run.stream and not is_sse:
                raise Fail("protocol_violation", f"stream requested, got content type {ctype!r}")
            if is_sse and 200 <= status < 300 and _header(event.headers, b"transfer-encoding"):
                # h11 accepts no transfer coding but chunked: the event stream's body is
                # read on the fast path below (h11's per-chunk events and state machine
                # cost a sixth of a worker's CPU per token event, measured with py-spy)
                # h11's bytes are bytearrays typed bytes: read untyped (compiled code
                # checks the declared type: measure.native), then made bytes
                leftover = bytes(cast(Any, conn).trailing_data[0])
                body = ChunkedDecoder(leftover)
                # whether the connection may carry another request, as h11 judges it when
                # it reads the body itself: from the request's head and this response's
                # (a `Connection: close` on either side, an HTTP/1.0 response)
                keep = bool(cast(Any, conn)._cstate.keep_alive)
                rd.chunked = True
                return (yield from _chunked(rd, body, status, cancel)) and keep
        elif isinstance(event, h11.InformationalResponse):
            continue
        elif isinstance(event, h11.Data):
            if is_sse and 200 <= status < 300:
                _feed_sse(run, bytes(cast(Any, event).data), t, cancel)  # as above
            else:
                run.body += cast(Any, event).data
                if len(run.body) > 64 * 2**20:
                    raise Fail("protocol_violation", "response body over 64 MiB")
        elif isinstance(event, h11.EndOfMessage):
            ns["t6"] = t
            finish(run, status, t)
            # the request's body was written whole (`wire`): the response decides, and a
            # peer that closed with its last bytes has closed the connection
            return conn.their_state is h11.DONE and not rd.eof
        elif isinstance(event, h11.ConnectionClosed):
            raise Fail("connection_reset", "connection closed before the response ended")


def _feed_sse(run: Run, data: bytes, t: int, cancel: CancelAt) -> None:
    if run.on_sse(data, t, cancel):
        _cancelled(run, cancel)


def _cancelled(run: Run, cancel: CancelAt) -> None:
    out = run.out
    out.cancelled_at = "first_token" if cancel == "first_token" else "mid_stream"
    raise Fail("cancelled", f"cancelled at {out.cancelled_at}")


# A plain chunk: a whole chunk of one SSE event of one `data: ` line. Its head is a plain
# size line (1 to 20 hex digits, no extension) and `data: ` (`_PLAIN_HEAD`); then the
# data, which holds no CR and no LF, the blank line and the chunk's CRLF (`_PLAIN_END`),
# the size counting from `data: ` to the blank line (`_chunked`). The data's end is found
# from the size, and checked with `find` (memchr): a regular expression's `[^\r\n]*`
# matched it byte by byte (2.0 µs for an OpenAI completions chunk of 229 bytes, against
# 0.9-1.0 µs so; a token event through `respond` in a hot loop: 5.6-5.7 µs, from 6.5-6.8).
_PLAIN_HEAD = re.compile(rb"([0-9A-Fa-f]{1,20})\r\ndata: ")
_PLAIN_END = b"\n\n\r\n"


def _chunked(rd: Reads, body: ChunkedDecoder, status: int, cancel: CancelAt) -> Respond:
    """A chunked event stream's body, after h11 read the head: the bytes already read
    first, then each read's chunks, decoded as h11 decodes them, to the last chunk.

    The fast path: when the decoder is between chunks and the SSE parser between events,
    while a read's next bytes are a whole chunk holding exactly one event of one `data: `
    line (a plain chunk, its size checked: `_PLAIN_HEAD`) of the adapter's common shape
    (`Run.on_plain`), that event is read from the bytes as they are; at the first that is
    not, nothing of it consumed, the rest of the read goes the general way
    (`ChunkedDecoder.feed`, `Run.on_sse`). The outcome is the same either way
    (tests/load/test_fastpath.py)."""
    run = rd.run
    switch = cancel if isinstance(cancel, StreamCancel) else None
    quick = (cancel is None or switch is not None) and run.adapter.fast
    data = b""
    closed = False
    while True:
        pos = 0
        parser = run.parser
        fast = quick and body.between
        if fast and not parser.between and _PLAIN_HEAD.match(data):
            # the stream's first bytes are `data: `, no BOM: its first event may go the
            # fast way too (before, it waited for the parser's BOM check: a token event
            # in 64 through the general path and Python's own JSON decoder)
            parser.no_bom()
        if fast and parser.between:
            end, limit = len(data), parser.max_line_bytes
            while pos < end and (m := _PLAIN_HEAD.match(data, pos)) is not None:
                size = int(m[1], 16)  # "data: " + the data + "\n\n"
                start = m.end()
                stop = start + size - 8  # the data's end
                if (
                    size < 8
                    or size - 2 > limit
                    or data[stop : stop + 4] != _PLAIN_END
                    or data.find(b"\n", start, stop) >= 0
                    or data.find(b"\r", start, stop) >= 0
                    or not run.on_plain(data[start:stop], size, rd.t)
                ):
                    break
                pos = stop + 4
                if switch is not None and switch.due(run.out.output_tokens):
                    _cancelled(run, cancel)
        try:
            if pos == len(data) > 0:  # all of it read on the fast path
                chunk = b""
            else:
                chunk = body.feed(data[pos:] if pos else data)
        except ValueError as exc:
            raise Fail("malformed_http", str(exc)) from None
        if chunk:
            _feed_sse(run, chunk, rd.t, cancel)
        if body.done:
            rd.ns["t6"] = rd.t
            finish(run, status, rd.t)
            return not body.rest and not closed
        if closed or (rd.eof and not data):
            raise Fail(
                "connection_reset",
                "closed mid-response: peer closed connection without sending complete "
                "message body (incomplete chunked read)",
            )
        data, closed = yield
