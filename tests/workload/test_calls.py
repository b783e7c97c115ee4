"""Programmed calls (calculet_load.workload.calls, conversation): what a call sends, what
it refuses, and what a conversation keeps, against a real scripted server on loopback."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.prompts import Prompt
from calculet_load.measure.session import RunContext, Session
from calculet_load.workload.calls import Caller, CallError
from calculet_load.workload.conversation import Conversation
from tests.measure.test_hostile import CHUNKED_HEAD, DONE, chat_event, chunk
from tests.support.hostile import READ, serve

pytestmark = pytest.mark.timeout(20)


def _answer(*texts: str) -> bytes:
    events = [chat_event(i + 1, t) for i, t in enumerate(texts)] + [DONE]
    return CHUNKED_HEAD + b"".join(chunk(e) for e in events) + b"0\r\n\r\n"


def _prompts(protocol: str, tokens: int, sample: int) -> Prompt:
    """Exact-length prompts without a tokenizer: `tokens` one-token words."""
    return Prompt(f"test:{sample}", tokens, " ".join(["w"] * tokens), count_source="test")


def _body(raw: bytes) -> dict[str, Any]:
    return dict(json.loads(raw.split(b"\r\n\r\n", 1)[1]))


@pytest.fixture
def callers() -> Iterator[Callable[[str], Caller]]:
    """Callers on sessions that are closed after the test."""
    made: list[Caller] = []

    def make(url: str) -> Caller:
        made.append(Caller(Session(RunContext("run", "w00"), url, "llama"), _prompts))
        return made[-1]

    yield make
    for c in made:
        c.session.close()


def test_a_call_sends_its_messages_and_the_body_fields_it_was_given(
    callers: Callable[[str], Caller],
) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    with serve([_answer("Sunny", " today")]) as srv:
        result = run_in_greenlet(
            lambda: callers(srv.url).call(
                "openai-chat",
                messages=[{"role": "user", "content": "Weather?"}],
                max_tokens=8,
                name="tools",
                body={"tools": tools, "response_format": {"type": "json_object"}},
            )
        )
        sent = _body(srv.requests[0])
    assert result.ok and result.text == "Sunny today" and result.output_tokens == 2
    assert result.record.ext.cell == "tools" and result.record.ext.protocol == "openai-chat"
    assert sent["messages"] == [{"role": "user", "content": "Weather?"}]
    assert sent["tools"] == tools and sent["response_format"] == {"type": "json_object"}
    assert sent["max_tokens"] == 8 and sent["stream"] is True and sent["ignore_eos"] is True
    # the prompt's length is the server's count: the client did not size these messages
    assert result.prompt_tokens == 4 and result.record.ext.prompt_count_source == "server"


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"max_tokens": 4}, "give one of messages or prompt_tokens"),
        (
            {"messages": [], "prompt_tokens": 8, "max_tokens": 4},
            "got ['messages', 'prompt_tokens']",
        ),
        ({"prompt_tokens": 8, "max_tokens": 0}, "max_tokens: a whole number >= 1"),
        ({"prompt_tokens": 0, "max_tokens": 4}, "prompt_tokens: a whole number >= 1"),
        ({"prompt_tokens": 8, "max_tokens": 4, "body": {"stream": False}}, "stream: a call's own"),
    ],
)
def test_a_call_written_wrongly_says_which_argument(
    kw: dict[str, Any], says: str, callers: Callable[[str], Caller]
) -> None:
    caller = callers("http://127.0.0.1:9")
    with pytest.raises(CallError, match=says.replace("[", r"\[").replace("]", r"\]")):
        caller.call("openai-chat", **kw)


def test_messages_go_to_the_chat_endpoint_only(callers: Callable[[str], Caller]) -> None:
    with pytest.raises(CallError, match="messages go to the chat endpoint"):
        callers("http://127.0.0.1:9").call("llama", messages=[], max_tokens=4)


def test_a_conversation_sends_its_history_and_keeps_only_what_succeeded(
    callers: Callable[[str], Caller],
) -> None:
    # one connection kept alive for the first two turns (the second fails: not reused),
    # a new one for the third
    oops = b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n"
    with serve([_answer("Blue", "."), READ, oops], [_answer("Grey")]) as srv:
        caller = callers(srv.url)
        chat = Conversation(caller, "run.w00.s000000", system="Be brief.", name="chat")
        first = run_in_greenlet(lambda: chat.say("Sea?", max_tokens=4))
        failed = run_in_greenlet(lambda: chat.say("Sky?", max_tokens=4))
        third = run_in_greenlet(lambda: chat.say(prompt_tokens=3, max_tokens=4))
        bodies = [_body(r) for r in srv.requests]
    assert first.ok and not failed.ok and third.ok
    assert [r.record.ext.turn for r in (first, failed, third)] == [0, 1, 2]
    assert {r.record.ext.session_id for r in (first, failed, third)} == {"run.w00.s000000"}
    assert bodies[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sea?"},
    ]
    # the failed turn left the history as it was: the third turn carries the first's answer
    assert bodies[2]["messages"][:3] == [
        *bodies[0]["messages"],
        {"role": "assistant", "content": "Blue."},
    ]
    third_user = bodies[2]["messages"][3]
    assert third_user["role"] == "user" and len(third_user["content"].split()) == 3
    assert chat.messages[-1] == {"role": "assistant", "content": "Grey"}
