"""Prompts with exact token counts, identified by corpus sample ids.

The corpus is synthetic and deterministic: sample `i` of corpus seed `s` is a stream of
pseudo-words drawn from (s, i), so a sample id (`synthetic:s:i`) names the same text on
every host and in every year. A prompt of exactly N tokens is made in one of two ways:

- token ids (OpenAI completions, llama.cpp): the sample's text is tokenized once by the
  target's own `/tokenize`; the prompt is the first N ids of that sample (cycled), so its
  length is exact by construction;
- text (OpenAI chat): words are added or removed until the target's `/tokenize` of the
  chat messages says N, template tokens included.

Only the sample id and the token count are ever recorded; prompt text never leaves this
module (no record, log or report holds it).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from typing import Any

from calculet_load.schema.access import TargetAccess, access_of

MAX_CONTEXT = 40960
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "do", "fu", "ga")

Tokenize = Callable[[dict[str, Any]], list[int]]


class WorkloadError(ValueError):
    """A prompt cannot be built as asked (the message names the parameter)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    sample_id: str
    tokens: int
    payload: str | list[int] = dataclasses.field(repr=False)  # never printed or recorded


def sample_words(seed: int, index: int, count: int) -> list[str]:
    """`count` pseudo-words of corpus sample (seed, index); deterministic everywhere."""
    rng = random.Random(f"calculet-corpus:{seed}:{index}")
    words = []
    for _ in range(count):
        n = rng.randint(1, 3)
        words.append("".join(rng.choice(_SYLLABLES) for _ in range(n)))
    return words


def http_tokenizer(url: str | TargetAccess, timeout_s: float = 30.0) -> Tokenize:
    """POST the body to the target's `/tokenize` (under its base path, with its TLS
    settings and headers: calculet_load.schema.access) and return the token ids."""
    access = access_of(url)

    def tokenize(body: dict[str, Any]) -> list[int]:
        status, data, _ = access.call(
            "POST", "/tokenize", json.dumps(body).encode(),
            {"Content-Type": "application/json"}, timeout_s,
        )  # fmt: skip
        if status != 200:
            raise WorkloadError(f"/tokenize: HTTP {status} from {access.url}")
        obj = json.loads(data)
        tokens = obj.get("tokens") if isinstance(obj, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise WorkloadError("/tokenize: response has no integer 'tokens' list")
        return tokens

    return tokenize


class PromptFactory:
    """Builds exact-length prompts for one target; caches tokenizations per sample."""

    def __init__(
        self,
        tokenize: Tokenize,
        *,
        mode: str,
        corpus_seed: int = 0,
        max_context: int = MAX_CONTEXT,
    ) -> None:
        if mode not in ("ids", "chat"):
            raise WorkloadError(f"mode: expected 'ids' or 'chat', got {mode!r}")
        self.tokenize = tokenize
        self.mode = mode
        self.corpus_seed = corpus_seed
        self.max_context = max_context
        self._ids: dict[int, list[int]] = {}
        self._chat: dict[tuple[int, int], Prompt] = {}

    def sample_id(self, index: int) -> str:
        return f"synthetic:{self.corpus_seed}:{index}"

    def prompt(self, tokens: int, sample: int = 0) -> Prompt:
        if not 1 <= tokens <= self.max_context - 1:
            raise WorkloadError(f"prompt_tokens: {tokens} outside 1..{self.max_context - 1}")
        if self.mode == "ids":
            return self._by_ids(tokens, sample)
        key = (tokens, sample)
        if key not in self._chat:
            self._chat[key] = self._by_text(tokens, sample)
        return self._chat[key]

    def _by_ids(self, tokens: int, sample: int) -> Prompt:
        ids = self._ids.get(sample)
        if ids is None:
            text = " ".join(sample_words(self.corpus_seed, sample, 2048))
            # llama.cpp's /tokenize reads `content`/`add_special`, vLLM's reads
            # `prompt`/`add_special_tokens`; each ignores the other's fields
            body = {"content": text, "add_special": False}
            ids = self.tokenize(body | {"prompt": text, "add_special_tokens": False})
            if not ids:
                raise WorkloadError("/tokenize returned no tokens for the corpus sample")
            self._ids[sample] = ids
        reps = -(-tokens // len(ids))
        return Prompt(self.sample_id(sample), tokens, (ids * reps)[:tokens])

    def _by_text(self, tokens: int, sample: int) -> Prompt:
        """Adjust the word count until the chat messages tokenize to exactly `tokens`."""
        words = sample_words(self.corpus_seed, sample, tokens)
        n = max(tokens - 8, 1)
        seen: set[int] = set()
        for _ in range(32):
            text = " ".join(words[:n]) if n <= len(words) else self._extend(words, n, sample)
            count = len(self.tokenize({"messages": [{"role": "user", "content": text}]}))
            if count == tokens:
                return Prompt(self.sample_id(sample), tokens, text)
            if n in seen or (count > tokens and n == 1):
                break
            seen.add(n)
            n = max(n + (tokens - count), 1)
        raise WorkloadError(
            f"prompt_tokens: cannot make a chat prompt of exactly {tokens} tokens "
            f"(the chat template alone may be longer)"
        )

    def _extend(self, words: list[str], n: int, sample: int) -> str:
        words.extend(sample_words(self.corpus_seed, sample + 1_000_003, n - len(words)))
        return " ".join(words[:n])
