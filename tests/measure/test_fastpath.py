"""The event stream's fast path reads exactly what the general path reads.

`measure.exchange._chunked` reads a whole chunk holding one plain `data: ` event of the
common OpenAI shape straight from the read's bytes (`_PLAIN_HEAD`, `Run.on_plain`,
`OpenAIAdapter.fast_event`: msgspec decodes and type-checks it in C), and hands
everything else to the general path (`ChunkedDecoder.feed`, `SSEParser.feed`,
`OpenAIAdapter.event`). Each stream here is read twice, split into the same reads: once
with the fast path and once with the adapter's fast path turned off. The outcome (every
field, every token event, the hash, the verdict and the error's class, detail and raw
value) must be the same. Streams are built from valid token events and from every
irregular form the fast path must refuse: other SSE framings, other chunk framings, and
event data of the wrong type, out of range, NaN, invalid UTF-8, lone surrogates, errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calculet_load.clock import FakeClock
from calculet_load.measure.exchange import respond, wire
from calculet_load.measure.outcome import CancelAt, Fail, Outcome, Timeouts
from calculet_load.measure.protocols import Adapter, LlamaAdapter, OpenAIAdapter
from calculet_load.measure.request_state import Run, conclude
from calculet_load.measure.rxstamps import Reads
from calculet_load.measure.sse import SSEParser

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"


PROTOCOLS = ("openai-completions", "openai-chat", "llama")


def _adapter(proto: str) -> Adapter:
    return LlamaAdapter() if proto == "llama" else OpenAIAdapter(proto == "openai-chat")


def _token(n: int, proto: str, text: str = " w") -> bytes:
    """The data of the n-th token event, as the server of `proto` sends it."""
    if proto == "llama":
        obj: dict[str, Any] = {
            "index": 0, "content": text, "tokens": [5], "stop": False, "id_slot": -1,
            "tokens_predicted": n, "tokens_evaluated": 8,
        }  # fmt: skip
    else:
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": text}, "finish_reason": None}
            if proto == "openai-chat"
            else {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        )
        usage = {"prompt_tokens": 8, "completion_tokens": n}
        obj = {"id": "x", "choices": [choice], "usage": usage}
    return json.dumps(obj, separators=(",", ":")).encode()


def _last(n: int, proto: str) -> bytes:
    """The data of the protocol's end: `[DONE]`, llama.cpp's `stop: true` event."""
    if proto != "llama":
        return b"[DONE]"
    timings = {"cache_n": 2, "prompt_n": 8, "predicted_n": n, "predicted_ms": 5.5}
    obj = {"content": "", "stop": True, "stop_type": "limit", "tokens_predicted": n,
           "tokens_evaluated": 8, "timings": timings}  # fmt: skip
    return json.dumps(obj, separators=(",", ":")).encode()


# Event data the fast path must refuse or read exactly as `event` does (n: the count so far)
ODD_DATA: list[bytes] = [
    b"[DONE]",
    b'{"error":{"message":"overloaded","type":"server_error"}}',
    b'{"error":"plain"}',
    b'{"error":null,"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":true}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%.0}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":-1}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":9223372036854775808}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":123456789012345678901234567890}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":1}}',  # goes back
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%,"prompt_tokens":NaN}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%},"timings":{"x":1e400}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%},"timings":{"cache_n":-2}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%},"timings":{"cache_n":4}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%},"timings":"fast"}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%,'
    b'"prompt_tokens_details":{"cached_tokens":3}}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%,'
    b'"prompt_tokens_details":{"cached_tokens":"3"}}}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%,"prompt_tokens_details":[]}}',
    b'{"choices":[{"text":"\\ud800"}],"usage":{"completion_tokens":%N%}}',
    b'{"choices":[{"text":"caf\xc3\xa9 \xe2\x82\xac"}],"usage":{"completion_tokens":%N%}}',
    b'{"choices":[{"text":"bad \xff byte"}],"usage":{"completion_tokens":%N%}}',
    b'\xef\xbb\xbf{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%}}',
    b'{"choices":[{"text":5}],"usage":{"completion_tokens":%N%}}',
    b'{"choices":[{"delta":{"content":"a"}}],"usage":{"completion_tokens":%N%}}',
    b'{"choices":[{"delta":"a"}],"usage":{"completion_tokens":%N%}}',
    b'{"choices":[{"text":"a","finish_reason":"length"}],"usage":{"completion_tokens":%N%}}',
    b'{"choices":[{"text":"a","text":"b"}],"usage":{"completion_tokens":%N%}}',
    b'{"choices":"a"}',
    b'{"choices":[7]}',
    b'{"choices":[],"usage":{"completion_tokens":%N%}}',
    b'{"choices":[{"text":""}],"usage":{"completion_tokens":%N%}}',
    b'{"choices":[{"text":""}],"usage":{"completion_tokens":%N+5%}}',
    b'{"choices":[{"text":"a"}]}',
    b'{"choices":[{"text":"a"}],"usage":null}',
    b'{"choices":[{"text":"a"}],"usage":5}',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%}} ',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%}}x',
    b'{"choices":[{"text":"a"}],"usage":{"completion_tokens":%N%}',
    b"[1,2]",
    b"",
]

# ... and for llama.cpp's native events
LLAMA_ODD: list[bytes] = [
    b'{"content":"a","stop":false,"tokens_predicted":%N%,"tokens_evaluated":8}',
    b'{"content":"a","stop":true,"tokens_predicted":%N%,"timings":{"predicted_n":%N%}}',
    b'{"content":"a","stop":1,"tokens_predicted":%N%}',
    b'{"content":"a","stop":"yes","tokens_predicted":%N%}',
    b'{"content":"a","tokens_predicted":1}',  # goes back
    b'{"content":"a","tokens_predicted":true}',
    b'{"content":"a","tokens_predicted":-3}',
    b'{"content":"a","tokens_predicted":%N%.0}',
    b'{"content":"a","tokens_predicted":99999999999999999999999}',
    b'{"content":"a","tokens_predicted":%N%,"tokens_evaluated":"8"}',
    b'{"content":"a","tokens_predicted":1,"tokens_evaluated":-1}',  # back, then bad
    b'{"content":5,"tokens_predicted":%N%}',
    b'{"content":null,"tokens_predicted":%N%}',
    b'{"content":"","tokens_predicted":%N+5%}',
    b'{"content":"a"}',
    b'{"content":"bad \xff byte","tokens_predicted":%N%}',
    b'{"content":"\\ud800","tokens_predicted":%N%}',
    b'{"content":"a","tokens_predicted":%N%,"x":NaN}',
    b'{"error":{"code":500,"message":"slot unavailable","type":"server_error"}}',
    b'{"error":"plain"}',
    b"[DONE]",
    b"[1]",
    b"",
]

# How an event's data goes into SSE (the first is the plain form the fast path reads)
FRAMINGS = [
    b"data: %s\n\n",
    b"data:%s\n\n",
    b"data: %s\r\n\r\n",
    b"data: %s\r\r",
    b"id: 7\ndata: %s\n\n",
    b"event: delta\ndata: %s\n\n",
    b": keep-alive\n\ndata: %s\n\n",
    b"data: %s\ndata: {}\n\n",
    b"data: %s\n",  # its blank line comes with the next event
]


def _chunk(body: bytes, how: int) -> bytes:
    """One chunk of `body` in one of several framings (0: the plain one)."""
    size = len(body)
    return [
        b"%x\r\n%s\r\n" % (size, body),
        b"%X\r\n%s\r\n" % (size, body),
        b"00%x\r\n%s\r\n" % (size, body),
        b"%x;ext=1\r\n%s\r\n" % (size, body),
        b"%x \r\n%s\r\n" % (size, body),
        b"%x\r\n%s\r\n" % (size + 1, body + b"\n"),  # one more byte: still valid SSE
        b"%x\r\n%s\r\n" % (max(size - 1, 1), body),  # a lying size: malformed
    ][how]


_TAKEN: list[list[int]] = []  # the counters of the `_fast_reads` blocks open


def read_response(
    reads: list[bytes],
    adapter: Adapter,
    closed_at_end: bool = False,
    limit: int | None = None,
    cancel: CancelAt = None,
    stream: bool = True,
    ask: tuple[tuple[str, str], ...] = (),
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Read the response from `reads` as an engine would (`ask`: more request headers);
    the verdict (("end", reusable), ("fail", class, detail, code, raw) or ("more",)) and
    the outcome. tests/measure/test_hostile.py and test_native.py read with it too."""
    clock = FakeClock()
    out = Outcome("req-1")
    run = Run(adapter, out, clock, stream)
    if limit is not None:
        run.parser = SSEParser(max_line_bytes=limit)
    conn, _ = wire(("/v1/completions", [("Host", "x"), ("Content-Length", "2"), *ask], b"{}"))
    ns: dict[str, int | None] = {"t0": 1_000, "t1": 2_000, "t2": None, "t6": None}
    rd = Reads(run, ns, Timeouts(), 10**18, False)
    gen = respond(conn, rd, cancel)
    next(gen)
    verdict: tuple[Any, ...] = ("more",)
    try:
        for i, data in enumerate(reads):
            closed = closed_at_end and i == len(reads) - 1
            rd.took(data, closed, 10_000 * (i + 1), None)
            gen.send((data, closed))
    except StopIteration as end:
        verdict = ("end", end.value)
    except Fail as f:
        verdict = ("fail", f.error_class, f.detail, f.code, f.raw)
    conclude(run, ns, 64, 0)
    for taken in _TAKEN:
        taken[0] += run.fast_events
    fields = dataclasses.asdict(out)
    fields["token_events"] = [msgspec.structs.astuple(e) for e in out.token_events]
    return verdict, fields


