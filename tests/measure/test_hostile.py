"""The timed client against a hostile server: every misbehaviour becomes one error class.

Each test has a real server on loopback (tests/support/hostile.py) play a scripted response,
runs `execute` in a greenlet and checks the outcome's exact `error_class` (and where it
says something: the code, the detail, the tokens counted before the failure, which of
t0..t6 were reached, that a failed connection is never pooled). Most tests then send a
valid request on a fresh pool to the same server: the client carries on.

Where a connection closes early (`test_cut_at_every_point`): before the response head is
complete or inside a Content-Length or chunked body it is `connection_reset` (the message
never ended); a close-delimited (HTTP/1.0) body ends at the close, so a stream without its
end marker is `truncated_stream`; bytes that cannot be the start of a status line are
`malformed_http` however the connection ends.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import gevent
import h11
import pyarrow.parquet as pq
import pytest

from calculet_load.measure import session as session_module
from calculet_load.measure import thread_loop, thread_reads
from calculet_load.measure.connections import Endpoint
from calculet_load.measure.exchange import prepare, wire
from calculet_load.measure.gevent_engine import GeventPool
from calculet_load.measure.io_engines import IOEngine, run_in_greenlet
from calculet_load.measure.outcome import ERROR_CLASSES, Outcome, Timeouts
from calculet_load.measure.prompts import Prompt
from calculet_load.measure.protocols import adapter_for
from calculet_load.measure.session import RequestSpec, RunContext, Session
from calculet_load.measure.sink import PartSink
from calculet_load.measure.thread_engine import ThreadPool
from tests.measure.test_fastpath import read_response
from tests.support.hostile import CLOSE, READ, RESET, Sleep, Step, Until, drip, serve
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(20)
# the I/O engine's pool the cases run on (`io_engine` sets it)
Pool: Callable[[Endpoint, int], IOEngine] = GeventPool


@pytest.fixture(autouse=True, params=["gevent", "thread", "thread-loop", "thread-backlog"])
def io_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every case on both I/O engines: the gevent one (measure.gevent_engine) and the
    thread one (measure.thread_engine) must give the same outcome; the thread one with its
    native reader (where it is built: measure.native), with reads on its loop
    (`thread-loop`), and with every read on its loop parsed after it was queued (as when
    the loop is late: measure.thread_loop.Backlog)."""
    # the native reader where it is built (else the loop's reads: test_reader.py says why)
    monkeypatch.setattr(thread_loop, "READ_NATIVELY", request.param == "thread")
    if request.param == "thread-backlog":
        monkeypatch.setattr(thread_reads, "LATE_READ_NS", -1)
    if request.param.startswith("thread"):
        here = globals()
        monkeypatch.setitem(here, "Pool", ThreadPool)
        monkeypatch.setitem(here, "Session", functools.partial(session_module.Session,
                                                               io_engine="thread"))  # fmt: skip
    return str(request.param)


LLAMA_CPP_SAMPLES = Path(__file__).resolve().parents[2].parent / "shared" / "protocol-samples"
FAST = Timeouts(connect_s=1.0, first_byte_s=0.3, idle_s=0.3, total_s=2.0)
# Requests that are not about timeouts (the hostile responses of every other kind, and the
# valid one after each shows the worker goes on) get seconds: a fresh-clone run's loaded
# machine saw 0.3 s pass before a valid answer. A test of a timeout gives its own, with the
# limits it is not about in seconds too (a stall before the head must not turn an idle
# timeout into a first-byte one).
PATIENT = Timeouts(connect_s=5.0, first_byte_s=5.0, idle_s=5.0, total_s=10.0)


# --- responses -----------------------------------------------------------------------------


def llama_event(n: int, text: str = "tok", *, stop: bool = False) -> bytes:
    """One llama.cpp `/completion` event as llama-server writes it (`n` = tokens_predicted)."""
    obj: dict[str, object] = {
        "index": 0,
        "content": "" if stop else text,
        "tokens": [] if stop else [1000 + n],
        "stop": stop,
        "id_slot": -1,
        "tokens_predicted": n,
        "tokens_evaluated": 4,
    }
    if stop:
        obj["stop_type"] = "limit"
        obj["timings"] = {"prompt_n": 4, "predicted_n": n, "predicted_ms": 5.5}
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def chat_event(n: int, text: str = "tok") -> bytes:
    """A vLLM-style chat chunk with continuous usage stats (`n` = completion_tokens)."""
    obj = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        "usage": {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n},
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
# Three tokens, one of them a multi-byte character, then the stop event.
SHORT_LLAMA = llama_event(1, "Once") + llama_event(2, " 产地") + llama_event(3, " a")
SHORT_LLAMA += llama_event(3, stop=True)
SHORT_CHAT = chat_event(1, "Once") + chat_event(2, " upon") + chat_event(3, " a") + DONE


def _llama_capture() -> bytes:
    path = LLAMA_CPP_SAMPLES / "llama.cpp" / "completion-stream.sse"
    if path.is_file():
        return path.read_bytes()
    # The captures live in ../shared beside the repo; without them, one of the same shape.
    return b"".join(llama_event(n, f" w{n}") for n in range(1, 33)) + llama_event(32, stop=True)


CAPTURE = _llama_capture()
CAPTURE_EVENTS = [e + b"\n\n" for e in CAPTURE.split(b"\n\n") if e]
assert b"".join(CAPTURE_EVENTS) == CAPTURE


@dataclasses.dataclass(frozen=True)
class Wire:
    """A framed response; `body_at[k]` = body bytes complete in `data[:k]`."""

    data: bytes
    head_len: int
    body_at: list[int]


def frame(
    parts: Sequence[bytes],
    framing: str = "length",
    *,
    status: bytes = b"200 OK",
    ctype: bytes | None = b"text/event-stream",
    headers: Sequence[bytes] = (),
) -> Wire:
    """The response carrying the body `parts`: Content-Length, chunked (a chunk per part,
    as llama-server flushes one per event) or close-delimited (HTTP/1.0, no length)."""
    version = b"HTTP/1.0" if framing == "close" else b"HTTP/1.1"
    lines = [version + b" " + status, b"Server: hostile"]
    if ctype is not None:
        lines.append(b"Content-Type: " + ctype)
    if framing == "length":
        lines.append(b"Content-Length: %d" % sum(map(len, parts)))
    elif framing == "chunked":
        lines.append(b"Transfer-Encoding: chunked")
    head = b"\r\n".join([*lines, *headers]) + b"\r\n\r\n"
    data, body_at, body = bytearray(head), [0] * (len(head) + 1), 0

    def put(raw: bytes, is_body: bool) -> None:
        nonlocal body
        for byte in raw:
            data.append(byte)
            body += is_body
            body_at.append(body)

    for part in parts:
        if framing == "chunked":
            if not part:
                continue
            put(b"%x\r\n" % len(part), False)
            put(part, True)
            put(b"\r\n", False)
        else:
            put(part, True)
    if framing == "chunked":
        put(b"0\r\n\r\n", False)
    return Wire(bytes(data), len(head), body_at)


