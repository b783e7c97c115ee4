"""One request's state while its response is read (`Run`): each event accounted as it
comes (the counts, the first event, first and last token stamps, the reasoning phase,
the hash of the generated text, the token events handed to a live listener), and the
outcome concluded from it once the request ended (`conclude`: the stamps in order, the
hash, the confirmed total and the count checks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from calculet_load.clock import Clock
from calculet_load.measure.outcome import CancelAt, Fail, OnToken, Outcome, StreamCancel
from calculet_load.measure.protocols import (
    Adapter,
    CountState,
    EventInfo,
    ProtocolError,
    safe_text,
)
from calculet_load.measure.sse import SSELineTooLong, SSEParser
from calculet_load.measure.totals import confirmed_total, disagreement
from calculet_load.schema.records import ClientNs, TokenEvent

FINISH_REASON_CHARS = 64
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class Run:
    """State of one request while it runs; an engine's `execute` drives it."""

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