def _odd(proto: str) -> list[bytes]:
    return LLAMA_ODD if proto == "llama" else ODD_DATA


@contextlib.contextmanager
def _fast_reads() -> Iterator[list[int]]:
    """Count the events the fast path read (`Run.fast_events`) in `_read` meanwhile (a
    counter the run keeps: compiled, its methods cannot be wrapped: measure.native)."""
    taken = [0]
    _TAKEN.append(taken)
    try:
        yield taken
    finally:
        del _TAKEN[next(i for i, t in enumerate(_TAKEN) if t is taken)]


def _both(
    reads: list[bytes], proto: str, closed_at_end: bool = False, limit: int | None = None
) -> tuple[Any, Any, int]:
    fast_adapter, slow_adapter = _adapter(proto), _adapter(proto)
    slow_adapter.fast = False  # the general path only
    with _fast_reads() as taken:
        fast = read_response(reads, fast_adapter, closed_at_end, limit)
    slow = read_response(reads, slow_adapter, closed_at_end, limit)
    return fast, slow, taken[0]


def _split(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    bounds = zip([0, *points], [*points, len(stream)], strict=True)
    return [p for p in (stream[a:b] for a, b in bounds) if p]


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_the_common_stream_takes_the_fast_path_and_reads_the_same(proto: str) -> None:
    events = [_token(n, proto) for n in range(1, 41)] + [_last(40, proto)]
    body = b"".join(_chunk(b"data: %s\n\n" % e, 0) for e in events) + END
    # the head alone, then one read per chunk, as a server writing each token gives
    reads = [HEAD]
    rest = body
    while rest:
        cut = rest.index(b"\r\n", rest.index(b"\r\n") + 2) + 2
        reads.append(rest[:cut])
        rest = rest[cut:]
    fast, slow, taken = _both(reads, proto)
    assert fast == slow
    verdict, out = fast
    assert verdict == ("end", True)
    assert out["output_tokens"] == 40 and out["error_class"] is None
    assert [e[2] for e in out["token_events"]] == [10_000 * (i + 2) for i in range(40)]
    if proto == "llama":
        assert out["server_total"] == 40 and out["cached_tokens"] == 2
    # every token event goes the fast way, the first too (the stream opens with `data: `:
    # no BOM for the parser to strip, SSEParser.no_bom); the end ([DONE], llama.cpp's
    # stop event) goes the general way
    assert taken == 40


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_a_stream_that_opens_with_a_bom_reads_the_same(proto: str) -> None:
    # the SSE parser strips a BOM at the stream's start: that first event goes the general
    # way, the rest the fast way, and both read the same as the general path alone
    events = [_token(n, proto) for n in range(1, 11)] + [_last(10, proto)]
    first = _chunk(b"\xef\xbb\xbfdata: %s\n\n" % events[0], 0)
    body = first + b"".join(_chunk(b"data: %s\n\n" % e, 0) for e in events[1:]) + END
    per_chunk = [HEAD, first, *(_chunk(b"data: %s\n\n" % e, 0) for e in events[1:]), END]
    for reads in ([HEAD, body], [HEAD + body[:5], body[5:]], per_chunk):
        fast, slow, taken = _both(reads, proto)
        assert fast == slow
        assert fast[0] == ("end", True) and fast[1]["output_tokens"] == 10
    assert taken == 9  # read per chunk: the token events after the first


def test_a_read_of_many_chunks_and_chunks_cut_across_reads_read_the_same() -> None:
    body = b"".join(
        _chunk(b"data: %s\n\n" % _token(n, "openai-completions"), 0) for n in range(1, 30)
    )
    body += _chunk(b"data: [DONE]\n\n", 0) + END
    for cuts in ([], [len(body) // 2], list(range(7, len(body), 97)), [3, 4, 5, 300]):
        reads = [HEAD, *_split(body, cuts)]
        fast, slow, taken = _both(reads, "openai-completions")
        assert fast == slow
        assert fast[0] == ("end", True)
        assert fast[1]["output_tokens"] == 29
    first = body.index(b"\r\n", body.index(b"\r\n") + 2) + 2
    _, _, taken = _both([HEAD, body[:first], body[first:]], "openai-completions")
    assert taken == 29  # each read's events but [DONE]


@pytest.mark.parametrize(("proto", "odd"), [(p, i) for p in PROTOCOLS for i in range(len(_odd(p)))])
def test_each_irregular_event_reads_the_same(proto: str, odd: int) -> None:
    events = [_token(n, proto) for n in range(1, 4)]
    events.append(_odd(proto)[odd].replace(b"%N%", b"4").replace(b"%N+5%", b"9"))
    events += [_token(n, proto) for n in range(5, 8)]
    body = b"".join(_chunk(b"data: %s\n\n" % e, 0) for e in events) + END
    per_chunk = [HEAD]
    rest = body
    while not rest.startswith(b"0\r\n"):
        size_end = rest.index(b"\r\n")
        cut = size_end + 2 + int(rest[:size_end], 16) + 2
        per_chunk.append(rest[:cut])
        rest = rest[cut:]
    per_chunk.append(rest)
    fast, slow, _ = _both(per_chunk, proto)
    assert fast == slow


def test_a_line_over_the_parsers_limit_is_refused_the_same() -> None:
    events = [_token(n, "openai-completions") for n in range(1, 6)]
    events[3] = _token(4, "openai-completions", text="x" * 200)
    body = b"".join(_chunk(b"data: %s\n\n" % e, 0) for e in events) + END
    fast, slow, _ = _both([HEAD, body], "openai-completions", limit=150)
    assert fast == slow
    assert fast[0][:2] == ("fail", "malformed_sse")


# mostly the common form, so that a stream has runs the fast path reads
_MOSTLY_ZERO = st.one_of(st.just(0), st.just(0), st.just(0), st.integers(0, 99))


@settings(max_examples=300, deadline=None)
@given(
    proto=st.sampled_from(PROTOCOLS),
    items=st.lists(
        st.tuples(
            st.one_of(*[st.just(-1)] * 5, st.integers(0, 999)),  # -1: a token event
            _MOSTLY_ZERO.map(lambda i: i % len(FRAMINGS)),
            _MOSTLY_ZERO.map(lambda i: i % 7),
            st.integers(0, 5).map(lambda i: i == 0),  # joined to the next event's chunk
            st.integers(0, 3).map(lambda i: i == 0),  # read with the chunk before it
        ),
        max_size=14,
    ),
    cuts=st.lists(st.integers(0, 5000), max_size=3),
    end=st.sampled_from([END, END, b"", b"0\r\nX-A: 1\r\n\r\n", b"0\r\n"]),
    closed=st.booleans(),
)
def test_any_stream_reads_the_same_on_both_paths(
    proto: str,
    items: list[tuple[int, int, int, bool, bool]],
    cuts: list[int],
    end: bytes,
    closed: bool,
) -> None:
    """Random streams: valid token events (-1) and irregular ones, in any framing, one
    chunk per event or several, a read per chunk or several chunks per read, and a few
    reads cut anywhere."""
    n = 0
    reads = [HEAD]
    pending = b""
    for which, framing, chunking, join, merge in items:
        n += 1
        if which >= 0:
            odd = _odd(proto)[which % len(_odd(proto))]
            data = odd.replace(b"%N%", b"%d" % n).replace(b"%N+5%", b"%d" % (n + 5))
        else:
            data = _token(n, proto)
        sse = FRAMINGS[framing] % data
        if join:
            pending += sse
            continue
        chunk = _chunk(pending + sse, chunking)
        pending = b""
        if merge and len(reads) > 1:
            reads[-1] += chunk
        else:
            reads.append(chunk)
    if pending:
        reads.append(_chunk(pending, 0))
    if end:
        reads.append(end)
    if cuts:
        reads = [HEAD, *_split(b"".join(reads[1:]), cuts)] if len(cuts) > 2 else reads
    fast, slow, _ = _both(reads, proto, closed_at_end=closed)
    assert fast == slow


def test_the_fast_path_is_off_when_a_cancel_is_asked() -> None:
    """Cancelling at the first token or after N tokens reads on the general path (its
    checks run per event there): one read per chunk, which the fast path would take."""
    reads = [HEAD]
    reads += [_chunk(b"data: %s\n\n" % _token(n, "openai-completions"), 0) for n in range(1, 6)]
    with _fast_reads() as taken:
        verdict, out = read_response(reads, OpenAIAdapter(False), cancel=3)
        assert verdict[:2] == ("fail", "cancelled")
        assert len(out["token_events"]) == 3
    assert taken == [0]
    with _fast_reads() as taken:
        verdict, _ = read_response(reads, OpenAIAdapter(False))
    assert verdict == ("more",) and taken == [5]  # the same reads, no cancel: fast
