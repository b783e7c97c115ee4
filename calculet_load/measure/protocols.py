# size: the protocols' bodies and event reading; the OpenAI event two ways on one count logic
"""Protocol adapters (DESIGN §3.1): build request bodies and read each event.

An adapter turns one SSE `data:` payload into an `EventInfo`: the generated tokens it
carried (from the server's cumulative counts: `usage.completion_tokens` with continuous
usage stats, `tokens_predicted` on llama.cpp; without them a local tokenizer counts
each event's text, and counting content chunks is only a flagged fallback), the finish
reason, the server's final total, an error. A role-only or usage-only event is an event
(t3) but carries no token (t4). Pure: no I/O, no clock.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from calculet_load.measure.fastshapes import INT64_MAX, FastChat, FastCompletion, FastLlama

ProtocolName = Literal["openai-chat", "openai-completions", "llama"]
# What a request sends as its prompt: text, token ids, or (OpenAI chat) the messages
Payload = str | list[int] | list[dict[str, Any]]


RAW_VALUE_CHARS = 64  # how much of an offending value a record keeps, as text


def raw_text(value: Any, limit: int = RAW_VALUE_CHARS) -> str:
    """A bounded, always-encodable text form of a value the server sent."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = f"{text[: limit - 24]}...({len(text)} chars)"
    return safe_text(text)


def safe_text(text: str) -> str:
    """`text` with lone surrogates (a JSON escape such as "\\ud800") made visible as
    backslash escapes: Arrow and Parquet refuse them, and one must not cost a part."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


class ProtocolError(ValueError):
    """The server broke the protocol; `error_class` says how (for the record), `raw` keeps
    the offending value as bounded text where there is one."""

    def __init__(self, error_class: str, detail: str, raw: str | None = None) -> None:
        super().__init__(detail)
        self.error_class = error_class
        self.raw = raw


@dataclasses.dataclass(slots=True)
class EventInfo:
    tokens: int = 0
    cumulative: int | None = None
    text: str = ""  # generated text (the answer's, where reasoning comes apart)
    reasoning: str = ""  # a reasoning model's thinking, streamed apart from the answer
    finish_reason: str | None = None
    done: bool = False  # the protocol's end of stream ([DONE], llama stop)
    final_total: int | None = None  # the server's total output tokens, when stated
    prompt_tokens: int | None = None
    error: str | None = None  # a server error event's message
    error_type: str | None = None
    timings: dict[str, Any] | None = None
    nonfinite: bool = False
    count_source: str | None = None  # whole responses: where the token count came from
    count_anomaly: str | None = None  # the count is not to be trusted as is: why
    cached_tokens: int | None = None  # prompt tokens served from the server's cache
    # the server's count of the reasoning tokens among the output
    # (`usage.completion_tokens_details.reasoning_tokens`)
    reasoning_total: int | None = None
    # an error event or body that also carried generated text (spec §14.1: error
    # responses carry no uninitialized output): how many characters
    error_output_chars: int = 0


@dataclasses.dataclass(slots=True)
class CountState:
    """Per-request counting state an adapter carries between events."""

    cumulative: int = 0
    source: str | None = None  # usage | tokens_predicted | tokenizer | chunks
    events: int = 0
    # The local tokenizer's count of a text (`measure.prompts.LocalTokenizer.count`):
    # used only when the server sends no per-event count.
    count_text: Callable[[str], int] | None = None


def count_chunk(info: EventInfo, state: CountState) -> None:
    """An event with text and no per-event count from the server: the local tokenizer
    counts its text (`tokenizer`) when one is given, else the chunk counts as one token
    (`chunks`, flagged). Either way the server's final total, when it sends one, is the
    request's count (measure.request_state `conclude`)."""
    if state.count_text is not None:
        n = state.count_text(info.reasoning + info.text if info.reasoning else info.text)
        state.source = "tokenizer"
    else:
        n = 1
        state.source = "chunks"
    state.cumulative += n
    info.tokens = n
    info.cumulative = state.cumulative


