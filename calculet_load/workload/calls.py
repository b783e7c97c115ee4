"""Programmed calls: a request its caller describes (messages, a prompt, or an exact
length), sent through a Session like every built-in request, its result handed back.

`Caller` is the Locust-free half of `LLMUser.llm` (calculet_load.locust.llmuser) and what
a conversation (calculet_load.workload.conversation) sends its turns with, in a Locust
run and in `accept` alike. Each call is one request: one record with every stamp, its
token events, the server join, and (in Locust) one request event and the LLM figures.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any

from calculet_load.measure.outcome import OnToken, StreamCancel
from calculet_load.measure.prompts import Prompt, WorkloadError
from calculet_load.measure.result import LLMResult
from calculet_load.measure.session import RequestSpec, Session

# chat messages: role and content (and whatever else the server takes: name, tool calls)
Messages = list[dict[str, Any]]
# the prompt of `tokens` tokens of corpus sample `sample` for a protocol (sized as the
# target's profile or tokenizer says: measure.prompts)
PromptSource = Callable[[str, int, int], Prompt]
SAMPLES = 16  # the corpus samples exact-length calls cycle through (as a mix entry's)
# The body fields a call sets itself: given through **body they would bypass its
# accounting (its length bound, its stream).
RESERVED = frozenset({"stream", "max_tokens", "n_predict", "max_completion_tokens"})


@dataclasses.dataclass(frozen=True, slots=True)
class Labels:
    """How a call's record is labelled: its arrival (open loop: the schedule's instant and
    lateness bound, a burst's id), the concurrency it ran at, its conversation."""

    arrival: str | None = None
    intended_start_ns: int | None = None
    late_after_ms: float | None = None
    burst_id: str | None = None
    concurrency: int | None = None
    session_id: str | None = None
    turn: int | None = None


class CallError(ValueError):
    """A call cannot be made as written (the message names the argument)."""


class Caller:
    """Sends programmed calls through `session`; exact-length prompts from `prompts`."""

    def __init__(self, session: Session, prompts: PromptSource) -> None:
        self.session = session
        self.prompts = prompts
        self._samples = itertools.count()

    def prompt(self, protocol: str, tokens: int, *, sample: int | None = None) -> Prompt:
        """An exact-length prompt (cycling the corpus samples); WorkloadError names the
        length when the target cannot be sized."""
        if sample is None:
            sample = next(self._samples) % SAMPLES
        return self.prompts(protocol, tokens, sample)

    def unique_text(self, tokens: int, *, sample: int | None = None) -> str:
        """Chat text of exactly `tokens` tokens as a lone user message, unique to this call
        (its nonce drawn now): what a conversation's turn sends, and then keeps sending
        in its history."""
        payload, _ = self.session.unique(self.prompt("openai-chat", tokens, sample=sample))
        if not isinstance(payload, str):
            raise WorkloadError("prompt_tokens: the chat prompt factory gave token ids")
        return payload

    def shared_text(self, tokens: int) -> str:
        """Chat text of exactly `tokens` tokens that every call of the run shares (a system
        prompt a prefix cache may serve to every session)."""
        payload = self.prompt("openai-chat", tokens, sample=SAMPLES).payload
        if not isinstance(payload, str):
            raise WorkloadError("shared_prefix_tokens: the chat prompt factory gave token ids")
        return payload

    def call(
        self,
        protocol: str,
        *,
        messages: Messages | None = None,
        prompt: str | list[int] | None = None,
        prompt_tokens: int | None = None,
        max_tokens: int,
        name: str | None = None,
        stream: bool = True,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = True,
        cancel: StreamCancel | None = None,
        on_token: OnToken | None = None,
        keep_text: bool = True,
        labels: Labels = Labels(),
        body: Mapping[str, Any] | None = None,
    ) -> LLMResult:
        """One request; its result (never raises for what the server does)."""
        spec = self.spec(
            protocol,
            messages=messages,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            name=name,
            stream=stream,
            temperature=temperature,
            seed=seed,
            ignore_eos=ignore_eos,
            cancel=cancel,
            on_token=on_token,
            keep_text=keep_text,
            labels=labels,
            body=body,
        )
        record, out = self.session.send(spec)
        return LLMResult.of(record, out)

    def spec(
        self,
        protocol: str,
        *,
        messages: Messages | None,
        prompt: str | list[int] | None,
        prompt_tokens: int | None,
        max_tokens: int,
        name: str | None,
        stream: bool,
        temperature: float,
        seed: int | None,
        ignore_eos: bool,
        cancel: StreamCancel | None,
        on_token: OnToken | None,
        keep_text: bool,
        labels: Labels,
        body: Mapping[str, Any] | None,
    ) -> RequestSpec:
        """The request a call describes; CallError names what is wrong with it."""
        given = [k for k, v in (("messages", messages), ("prompt", prompt)) if v is not None]
        if prompt_tokens is not None:
            given.append("prompt_tokens")
        if len(given) != 1:
            what = "messages" if protocol == "openai-chat" else "prompt"
            raise CallError(f"give one of {what} or prompt_tokens, got {given or 'neither'}")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise CallError(f"max_tokens: a whole number >= 1, got {max_tokens!r}")
        if messages is not None and protocol != "openai-chat":
            raise CallError(f"messages go to the chat endpoint; {protocol} takes a prompt")
        extra = dict(body or {})
        reserved = sorted(RESERVED & extra.keys())
        if reserved:
            raise CallError(f"{', '.join(reserved)}: a call's own argument, not a body field")
        if prompt_tokens is not None:
            if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
                raise CallError(f"prompt_tokens: a whole number >= 1, got {prompt_tokens!r}")
            built = self.prompt(protocol, prompt_tokens)
        else:
            built = Prompt.written(prompt if prompt is not None else "")
        return RequestSpec(
            prompt=built,
            max_tokens=max_tokens,
            stream=stream,
            temperature=temperature,
            seed=seed,
            ignore_eos=ignore_eos,
            cell=name or protocol,
            concurrency=labels.concurrency,
            arrival=labels.arrival,
            intended_start_ns=labels.intended_start_ns,
            late_after_ms=labels.late_after_ms,
            burst_id=labels.burst_id,
            cancel=cancel,
            protocol=protocol,
            messages=messages,
            extra_body=extra or None,
            keep_text=keep_text,
            on_token=on_token,
            session_id=labels.session_id,
            turn=labels.turn,
        )
