"""Incremental Server-Sent Events parser: bytes in, events out, no I/O, no clock.

Contract:
- `SSEParser.feed(chunk)` returns every event the chunk completes, in order, so the time
  the caller stamped when its read returned is the arrival time of those events.
- The WHATWG HTML "event stream interpretation" rules, exactly: lines end in CRLF, LF or a
  lone CR, and a CR ending one chunk plus an LF starting the next are one line ending (the
  line is processed at the CR, without waiting for the next read); a leading UTF-8 BOM is
  stripped once; invalid UTF-8 becomes U+FFFD and is counted; `data` values are joined
  with "\\n"; one space after the colon is removed; a line without a colon is a field name
  with an empty value; an `id` containing NUL is ignored; `retry` is taken only if it is
  all ASCII digits; unknown fields are ignored; a blank line dispatches the event unless
  no `data` line was seen, and resets the event type either way.
- End of stream (`close()`): an unterminated event is discarded, as the spec says, and
  `truncated` tells whether anything was.
- A line longer than `max_line_bytes` raises `SSELineTooLong` (a malformed stream).

Lines are cut on the CR/LF bytes and each complete line is then decoded on its own. That
is the same as decoding the whole stream first: CR and LF are ASCII, no byte of a UTF-8
multi-byte sequence is below 0x80, and the decoder never folds an ASCII byte into an
invalid sequence. A character split across reads waits in the line buffer until its line
ends. tests/measure/test_sse.py checks this against a literal transcription of the spec.

Why not sseclient-py: measured by the `test_sseclient_*` tests in tests/measure/test_sse.py,
version 1.9 hands over an event whose final CR and LF arrive in different reads only with
the next read, merges events separated by mixed line endings, dispatches an unterminated
event at EOF, drops the first event after a BOM, raises on invalid UTF-8 and forgets the
last event id. It is right on LF-only streams such as the llama.cpp captures, on lone-CR
streams and on characters split across reads.
"""

from contextlib import suppress
from dataclasses import dataclass
from typing import NoReturn

__all__ = ["SSEEvent", "SSELineTooLong", "SSEParser"]

