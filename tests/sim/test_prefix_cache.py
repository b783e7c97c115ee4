"""The prefix cache: block matching, LRU eviction, capacity and reset (the pure cache),
then what the real simulator serves from it and how it says so."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from calculet_sim.prefix_cache import PrefixCache
from calculet_sim.tokens import Tokenizer
from tests.support.simhelpers import CHAT, COMPLETIONS, LLAMA, by_request, prompt_ids
from tests.support.simproc import SimProcess

StartSim = Callable[..., SimProcess]
FAST = ("--time-scale", "0.01")


def _ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------- the pure cache
def test_hits_are_whole_blocks_of_a_matching_prefix() -> None:
    cache = PrefixCache(block_tokens=4, capacity_tokens=1000)
    cache.insert(_ids(10))  # blocks [0:4] and [4:8]; the 2 tokens after are no block
    assert cache.tokens == 8
    assert cache.lookup(_ids(10)) == 8
    assert cache.lookup(_ids(7)) == 4  # [4:8] would hold the last token: recomputed
    assert cache.lookup(_ids(9)) == 8
    assert cache.lookup([*_ids(6), 99, 98, 97]) == 4  # diverges inside the second block
    assert cache.lookup([5, *_ids(9)[1:]]) == 0  # the first token differs: nothing hits
    assert (cache.queried_tokens, cache.hit_tokens) == (10 + 7 + 9 + 9 + 9, 8 + 4 + 8 + 4)


def test_a_block_hits_only_after_its_whole_prefix() -> None:
    cache = PrefixCache(block_tokens=4, capacity_tokens=1000)
    a = _ids(12)
    cache.insert(a)
    # the same second and third blocks behind another first block: a chain, no hit
    b = [7, 7, 7, 7, *a[4:], 1]
    assert cache.lookup(b) == 0
    assert cache.lookup([*a, 1]) == 12


def test_capacity_is_bounded_and_lru_evicts_a_sequence_from_its_tail() -> None:
    cache = PrefixCache(block_tokens=4, capacity_tokens=16)  # 4 blocks
    a, b = _ids(16, 1000), _ids(8, 2000)
    cache.insert(a)
    assert cache.tokens == 16
    cache.insert(b)  # 2 blocks more: a's two deepest blocks go, its head stays
    assert cache.tokens == 16 and cache.evicted_blocks == 2
    assert cache.lookup([*a, 1]) == 8
    assert cache.lookup([*b, 1]) == 8
    # a was used before b: b is the most recent now, a's head is evicted next
    cache.insert(_ids(8, 3000))
    assert cache.lookup([*a, 1]) == 0
    assert cache.lookup([*b, 1]) == 8
    # a sequence longer than the capacity keeps its head
    cache.insert(_ids(40, 4000))
    assert cache.tokens == 16
    assert cache.lookup([*_ids(40, 4000), 1]) == 16


def test_a_hit_refreshes_its_blocks() -> None:
    cache = PrefixCache(block_tokens=4, capacity_tokens=16)
    a, b = _ids(8, 1000), _ids(8, 2000)
    cache.insert(a)
    cache.insert(b)
    assert cache.lookup([*a, 1]) == 8  # a is now more recent than b
    cache.insert(_ids(8, 3000))
    assert cache.lookup([*a, 1]) == 8
    assert cache.lookup([*b, 1]) == 0


def test_shrink_and_clear() -> None:
    cache = PrefixCache(block_tokens=4, capacity_tokens=64)
    cache.insert(_ids(32))
    cache.insert(_ids(32), room_tokens=10)  # room for 2 whole blocks: the head
    assert cache.tokens == 8
    assert cache.lookup(_ids(32)) == 8
    cache.shrink_to(-5)
    assert cache.tokens == 0 and cache.lookup(_ids(32)) == 0
    cache.insert(_ids(32))
    cache.clear()
    assert cache.tokens == 0 and cache.lookup(_ids(32)) == 0
    state = cache.state()
    assert state["cached_tokens"] == 0 and state["capacity_tokens"] == 64


def test_a_text_prompt_continued_encodes_as_the_whole_text() -> None:
    """What a completions request leaves for its next turn, `encode(prompt + answer)`,
    taken from the prompt's ids and its last word: the same ids, over seeded texts with
    every kind of boundary (trailing whitespace, long runs split at 8, multi-byte and
    Unicode whitespace)."""
    tok = Tokenizer(32_000)
    rng = random.Random(7)
    alphabet = "ab \n\tcé字\u00a0\u2003"
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        more = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
        assert tok.encode_more(text, tok.encode(text), more) == tok.encode(text + more), (
            text,
            more,
        )


# --------------------------------------------------------------- the simulator
def _chat(sim: SimProcess, msgs: list[dict[str, str]], n: int, rid: str) -> tuple[str, Any]:
    """One streamed chat turn: its text and its final usage."""
    body = {
        "messages": msgs,
        "max_tokens": n,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    s = sim.stream(CHAT, body, headers={"X-Request-Id": rid})
    assert s.status == 200, s.raw[:300]
    chunks = s.json_events()
    usages = [c["usage"] for c in chunks]
    # every usage object says what the cache served, the same in each
    assert {u["prompt_tokens_details"]["cached_tokens"] for u in usages} == {
        usages[-1]["prompt_tokens_details"]["cached_tokens"]
    }
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, usages[-1]


def _count(sim: SimProcess, msgs: list[dict[str, str]]) -> int:
    status, body = sim.json("POST", "/tokenize", {"messages": msgs})
    assert status == 200
    return int(body["count"])


def _admitted(sim: SimProcess, rids: list[str]) -> dict[str, dict[str, Any]]:
    rows = by_request(r for r in sim.traces("server_events") if r["event"] == "admitted")
    assert set(rids) <= set(rows)
    return {rid: rows[rid][0]["detail"] for rid in rids}


def test_a_chat_turn_hits_the_whole_blocks_of_the_turn_before(start_sim: StartSim) -> None:
    sim = start_sim(*FAST, faults=True)
    turn1 = [
        {"role": "system", "content": "You answer in prose. " * 12},
        {"role": "user", "content": "Tell me about the sea."},
    ]
    text, usage1 = _chat(sim, turn1, 40, "t1")
    assert usage1["prompt_tokens_details"]["cached_tokens"] == 0
    answered = [*turn1, {"role": "assistant", "content": text}]
    turn2 = [*answered, {"role": "user", "content": "And the sky?"}]
    _, usage2 = _chat(sim, turn2, 8, "t2")
    # what turn 2 shares with turn 1: its prompt and answer as a message, without the
    # assistant primer (3 tokens) /tokenize adds after the last message
    shared = _count(sim, answered) - 3
    prompt1 = usage1["prompt_tokens"]
    assert shared > prompt1 + 20  # the answer's text is part of it
    assert usage2["prompt_tokens"] == _count(sim, turn2)
    assert usage2["prompt_tokens_details"]["cached_tokens"] == shared // 16 * 16
    assert usage2["prompt_tokens_details"]["cached_tokens"] >= prompt1 // 16 * 16
    # the trace says the same, on the request's `admitted` row
    details = _admitted(sim, ["t1", "t2"])
    assert details["t1"]["cached_tokens"] == 0
    assert details["t2"]["cached_tokens"] == shared // 16 * 16
    # its prefill step started from the cached prefix
    steps = {(r["request_id"], r["kind"]): r for r in sim.traces("steps")}
    assert steps[("t2", "prefill")]["kv_before"] == shared // 16 * 16
    assert steps[("t1", "prefill")]["kv_before"] == 0
    # a whole (non-streamed) response says it too
    status, whole = sim.json("POST", CHAT, {"messages": turn2, "max_tokens": 2})
    assert status == 200
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        (usage2["prompt_tokens"] - 1) // 16 * 16
    )
    state = sim.state()["prefix_cache"]
    assert state["enabled"] is True and state["block_tokens"] == 16
    assert state["capacity_tokens"] == 131_072  # the KV budget
    assert 0 < state["cached_tokens"] <= state["capacity_tokens"]
    assert (
        state["hit_tokens"]
        == shared // 16 * 16 + whole["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


def test_completions_and_llama_hit_their_prompt_and_answer(start_sim: StartSim) -> None:
    sim = start_sim(*FAST)
    prompt = "Once upon a time there was a lighthouse keeper. " * 6
    body = {"prompt": prompt, "max_tokens": 40, "ignore_eos": True}
    status, first = sim.json("POST", COMPLETIONS, body)
    assert status == 200
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    answer = first["choices"][0]["text"]
    # the next turn sends the prompt's text and the answer's, verbatim
    _, tok = sim.json("POST", "/tokenize", {"content": prompt + answer})
    status, second = sim.json("POST", COMPLETIONS, {**body, "prompt": prompt + answer + " More."})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == tok["count"] // 16 * 16
    # llama.cpp with a prompt of ids: the ids, then the answer's text tokenized
    ids = prompt_ids(100, salt=5)
    status, got = sim.json("POST", LLAMA, {"prompt": ids, "n_predict": 30, "cache_prompt": True})
    assert status == 200 and got["timings"]["cache_n"] == 0
    _, answer_ids = sim.json("POST", "/tokenize", {"content": got["content"]})
    follow = [*ids, *answer_ids["tokens"], *prompt_ids(5, salt=6)]
    status, again = sim.json("POST", LLAMA, {"prompt": follow, "n_predict": 2})
    assert status == 200
    cached = (100 + answer_ids["count"]) // 16 * 16
    assert again["timings"]["cache_n"] == cached
    # llama.cpp's split: prompt_n computed, cache_n served, tokens_evaluated both
    assert again["timings"]["prompt_n"] == len(follow) - cached
    assert again["tokens_evaluated"] == len(follow)
    assert again["tokens_cached"] == len(follow) + 2


def test_llama_cache_prompt_false_neither_looks_up_nor_keeps(start_sim: StartSim) -> None:
    sim = start_sim(*FAST, faults=True)
    body = {"prompt": prompt_ids(200, salt=9), "n_predict": 3, "stream": True}
    for rid in ("off-1", "off-2"):
        s = sim.stream(LLAMA, {**body, "cache_prompt": False}, headers={"X-Request-Id": rid})
        final = s.json_events()[-1]
        assert final["stop"] is True and final["timings"]["cache_n"] == 0
        assert final["timings"]["prompt_n"] == 200
    state = sim.state()["prefix_cache"]
    assert state["queried_tokens"] == 0 and state["cached_tokens"] == 0
    # true (llama.cpp's default, as when it is left out) does both
    for rid in ("on-1", "on-2"):
        s = sim.stream(LLAMA, body, headers={"X-Request-Id": rid})
        last = s.json_events()[-1]
    assert last["timings"]["cache_n"] == 192  # 199 // 16 whole blocks
    details = _admitted(sim, ["off-1", "off-2", "on-1", "on-2"])
    assert [d["cached_tokens"] for d in details.values()] == [0, 0, 0, 192]


def test_cache_off_reports_zero_everywhere(start_sim: StartSim) -> None:
    sim = start_sim(*FAST, "--set", "prefix_cache.enabled=false", faults=True)
    msgs = [{"role": "user", "content": "Say something long. " * 20}]
    for rid in ("a", "b"):
        _, usage = _chat(sim, msgs, 4, rid)
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    for _ in range(2):
        _, whole = sim.json("POST", COMPLETIONS, {"prompt": "x " * 100, "max_tokens": 2})
        assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        _, got = sim.json("POST", LLAMA, {"prompt": "x " * 100, "n_predict": 2})
        assert got["timings"]["cache_n"] == 0
    assert [d["cached_tokens"] for d in _admitted(sim, ["a", "b"]).values()] == [0, 0]
    state = sim.state()["prefix_cache"]
    assert state["enabled"] is False and state["cached_tokens"] == 0
    metrics = _metrics(sim)
    assert metrics["calculet_prefix_cache_capacity_tokens"] == 0
    assert metrics["calculet_prefix_cache_queried_tokens_total"] == 0


def _metrics(sim: SimProcess) -> dict[str, float]:
    status, _, body = sim.request("GET", "/metrics")
    assert status == 200
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
        if s.name.startswith("calculet_prefix_cache")
    }


def test_metrics_count_queried_and_hit_tokens(start_sim: StartSim) -> None:
    sim = start_sim(*FAST)
    ids = prompt_ids(333, salt=4)
    for _ in range(3):
        sim.json("POST", LLAMA, {"prompt": ids, "n_predict": 1})
    m = _metrics(sim)
    assert m["calculet_prefix_cache_queried_tokens_total"] == 3 * 333
    assert m["calculet_prefix_cache_hit_tokens_total"] == 2 * 320
    assert m["calculet_prefix_cache_tokens"] == 320  # 333 // 16 blocks, the answer's too
    assert m["calculet_prefix_cache_capacity_tokens"] == 131_072
    assert m["calculet_prefix_cache_evicted_blocks_total"] == 0


@pytest.mark.parametrize("action", ["reset", "load"])
def test_a_reset_or_a_new_generation_empties_the_cache(start_sim: StartSim, action: str) -> None:
    sim = start_sim(*FAST, "--set", "scheduling.reset_min_interval_ms=0", faults=True)
    body = {"prompt": prompt_ids(100, salt=2), "n_predict": 2}
    sim.json("POST", LLAMA, body)
    _, hit = sim.json("POST", LLAMA, body)
    assert hit["timings"]["cache_n"] == 96
    if action == "reset":
        status, out = sim.admin("POST", "/admin/reset")
    else:
        status, out = sim.admin("POST", "/admin/load", {"calbin_sha256": "ab" * 32})
    assert status == 200, out
    assert sim.state()["prefix_cache"]["cached_tokens"] == 0
    _, cold = sim.json("POST", LLAMA, body)
    assert cold["timings"]["cache_n"] == 0
    # and it fills again
    _, warm = sim.json("POST", LLAMA, body)
    assert warm["timings"]["cache_n"] == 96


def test_the_cache_gives_way_to_running_requests(start_sim: StartSim) -> None:
    """Cached KV lives in the KV budget that running requests leave unreserved."""
    sim = start_sim(*FAST, "--set", "scheduling.kv_budget_tokens=4096", faults=True)
    a = {"prompt": prompt_ids(2000, salt=1), "n_predict": 2}
    sim.json("POST", LLAMA, a)
    _, hit = sim.json("POST", LLAMA, a)
    assert hit["timings"]["cache_n"] == 1984
    assert sim.state()["prefix_cache"]["capacity_tokens"] == 4096
    # b reserves 3900 + 100 of the 4096 tokens: a's blocks make room for it
    b = {"prompt": prompt_ids(3900, salt=2), "n_predict": 100, "ignore_eos": True}
    status, _ = sim.json("POST", LLAMA, b)
    assert status == 200
    _, after = sim.json("POST", LLAMA, a)
    assert after["timings"]["cache_n"] == 0
    assert sim.state()["prefix_cache"]["evicted_blocks"] >= 125
