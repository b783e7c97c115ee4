"""Conversations: chat sessions whose every turn carries the history before it.

A `Conversation` keeps one session's messages. `say()` appends a user turn (text given,
or an exact-length text unique to this session), sends the whole history to the chat
endpoint, and appends the answer the server generated, so the next turn sends it back,
as a chat client does. A server's prefix cache can then serve each turn's history (and a
system prompt every session shares): `ext.cached_prompt_tokens` says how much it did.

Every turn is one request and one record, labelled with the session (`ext.session_id`)
and the turn's index in it (`ext.turn`, from 0); its context length is the record's
`workload.prompt_tokens`, the whole history and the new message as the server counted
them. A failed turn is recorded and leaves the history as it was: the next turn is sent
as if it had not happened (its index still counts on).

`run_session` plays the built-in `conversation` workload (a mix entry of that kind, a
matrix cell of that kind): its turns, with think times between them, drawn from the
entry's distribution and the session's seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

import gevent

from calculet_load.measure.result import LLMResult
from calculet_load.workload.calls import Labels, Messages


class Talk(Protocol):
    """What a conversation sends its turns with: a `Caller`, or a Locust user's client."""

    def call(self, protocol: str, **kw: Any) -> LLMResult: ...

    def unique_text(self, tokens: int) -> str: ...

    def shared_text(self, tokens: int) -> str: ...


class Conversation:
    """One chat session's history and its turns."""

    def __init__(
        self,
        caller: Talk,
        session_id: str,
        *,
        system: str | None = None,
        shared_prefix_tokens: int = 0,
        name: str | None = None,
        labels: Callable[[], Labels] = Labels,
    ) -> None:
        """`system`: the system prompt's text; or `shared_prefix_tokens`: a system prompt of
        that many tokens that every session of the run shares. `name`: the turns' cell
        (default: the protocol's name). `labels`: each turn's arrival labels (a Locust
        user's: its first call in an open loop carries the arrival's instant)."""
        if system is not None and shared_prefix_tokens:
            raise ValueError("give system or shared_prefix_tokens, not both")
        if shared_prefix_tokens < 0:
            raise ValueError(f"shared_prefix_tokens: >= 0, got {shared_prefix_tokens}")
        self.caller = caller
        self.session_id = session_id
        self.name = name
        self.labels = labels
        self.messages: Messages = []
        if shared_prefix_tokens:
            system = caller.shared_text(shared_prefix_tokens)
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self.turn = 0
        self.results: list[LLMResult] = []

    def say(
        self,
        content: str | None = None,
        *,
        prompt_tokens: int | None = None,
        max_tokens: int,
        name: str | None = None,
        **call: Any,
    ) -> LLMResult:
        """Send the history with a new user turn (`content`, or `prompt_tokens` of text
        unique to this session); the answer joins the history when the turn succeeds.
        `call`: what `Caller.call` takes besides (stream, temperature, body, ...)."""
        if (content is None) == (prompt_tokens is None):
            raise ValueError("say() takes content or prompt_tokens (one of them)")
        if content is None:
            assert prompt_tokens is not None
            content = self.caller.unique_text(prompt_tokens)
        user = {"role": "user", "content": content}
        labels = self.labels()
        result = self.caller.call(
            "openai-chat",
            messages=[*self.messages, user],
            max_tokens=max_tokens,
            name=name or self.name,
            labels=Labels(
                arrival=labels.arrival,
                intended_start_ns=labels.intended_start_ns,
                late_after_ms=labels.late_after_ms,
                burst_id=labels.burst_id,
                concurrency=labels.concurrency,
                session_id=self.session_id,
                turn=self.turn,
            ),
            **call,
        )
        self.turn += 1
        self.results.append(result)
        if result.ok:
            self.messages += [user, {"role": "assistant", "content": result.text}]
        return result


def think_time_s(distribution: str, mean_s: float, rng: random.Random) -> float:
    """A think time: `constant` (the mean) or `exponential` (drawn with that mean)."""
    if mean_s <= 0:
        return 0.0
    if distribution == "exponential":
        return rng.expovariate(1.0 / mean_s)
    return mean_s


def run_session(
    conversation: Conversation,
    *,
    turns: int,
    prompt_tokens: int,
    max_tokens: int,
    think_s: float = 0.0,
    think: str = "constant",
    seed: int = 0,
    stopped: Callable[[], bool] = lambda: False,
    **call: Any,
) -> list[LLMResult]:
    """The built-in conversation: `turns` turns of `prompt_tokens` new tokens each, a
    think time between two turns (none after the last); stops early when `stopped()`."""
    rng = random.Random(f"{conversation.session_id}:{seed}")
    for i in range(turns):
        if stopped():
            break
        if i:
            pause = think_time_s(think, think_s, rng)
            if pause > 0:
                gevent.sleep(pause)
        conversation.say(prompt_tokens=prompt_tokens, max_tokens=max_tokens, **call)
    return conversation.results