def http(
    body: bytes = b"",
    framing: str = "length",
    *,
    status: bytes = b"200 OK",
    ctype: bytes | None = b"text/event-stream",
    headers: Sequence[bytes] = (),
) -> bytes:
    return frame([body], framing, status=status, ctype=ctype, headers=headers).data


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# A chunked response head: the body's chunks follow, then b"0\r\n\r\n".
CHUNKED_HEAD = frame([], "chunked").data[: -len(b"0\r\n\r\n")]


VALID = [http(SHORT_LLAMA)]
VALID_TOKENS = 3


# --- running requests ----------------------------------------------------------------------


def request(
    url: str,
    proto: str = "llama",
    *,
    stream: bool = True,
    timeouts: Timeouts = PATIENT,
    pool: IOEngine | None = None,
    request_id: str = "req-1",
) -> Outcome:
    adapter = adapter_for(proto)
    body = adapter.body(
        "Once upon a time",
        32,
        stream=stream,
        model=None,
        temperature=0.0,
        seed=None,
        ignore_eos=False,
    )
    own = Pool(Endpoint(url), 4) if pool is None else None
    use = pool or own
    assert use is not None
    try:
        return run_in_greenlet(
            lambda: use.execute(adapter, body, request_id, stream=stream, timeouts=timeouts)
        )
    finally:
        if own is not None:
            own.close()


def play(
    script: Sequence[Step],
    proto: str = "llama",
    *,
    stream: bool = True,
    timeouts: Timeouts = PATIENT,
) -> Outcome:
    """One request against `script`, then a valid one on a fresh pool (the worker goes on)."""
    with serve(script, VALID) as server:
        pool = Pool(Endpoint(server.url), 4)
        try:
            out = request(server.url, proto, stream=stream, timeouts=timeouts, pool=pool)
            assert out.error_class is None or out.error_class in ERROR_CLASSES
            if out.error_class is not None:
                assert pool.open == 0, "a failed connection went back to the pool"
                assert out.error_code, "every failure carries a code"
        finally:
            pool.close()
        after = request(server.url, request_id="req-after")
        assert after.ok, (after.error_class, after.error_detail)
        assert after.output_tokens == VALID_TOKENS
    return out


def failed(out: Outcome, error_class: str, tokens: int = 0) -> None:
    assert (out.error_class, out.output_tokens) == (error_class, tokens), out.error_detail


def stamps(out: Outcome) -> list[bool]:
    """Which of t0..t6 were reached."""
    ns = out.client_ns
    points = [
        ns.request_start,
        ns.headers_sent,
        ns.response_headers,
        ns.first_event,
        ns.first_token,
        ns.last_token,
        ns.response_end,
    ]
    return [p is not None for p in points]


def assert_ordered(out: Outcome) -> None:
    """t0 <= t2 <= ... <= t6 as reached, t1 after t0, and t1 after t2 exactly when the
    outcome says a late user-space t1 broke that order (`sent_stamp_late`: the head's
    kernel stamp is kept, not raised to t1)."""
    ns = out.client_ns
    points = [
        ns.request_start,
        ns.response_headers,
        ns.first_event,
        ns.first_token,
        ns.last_token,
        ns.response_end,
    ]
    reached = [p for p in points if p is not None]
    assert reached == sorted(reached)
    t0, t1, t2 = ns.request_start, ns.headers_sent, ns.response_headers
    if t1 is not None:
        assert t0 is not None and t0 <= t1
        late = t2 is not None and t1 > t2
        assert late == out.sent_stamp_late, (t1, t2, out.sent_stamp_source)
        assert not late or out.sent_stamp_source == "send"


# --- the baseline: a real llama.cpp stream -------------------------------------------------


def test_valid_capture_succeeds_and_the_connection_is_reused() -> None:
    wire = frame(CAPTURE_EVENTS, "chunked")
    with serve([wire.data, READ, wire.data]) as server:
        pool = Pool(Endpoint(server.url), 2)
        try:
            first = request(server.url, pool=pool, request_id="req-1")
            second = request(server.url, pool=pool, request_id="req-2")
            assert pool.open == 1
        finally:
            pool.close()
    for out in (first, second):
        assert out.ok, out.error_detail
        assert (out.http_status, out.output_tokens, out.server_total) == (200, 32, 32)
        assert (out.finish_reason, out.count_source) == ("length", "tokens_predicted")
        assert out.events == len(CAPTURE_EVENTS)
        assert out.token_hash is not None and not out.token_count_mismatch
        assert stamps(out) == [True] * 7
        assert_ordered(out)
    assert (first.connection_reused, second.connection_reused) == (False, True)
    assert server.connections == 1
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0] == b"post /completion http/1.1"
    assert b"x-request-id: req-1" in lines and b"accept: text/event-stream" in lines
    assert json.loads(body)["stream"] is True and json.loads(body)["n_predict"] == 32
    assert b"x-request-id: req-2" in server.requests[1].lower()


# --- a connection closed at every point of the response ------------------------------------


def _cut_points(wire: Wire) -> list[int]:
    n, head = len(wire.data), wire.head_len
    status_end = wire.data.index(b"\r\n")
    points = {0, 1, 4, 5, 9, 12, status_end, status_end + 1, status_end + 9}
    points |= {head - 3, head - 2, head - 1, head, head + 1, head + 3}
    ends = [k for k in range(head, n + 1) if wire.body_at[k] != wire.body_at[k - 1]]
    # around the end of the first, second and last events, inside the first and last ones
    event_ends = [sum(map(len, CAPTURE_EVENTS[: i + 1])) for i in range(len(CAPTURE_EVENTS))]
    for body_end in (event_ends[0], event_ends[1], event_ends[-2], event_ends[-1]):
        k = ends[body_end - 1]  # the wire offset right after that body byte
        points |= {k - 2, k - 1, k, k + 1}
    points |= {ends[20], ends[event_ends[-2] + 40], n - 3, n - 1, n}
    return sorted(p for p in points if 0 <= p <= n)


def _tokens_in(body_len: int) -> int:
    """tokens_predicted of the last capture event complete in the first body_len bytes."""
    tokens, end = 0, 0
    for event in CAPTURE_EVENTS:
        end += len(event)
        if end > body_len:
            break
        tokens = json.loads(event[6:])["tokens_predicted"]
    return tokens


def _event_boundary(body_len: int) -> bool:
    ends, end = {0}, 0
    for event in CAPTURE_EVENTS:
        end += len(event)
        ends.add(end)
    return body_len in ends


WIRES = {f: frame(CAPTURE_EVENTS, f) for f in ("length", "chunked", "close")}
CUTS = [
    pytest.param(f, k, id=f"{f}-{k}-" + ("head" if k < w.head_len else "body"))
    for f, w in WIRES.items()
    for k in _cut_points(w)
]


