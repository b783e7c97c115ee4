"""The common shapes of a token event (OpenAI's, llama.cpp's) as msgspec Structs: the
adapters' fast path decodes and type-checks an event into them in C
(measure.protocols, `Adapter.fast_event`).

A module of their own: msgspec builds each Struct class with its own metaclass, so they
stay interpreted when the modules on a token event's path are compiled
(measure.native)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

# Every count the server sends lands in an int64 column: a value outside 0..INT64_MAX is
# refused where it is parsed, so it can never reach (and sink) a part of good records.
INT64_MAX = 2**63 - 1

# The common shape of a token event (OpenAI's, llama.cpp's), decoded and type-checked in C
# by msgspec (`fast_event`): unknown fields ignored, a value of another type, a count
# outside 0..INT64_MAX, NaN or Infinity, invalid UTF-8 or a lone surrogate fail the decode,
# and `event` reads the event instead (and says what is wrong with it).
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]


class FastDetails(msgspec.Struct):
    cached_tokens: Count | None = None


class FastOutputDetails(msgspec.Struct):
    reasoning_tokens: Count | None = None


class FastUsage(msgspec.Struct):
    completion_tokens: Count | None = None
    prompt_tokens: Count | None = None
    prompt_tokens_details: FastDetails | None = None
    completion_tokens_details: FastOutputDetails | None = None


class FastChoice(msgspec.Struct):
    text: str | None = None
    finish_reason: str | None = None


class FastDelta(msgspec.Struct):
    content: str | None = None
    # a reasoning model's thinking, streamed apart from the answer: `reasoning_content`
    # (vLLM's reasoning parsers, llama.cpp, DeepSeek), `reasoning` (newer vLLM)
    reasoning_content: str | None = None
    reasoning: str | None = None


class FastChatChoice(msgspec.Struct):
    delta: FastDelta | None = None
    finish_reason: str | None = None


class FastCompletion(msgspec.Struct):
    choices: list[FastChoice]
    usage: FastUsage | None = None
    timings: dict[str, Any] | None = None
    error: Any = None


class FastChat(msgspec.Struct):
    choices: list[FastChatChoice]
    usage: FastUsage | None = None
    timings: dict[str, Any] | None = None
    error: Any = None


class FastLlama(msgspec.Struct):
    content: str | None = None
    tokens_predicted: Count | None = None
    tokens_evaluated: Count | None = None
    stop: Any = None
    error: Any = None