class _NonFinite:
    """json.loads hook: remembers that NaN/Infinity appeared, then returns the float."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, name: str) -> float:
        self.seen = True
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


class _SawNonFinite(Exception):
    """Raised by the shared decoder's hook: the slow path parses again and remembers."""


def _refuse_constant(name: str) -> float:
    raise _SawNonFinite(name)


# One decoder for every event: json.loads(data, parse_constant=...) would build a new
# JSONDecoder per call (measured: a fifth of the JSON cost of a token event). A NaN or
# Infinity, rare, stops it and the event is parsed again with the remembering hook.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def load_json(data: str) -> tuple[Any, bool]:
    """Parse JSON; returns (value, had NaN/Infinity). Raises ProtocolError(invalid_json)."""
    if not data.startswith("\ufeff"):  # json.loads refuses a BOM: the slow path says so
        try:
            return _DECODER.decode(data), False
        except _SawNonFinite:
            pass
        except (ValueError, RecursionError):
            pass  # the slow path raises it again, with its message
    hook = _NonFinite()
    try:
        return json.loads(data, parse_constant=hook), hook.seen
    except json.JSONDecodeError as bad:  # a name of its own: compiled code types it
        raise ProtocolError("invalid_json", f"event data: {bad.msg} at char {bad.pos}") from None
    except (ValueError, RecursionError) as exc:
        # JSON beyond this decoder's limits (RFC 8259 §9 allows limits): an integer of more
        # than sys.get_int_max_str_digits() digits raises ValueError, nesting deeper than
        # the recursion limit RecursionError. Either would otherwise escape the client.
        detail = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
        raise ProtocolError("invalid_json", f"event data: {detail[:200]}") from None


def _int(obj: Any, key: str) -> int | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(
            "protocol_violation", f"{key}: expected a non-negative integer", raw_text(value)
        )
    if not 0 <= value <= INT64_MAX:
        raw = raw_text(value)
        raise ProtocolError("value_out_of_range", f"{key}: {raw} is outside 0..2**63-1", raw)
    return value


