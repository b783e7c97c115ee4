"""What a programmed user reads of a response: its text (kept in memory only when asked),
a reasoning model's phases, a cancel its caller holds, and token events as they arrive.

Each case runs against a real scripted server on loopback (tests/support/hostile.py) on both
I/O engines, through `execute` as the users' calls do.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from calculet_load.measure import thread_loop
from calculet_load.measure.connections import Endpoint
from calculet_load.measure.gevent_engine import GeventPool
from calculet_load.measure.io_engines import IOEngine, run_in_greenlet
from calculet_load.measure.outcome import StreamCancel
from calculet_load.measure.protocols import adapter_for
from calculet_load.measure.thread_engine import ThreadPool
from calculet_load.schema.records import TokenEvent
from tests.measure.test_hostile import CHUNKED_HEAD, DONE, PATIENT, chat_event, chunk, llama_event
from tests.support.hostile import Until, serve

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(params=["gevent", "thread"])
def send(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """One request to a scripted server on the given engine: (url, protocol, **kw) ->
    its outcome."""
    threaded = request.param == "thread"
    if threaded:
        monkeypatch.setattr(thread_loop, "READ_NATIVELY", True)

    def go(url: str, protocol: str, **kw: Any) -> Any:
        pool: IOEngine = (ThreadPool if threaded else GeventPool)(Endpoint(url), 4)
        adapter = adapter_for(protocol)
        body = adapter.body(
            "hi", 16, stream=True, model=None, temperature=0.0, seed=None, ignore_eos=True
        )
        try:
            return run_in_greenlet(
                lambda: pool.execute(adapter, body, "r1", stream=True, timeouts=PATIENT, **kw)
            )
        finally:
            pool.close()

    return go


def reasoning_event(n: int, text: str) -> bytes:
    """A chat chunk that carries a reasoning model's thinking apart from the answer."""
    obj = {
        "choices": [{"index": 0, "delta": {"reasoning_content": text}, "finish_reason": None}],
        "usage": {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n},
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chunks(*events: bytes, end: bool = True) -> bytes:
    """Events as chunks of a chunked body (one per event, as servers flush them)."""
    return b"".join(chunk(e) for e in events) + (b"0\r\n\r\n" if end else b"")


def sse(*events: bytes) -> bytes:
    """A whole chunked event-stream response."""
    return CHUNKED_HEAD + chunks(*events)


def test_the_text_is_kept_only_when_asked(send: Any) -> None:
    body = sse(chat_event(1, "Once"), chat_event(2, " upon"), chat_event(3, " a"), DONE)
    with serve([body], [body]) as srv:
        kept = send(srv.url, "openai-chat", keep_text=True)
        plain = send(srv.url, "openai-chat")
    assert kept.ok and kept.text == "Once upon a" and kept.reasoning_text == ""
    assert plain.ok and plain.text is None and plain.reasoning_text is None
    assert kept.token_hash == plain.token_hash  # keeping the text changes no figure
    assert kept.reasoning_tokens is None and kept.first_answer_ns is None  # no reasoning


def test_reasoning_apart_from_the_answer(send: Any) -> None:
    # 3 reasoning tokens, then "\n\n" (answer, but only whitespace), then the answer
    events = [reasoning_event(1, "Let"), reasoning_event(2, " me"), reasoning_event(3, " see")]
    events += [chat_event(4, "\n\n"), chat_event(5, "Blue"), chat_event(6, "."), DONE]
    with serve([sse(*events)]) as srv:
        out = send(srv.url, "openai-chat", keep_text=True)
    assert out.ok and out.output_tokens == 6
    assert (out.reasoning_tokens, out.answer_tokens) == (3, 3)
    assert out.text == "\n\nBlue." and out.reasoning_text == "Let me see"
    # the first answer token is the first event whose answer text is not whitespace
    fifth = out.token_events[4]
    assert out.first_answer_ns == fifth.arrival_ns
    assert out.client_ns.first_token == out.token_events[0].arrival_ns <= out.first_answer_ns


def test_reasoning_inline_in_think_tags(send: Any) -> None:
    steps = ["<think>", " hmm", "</think>", "\n\n", " Answer", " here"]
    events = [llama_event(i + 1, t) for i, t in enumerate(steps)]
    with serve([sse(*events, llama_event(6, stop=True))]) as srv:
        out = send(srv.url, "llama", keep_text=True)
    assert out.ok and (out.reasoning_tokens, out.answer_tokens) == (3, 3)
    assert out.text == "\n\n Answer here" and out.reasoning_text == "<think> hmm</think>"
    assert out.first_answer_ns == out.token_events[4].arrival_ns


def test_the_servers_reasoning_count_wins(send: Any) -> None:
    final = {
        "choices": [],
        "usage": {
            "prompt_tokens": 4,
            "completion_tokens": 3,
            "completion_tokens_details": {"reasoning_tokens": 2},
        },
    }
    last = b"data: " + json.dumps(final).encode() + b"\n\n"
    events = [reasoning_event(1, "a b"), chat_event(3, "c"), last, DONE]
    with serve([sse(*events)]) as srv:
        out = send(srv.url, "openai-chat")
    # the event carried two tokens of thinking at once: the server says so
    assert out.ok and (out.reasoning_tokens, out.answer_tokens) == (2, 1)


def test_a_cancel_after_tokens_ends_the_stream_with_its_tokens(send: Any) -> None:
    held = threading.Event()
    events = [chat_event(n, f" w{n}") for n in range(1, 4)]
    body = [CHUNKED_HEAD + chunks(*events, end=False), Until(held, 5.0)]
    body += [chunks(chat_event(4, " x"), DONE)]
    with serve(body) as srv:
        out = send(srv.url, "openai-chat", cancel=StreamCancel(after_tokens=2))
        held.set()
    assert out.error_class == "cancelled" and out.cancelled_at == "mid_stream"
    assert out.output_tokens >= 2 and len(out.token_events) == out.output_tokens


def test_a_listener_sees_tokens_as_they_arrive_and_can_cancel(send: Any) -> None:
    """The server holds the stream after two tokens until the listener has seen the second:
    a listener called only when the request ends would leave it holding for 5 s. At the
    third the listener cancels; the stream ends at the next event after that."""
    held, cancelled = threading.Event(), threading.Event()
    seen: list[tuple[TokenEvent, str, int]] = []
    switch = StreamCancel()

    def listener(ev: TokenEvent, text: str, reasoning: str) -> None:
        seen.append((ev, text, time.monotonic_ns()))
        if len(seen) == 2:
            held.set()
        if len(seen) == 3:
            switch.cancel()
            cancelled.set()

    rest = chunks(*[chat_event(n, f" w{n}") for n in range(4, 9)], DONE)
    body = [CHUNKED_HEAD + chunks(chat_event(1, "a"), chat_event(2, "b"), end=False)]
    body += [Until(held, 5.0), chunks(chat_event(3, " w3"), end=False), Until(cancelled, 5.0)]
    body += [rest]
    began = time.monotonic()
    with serve(body) as srv:
        out = send(srv.url, "openai-chat", on_token=listener, keep_text=True, cancel=switch)
    assert time.monotonic() - began < 4.0, "the listener did not see the tokens live"
    assert [text for _, text, _ in seen[:3]] == ["a", "b", " w3"]
    assert all(ev.arrival_ns <= at for ev, _, at in seen)  # no stamp moved for a listener
    assert out.error_class == "cancelled" and out.cancelled_at == "mid_stream"
    assert 3 <= out.output_tokens < 8 and out.text.startswith("ab w3")


def test_a_listener_alone_sees_tokens_live(send: Any) -> None:
    """No cancel: the thread engine's native reader would tell its loop at the stream's
    end only; a listener makes it tell each read as it comes."""
    held = threading.Event()
    seen: list[str] = []

    def listener(ev: TokenEvent, text: str, reasoning: str) -> None:
        seen.append(text)
        if len(seen) == 2:
            held.set()

    body = [CHUNKED_HEAD + chunks(chat_event(1, "a"), chat_event(2, "b"), end=False)]
    body += [Until(held, 5.0), chunks(chat_event(3, "c"), DONE)]
    began = time.monotonic()
    with serve(body) as srv:
        out = send(srv.url, "openai-chat", on_token=listener)
    assert time.monotonic() - began < 4.0, "the listener saw the tokens at the end only"
    assert out.ok and seen == ["a", "b", "c"] and out.text is None  # not kept: not asked