@pytest.mark.parametrize(("framing", "cut"), CUTS)
def test_cut_at_every_point(framing: str, cut: int) -> None:
    wire = WIRES[framing]
    out = play([wire.data[:cut], CLOSE])
    body_len = wire.body_at[cut]
    tokens = _tokens_in(body_len)
    if cut == len(wire.data):
        assert out.ok, out.error_detail
        assert out.output_tokens == out.server_total == 32
        return
    if cut < wire.head_len:
        failed(out, "connection_reset")
        assert stamps(out) == [True, True] + [False] * 5
        return
    assert out.http_status == 200 and out.client_ns.response_headers is not None
    assert out.output_tokens == tokens
    assert (out.client_ns.first_token is not None) == (tokens > 0)
    if framing == "close":
        # The close is the end of the message: the stream lacks its stop event.
        failed(out, "truncated_stream", tokens)
        inside = "inside an event" if not _event_boundary(body_len) else "without the protocol"
        assert inside in (out.error_detail or "")
        assert out.client_ns.response_end is not None
    else:
        failed(out, "connection_reset", tokens)
        assert out.client_ns.response_end is None


def test_full_stream_without_its_last_chunk_terminator_is_a_reset_with_every_token() -> None:
    wire = WIRES["chunked"]
    out = play([wire.data[: -len(b"0\r\n\r\n")], CLOSE])
    failed(out, "connection_reset", 32)
    assert out.server_total == 32 and out.finish_reason == "length"


# --- streams that end cleanly without the end marker ---------------------------------------


@pytest.mark.parametrize(
    ("proto", "body", "detail"),
    [
        pytest.param("llama", SHORT_LLAMA.rsplit(b"data:", 1)[0], "end marker", id="llama-no-stop"),
        pytest.param("openai-chat", SHORT_CHAT[: -len(DONE)], "end marker", id="chat-no-done"),
        pytest.param("llama", SHORT_LLAMA[:-1], "inside an event", id="llama-stop-unterminated"),
        pytest.param(
            "openai-chat", SHORT_CHAT[:-2], "inside an event", id="chat-done-unterminated"
        ),
    ],
)
@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_clean_end_without_the_end_marker_is_truncated(
    proto: str, body: bytes, detail: str, framing: str
) -> None:
    out = play([http(body, framing)], proto)
    failed(out, "truncated_stream", VALID_TOKENS)
    assert detail in (out.error_detail or "")
    assert stamps(out) == [True] * 7  # the HTTP message did end


# --- hostile event contents ----------------------------------------------------------------

L1, L2, L3 = llama_event(1, "a"), llama_event(2, "b"), llama_event(3, "c")
STOP3 = llama_event(3, stop=True)
C1, C2 = chat_event(1), chat_event(2)


def _llama_raw(fields: str) -> bytes:
    return b'data: {"index":0,' + fields.encode() + b"}\n\n"


EVENT_CASES = [
    # (id, protocol, body, class, tokens counted before the failure)
    ("invalid-json", "llama", L1 + b'data: {"content":"x",\n\n' + STOP3, "invalid_json", 1),
    ("not-an-object", "llama", L1 + b"data: [1,2,3]\n\n", "protocol_violation", 1),
    ("string-event", "openai-chat", C1 + b'data: "hello"\n\n', "protocol_violation", 1),
    ("choices-not-list", "openai-chat", b'data: {"choices":{"0":{}}}\n\n', "protocol_violation", 0),
    (
        "choice-not-object",
        "openai-completions",
        b'data: {"choices":[7]}\n\n',
        "protocol_violation",
        0,
    ),
    (
        "delta-not-object",
        "openai-chat",
        b'data: {"choices":[{"delta":"x"}]}\n\n',
        "protocol_violation",
        0,
    ),
    (
        "content-not-string-chat",
        "openai-chat",
        C1 + b'data: {"choices":[{"delta":{"content":5}}]}\n\n',
        "protocol_violation",
        1,
    ),
    (
        "finish-reason-not-string",
        "openai-completions",
        b'data: {"choices":[{"text":"a","finish_reason":{"x":1}}]}\n\n',
        "protocol_violation",
        0,
    ),
    ("content-not-string-llama", "llama", _llama_raw('"content":5'), "protocol_violation", 0),
    (
        "count-is-string",
        "llama",
        _llama_raw('"content":"a","tokens_predicted":"1"'),
        "protocol_violation",
        0,
    ),
    (
        "count-negative",
        "llama",
        _llama_raw('"content":"a","tokens_predicted":-1'),
        "value_out_of_range",
        0,
    ),
    (
        "count-beyond-int64",
        "llama",
        L1 + L2 + L3 + STOP3.replace(b'"tokens_predicted":3', b'"tokens_predicted":%d' % 2**70),
        "value_out_of_range",
        3,
    ),
    (
        "predicted-n-beyond-int64",
        "llama",
        L1 + L2 + L3 + STOP3.replace(b'"predicted_n":3', b'"predicted_n":%d' % 2**64),
        "value_out_of_range",
        3,
    ),
    (
        "usage-beyond-int64",
        "openai-chat",
        C1 + chat_event(2**63) + DONE,
        "value_out_of_range",
        1,
    ),
    (
        "prompt-tokens-beyond-int64",
        "llama",
        L1 + _llama_raw(f'"content":"b","tokens_predicted":2,"tokens_evaluated":{2**66}'),
        "value_out_of_range",
        1,
    ),
    (
        "count-infinite",
        "llama",
        _llama_raw('"content":"a","tokens_predicted":Infinity'),
        "protocol_violation",
        0,
    ),
    ("count-backwards", "llama", L1 + L2 + L3 + llama_event(2) + STOP3, "protocol_violation", 3),
    (
        "usage-backwards",
        "openai-chat",
        C1 + C2 + chat_event(1) + DONE,
        "protocol_violation",
        2,
    ),
    ("event-after-stop", "llama", L1 + L2 + L3 + STOP3 + L3, "protocol_violation", 3),
    ("event-after-done", "openai-chat", C1 + DONE + C2, "protocol_violation", 1),
    ("done-after-done", "openai-chat", C1 + DONE + DONE, "protocol_violation", 1),
    (
        "nan-in-timings",
        "llama",
        L1 + L2 + L3 + STOP3.replace(b'"predicted_ms":5.5', b'"predicted_ms":NaN'),
        "nonfinite_number",
        3,
    ),
    (
        "infinity-in-field",
        "llama",
        L1 + _llama_raw('"content":"","x":Infinity') + STOP3,
        "nonfinite_number",
        3,
    ),
    (
        "minus-infinity",
        "openai-chat",
        C1 + b'data: {"choices":[],"p":-Infinity}\n\n' + DONE,
        "nonfinite_number",
        1,
    ),
    # The stream stops at the bad event: the events of one read are all taken in first.
    (
        "invalid-utf8",
        "llama",
        L1 + b'data: {"content":"\xff\xfe","tokens_predicted":2}\n\n',
        "invalid_utf8",
        2,
    ),
    ("invalid-utf8-comment", "llama", L1 + b": \xc3\x28\n\n", "invalid_utf8", 1),
    (
        "huge-integer",
        "llama",
        L1 + _llama_raw('"content":"a","tokens_predicted":1' + "0" * 5000),
        "invalid_json",
        1,
    ),
    ("deep-nesting", "llama", L1 + b"data: " + b"[" * 100_000 + b"\n\n", "invalid_json", 1),
    (
        "deep-nesting-openai",
        "openai-chat",
        b"data: " + b'{"a":' * 50_000 + b"\n\n",
        "invalid_json",
        0,
    ),
]