def _str(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ProtocolError("protocol_violation", f"{key}: expected a string", raw_text(value))
    return value


def _cached_tokens(obj: dict[str, Any]) -> int | None:
    """Prompt tokens the server served from its prefix cache, where it says so:
    `usage.prompt_tokens_details.cached_tokens` (OpenAI, vLLM, SGLang, llama.cpp) or
    `timings.cache_n` (llama.cpp)."""
    usage = obj.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = _int(details, "cached_tokens") if isinstance(details, dict) else None
    if cached is None and isinstance(obj.get("timings"), dict):
        cached = _int(obj["timings"], "cache_n")
    return cached


def _is_messages(prompt: Payload) -> bool:
    return isinstance(prompt, list) and any(isinstance(m, dict) for m in prompt)


def _reasoning_total(usage: Any) -> int | None:
    """`usage.completion_tokens_details.reasoning_tokens` (OpenAI, vLLM), or None."""
    details = usage.get("completion_tokens_details") if isinstance(usage, dict) else None
    return _int(details, "reasoning_tokens") if isinstance(details, dict) else None


def _texts(node: Any, keys: tuple[str, ...]) -> int:
    """Characters of the strings under `keys` in `node` (a dict) or its `choices[]`
    entries and their `delta`/`message`: what an error response should not carry."""
    if not isinstance(node, dict):
        return 0
    n = sum(len(v) for k in keys if isinstance(v := node.get(k), str))
    choices = node.get("choices")
    for ch in choices if isinstance(choices, list) else []:
        if isinstance(ch, dict):
            n += _texts(ch, keys) + _texts(ch.get("delta"), keys) + _texts(ch.get("message"), keys)
    return n


def error_output_chars(obj: Any) -> int:
    """Generated text (OpenAI `choices[].text`, `.delta.content`, `.message.content`;
    llama.cpp `content`) in an error body or error event, in characters."""
    return _texts(obj, ("content", "text"))


def _error_of(obj: dict[str, Any]) -> tuple[str, str] | None:
    err = obj.get("error")
    if err is None:
        return None
    if isinstance(err, dict):
        kind = err.get("type") or err.get("code") or "error"
        return str(kind), str(err.get("message", ""))
    return "error", str(err)


# An event with no text may still carry one token (an end-of-sequence or other special
# token renders as nothing); a counter that rises by more on such an event is counting
# tokens nobody received, so the count is flagged as a mismatch rather than believed.
CONTENTLESS_STEP_MAX = 1


class Adapter(abc.ABC):
    name: ProtocolName
    path: str
    fast = False  # `fast_event` reads the common shape (else every event goes to `event`)

    @abc.abstractmethod
    def body(
        self,
        prompt: Payload,
        max_tokens: int,
        *,
        stream: bool,
        model: str | None,
        temperature: float,
        seed: int | None,
        ignore_eos: bool,
    ) -> dict[str, Any]:
        """The JSON request body."""

    @abc.abstractmethod
    def event(self, data: str, state: CountState) -> EventInfo:
        """One SSE `data:` payload."""

    @abc.abstractmethod
    def whole(self, body: bytes) -> EventInfo:
        """A non-streaming response body as one event carrying every token."""

    def fast_event(self, data: bytes, state: CountState) -> EventInfo | None:
        """`event` of the raw bytes of an event of the protocol's common shape, faster;
        None when it is not (then `event` reads it)."""
        return None

    def _advance(self, info: EventInfo, state: CountState, cumulative: int, source: str) -> None:
        if cumulative < state.cumulative:
            raise ProtocolError(
                "protocol_violation",
                f"{source}: cumulative count went back from {state.cumulative} to {cumulative}",
                str(cumulative),
            )
        step = cumulative - state.cumulative
        if step > CONTENTLESS_STEP_MAX and not (info.text or info.reasoning):
            info.count_anomaly = (
                f"{source} rose by {step} (to {cumulative}) on an event "
                "that carried no generated text"
            )
        info.tokens = step
        info.cumulative = cumulative
        state.cumulative = cumulative
        state.source = source


class OpenAIAdapter(Adapter):
    """OpenAI chat or completions, streaming with usage on every chunk (vLLM style)."""

    fast = True

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self._fast = msgspec.json.Decoder(FastChat if chat else FastCompletion)
        self.name = "openai-chat" if chat else "openai-completions"
        self.path = "/v1/chat/completions" if chat else "/v1/completions"

    def body(
        self,
        prompt: Payload,
        max_tokens: int,
        *,
        stream: bool,
        model: str | None,
        temperature: float,
        seed: int | None,
        ignore_eos: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream}
        if self.chat:
            if isinstance(prompt, str):
                body["messages"] = [{"role": "user", "content": prompt}]
            elif all(isinstance(m, dict) for m in prompt):
                body["messages"] = prompt
            else:
                raise ValueError("openai-chat takes a text prompt or messages, not token ids")
        elif _is_messages(prompt):
            raise ValueError(f"{self.name} takes a text prompt or token ids, not messages")
        else:
            body["prompt"] = prompt
        if model:
            body["model"] = model
        body["temperature"] = temperature
        if seed is not None:
            body["seed"] = seed
        if ignore_eos:
            body["ignore_eos"] = True
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return body

    def event(self, data: str, state: CountState) -> EventInfo:
        info = EventInfo()
        if data == "[DONE]":
            info.done = True
            return info
        obj, info.nonfinite = load_json(data)
        if not isinstance(obj, dict):
            raise ProtocolError("protocol_violation", "event: expected a JSON object")
        err = _error_of(obj)
        if err is not None:
            info.error_type, info.error = err
            info.error_output_chars = error_output_chars(obj)
            return info
        choices = obj.get("choices")
        if not isinstance(choices, list):
            raise ProtocolError("protocol_violation", "choices: expected a list")
        has_content = False
        for ch in choices:
            if not isinstance(ch, dict):
                raise ProtocolError("protocol_violation", "choices[]: expected an object")
            src = ch.get("delta") if self.chat else ch
            if src is None:
                src = {}
            elif not isinstance(src, dict):
                raise ProtocolError("protocol_violation", "choices[].delta: expected an object")
            piece = _str(src, "content" if self.chat else "text")
            if piece:
                info.text += piece
                has_content = True
            if self.chat:
                thought = _str(src, "reasoning_content") or _str(src, "reasoning")
                if thought:
                    info.reasoning += thought
                    has_content = True
            reason = _str(ch, "finish_reason")
            if reason:
                info.finish_reason = reason
        usage = obj.get("usage")
        completion = _int(usage, "completion_tokens") if usage is not None else None
        if usage is not None:
            info.prompt_tokens = _int(usage, "prompt_tokens")
            info.reasoning_total = _reasoning_total(usage)
        self._count_usage(info, state, completion, not choices, has_content)
        timings = obj.get("timings")
        if isinstance(timings, dict):
            info.timings = timings
        info.cached_tokens = _cached_tokens(obj)
        return info

    def fast_event(self, data: bytes, state: CountState) -> EventInfo | None:
        """`event` for the common shape, decoded and checked in C (msgspec): the same
        EventInfo, or None when the data is anything else (an error event, `[DONE]`, a
        value of another type or out of range, NaN, invalid UTF-8, not JSON): `event`
        then reads it and says what is wrong. Raises what `event` raises after the same
        values (a count going back, a bad `timings.cache_n`)."""
        try:
            obj: Any = self._fast.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        if obj.error is not None:
            return None
        info = EventInfo()
        has_content = False
        for ch in obj.choices:
            if self.chat:
                delta = ch.delta
                piece = None if delta is None else delta.content
                if delta is not None:
                    thought = delta.reasoning_content or delta.reasoning
                    if thought:
                        info.reasoning += thought
                        has_content = True
            else:
                piece = ch.text
            if piece:
                info.text += piece
                has_content = True
            if ch.finish_reason:
                info.finish_reason = ch.finish_reason
        usage = obj.usage
        completion = None
        if usage is not None:
            completion, info.prompt_tokens = usage.completion_tokens, usage.prompt_tokens
            out_details = usage.completion_tokens_details
            if out_details is not None:
                info.reasoning_total = out_details.reasoning_tokens
        self._count_usage(info, state, completion, not obj.choices, has_content)
        timings = obj.timings
        if timings is not None:
            info.timings = timings
        details = None if usage is None else usage.prompt_tokens_details
        info.cached_tokens = None if details is None else details.cached_tokens
        if info.cached_tokens is None and timings is not None:
            info.cached_tokens = _int(timings, "cache_n")
        return info

    def _count_usage(
        self,
        info: EventInfo,
        state: CountState,
        completion: int | None,
        no_choices: bool,
        has_content: bool,
    ) -> None:
        if completion is not None and state.source in (None, "usage"):
            self._advance(info, state, completion, "usage")
            if no_choices:  # the include_usage summary chunk: the final total
                info.final_total = completion
        elif completion is not None:
            info.final_total = completion  # final usage after a chunk-counted stream
        elif has_content:
            count_chunk(info, state)  # no per-chunk usage

    def whole(self, body: bytes) -> EventInfo:
        obj, nonfinite = load_json(body.decode("utf-8", errors="replace"))
        if not isinstance(obj, dict):
            raise ProtocolError("protocol_violation", "body: expected a JSON object")
        info = EventInfo(nonfinite=nonfinite, done=True)
        err = _error_of(obj)
        if err is not None:
            info.error_type, info.error = err
            info.error_output_chars = error_output_chars(obj)
            return info
        choices = obj.get("choices")
        if choices is None:
            choices = []
        if not isinstance(choices, list):
            raise ProtocolError("protocol_violation", "choices: expected a list")
        ch = choices[0] if choices else {}
        if not isinstance(ch, dict):
            raise ProtocolError("protocol_violation", "choices[]: expected an object")
        msg = ch.get("message") if self.chat else ch
        if msg is None:
            msg = {}
        elif not isinstance(msg, dict):
            raise ProtocolError("protocol_violation", "choices[].message: expected an object")
        text = msg.get("content" if self.chat else "text")
        info.text = text if isinstance(text, str) else ""
        if self.chat:
            thought = msg.get("reasoning_content") or msg.get("reasoning")
            info.reasoning = thought if isinstance(thought, str) else ""
        info.finish_reason = _str(ch, "finish_reason")
        usage = obj.get("usage")
        total = _int(usage, "completion_tokens")
        if total is None:
            # No usage: the tokens of a whole response cannot be counted honestly.
            info.count_source = "missing"
        else:
            info.final_total = info.tokens = info.cumulative = total
            info.count_source = "usage"
        info.prompt_tokens = _int(usage, "prompt_tokens")
        if isinstance(usage, dict):
            info.reasoning_total = _reasoning_total(usage)
        info.cached_tokens = _cached_tokens(obj)
        timings = obj.get("timings")
        if isinstance(timings, dict):
            info.timings = timings
        return info


class LlamaAdapter(Adapter):
    """llama.cpp native `/completion`: counts from `tokens_predicted`; no `[DONE]`."""

    name: ProtocolName = "llama"
    path = "/completion"
    fast = True

    def body(
        self,
        prompt: Payload,
        max_tokens: int,
        *,
        stream: bool,
        model: str | None,
        temperature: float,
        seed: int | None,
        ignore_eos: bool,
    ) -> dict[str, Any]:
        if _is_messages(prompt):
            raise ValueError("llama takes a text prompt or token ids, not messages")
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": max_tokens,
            "stream": stream,
            "cache_prompt": False,  # measure prefill every time
            "temperature": temperature,
            "return_tokens": True,
        }
        if seed is not None:
            body["seed"] = seed
        if ignore_eos:
            body["ignore_eos"] = True
        return body

    def event(self, data: str, state: CountState) -> EventInfo:
        info = EventInfo()
        obj, info.nonfinite = load_json(data)
        if not isinstance(obj, dict):
            raise ProtocolError("protocol_violation", "event: expected a JSON object")
        err = _error_of(obj)
        if err is not None:
            info.error_type, info.error = err
            info.error_output_chars = error_output_chars(obj)
            return info
        content = obj.get("content")
        if content is not None and not isinstance(content, str):
            raise ProtocolError("protocol_violation", "content: expected a string")
        info.text = content or ""
        predicted = _int(obj, "tokens_predicted")
        self._count_predicted(info, state, predicted)
        info.prompt_tokens = _int(obj, "tokens_evaluated")
        if obj.get("stop") is True:
            info.done = True
            timings = obj.get("timings")
            if isinstance(timings, dict):
                info.timings = timings
                info.final_total = _int(timings, "predicted_n")
                info.cached_tokens = _int(timings, "cache_n")
            if info.final_total is None:
                info.final_total = predicted
            stop_type = obj.get("stop_type")
            info.finish_reason = "stop" if stop_type in ("eos", "word") else "length"
        return info

    def fast_event(self, data: bytes, state: CountState) -> EventInfo | None:
        """`event` for a token event (not the final `stop: true` one, which `event`
        reads), decoded and checked in C as `OpenAIAdapter.fast_event`'s."""
        try:
            obj: Any = _FAST_LLAMA.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        if obj.error is not None or obj.stop is True:
            return None
        info = EventInfo(text=obj.content or "")
        self._count_predicted(info, state, obj.tokens_predicted)
        info.prompt_tokens = obj.tokens_evaluated
        return info

    def _count_predicted(self, info: EventInfo, state: CountState, predicted: int | None) -> None:
        if predicted is not None:
            self._advance(info, state, predicted, "tokens_predicted")
        elif info.text:
            count_chunk(info, state)

    def whole(self, body: bytes) -> EventInfo:
        state = CountState()
        info = self.event(body.decode("utf-8", errors="replace"), state)
        info.done = True
        info.count_source = state.source or "missing"
        return info


ADAPTERS: dict[str, Adapter] = {
    "openai-chat": OpenAIAdapter(chat=True),
    "openai-completions": OpenAIAdapter(chat=False),
    "llama": LlamaAdapter(),
}


_FAST_LLAMA = msgspec.json.Decoder(FastLlama)


def adapter_for(name: str) -> Adapter:
    try:
        return ADAPTERS[name]
    except KeyError:
        raise ValueError(f"protocol: unknown {name!r}; one of {sorted(ADAPTERS)}") from None
