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
from typing import Any

from calculet_sim.engine import UINT32_MAX, GenRequest, Reject
from calculet_sim.tokens import Tokenizer

# Chat template: each message costs 4 tokens of markup, the assistant primer 3.
_MSG_MARKUP = [151644, 151645, 198, 271]
_PRIMER = [151644, 77091, 198]


def _field(body: dict[str, Any], name: str, types: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    is_bool = isinstance(value, bool)
    if not isinstance(value, types) or (is_bool and bool not in types):
        names = "/".join(t.__name__ for t in types)
        raise Reject(
            400, "invalid_request", f"{name}: expected {names}, got {type(value).__name__}"
        )
    return value


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = _field(body, name, (int,), default)
    if value is not None and not -(2**63) <= value <= 2**64:
        raise Reject(400, "invalid_length", f"{name}: {value} out of range")
    return value  # type: ignore[no-any-return]


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


def _chat_ids(messages: Any, tok: Tokenizer) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise Reject(400, "invalid_request", "messages: expected a non-empty list")
    ids: list[int] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise Reject(400, "invalid_request", f"messages[{i}]: expected an object")
        if not isinstance(m.get("role"), str):
            raise Reject(400, "invalid_request", f"messages[{i}].role: expected a string")
        content = m.get("content")
        if not isinstance(content, str):
            raise Reject(400, "invalid_request", f"messages[{i}].content: expected a string")
        ids += _MSG_MARKUP[:2] + tok.encode(content) + _MSG_MARKUP[2:]
    return ids + _PRIMER


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
        n_predict = _int_field(body, "n_predict", -1)
        max_tokens = max_context - len(ids) if n_predict == -1 else n_predict
    else:
        max_tokens = _int_field(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", 16)
    assert max_tokens is not None
    if max_tokens > UINT32_MAX or max_tokens < -(2**31):
        raise Reject(400, "invalid_length", f"max_tokens: {max_tokens} overflows uint32")
    temperature = float(_field(body, "temperature", (int, float), 0.0))
    if temperature < 0 or temperature != temperature:
        raise Reject(400, "invalid_request", "temperature: must be >= 0")
    stream = _field(body, "stream", (bool,), False)
    opts_raw = _field(body, "stream_options", (dict,), {})
    include = _field(opts_raw, "include_usage", (bool,), False)
    continuous = _field(opts_raw, "continuous_usage_stats", (bool,), False)
    _field(body, "cache_prompt", (bool,), True)
    _field(body, "return_tokens", (bool,), True)
    req = GenRequest(
        request_id,
        ids,
        max_tokens,
        ignore_eos=_field(body, "ignore_eos", (bool,), False),
        temperature=temperature,
        seed=_int_field(body, "seed", None),
        model=_field(body, "model", (str,), None),
    )
    opts = Options(protocol, stream, include, continuous)
    return req, opts


def dumps(obj: Any) -> str:
    # allow_nan: the broken numeric-check mode must be able to put NaN on the wire.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=True)


class Formatter:
    """Builds the events of one response. `usage(n)` is cumulative output tokens."""

    def __init__(self, opts: Options, req: GenRequest, model_name: str) -> None:
        self.o = opts
        self.prompt_tokens = len(req.prompt_ids)
        self.model = req.model or model_name
        self.created = int(time.time())
        self.id = ("chatcmpl-" if opts.protocol == "chat" else "cmpl-") + req.request_id

    def usage(self, n: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
        }

    def _chunk(self, choices: list[dict[str, Any]], n: int, final_usage: bool = False) -> str:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.o.protocol == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.o.continuous_usage or final_usage:
            obj["usage"] = self.usage(n)
        return dumps(obj)

    def start(self) -> list[str]:
        if self.o.protocol == "chat":
            choice = {"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None}
            choice["finish_reason"] = None
            return [self._chunk([choice], 0)]
        return []

    def tokens(self, text: str, ids: list[int], n_total: int, nan: bool) -> str:
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
        key = "delta" if self.o.protocol == "chat" else "text"
        payload: Any = {"content": text} if key == "delta" else text
        choice = {"index": 0, key: payload, "logprobs": logprob, "finish_reason": None}
        return self._chunk([choice], n_total)

    def finish(self, reason: str, n_total: int, timings: dict[str, float]) -> list[str]:
        if self.o.protocol == "llama":
            obj = {
                "index": 0,
                "content": "",
                "tokens": [],
                "id_slot": 0,
                "stop": True,
                "model": self.model,
                "tokens_predicted": n_total,
                "tokens_evaluated": self.prompt_tokens,
                "stop_type": "eos" if reason == "stop" else "limit",
                "truncated": False,
                "timings": timings,
            }
            return [dumps(obj)]
        key = "delta" if self.o.protocol == "chat" else "text"
        choice = {"index": 0, key: {} if key == "delta" else "", "logprobs": None}
        choice["finish_reason"] = reason
        events = [self._chunk([choice], n_total)]
        if self.o.include_usage:
            events.append(self._chunk([], n_total, final_usage=True))
        events.append("[DONE]")
        return events

    def error(self, status: int, code: str, message: str) -> list[str]:
        err = {"error": {"code": status, "type": code, "message": message}}
        return [dumps(err)] if self.o.protocol == "llama" else [dumps(err), "[DONE]"]

    def whole(
        self, text: str, ids: list[int], reason: str, n: int, timings: dict[str, float], nan: bool
    ) -> dict[str, Any]:
        """The non-streaming response body."""
        if self.o.protocol == "llama":
            return {
                "index": 0,
                "content": text,
                "tokens": ids,
                "id_slot": 0,
                "stop": True,
                "model": self.model,
                "tokens_predicted": n,
                "tokens_evaluated": self.prompt_tokens,
                "stop_type": "eos" if reason == "stop" else "limit",
                "timings": timings,
                **({"probs": [{"logprob": float("nan")}]} if nan else {}),
            }
        logprobs = {"logprob": float("nan")} if nan else None
        if self.o.protocol == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
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
            "choices": [choice],
            "usage": self.usage(n),
        }


def timings(
    prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float
) -> dict[str, float]:
    """llama.cpp-style `timings` (milliseconds of real time as this server measured them)."""
    return {
        "cache_n": 0,
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