@pytest.mark.parametrize(
    ("proto", "body", "error_class", "tokens"),
    [pytest.param(*case[1:], id=case[0]) for case in EVENT_CASES],
)
def test_hostile_event(proto: str, body: bytes, error_class: str, tokens: int) -> None:
    out = play([http(body, "chunked")], proto)
    failed(out, error_class, tokens)
    assert out.error_code == error_class
    assert out.client_ns.response_headers is not None
    assert (out.client_ns.first_token is not None) == (tokens > 0)


def test_nonfinite_is_flagged_but_the_tokens_stand() -> None:
    body = L1 + L2 + L3 + STOP3.replace(b'"predicted_ms":5.5', b'"predicted_ms":NaN')
    out = play([http(body)])
    failed(out, "nonfinite_number", 3)
    assert out.nonfinite and out.server_total == 3 and out.finish_reason == "length"
    assert out.timings is not None and out.timings["predicted_n"] == 3


@pytest.mark.parametrize(
    ("proto", "body", "code", "message", "tokens"),
    [
        pytest.param(
            "llama",
            L1 + b'data: {"error":{"code":500,"message":"slot lost","type":"server_error"}}\n\n',
            "server_error",
            "slot lost",
            1,
            id="llama",
        ),
        pytest.param(
            "openai-chat",
            C1 + C2 + b'data: {"error":{"message":"overloaded","type":"overloaded_error"}}\n\n',
            "overloaded_error",
            "overloaded",
            2,
            id="openai-type",
        ),
        pytest.param(
            "openai-completions",
            b'data: {"error":{"message":"no","code":"engine_dead"}}\n\n',
            "engine_dead",
            "no",
            0,
            id="openai-code-only",
        ),
        pytest.param("llama", b'data: {"error":"boom"}\n\n', "error", "boom", 0, id="string"),
    ],
)
def test_error_event(proto: str, body: bytes, code: str, message: str, tokens: int) -> None:
    out = play([http(body + STOP3, "chunked")], proto)
    failed(out, "server_error_event", tokens)
    assert (out.error_code, out.error_detail) == (code, message)


@pytest.mark.parametrize(
    ("proto", "script", "chars"),
    [
        pytest.param(  # the final error event carries the text of tokens never sent
            "openai-chat",
            [http(C1 + b'data: {"error":{"message":"ccu","type":"server_error"},'
                  b'"choices":[{"delta":{"content":"leaked"}}]}\n\n', "chunked")],
            6, id="chat-error-event-with-content",
        ),
        pytest.param(
            "llama",
            [http(L1 + b'data: {"error":{"message":"slot lost"},"content":"abc"}\n\n', "chunked")],
            3, id="llama-error-event-with-content",
        ),
        pytest.param(  # an HTTP error body with a completion in it
            "openai-completions",
            [http(b'{"error":{"message":"nan","type":"numeric"},"choices":[{"text":"12345"}]}',
                  status=b"500 Internal", ctype=b"application/json"), CLOSE],
            5, id="500-body-with-text",
        ),
        pytest.param(
            "openai-chat",
            [http(b'{"error":{"message":"busy","type":"overloaded"}}', status=b"503 Busy",
                  ctype=b"application/json"), CLOSE],
            0, id="503-clean-body",
        ),
        pytest.param(
            "llama",
            [http(L1 + b'data: {"error":{"code":500,"message":"slot lost"}}\n\n', "chunked")],
            0, id="llama-clean-error-event",
        ),
    ],
)  # fmt: skip
def test_an_error_response_that_carries_output_is_recorded(
    proto: str, script: list[Step], chars: int
) -> None:
    """Spec §14.1: error responses carry no uninitialized output. The text an error event
    or body carries beside its error is counted (`ext.error_output_chars`; the
    `error_output` rule fails on it); the tokens streamed before a final error event are
    the request's partial output, not counted."""
    out = play(script, proto)
    assert out.error_class is not None
    assert out.error_output_chars == chars


def test_lone_surrogate_escape_is_data_not_a_crash() -> None:
    body = L1 + _llama_raw('"content":"\\ud800","tokens_predicted":2') + STOP3
    out = play([http(body)])
    assert out.ok, out.error_detail
    assert out.output_tokens == 3 and out.token_hash is not None


def test_giant_line_is_malformed_sse() -> None:
    giant = b"data: " + b"x" * (1 << 20)  # over SSEParser's default 1 MiB line limit
    start = time.monotonic()
    out = play([http(L1 + giant + b"\n\n" + STOP3, "chunked")])
    failed(out, "malformed_sse", 1)
    assert "longer than 1048576 bytes" in (out.error_detail or "")
    assert time.monotonic() - start < 2.0


def test_giant_line_still_arriving_fails_before_it_ends() -> None:
    # The server is still sending (no newline yet) when the limit is crossed.
    pieces: list[Step] = [CHUNKED_HEAD, b"%x\r\n" % (2 << 20), b"data: "]
    pieces += [b"y" * 65536, Sleep(0.01)] * 20
    out = play(pieces)
    failed(out, "malformed_sse")


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"\xef\xbb\xbf" + SHORT_LLAMA, id="bom"),
        pytest.param(SHORT_LLAMA.replace(b"\n", b"\r\n"), id="crlf"),
        pytest.param(SHORT_LLAMA.replace(b"\n", b"\r"), id="lone-cr"),
        pytest.param(b": ping\n\nevent: message\nid: 1\nretry: 10\n" + SHORT_LLAMA, id="fields"),
    ],
)
def test_unusual_but_valid_sse_succeeds(body: bytes) -> None:
    out = play([http(body)])
    assert out.ok, out.error_detail
    assert out.output_tokens == VALID_TOKENS


# --- HTTP status, framing and content type -------------------------------------------------

DEEP_JSON = b"[" * 100_000


