"""Deterministic tokenizer and output model of the simulator.

Text tokenizes into word pieces (a run of up to 8 non-space characters with its leading
whitespace is one token), so `/tokenize` sizes a prompt exactly. Output token ids are a
pure function of (prompt key, sampling key, position): a greedy golden prompt always
yields the same ids. Some output characters are multi-byte UTF-8 spread over byte
tokens, so a token can end inside a character, as on real servers.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Sequence

PAD, BOS, EOS = 0, 1, 2
BYTE_BASE = 3  # ids 3..258 are the byte-fallback tokens <0x00>..<0xFF>
WORD_BASE = BYTE_BASE + 256
NEWLINE = BYTE_BASE + 0x0A
# The top ids of the vocabulary are the chat template's special tokens; word pieces
# never use them, and every id the server hands out (a chat template from /tokenize
# included) is inside the vocabulary, so it can be sent back as a prompt.
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "system", "user", "assistant", "tool")
# A reasoning model's tags sit just below them, in its vocabulary only: adding them to
# every vocabulary would shrink the word range and move every word id (and every golden
# token hash) of the models without a reasoning phase.
REASONING_TOKENS = ("<think>", "</think>")

_PIECE = re.compile(r"\s*\S{1,8}|\s+")
_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "sa", "to", "vi",
    "be", "do", "fu", "ga", "hi", "jo", "ku", "le",
)  # fmt: skip
_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One round of SplitMix64: a cheap, well-mixed 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def key_of(ids: Sequence[int]) -> int:
    """A 64-bit key of a token-id sequence (the prompt's identity for generation)."""
    digest = hashlib.blake2b(array("I", ids).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def n_words(vocab_size: int, reasoning: bool = False) -> int:
    """How many word-piece ids a vocabulary has (between the bytes and the specials)."""
    return vocab_size - WORD_BASE - len(SPECIAL_TOKENS) - (len(REASONING_TOKENS) * reasoning)


def token_hash(ids: Sequence[int]) -> str:
    """sha256 of the token ids as little-endian uint32: the output's identity."""
    return hashlib.sha256(array("I", ids).tobytes()).hexdigest()


class Tokenizer:
    """Word-piece tokenizer over a vocabulary of `vocab_size` ids; a reasoning model's
    has the `<think>`/`</think>` tags too (`think_ids`)."""

    def __init__(self, vocab_size: int, reasoning: bool = False) -> None:
        self.vocab_size = vocab_size
        self._specials = (REASONING_TOKENS if reasoning else ()) + SPECIAL_TOKENS
        self.words = n_words(vocab_size, reasoning)  # word-piece ids
        self.think_ids: tuple[int, int] | None = None
        # the tags' text, in the cache of pieces: `piece` pays nothing for them
        self._pieces: dict[int, bytes] = {}
        if reasoning:
            start, end = (self._special_id(t) for t in REASONING_TOKENS)
            self.think_ids = (start, end)
            self._pieces = {start: REASONING_TOKENS[0].encode(), end: REASONING_TOKENS[1].encode()}

    def _special_id(self, name: str) -> int:
        return self.vocab_size - len(self._specials) + self._specials.index(name)

    def special(self, name: str) -> int | None:
        """The id of a special token of the chat template, None if there is no such one."""
        return self._special_id(name) if name in SPECIAL_TOKENS else None

    def encode(self, text: str) -> list[int]:
        n = self.words
        return [
            WORD_BASE + int.from_bytes(hashlib.blake2b(m.encode(), digest_size=4).digest()) % n
            for m in _PIECE.findall(text)
        ]

    def count(self, text: str) -> int:
        return len(_PIECE.findall(text))

    def encode_more(self, text: str, ids: list[int], more: str) -> list[int]:
        """`encode(text + more)`, given `ids == encode(text)`: only the text's last word
        (where `more` may join it) is encoded again, not the whole text."""
        # A piece ends wherever a non-space meets whitespace (`\S{1,8}` stops there and the
        # next piece starts with `\s*`): encode again from the last such place.
        body = text.rstrip()
        k = len(body)
        if k == len(text):  # no whitespace at the end: the last word may go on in `more`
            while k and not body[k - 1].isspace():
                k -= 1
            k = len(body[:k].rstrip())
        tail = text[k:]
        return [*ids[: len(ids) - self.count(tail)], *self.encode(tail + more)]

    def piece(self, token_id: int) -> bytes:
        """The bytes a token contributes to the output text."""
        if token_id < BYTE_BASE:
            return b""
        if token_id < WORD_BASE:
            return bytes((token_id - BYTE_BASE,))
        cached = self._pieces.get(token_id)
        if cached is None:
            k = token_id - WORD_BASE
            syl = [_SYLLABLES[k % 16], _SYLLABLES[(k >> 4) % 16]]
            if k >> 8:
                syl.append(_SYLLABLES[(k >> 8) % 16])
            cached = self._pieces[token_id] = (" " + "".join(syl)).encode()
        return cached


class OutputModel:
    """Yields the output token ids of one sequence, position by position.

    `key` identifies (prompt, sampling); the same key always yields the same ids.
    A multi-byte character occupies consecutive byte tokens.

    A reasoning phase of `reasoning` tokens (a reasoning model's `think_ids` given) comes
    first: `<think>`, plain words, `</think>`. Its thoughts are whole words (no character
    spans the closing tag) and it has no EOS (a model does not stop mid-thought).
    """

    __slots__ = (
        "_eos_p", "_key", "_mb_rate", "_n_words", "_pending", "_reasoning", "_tags", "ignore_eos"
    )  # fmt: skip

    def __init__(
        self,
        key: int,
        words: int,
        multibyte_rate: float,
        eos_probability: float,
        ignore_eos: bool,
        reasoning: int = 0,
        think_ids: tuple[int, int] | None = None,
    ) -> None:
        self._key = key
        self._n_words = words
        self._mb_rate = int(multibyte_rate * 1_000_000)
        self._eos_p = int(eos_probability * 1_000_000)
        self.ignore_eos = ignore_eos
        self._pending: list[int] = []
        self._tags = think_ids or (EOS, EOS)
        self._reasoning = reasoning if think_ids is not None and reasoning >= 2 else 0

    def rekey(self, key: int) -> None:
        """Switch the sampling key (a new model generation computes other logits)."""
        self._key = key

    @property
    def reasoning(self) -> int:
        """Tokens of the reasoning phase, both tags included (0: none)."""
        return self._reasoning

    def token_at(self, position: int) -> int:
        if self._pending:
            return self._pending.pop(0)
        r = splitmix64(self._key ^ (position * 0x9E3779B97F4A7C15 & _MASK64))
        if position < self._reasoning:
            if position == 0:
                return self._tags[0]
            if position == self._reasoning - 1:
                return self._tags[1]
            return WORD_BASE + (r >> 44) % self._n_words
        if not self.ignore_eos and (r & 0xFFFFF) % 1_000_000 < self._eos_p:
            return EOS
        if ((r >> 20) & 0xFFFFF) % 1_000_000 < self._mb_rate:
            # A CJK ideograph (3 bytes) or, one time in 8, an emoji (4 bytes).
            if (r >> 40) & 7:
                char = chr(0x4E00 + (r >> 43) % 0x5000)
            else:
                char = chr(0x1F300 + (r >> 43) % 0x300)
            byte_ids = [BYTE_BASE + b for b in char.encode()]
            self._pending = byte_ids[1:]
            return byte_ids[0]
        return WORD_BASE + (r >> 44) % self._n_words


class Utf8Stream:
    """Turns token bytes into text, holding back an incomplete trailing character.

    With `holdback` off, incomplete bytes are emitted at once as U+FFFD (a naive server).
    """

    __slots__ = ("_buf", "holdback")

    def __init__(self, holdback: bool) -> None:
        self.holdback = holdback
        self._buf = b""

    def feed(self, data: bytes) -> str:
        buf = self._buf + data
        if not self.holdback:
            self._buf = b""
            return buf.decode("utf-8", errors="replace")
        cut = _complete_prefix(buf)
        self._buf = buf[cut:]
        return buf[:cut].decode("utf-8", errors="replace")

    @property
    def holding(self) -> bool:
        return bool(self._buf)

    def flush(self) -> str:
        buf, self._buf = self._buf, b""
        return buf.decode("utf-8", errors="replace")


class TextOut:
    """One response's generated ids as the text it carries: `feed` returns the new
    (reasoning, answer) text; `reasoning_tokens` counts the reasoning phase's tokens, its
    tags included (OpenAI's `completion_tokens_details.reasoning_tokens`).

    `separate` (vLLM's reasoning parser, llama.cpp `--reasoning-format deepseek`): the
    thoughts are reasoning text and the tags no text at all. Otherwise the tags and the
    thoughts are answer text (`<think> ... </think>` inline, llama.cpp `none`), and the
    reasoning text stays empty. A tokenizer without tags has a fast path.
    """

    __slots__ = ("_answer", "_in_thought", "_reasoning", "_tags", "_tok", "reasoning_tokens")

    def __init__(self, tok: Tokenizer, holdback: bool, separate: bool) -> None:
        self._tok = tok
        self._tags = tok.think_ids
        self._answer = Utf8Stream(holdback)
        # thoughts are whole words: no character to hold back
        self._reasoning = Utf8Stream(holdback) if separate else None
        self._in_thought = False
        self.reasoning_tokens = 0

    def feed(self, ids: Sequence[int]) -> tuple[str, str]:
        piece = self._tok.piece
        if self._tags is None:
            return "", self._answer.feed(b"".join(piece(t) for t in ids))
        start, end = self._tags
        thought: list[bytes] = []
        answer: list[bytes] = []
        for t in ids:
            if t == start or self._in_thought:
                self.reasoning_tokens += 1
                self._in_thought = t != end
                if self._reasoning is None:
                    answer.append(piece(t))
                elif t != start and t != end:
                    thought.append(piece(t))
            else:
                answer.append(piece(t))
        said = self._reasoning.feed(b"".join(thought)) if self._reasoning else ""
        return said, self._answer.feed(b"".join(answer)) if answer else ""

    @property
    def separate(self) -> bool:
        """Whether thoughts are reasoning text apart from the answer."""
        return self._reasoning is not None

    def flush(self) -> tuple[str, str]:
        said = self._reasoning.flush() if self._reasoning else ""
        return said, self._answer.flush()

    def whole(self, ids: Sequence[int]) -> tuple[str, str]:
        """The (reasoning, answer) text of all of `ids` at once."""
        r1, a1 = self.feed(ids)
        r2, a2 = self.flush()
        return r1 + r2, a1 + a2


def _complete_prefix(buf: bytes) -> int:
    """Length of `buf` without an incomplete UTF-8 sequence at its end."""
    n = len(buf)
    for back in range(1, min(4, n) + 1):
        b = buf[n - back]
        if b < 0x80:
            return n
        if b >= 0xC0:  # a lead byte: is its sequence complete?
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if back >= need else n - back
    return n
