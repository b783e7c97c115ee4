"""The simulator's prefix cache: computed KV of earlier prompts and answers, reused by
a later prompt that starts with the same tokens (vLLM's automatic prefix caching,
llama.cpp's prompt cache).

Tokens are cached in whole blocks of `block_tokens`. A block is named by a hash chain
over every token up to its end, so it hits only when everything before it matches too.
A lookup is the longest run of cached blocks from the prompt's start, and never the
prompt's last token: a prefill must compute at least one token to yield logits (vLLM
and llama.cpp both recompute it). Blocks are evicted least recently used first; within
one sequence its deepest blocks go first, so a shared head (a system prompt) outlives
the tails that hang off it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence


class PrefixCache:
    """Cached blocks, in least-recently-used order, at most `capacity_tokens` of them."""

    def __init__(self, block_tokens: int, capacity_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_tokens = capacity_tokens
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of them, served from the cache
        self.evicted_blocks = 0

    @property
    def tokens(self) -> int:
        """Tokens held (whole blocks)."""
        return len(self._blocks) * self.block_tokens

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def _chain(self, ids: Sequence[int], n_blocks: int) -> Iterator[int]:
        b = self.block_tokens
        h = 0
        for i in range(n_blocks):
            h = hash((h, *ids[i * b : (i + 1) * b]))
            yield h

    def _touch(self, chain: list[int]) -> None:
        # deepest first: the head ends most recently used, so eviction takes tails first
        for h in reversed(chain):
            self._blocks[h] = None
            self._blocks.move_to_end(h)

    def lookup(self, ids: Sequence[int]) -> int:
        """Tokens of `ids` served from the cache (whole blocks, not the last token);
        the blocks hit become the most recently used."""
        hit: list[int] = []
        for h in self._chain(ids, (len(ids) - 1) // self.block_tokens):
            if h not in self._blocks:
                break
            hit.append(h)
        self._touch(hit)
        cached = len(hit) * self.block_tokens
        self.queried_tokens += len(ids)
        self.hit_tokens += cached
        return cached

    def insert(self, ids: Sequence[int], room_tokens: int | None = None) -> None:
        """Cache every whole block of `ids`, then evict down to the capacity (and to
        `room_tokens`, the KV memory free for the cache now, when given)."""
        self._touch(list(self._chain(ids, len(ids) // self.block_tokens)))
        self.shrink_to(self.capacity_tokens if room_tokens is None else room_tokens)

    def shrink_to(self, tokens: int) -> None:
        """Evict least recently used blocks until at most `tokens` (and the capacity)
        are held."""
        keep = max(min(tokens, self.capacity_tokens), 0) // self.block_tokens
        while len(self._blocks) > keep:
            self._blocks.popitem(last=False)
            self.evicted_blocks += 1

    def clear(self) -> None:
        """Forget every block (a reset or a new generation: the device's KV is gone)."""
        self._blocks.clear()

    def state(self) -> dict[str, int]:
        return {
            "block_tokens": self.block_tokens,
            "capacity_tokens": self.capacity_tokens,
            "cached_tokens": self.tokens,
            "cached_blocks": self.blocks,
            "queried_tokens": self.queried_tokens,
            "hit_tokens": self.hit_tokens,
            "evicted_blocks": self.evicted_blocks,
        }
