"""One HTTP/1.1 exchange on the wire, whichever engine does the waiting: the request's
bytes (`prepare`: target, headers and JSON body; `wire`: h11 writes the head), and the
response read as a generator fed with each read's bytes after `Reads.took` stamped
them (`respond`: h11 for the head; a chunked event stream's body read on a fast path of
plain chunks, or through measure.chunked and measure.sse; `finish`: the checks of the
response's end). No waiting here: an engine reads the socket and sends the bytes in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator
from typing import Any, cast

import h11
import msgspec

from calculet_load.measure.chunked import ChunkedDecoder
from calculet_load.measure.outcome import CancelAt, Fail, StreamCancel
from calculet_load.measure.protocols import (
    Adapter,
    ProtocolError,
    error_output_chars,
    raw_text,
)
from calculet_load.measure.request_state import Run
from calculet_load.measure.rxstamps import Reads

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
    if isinstance(cancel, StreamCancel) and cancel.at_stop:
        out.cancelled_at = "run_stop"
        raise Fail("cancelled", "cut when the run stopped")
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
    (tests/measure/test_fastpath.py)."""
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