_BOM = b"\xef\xbb\xbf"
_ENCODED_REPLACEMENT_CHAR = b"\xef\xbf\xbd"


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event.

    `id` is the stream's last event ID at dispatch (None until an `id` field has been
    seen; "" after an empty `id` field reset it). `retry_ms` is the stream's reconnection
    time as last set by a valid `retry` field, None if none has been.
    """

    data: str
    event: str = "message"
    id: str | None = None
    retry_ms: int | None = None

    def __reduce__(self) -> tuple[type["SSEEvent"], tuple[str, str, str | None, int | None]]:
        # by its fields: a compiled frozen class cannot be unpickled field by field
        return (SSEEvent, (self.data, self.event, self.id, self.retry_ms))


class SSELineTooLong(ValueError):
    """A line is longer than the parser's `max_line_bytes`; the stream is malformed.

    `offset` is the stream byte offset of the line's first byte (a stripped BOM counts);
    `events` holds the events completed earlier in the same `feed()` call.
    """

    def __init__(self, offset: int, limit: int, events: list[SSEEvent]) -> None:
        super().__init__(f"SSE line starting at byte offset {offset} is longer than {limit} bytes")
        self.offset = offset
        self.limit = limit
        self.events = events

    def __reduce__(self) -> tuple[type["SSELineTooLong"], tuple[int, int, list[SSEEvent]]]:
        return (SSELineTooLong, (self.offset, self.limit, self.events))


class SSEParser:
    """Parses one event stream. Feed it every byte read, in order, then `close()` it.

    After `SSELineTooLong` every further `feed()` raises it again (with no events).
    `feed()` after `close()` raises ValueError.
    """

    __slots__ = (
        "_bom_pending",
        "_buf",
        "_closed",
        "_comments",
        "_data",
        "_event_type",
        "_failed_at",
        "_fed",
        "_fields_pending",
        "_guarded",
        "_id_buffer",
        "_invalid_utf8",
        "_last_event_id",
        "_max_line_bytes",
        "_retry_ms",
        "_skip_lf",
        "_truncated",
    )

    def __init__(self, max_line_bytes: int = 1 << 20) -> None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
        self._max_line_bytes = max_line_bytes
        self._buf = b""
        self._fed = 0
        # The last chunk ended in CR: an LF opening the next chunk completes that CRLF.
        self._skip_lf = False
        self._bom_pending = True
        self._data: list[str] = []
        self._event_type = ""
        self._id_buffer: str | None = None
        self._last_event_id: str | None = None
        self._retry_ms: int | None = None
        self._fields_pending = False
        self._comments = 0
        self._invalid_utf8 = 0
        self._closed = False
        self._truncated = False
        self._failed_at: int | None = None
        # Set while any rare state above holds, so feed() tests one flag on its hot path.
        self._guarded = True

    @property
    def comments(self) -> int:
        """Comment lines seen (lines starting with ':', e.g. keep-alive pings)."""
        return self._comments

    @property
    def invalid_utf8(self) -> int:
        """Invalid UTF-8 sequences replaced by U+FFFD.

        Counted when their line ends; those in an unterminated last line, at `close()`.
        """
        return self._invalid_utf8

    @property
    def last_event_id(self) -> str | None:
        """The last event ID string, updated at each blank line; None if never set."""
        return self._last_event_id

    @property
    def retry_ms(self) -> int | None:
        """The reconnection time from the last valid `retry` field; None if never set."""
        return self._retry_ms

    @property
    def truncated(self) -> bool:
        """After `close()`: True if the stream ended inside a line or an event."""
        return self._truncated

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume the next bytes of the stream; return the events they complete."""
        self._fed += len(chunk)
        if self._guarded:
            chunk = self._enter(chunk)
        data = self._buf + chunk if self._buf else chunk
        events: list[SSEEvent] = []
        if len(data) > self._max_line_bytes or b"\r" in data:
            return self._feed_any(data, events)
        lines = data.split(b"\n")
        self._buf = lines.pop()
        for raw in lines:
            if raw:
                self._field(raw)
            elif (event := self._dispatch()) is not None:
                events.append(event)
        return events

    @property
    def between(self) -> bool:
        """Between events with nothing held (no partial line, no field of an event yet,
        no rare state): a caller may read whole plain events itself and `skip` them."""
        return not (self._guarded or self._buf or self._fields_pending)

    @property
    def max_line_bytes(self) -> int:
        return self._max_line_bytes

    def no_bom(self) -> None:
        """Before the first byte: the stream is known not to open with a BOM (its first
        bytes are `data: `). The parser is then `between` events from the start, as `feed`
        leaves it after the BOM check, so a caller may read the first event itself. Does
        nothing once bytes were fed."""
        if self._bom_pending and not self._fed and not self._buf:
            self._bom_pending = False
            self._guarded = self._closed or self._skip_lf or self._failed_at is not None

    def skip(self, n: int) -> None:
        """Consume `n` bytes the caller read as whole events of `data:` lines, `between`
        events: the parser is left as `feed` leaves it after them (between events, the
        same last event id and event type)."""
        self._fed += n

    def close(self) -> list[SSEEvent]:
        """End of stream. Returns [] (the spec discards an unterminated event); idempotent."""
        if not self._closed:
            self._closed = self._guarded = True
            self._truncated = bool(self._buf) or self._fields_pending or self._failed_at is not None
            if self._buf:
                # Never interpreted, but its invalid UTF-8 is still invalid UTF-8.
                self._decode(self._buf)
            self._buf = b""
            self._data = []
        return []

    def _enter(self, chunk: bytes) -> bytes:
        """The rare states, kept off the hot path: closed, failed, CR pending, BOM pending."""
        if self._closed:
            raise ValueError("SSEParser.feed() called after close()")
        if self._failed_at is not None:
            raise SSELineTooLong(self._failed_at, self._max_line_bytes, [])
        if not chunk:
            return chunk
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
        if self._bom_pending:
            head = self._buf + chunk
            if len(head) < len(_BOM) and _BOM.startswith(head):
                self._buf = b""
                return head
            self._bom_pending = False
            self._buf = b""
            chunk = head[len(_BOM) :] if head.startswith(_BOM) else head
        self._guarded = False
        return chunk

    def _feed_any(self, data: bytes, events: list[SSEEvent]) -> list[SSEEvent]:
        # The next CR and LF positions are cached, so a chunk is scanned once whatever
        # mix of line endings it holds.
        if self._bom_pending:
            # Fewer bytes than a BOM, all of them a prefix of it: wait for more.
            self._buf = data
            return events
        limit = self._max_line_bytes
        base = self._fed - len(data)
        n = len(data)
        start = 0
        lf = data.find(b"\n")
        cr = data.find(b"\r")
        while lf >= 0 or cr >= 0:
            if cr < 0 or 0 <= lf < cr:
                end = lf
                after = lf + 1
                lf = data.find(b"\n", after)
            else:
                end = cr
                after = cr + 1
                if after == n:
                    self._skip_lf = self._guarded = True
                elif data[after] == 0x0A:
                    after += 1
                    lf = data.find(b"\n", after)
                cr = data.find(b"\r", after)
            if end - start > limit:
                self._fail(base + start, events)
            if end > start:
                self._field(data[start:end])
            elif (event := self._dispatch()) is not None:
                events.append(event)
            start = after
        if n - start > limit:
            self._fail(base + start, events)
        self._buf = data[start:]
        return events

    def _fail(self, offset: int, events: list[SSEEvent]) -> NoReturn:
        self._failed_at = offset
        self._guarded = True
        self._buf = b""
        self._skip_lf = False
        raise SSELineTooLong(offset, self._max_line_bytes, events)

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", "replace")
            # A U+FFFD that arrived as valid UTF-8 is data, not a replacement.
            self._invalid_utf8 += text.count("\ufffd") - raw.count(_ENCODED_REPLACEMENT_CHAR)
            return text

    def _field(self, raw: bytes) -> None:
        line = self._decode(raw)
        if line.startswith("data:"):
            self._fields_pending = True
            self._data.append(line[6:] if line.startswith(" ", 5) else line[5:])
            return
        if line[0] == ":":
            self._comments += 1
            return
        self._fields_pending = True
        colon = line.find(":")
        if colon < 0:
            name, value = line, ""
        else:
            name = line[:colon]
            value = line[colon + 2 :] if line.startswith(" ", colon + 1) else line[colon + 1 :]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event_type = value
        elif name == "id":
            if "\x00" not in value:
                self._id_buffer = value
        elif name == "retry" and value.isascii() and value.isdigit():
            # int() refuses more than sys.get_int_max_str_digits() digits; no server
            # means a reconnection time that long, so such a field is ignored.
            with suppress(ValueError):
                self._retry_ms = int(value)

    def _dispatch(self) -> SSEEvent | None:
        self._fields_pending = False
        self._last_event_id = self._id_buffer
        event_type, self._event_type = self._event_type, ""
        if not self._data:
            return None
        data, self._data = self._data, []
        return SSEEvent(
            "\n".join(data), event_type or "message", self._last_event_id, self._retry_ms
        )