@pytest.mark.parametrize(
    ("response", "status", "error_class", "code", "detail"),
    [
        pytest.param(
            http(
                b'{"error":{"type":"rate_limit_exceeded","message":"slow down"}}',
                status=b"429 Too Many Requests",
                ctype=b"application/json",
                headers=[b"Retry-After: 1"],
            ),
            429,
            "http_4xx",
            "rate_limit_exceeded",
            "slow down",
            id="429-json",
        ),
        pytest.param(
            http(
                b'{"error":{"code":"context_length_exceeded","message":"too long"}}',
                "chunked",
                status=b"400 Bad Request",
                ctype=b"application/json",
            ),
            400,
            "http_4xx",
            "context_length_exceeded",
            "too long",
            id="400-json-chunked",
        ),
        pytest.param(
            http(b"<html><body>oops</body></html>", status=b"500 Oops", ctype=b"text/html"),
            500,
            "http_5xx",
            "500",
            "non-JSON error body (30 bytes)",
            id="500-html",
        ),
        pytest.param(
            http(b"", status=b"503 Service Unavailable", ctype=None),
            503,
            "http_5xx",
            "503",
            "non-JSON error body (0 bytes)",
            id="503-empty",
        ),
        pytest.param(
            http(b'{"detail":"no"}', "close", status=b"404 Not Found", ctype=b"application/json"),
            404,
            "not_found",
            "404",
            "error body without an error object",
            id="404-close-delimited",
        ),
        pytest.param(
            http(DEEP_JSON, status=b"500 Internal", ctype=b"application/json"),
            500,
            "http_5xx",
            "500",
            "non-JSON error body (100000 bytes)",
            id="500-deep-json",
        ),
        pytest.param(
            http(b"", status=b"302 Found", ctype=None, headers=[b"Location: http://x/"]),
            302,
            "http_other",
            "302",
            "non-JSON error body (0 bytes)",
            id="302-redirect",
        ),
        pytest.param(
            http(b"<html>hi</html>", ctype=b"text/html"),
            200,
            "protocol_violation",
            "protocol_violation",
            "stream requested, got content type 'text/html'",
            id="200-html",
        ),
        pytest.param(
            http(b"", status=b"204 No Content", ctype=None),
            204,
            "protocol_violation",
            "protocol_violation",
            "stream requested, got content type ''",
            id="204-no-content",
        ),
    ],
)
def test_http_status(
    response: bytes, status: int, error_class: str, code: str, detail: str
) -> None:
    out = play([response, CLOSE])
    failed(out, error_class)
    assert (out.http_status, out.error_code, out.error_detail) == (status, code, detail)
    assert out.client_ns.response_headers is not None and out.events == 0


def test_content_type_is_case_insensitive() -> None:
    out = play([http(SHORT_LLAMA, ctype=b"Text/Event-Stream; charset=utf-8")])
    assert out.ok, out.error_detail
    assert out.output_tokens == VALID_TOKENS


def test_interim_100_continue_is_skipped() -> None:
    out = play([b"HTTP/1.1 100 Continue\r\n\r\n", Sleep(0.02), http(SHORT_LLAMA, "chunked")])
    assert out.ok, out.error_detail
    assert (out.http_status, out.output_tokens) == (200, VALID_TOKENS)


def test_the_request_is_what_h11_writes() -> None:
    """`wire` has h11 write the head only and appends the body: the bytes are h11's whole
    request. A Transfer-Encoding from --header would frame the body h11 no longer writes:
    it is never sent (the body's Content-Length is ours)."""
    body = '{"text":"\u00e9"}'.encode()
    request = ("/v1/completions", [("Host", "x"), ("Content-Length", str(len(body)))], body)
    whole = h11.Connection(h11.CLIENT)
    sent = whole.send(h11.Request(method="POST", target=request[0], headers=request[1]))
    sent += whole.send(h11.Data(data=request[2])) + whole.send(h11.EndOfMessage())
    assert wire(request)[1] == sent
    endpoint = Endpoint("http://127.0.0.1:1")
    endpoint.headers = [("Transfer-Encoding", "chunked"), ("X-Team", "perf")]
    _, headers, payload = prepare(endpoint, adapter_for("llama"), {"a": 1}, "r1", True, None)
    names = [n.lower() for n, _ in headers]
    assert "transfer-encoding" not in names and "x-team" in names
    assert ("Content-Length", str(len(payload))) in headers


_SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
_EVENTS = (
    b'data: {"content":" w","stop":false,"tokens_predicted":1}\n\n'
    b'data: {"content":"","stop":true,"tokens_predicted":1}\n\n'
)
_CHUNKS = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_EVENTS), _EVENTS)
_WHOLE = b'{"content":" w","tokens_predicted":1,"stop":true}'
_TWO_CONNECTION_HEADERS = b"Connection: keep-alive\r\nConnection: Close\r\n\r\n"  # h11 joins them


def _length(head: bytes) -> bytes:
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(_WHOLE), _WHOLE)


@pytest.mark.parametrize(
    ("reads", "closed_last", "reusable"),
    [
        ([_length(b"HTTP/1.1 200 OK\r\n")], False, True),
        ([_length(b"HTTP/1.1 200 OK\r\nConnection: close\r\n")], False, False),
        ([_length(b"HTTP/1.0 200 OK\r\n")], False, False),
        ([_length(b"HTTP/1.1 200 OK\r\n")], True, False),
        ([_SSE_HEAD + b"\r\n", _CHUNKS], False, True),
        ([_SSE_HEAD + b"Connection: keep-alive, close\r\n\r\n", _CHUNKS], False, False),
        ([_SSE_HEAD + _TWO_CONNECTION_HEADERS, _CHUNKS], False, False),
        ([_SSE_HEAD + b"\r\n", _CHUNKS], True, False),
    ],
    ids=["length", "length-close", "http-1.0", "length-then-closed", "chunked",
         "chunked-close", "chunked-second-close", "chunked-then-closed"],
)  # fmt: skip
def test_reuse_follows_the_response(reads: list[bytes], closed_last: bool, reusable: bool) -> None:
    """With h11 told of the request's head only, the response decides reuse (the request
    asked for nothing), on h11's reading of a body and on the event stream's own
    (`_chunked`)."""
    stream = b"event-stream" in reads[0]
    verdict, _ = read_response(reads, adapter_for("llama"), closed_last, stream=stream)
    assert verdict == ("end", reusable)


@pytest.mark.parametrize(
    "reads",
    [[_length(b"HTTP/1.1 200 OK\r\n")], [_SSE_HEAD + b"\r\n", _CHUNKS]],
    ids=["length", "chunked"],
)
def test_a_request_that_asks_to_close_is_not_reused(reads: list[bytes]) -> None:
    """A `--header Connection: close` closes the connection after its response, whoever
    reads the body (h11, or the event stream's own `_chunked`)."""
    stream = b"event-stream" in reads[0]
    ask = (("Connection", "close"),)
    verdict, _ = read_response(reads, adapter_for("llama"), stream=stream, ask=ask)
    assert verdict == ("end", False)


def test_a_switch_of_protocols_is_not_http() -> None:
    """A 101 to an `Upgrade` a --header asked for pauses h11: an error, not a wait."""
    switch = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n"
    ask = (("Upgrade", "x"), ("Connection", "upgrade"))
    verdict, _ = read_response([switch, b"anything"], adapter_for("llama"), ask=ask)
    assert verdict[:2] == ("fail", "malformed_http")


def test_connection_close_header_is_honoured() -> None:
    with serve([http(SHORT_LLAMA, headers=[b"Connection: close"])]) as server:
        pool = Pool(Endpoint(server.url), 2)
        try:
            out = request(server.url, pool=pool)
            assert pool.open == 0  # not kept for reuse
        finally:
            pool.close()
    assert out.ok and out.output_tokens == VALID_TOKENS


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"


