"""Wire formats of the simulator (DESIGN §3.1): request parsing and event formatting.

OpenAI chat and completions follow vLLM (`stream_options.include_usage` adds a final
usage chunk with empty `choices`; `continuous_usage_stats` adds cumulative usage to
every chunk; `data: [DONE]` ends the stream). llama.cpp `/completion` follows the real
captures in shared/protocol-samples: `content`, `tokens`, `tokens_predicted` per event,
a last event with `stop: true` and `timings`, and no `[DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from calculet_sim.engine import GenRequest, Reject
from calculet_sim.tokens import NEWLINE, SPECIAL_TOKENS, Tokenizer

_ROLES = SPECIAL_TOKENS[2:]


def _field(
    body: dict[str, Any], name: str, types: tuple[type, ...], default: Any, where: str = ""
) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    is_bool = isinstance(value, bool)
    if not isinstance(value, types) or (is_bool and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise Reject(
            400,
            "invalid_request",
            f"{where}{name}: expected {names}, got {type(value).__name__}",
        )
    return value


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = _field(body, name, (int,), default)
    if value is not None and not -(2**63) <= value <= 2**64:
        raise Reject(400, "invalid_length", f"{name}: {value} out of range")
    return value  # type: ignore[no-any-return]


# Above this the sampling key would overflow; no real sampler goes near it either.
_MAX_TEMPERATURE = 1e6


def _prompt_ids(value: Any, tok: Tokenizer, field: str) -> list[int]:
    if isinstance(value, str):
        return tok.encode(value)
    if isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        for i, x in enumerate(value):
            if not 0 <= x < tok.vocab_size:
                raise Reject(
                    400, "invalid_request", f"{field}[{i}]: token id {x} not in vocabulary"
                )
        return list(value)
    raise Reject(400, "invalid_request", f"{field}: expected a string or a list of token ids")


def _followup(
    protocol: str, prompt: Any, ids: list[int], tok: Tokenizer
) -> Callable[[str], list[int]]:
    """The ids a next turn sends for this prompt and its answer text, verbatim: what the
    prefix cache keeps of a finished request (the answer's text re-encodes to other ids
    than the generated ones)."""
    if protocol == "chat":
        # As a message, the answer follows the assistant role at once: the primer's
        # closing newline is not part of it.
        head, end = ids[:-1], tok.special("<|im_end|>")
        assert end is not None
        return lambda answer: [*head, *tok.encode(answer), end, NEWLINE]
    if isinstance(prompt, str):
        return lambda answer: tok.encode_more(prompt, ids, answer)
    return lambda answer: [*ids, *tok.encode(answer)]


def _chat_ids(messages: Any, tok: Tokenizer) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise Reject(400, "invalid_request", "messages: expected a non-empty list")
    # ChatML: each message costs 4 tokens of markup
    # (<|im_start|> role content <|im_end|> "\n"), the assistant primer 3.
    start, end = tok.special("<|im_start|>"), tok.special("<|im_end|>")
    assert start is not None and end is not None
    ids: list[int] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise Reject(400, "invalid_request", f"messages[{i}]: expected an object")
        role = m.get("role")
        role_id = tok.special(role) if role in _ROLES else None
        if role_id is None:
            raise Reject(
                400, "invalid_request", f"messages[{i}].role: expected one of {', '.join(_ROLES)}"
            )
        content = m.get("content")
        if not isinstance(content, str):
            raise Reject(400, "invalid_request", f"messages[{i}].content: expected a string")
        ids += [start, role_id, *tok.encode(content), end, NEWLINE]
    assistant = tok.special("assistant")
    assert assistant is not None
    return [*ids, start, assistant, NEWLINE]


class Options:
    """What a request asked for beyond the generation itself."""

    __slots__ = ("continuous_usage", "include_usage", "model", "protocol", "stream")

    def __init__(self, protocol: str, stream: bool, include_usage: bool, continuous: bool) -> None:
        self.protocol = protocol
        self.stream = stream
        self.include_usage = include_usage
        self.continuous_usage = continuous
        self.model = ""


def parse_request(
    protocol: str, body: Any, request_id: str, tok: Tokenizer, max_context: int
) -> tuple[GenRequest, Options]:
    if not isinstance(body, dict):
        raise Reject(400, "invalid_request", "body: expected a JSON object")
    if protocol == "chat":
        ids = _chat_ids(body.get("messages"), tok)
    else:
        if "prompt" not in body:
            raise Reject(400, "invalid_request", "prompt: required")
        ids = _prompt_ids(body["prompt"], tok, "prompt")
    if protocol == "llama":
        length_field = "n_predict"
        n_predict = _int_field(body, "n_predict", -1)
        # -1: until the context is full (at least 1, so an over-long prompt is
        # reported as such by the length check, not as a negative n_predict).
        max_tokens = max(max_context - len(ids), 1) if n_predict == -1 else n_predict
    else:
        length_field = "max_completion_tokens"
        max_tokens = _int_field(body, "max_completion_tokens", None)
        if max_tokens is None:
            length_field = "max_tokens"
            max_tokens = _int_field(body, "max_tokens", 16)
    assert max_tokens is not None  # its uint32 bounds are the engine's length check
    temperature = float(_field(body, "temperature", (int, float), 0.0))
    if not (0 <= temperature <= _MAX_TEMPERATURE):  # also refuses NaN and Infinity
        raise Reject(
            400, "invalid_request", f"temperature: {temperature} outside 0..{_MAX_TEMPERATURE:g}"
        )
    stream = _field(body, "stream", (bool,), False)
    opts_raw = _field(body, "stream_options", (dict,), {})
    include = _field(opts_raw, "include_usage", (bool,), False, "stream_options.")
    continuous = _field(opts_raw, "continuous_usage_stats", (bool,), False, "stream_options.")
    # llama.cpp's default is true; the OpenAI endpoints cache whenever the server does
    cache_prompt = _field(body, "cache_prompt", (bool,), True) or protocol != "llama"
    _field(body, "return_tokens", (bool,), True)
    # vLLM's switch of a reasoning model's thinking (Qwen3's chat template reads it)
    kwargs = _field(body, "chat_template_kwargs", (dict,), {})
    thinking = _field(kwargs, "enable_thinking", (bool,), True, "chat_template_kwargs.")
    prompt = body.get("prompt")
    req = GenRequest(
        request_id,
        ids,
        max_tokens,
        ignore_eos=_field(body, "ignore_eos", (bool,), False),
        temperature=temperature,
        seed=_int_field(body, "seed", None),
        model=_field(body, "model", (str,), None),
        length_field=length_field,
        protocol=protocol,
        cache_prompt=cache_prompt,
        thinking=thinking,
        followup=_followup(protocol, prompt, ids, tok),
    )
    opts = Options(protocol, stream, include, continuous)
    return req, opts


def dumps(obj: Any) -> str:
    # allow_nan: the broken numeric-check mode must be able to put NaN on the wire.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=True)


class Formatter:
    """Builds the events of one response. `usage(n, r)`: cumulative output tokens, r of
    them reasoning.

    Every usage object says how many prompt tokens the prefix cache served
    (`prompt_tokens_details.cached_tokens`, 0 when none or the cache is off); a
    reasoning model's also says how many output tokens were reasoning
    (`completion_tokens_details.reasoning_tokens`). llama.cpp says the former in
    `timings.cache_n`.
    """

    def __init__(
        self,
        opts: Options,
        req: GenRequest,
        model_name: str,
        fingerprint: str = "calculet-sim",
        cached_tokens: int = 0,
        reasoning_model: bool = False,
    ) -> None:
        self.o = opts
        self.prompt_tokens = len(req.prompt_ids)
        self.cached = {"cached_tokens": cached_tokens}  # the same in every usage object
        self.reasoning_model = reasoning_model
        self.model = req.model or model_name
        self.created = int(time.time())
        self.id = ("chatcmpl-" if opts.protocol == "chat" else "cmpl-") + req.request_id
        self.fingerprint = fingerprint

    def usage(self, n: int, n_reasoning: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
            "prompt_tokens_details": self.cached,
        }
        if self.reasoning_model:
            out["completion_tokens_details"] = {"reasoning_tokens": n_reasoning}
        return out

    def _chunk(
        self, choices: list[dict[str, Any]], n: int, n_reasoning: int, final_usage: bool = False
    ) -> str:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.o.protocol == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if self.o.continuous_usage or final_usage:
            obj["usage"] = self.usage(n, n_reasoning)
        return dumps(obj)

    def start(self) -> list[str]:
        if self.o.protocol == "chat":
            choice = {"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None}
            choice["finish_reason"] = None
            return [self._chunk([choice], 0, 0)]
        return []

    def tokens(
        self,
        text: str,
        ids: list[int],
        n_total: int,
        nan: bool,
        reasoning: str = "",
        n_reasoning: int = 0,
    ) -> str:
        """One token event: `text` is the answer's, `reasoning` the thoughts' (chat with
        separate reasoning only: elsewhere the thoughts are inline in `text`)."""
        logprob = {"logprob": float("nan")} if nan else None
        if self.o.protocol == "llama":
            obj: dict[str, Any] = {
                "index": 0,
                "content": text,
                "tokens": ids,
                "stop": False,
                "id_slot": 0,
                "tokens_predicted": n_total,
                "tokens_evaluated": self.prompt_tokens,
            }
            if logprob:
                obj["probs"] = [logprob]
            return dumps(obj)
        if self.o.protocol == "chat":
            delta: dict[str, str] = {"reasoning_content": reasoning} if reasoning else {}
            if text or not reasoning:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprob, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprob, "finish_reason": None}
        return self._chunk([choice], n_total, n_reasoning)

    def _llama_final(
        self, text: str, ids: list[int], reason: str, n: int, timings: dict[str, float]
    ) -> dict[str, Any]:
        # Keys in the order of llama.cpp's last event (protocol-samples), minus
        # generation_settings and the echoed prompt.
        return {
            "index": 0,
            "content": text,
            "tokens": ids,
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": n,
            "tokens_evaluated": self.prompt_tokens,
            "has_new_line": "\n" in text,
            "truncated": False,
            "stop_type": "eos" if reason == "stop" else "limit",
            "stopping_word": "",
            # the tokens in the slot's KV once done (llama.cpp's n_past)
            "tokens_cached": self.prompt_tokens + n,
            "timings": timings,
        }

    def finish(
        self, reason: str, n_total: int, timings: dict[str, float], n_reasoning: int = 0
    ) -> list[str]:
        if self.o.protocol == "llama":
            return [dumps(self._llama_final("", [], reason, n_total, timings))]
        key = "delta" if self.o.protocol == "chat" else "text"
        choice = {"index": 0, key: {} if key == "delta" else "", "logprobs": None}
        choice["finish_reason"] = reason
        events = [self._chunk([choice], n_total, n_reasoning)]
        if self.o.include_usage:
            events.append(self._chunk([], n_total, n_reasoning, final_usage=True))
        events.append("[DONE]")
        return events

    def error(self, status: int, code: str, message: str) -> list[str]:
        err = {"error": {"code": status, "type": code, "message": message}}
        return [dumps(err)] if self.o.protocol == "llama" else [dumps(err), "[DONE]"]

    def whole(
        self,
        text: str,
        ids: list[int],
        reason: str,
        n: int,
        timings: dict[str, float],
        nan: bool,
        reasoning: str | None = None,
        n_reasoning: int = 0,
    ) -> dict[str, Any]:
        """The non-streaming response body; `reasoning` (chat with separate reasoning
        only) becomes `message.reasoning_content`."""
        if self.o.protocol == "llama":
            final = self._llama_final(text, ids, reason, n, timings)
            if nan:
                final["probs"] = [{"logprob": float("nan")}]
            return final
        logprobs = {"logprob": float("nan")} if nan else None
        if self.o.protocol == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning is not None:
                message["reasoning_content"] = reasoning or None
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [choice],
            "usage": self.usage(n, n_reasoning),
        }


def timings(
    prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float, cache_n: int = 0
) -> dict[str, float]:
    """llama.cpp-style `timings` (milliseconds of real time as this server measured them).

    As llama.cpp's: `cache_n` prompt tokens came from the cache and `prompt_n` were
    computed (the prompt is their sum, `tokens_evaluated`)."""
    prompt_n -= cache_n
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / prompt_n, 6) if prompt_n else 0.0,
        "prompt_per_second": round(prompt_n / prompt_ms * 1000, 3) if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(predicted_ms / predicted_n, 6) if predicted_n else 0.0,
        "predicted_per_second": (
            round(predicted_n / predicted_ms * 1000, 3) if predicted_ms > 0 else 0.0
        ),
    }
