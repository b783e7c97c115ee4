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

`Sessions` plays the built-in `conversation` workload (a mix entry of that kind: see
calculet_load.workload.mixes) through a `Caller`: each `SessionStart` (an arrival of such
an entry) is one session of its turns, with think times between them drawn from the
entry's distribution and the session's seed; it ends at its first failed turn, as a
chat client would.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable
from typing import Any

import gevent

from calculet_load.measure.prompts import Prompt
from calculet_load.measure.result import LLMResult
from calculet_load.measure.session import RequestSpec, Session
from calculet_load.workload.calls import Caller, Labels, Messages
from calculet_load.workload.mixes import MixEntry


class Conversation:
    """One chat session's history and its turns."""

    def __init__(
        self,
        caller: Caller,
        session_id: str,
        *,
        system: str | None = None,
        shared_prefix_tokens: int = 0,
        name: str | None = None,
        labels: Callable[[], Labels] = Labels,
        after: Callable[[LLMResult], object] = lambda result: None,
    ) -> None:
        """`system`: the system prompt's text; or `shared_prefix_tokens`: a system prompt of
        that many tokens that every session of the run shares. `name`: the turns' cell
        (default: the protocol's name). `labels`: each turn's arrival labels (a Locust
        user's: its first call in an open loop carries the arrival's instant); `after`:
        called with each turn's result (a closed loop's pause after a failure)."""
        if system is not None and shared_prefix_tokens:
            raise ValueError("give system or shared_prefix_tokens, not both")
        if shared_prefix_tokens < 0:
            raise ValueError(f"shared_prefix_tokens: >= 0, got {shared_prefix_tokens}")
        self.caller = caller
        self.session_id = session_id
        self.name = name
        self.labels = labels
        self.after = after
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
        self.after(result)
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
    think time between two turns (none after the last); it ends early when `stopped()`
    or at a failed turn."""
    rng = random.Random(f"{conversation.session_id}:{seed}")
    for i in range(turns):
        if stopped():
            break
        if i:
            pause = think_time_s(think, think_s, rng)
            if pause > 0:
                gevent.sleep(pause)
        if not conversation.say(prompt_tokens=prompt_tokens, max_tokens=max_tokens, **call).ok:
            break
    return conversation.results


@dataclasses.dataclass(frozen=True, slots=True)
class SessionStart:
    """Arrival k of a conversation entry: a session of its turns, the first labelled
    `labels` (an open loop's instant, a closed loop's concurrency), every one counted
    under `cell` (a Locust run's mix entry, an `accept` matrix cell)."""

    k: int
    entry: MixEntry
    labels: Labels
    cell: str


class Sessions:
    """The built-in conversation workload's sessions, sent through `caller`; their ids
    `<run id>.<worker>.s<n>` (`next_id`, which programmed conversations take too)."""

    def __init__(
        self, caller: Caller, seed: int = 0, stopped: Callable[[], bool] = lambda: False
    ) -> None:
        self.caller = caller
        self.seed = seed
        self.stopped = stopped
        self._ids = itertools.count()

    @property
    def session(self) -> Session:
        return self.caller.session

    def next_id(self) -> str:
        ctx = self.caller.session.ctx
        return f"{ctx.run_id}.{ctx.worker}.s{next(self._ids):06d}"

    def prepare(self, entry: MixEntry) -> None:
        """Build an entry's prompts before the first session (start-up is not load)."""
        for sample in range(entry.samples):
            self.caller.prompt("openai-chat", entry.prompt_tokens, sample=sample)
        if entry.system_prompt_tokens:
            self.caller.shared_text(entry.system_prompt_tokens)

    def run(self, start: SessionStart) -> list[LLMResult]:
        """One session; its first turn carries the start's labels, the later ones its
        kind of arrival and concurrency (sent when the turn before ended)."""
        first = [start.labels]
        later = Labels(arrival=start.labels.arrival, concurrency=start.labels.concurrency)
        entry = start.entry
        conversation = Conversation(
            self.caller,
            self.next_id(),
            shared_prefix_tokens=entry.system_prompt_tokens,
            name=start.cell,
            labels=lambda: first.pop() if first else later,
        )
        return run_session(
            conversation,
            turns=entry.turns,
            prompt_tokens=entry.prompt_tokens,
            max_tokens=entry.max_tokens,
            think_s=entry.think_time_s,
            think=entry.think,
            seed=self.seed,
            stopped=self.stopped,
            temperature=entry.temperature,
        )

    def dropped_spec(self, start: SessionStart) -> RequestSpec:
        """What a session whose start found the in-flight cap full is recorded as: a
        dropped arrival of its first turn."""
        lb = start.labels
        return RequestSpec(
            prompt=Prompt.written(),
            max_tokens=start.entry.max_tokens,
            cell=start.cell,
            arrival=lb.arrival,
            intended_start_ns=lb.intended_start_ns,
            late_after_ms=lb.late_after_ms,
            burst_id=lb.burst_id,
            protocol="openai-chat",
            turn=0,
        )