@pytest.mark.parametrize(
    "script",
    [
        pytest.param([b"garbage\r\n\r\n"], id="garbage-head"),
        pytest.param([b"SSH-2.0-OpenSSH_9.6\r\nProtocol mismatch.\r\n", CLOSE], id="ssh-then-fin"),
        pytest.param([b"\x16\x03\x01\x00\xa5\x01\x00", CLOSE], id="tls-bytes-then-fin"),
        pytest.param([b"HTTP/1.1 2x0 OK\r\n\r\n"], id="bad-status-code"),
        pytest.param([b"HTTP/2 200\r\n\r\n"], id="http2-status"),
        pytest.param([HEAD + b"Content-Type text/event-stream\r\n\r\n"], id="header-no-colon"),
        pytest.param([HEAD + b"Transfer-Encoding: gzip\r\n\r\n"], id="unknown-te"),
        pytest.param([HEAD + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n"], id="two-lengths"),
        pytest.param([HEAD + b"Content-Length: -1\r\n\r\n"], id="negative-length"),
        pytest.param([HEAD + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n"], id="head-over-limit"),
        pytest.param([b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n"], id="101"),
    ],
)
def test_malformed_http(script: list[Step]) -> None:
    out = play(script)
    failed(out, "malformed_http")
    assert out.client_ns.response_headers is None and out.events == 0


def test_bad_chunk_after_tokens_is_malformed_http_with_the_tokens() -> None:
    out = play([CHUNKED_HEAD, chunk(L1), Sleep(0.02), b"zz\r\n" + chunk(L2)])
    failed(out, "malformed_http", 1)
    assert out.http_status == 200 and stamps(out) == [True] * 6 + [False]


# --- timeouts ------------------------------------------------------------------------------


def _timed(script: Sequence[Step], timeouts: Timeouts) -> tuple[Outcome, float]:
    start = time.monotonic()
    out = play(script, timeouts=timeouts)
    return out, time.monotonic() - start


def test_server_never_answers_is_first_byte_timeout() -> None:
    out, elapsed = _timed([Sleep(5.0)], FAST)
    failed(out, "first_byte_timeout")
    assert stamps(out) == [True, True] + [False] * 5
    assert 0.25 < elapsed < 1.5


# The idle limit alone short: the bytes before the stall come at once, and a loaded machine
# that holds the server's thread for 0.3 s must not make them a first-byte timeout.
IDLE_ONLY = Timeouts(connect_s=5.0, first_byte_s=5.0, idle_s=0.3, total_s=8.0)


def test_stall_inside_the_status_line_is_idle_not_first_byte() -> None:
    # Bytes have arrived: from then on the idle timeout applies, not the first-byte one.
    out, elapsed = _timed([b"HTTP/1.1 20", Sleep(6.0)], IDLE_ONLY)
    failed(out, "idle_timeout")
    assert elapsed < 2.0


def test_stall_after_tokens_is_idle_timeout_with_the_tokens_counted() -> None:
    out, elapsed = _timed([CHUNKED_HEAD + chunk(L1) + chunk(L2), Sleep(5.0)], IDLE_ONLY)
    failed(out, "idle_timeout", 2)
    assert stamps(out) == [True] * 6 + [False]
    assert 0.25 < elapsed < 1.5


def test_drip_slower_than_the_idle_timeout_is_idle_timeout() -> None:
    wire = http(SHORT_LLAMA)
    head_end = wire.index(b"\r\n\r\n") + 4
    fast, slow = wire[head_end : head_end + 4], wire[head_end + 4 :]
    out = play([wire[:head_end], *drip(fast, 0.05), *drip(slow, 0.45)], timeouts=IDLE_ONLY)
    failed(out, "idle_timeout")
    assert out.client_ns.response_headers is not None and out.events == 0


def test_slow_drip_within_the_idle_timeout_succeeds() -> None:
    wire = http(SHORT_LLAMA, "chunked")
    head_end = wire.index(b"\r\n\r\n") + 4
    second = wire.index(b"data:", wire.index(b"data:") + 1)
    wide = wire.index("产".encode()) - 4  # a multi-byte character split across reads
    script: list[Step] = []
    for piece in (
        (0, head_end - 6),
        (head_end - 6, head_end + 6),  # one byte at a time across the head's end
        (head_end + 6, second - 6),
        (second - 6, second + 2),  # across the boundary of two events
        (second + 2, wide),
        (wide, wide + 10),  # and through a multi-byte character
        (wide + 10, len(wire)),
    ):
        a, b = piece
        size = 1 if b - a <= 12 else 64
        script += drip(wire[a:b], 0.05, size)
    # 42 pieces 0.05 s apart: 2.1 s in all, past the idle limit, so the limit runs from
    # each read; a second's margin over the gaps, so no descheduling makes one of them idle
    relaxed = Timeouts(connect_s=5.0, first_byte_s=5.0, idle_s=1.0, total_s=10.0)
    out = play(script, timeouts=relaxed)
    assert out.ok, out.error_detail
    assert (out.output_tokens, out.server_total, out.events) == (3, 3, 4)
    assert out.client_ns.response_headers is not None and out.client_ns.first_token is not None
    # the stamps follow the bytes: the first token came well after the head
    assert out.client_ns.first_token - out.client_ns.response_headers > 0.25e9


def test_comment_pings_keep_an_idle_stream_alive() -> None:
    script: list[Step] = [CHUNKED_HEAD, chunk(L1)]
    # 2 s without a token, idle 1 s: pings 0.1 s apart leave a descheduled server thread
    # 0.9 s before the client would see the stream idle
    script += [Sleep(0.1), chunk(b": ping\n\n")] * 20
    script += [chunk(L2 + L3 + STOP3), b"0\r\n\r\n"]
    relaxed = Timeouts(connect_s=5.0, first_byte_s=5.0, idle_s=1.0, total_s=8.0)
    out, elapsed = _timed(script, relaxed)
    assert out.ok, out.error_detail
    assert out.output_tokens == VALID_TOKENS and elapsed > 2.0


def test_drip_past_the_total_timeout_is_total_timeout() -> None:
    script: list[Step] = [CHUNKED_HEAD, chunk(L1)]
    script += [Sleep(0.1), chunk(b": ping\n\n")] * 40  # never idle, never done
    # idle 1 s: a ping 0.1 s late by a descheduling is still not idle; total 2 s, well
    # past the idle limit
    out, elapsed = _timed(
        script, Timeouts(connect_s=5.0, first_byte_s=5.0, idle_s=1.0, total_s=2.0)
    )
    failed(out, "total_timeout", 1)
    assert 1.9 < elapsed < 3.0


# --- resets and refusals -------------------------------------------------------------------


def test_reset_mid_stream_keeps_the_tokens_before_it() -> None:
    out = play([CHUNKED_HEAD + chunk(L1) + chunk(L2), Sleep(0.1), RESET])
    failed(out, "connection_reset", 2)
    assert stamps(out) == [True] * 6 + [False]
    assert "reset" in (out.error_detail or "").lower()


@pytest.mark.parametrize(
    "script",
    [
        pytest.param([RESET], id="reset-at-once"),
        pytest.param([CLOSE], id="fin-at-once"),
        pytest.param([Sleep(0.05), HEAD[:9], Sleep(0.05), RESET], id="reset-in-status-line"),
    ],
)
def test_closed_before_the_head_is_connection_reset(script: list[Step]) -> None:
    out = play(script)
    failed(out, "connection_reset")
    assert out.http_status is None and stamps(out) == [True, True] + [False] * 5


def test_connection_refused() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    pool = Pool(Endpoint(url), 1)
    try:
        out = request(url, pool=pool)
        assert pool.open == 0
        failed(out, "connect_refused")
        assert stamps(out) == [True] + [False] * 6
        again = request(url, pool=pool)  # the slot was given back
        failed(again, "connect_refused")
    finally:
        pool.close()


@pytest.fixture
def full_backlog() -> Iterator[str]:
    """A listener whose accept queue is full: the kernel drops further SYNs."""
    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(3):
            s = socket.socket()
            fillers.append(s)
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
        time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        for s in fillers:
            s.close()
        listener.close()


def test_connect_timeout(full_backlog: str) -> None:
    short = Timeouts(connect_s=0.3, first_byte_s=0.3, idle_s=0.3, total_s=2.0)
    start = time.monotonic()
    pool = Pool(Endpoint(full_backlog), 1)
    try:
        out = request(full_backlog, timeouts=short, pool=pool)
        assert pool.open == 0
    finally:
        pool.close()
    failed(out, "connect_timeout")
    assert 0.25 < time.monotonic() - start < 1.5
    assert stamps(out) == [True] + [False] * 6


# --- keep-alive and the pool ---------------------------------------------------------------


def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait for `cond` (set by the server's threads), letting the event loop run."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the server"
        gevent.sleep(0.01)


@pytest.mark.parametrize(
    ("after_first", "reused"),
    [
        pytest.param([READ, VALID[0]], True, id="kept-open"),
        pytest.param([Sleep(0.05), CLOSE], False, id="closed-while-idle"),
        pytest.param([Sleep(0.05), RESET], False, id="reset-while-idle"),
        pytest.param([Sleep(0.05), b"HTTP/1.1 200 OK\r\n\r\n"], False, id="stray-bytes-while-idle"),
    ],
)
def test_idle_keepalive_connection(after_first: list[Step], reused: bool) -> None:
    with serve([VALID[0], *after_first], VALID) as server:
        pool = Pool(Endpoint(server.url), 1)
        try:
            first = request(server.url, pool=pool)
            assert first.ok and pool.open == 1
            time.sleep(0.25)  # the connection sits idle in the pool
            if not reused:
                # whatever the server does to the idle connection has happened: waited
                # for, as a loaded machine can hold the server's thread past the sleep
                # (stray bytes after the second request would be read as its answer)
                _until(lambda: server.played == 1)
            second = request(server.url, pool=pool, request_id="req-2")
            assert pool.open == 1
        finally:
            pool.close()
    assert second.ok, second.error_detail
    assert second.output_tokens == VALID_TOKENS
    assert second.connection_reused is reused
    assert server.connections == (1 if reused else 2)


@pytest.mark.parametrize("then_ok", [True, False], ids=["fresh-answers", "fresh-closes-too"])
def test_a_kept_alive_connection_closed_under_the_request_is_retried_once(then_ok: bool) -> None:
    """llama.cpp closes every connection after a streamed response, with no
    `Connection: close`: the next request on it gets not a byte. That is the kept-alive
    connection's failure: the request goes once more on a new connection (stale_retry);
    a new connection that fails the same way is an error, and there is no third try."""
    second_script = VALID if then_ok else [CLOSE]
    with serve([VALID[0], READ, CLOSE], second_script, [CLOSE]) as server:
        pool = Pool(Endpoint(server.url), 1)
        try:
            first = request(server.url, pool=pool)
            assert first.ok and not first.stale_retry
            second = request(server.url, pool=pool, request_id="req-2")
        finally:
            pool.close()
    assert second.stale_retry
    assert second.connection_reused is False  # the outcome is the new connection's
    assert server.connections == 2
    assert [r.count(b"req-2") for r in server.requests[1:]] == [1, 1]  # sent twice, no more
    if then_ok:
        assert second.ok, second.error_detail
        assert second.output_tokens == VALID_TOKENS
    else:
        failed(second, "connection_reset")
        assert second.error_detail == "closed before any response byte"


def test_pool_exhausted_is_immediate_and_the_held_request_completes() -> None:
    # The server holds its answer until the refusal is in (at most 5 s): the held request
    # keeps the one connection however late a loaded machine runs either side.
    answer = threading.Event()
    with serve([Until(answer, 5.0), VALID[0]]) as server:
        pool = Pool(Endpoint(server.url), 1)
        try:
            slow = Timeouts(connect_s=5.0, first_byte_s=8.0, idle_s=8.0, total_s=10.0)
            held = gevent.spawn(request, server.url, timeouts=slow, pool=pool)
            _until(lambda: len(server.requests) == 1)  # the held request is on the wire
            assert pool.open == 1
            start = time.monotonic()
            refused = request(server.url, pool=pool, request_id="req-2")
            # refused without waiting for the connection: the held one is still unanswered
            # (a pool that queued would return only after its 5 s)
            assert not held.ready() and time.monotonic() - start < 1.0
            answer.set()
            first = held.get(timeout=10)
        finally:
            answer.set()
            pool.close()
    failed(refused, "pool_exhausted")
    assert refused.error_detail == "all 1 connections busy"
    assert stamps(refused) == [True] + [False] * 6 and refused.connection_reused is None
    assert first.ok and first.output_tokens == VALID_TOKENS
    assert server.connections == 1


# --- non-streaming responses ---------------------------------------------------------------

COMPLETION = {
    "choices": [{"text": "Once upon", "index": 0, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11},
}


def _json(body: bytes, framing: str = "length") -> list[Step]:
    return [http(body, framing, ctype=b"application/json")]


def test_non_stream_success() -> None:
    out = play(_json(json.dumps(COMPLETION).encode()), "openai-completions", stream=False)
    assert out.ok, out.error_detail
    assert (out.output_tokens, out.server_total, out.finish_reason) == (7, 7, "length")
    ns = out.client_ns
    assert ns.first_token == ns.response_end and ns.last_token is None


@pytest.mark.parametrize(
    ("proto", "body", "error_class"),
    [
        pytest.param("openai-completions", b'{"choices": [', "invalid_json", id="invalid-json"),
        pytest.param("llama", b"", "invalid_json", id="empty-body"),
        pytest.param("llama", DEEP_JSON, "invalid_json", id="deep-nesting"),
        pytest.param(
            "openai-completions",
            json.dumps({**COMPLETION, "latency_ms": math.nan}).encode(),
            "nonfinite_number",
            id="nan",
        ),
        pytest.param("openai-chat", b'{"choices": 5}', "protocol_violation", id="choices-int"),
        pytest.param(
            "openai-chat", b'{"choices": {"a": 1}}', "protocol_violation", id="choices-dict"
        ),
        pytest.param(
            "openai-chat",
            b'{"choices": [{"message": "hi"}]}',
            "protocol_violation",
            id="message-str",
        ),
        pytest.param("openai-chat", b"[]", "protocol_violation", id="not-an-object"),
        pytest.param(
            "openai-chat",
            b'{"error": {"type": "invalid_request_error", "message": "bad"}}',
            "server_error_event",
            id="error-object",
        ),
    ],
)
def test_non_stream_hostile_body(proto: str, body: bytes, error_class: str) -> None:
    out = play(_json(body, "chunked"), proto, stream=False)
    failed(out, error_class, 7 if error_class == "nonfinite_number" else 0)


# --- values a record must never be lost to -------------------------------------------------


def test_an_out_of_range_count_keeps_its_raw_value_as_bounded_text() -> None:
    huge = 2**70
    stop = STOP3.replace(b'"tokens_predicted":3', b'"tokens_predicted":%d' % huge)
    out = play([http(L1 + L2 + L3 + stop)])
    failed(out, "value_out_of_range", 3)
    assert out.invalid_value == str(huge)
    assert "tokens_predicted" in (out.error_detail or "")
    giant = 10**70  # 71 digits: kept bounded, its length said
    stop = STOP3.replace(b'"tokens_predicted":3', b'"tokens_predicted":%d' % giant)
    out = play([http(L1 + L2 + L3 + stop)])
    assert out.invalid_value is not None and len(out.invalid_value) <= 64
    assert out.invalid_value.endswith("(71 chars)")


def test_unrequested_content_encoding_is_classified_and_identity_is_asked_for() -> None:
    with serve([http(SHORT_LLAMA, headers=[b"Content-Encoding: gzip"])], VALID) as server:
        out = request(server.url)
        after = request(server.url, request_id="req-after")
        sent = server.requests[0]
    failed(out, "content_encoding", 0)
    assert out.invalid_value == "gzip"
    assert after.ok and after.output_tokens == VALID_TOKENS
    assert b"\r\naccept-encoding: identity\r\n" in sent.lower()


def test_identity_content_encoding_is_accepted() -> None:
    out = play([http(SHORT_LLAMA, headers=[b"Content-Encoding: identity"])])
    assert out.ok and out.output_tokens == VALID_TOKENS


@pytest.mark.parametrize(
    ("proto", "body", "tokens"),
    [
        pytest.param("llama", L1 + llama_event(4, "") + llama_event(4, stop=True), 4, id="llama"),
        pytest.param("openai-chat", C1 + chat_event(4, "") + DONE, 4, id="openai-chat"),
    ],
)
def test_a_counter_that_jumps_without_content_is_a_mismatch(
    proto: str, body: bytes, tokens: int
) -> None:
    out = play([http(body)], proto)
    assert out.ok and out.output_tokens == tokens
    assert out.token_count_mismatch
    assert out.count_anomaly is not None and "rose by 3" in out.count_anomaly


def test_tokens_flushed_without_text_before_an_error_are_not_an_anomaly() -> None:
    # a stream cut by an error may flush tokens whose bytes end inside a UTF-8 character
    # (held back, as llama.cpp does, and never completed): no text, and no mismatch
    err = b'data: {"error":{"code":500,"message":"slot lost","type":"server_error"}}\n\n'
    out = play([http(L1 + llama_event(3, "") + err)])
    failed(out, "server_error_event", 3)
    assert out.count_anomaly is None and not out.token_count_mismatch


def test_one_token_without_content_is_not_an_anomaly() -> None:
    # an end-of-sequence (special) token renders as no text and still counts one
    out = play([http(L1 + L2 + llama_event(3, "") + STOP3)])
    assert out.ok and out.output_tokens == 3
    assert out.count_anomaly is None and not out.token_count_mismatch


@pytest.mark.parametrize(
    ("max_tokens", "slack", "flagged"), [(2, 0, True), (3, 0, False), (2, 1, False)]
)
def test_output_above_max_tokens_is_flagged(max_tokens: int, slack: int, flagged: bool) -> None:
    adapter = adapter_for("llama")
    body = adapter.body("x", max_tokens, stream=True, model=None, temperature=0.0, seed=None,
                        ignore_eos=True)  # fmt: skip
    with serve([http(L1 + L2 + L3 + STOP3)]) as server:
        pool = Pool(Endpoint(server.url), 1)
        try:
            out = run_in_greenlet(
                lambda: pool.execute(
                    adapter,
                    body,
                    "r",
                    stream=True,
                    timeouts=PATIENT,  # not about timeouts
                    max_tokens=max_tokens,
                    output_slack_tokens=slack,
                )
            )
        finally:
            pool.close()
    assert out.ok and out.output_tokens == 3
    assert out.token_count_mismatch is flagged
    if flagged:
        assert out.count_anomaly == "output 3 tokens above the requested max 2 (+0 slack)"


def test_a_lone_surrogate_in_an_error_message_still_makes_a_writable_record() -> None:
    body = b'data: {"error":{"message":"bad \\ud800 slot","type":"x\\udfff"}}\n\n'
    out = play([http(body)])
    failed(out, "server_error_event", 0)
    assert out.error_detail == "bad \\ud800 slot" and out.error_code == "x\\udfff"
    (out.error_detail + out.error_code).encode("utf-8")  # encodable: Arrow takes it


def test_the_record_and_its_table_carry_the_error_output(tmp_path: Path) -> None:
    """The counted characters reach the record (`ext.error_output_chars`) and its Parquet
    part; a clean error leaves the column null."""
    leaky = http(b'{"error":{"message":"x"},"choices":[{"message":{"content":"hello"}}]}',
                 status=b"500 Internal", ctype=b"application/json")  # fmt: skip
    clean = http(b'{"error":{"message":"x"}}', status=b"500 Internal", ctype=b"application/json")
    spec = RequestSpec(prompt=Prompt("s", 4, "a b c d"), max_tokens=4, reuse=True)
    with serve([leaky, CLOSE], [clean, CLOSE]) as server:
        sink = PartSink(str(tmp_path), "w1")
        session = Session(RunContext("run", "w1"), server.url, "openai-chat", sink=sink)
        first, _ = run_in_greenlet(lambda: session.send(spec))
        second, _ = run_in_greenlet(lambda: session.send(spec))
        session.close()
        sink.close()
    assert (first.ext.error_class, first.ext.error_output_chars) == ("http_5xx", 5)
    assert (second.ext.error_class, second.ext.error_output_chars) == ("http_5xx", None)
    table = pq.read_table(next(tmp_path.rglob("part-*.parquet")))
    assert table.column("ext.error_output_chars").to_pylist() == [5, None]
