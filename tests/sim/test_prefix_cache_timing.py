"""Time to first token with and without the prefix cache, as a client of the real
simulator sees it: a turn's prefill costs only its uncached tokens.

Time scale 1 and no jitter or warm-up: every compared prefill differs from the next by
about 100 ms or more of the model (`8 + 0.05 U + 1e-6 (P² - C²)` ms for P prompt tokens, C of
them cached, U = P - C uncached), far beyond the client's and the event loop's noise.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.simhelpers import CHAT, LLAMA, prompt_ids
from tests.support.simproc import SimProcess

StartSim = Callable[..., SimProcess]
# real milliseconds compared with each other, with margins of 100 ms: two neighbours
# leave them that
pytestmark = pytest.mark.quiet

MODEL = ("--set", "timing.jitter=0", "--set", "timing.warmup_extra_ms=0")
CACHE_OFF = ("--set", "prefix_cache.enabled=false")


def _ttft_ms(sim: SimProcess, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """The first non-empty token's arrival after the send, and the last usage (or the
    llama.cpp final event)."""
    t0 = time.monotonic_ns()
    s = sim.stream(path, body)
    assert s.status == 200, s.raw[:300]
    events = s.json_events()
    first = next(
        t
        for t, e in s.events
        if e.data != "[DONE]" and _text(e.data)  # role-only and usage-only chunks have none
    )
    last = events[-1] if path == LLAMA else events[-1]["usage"]
    return (first - t0) / 1e6, last


def _text(data: str) -> str:
    obj = json.loads(data)
    if "choices" not in obj:
        return str(obj.get("content") or "")
    return "".join(str(c.get("delta", {}).get("content") or "") for c in obj["choices"])


def _words(n: int, salt: str) -> str:
    return " ".join(f"{salt}{i}" for i in range(n))


def _conversation(sim: SimProcess, salt: str) -> list[tuple[float, int, int]]:
    """Four chat turns over a shared 4000-token system prompt, 3000 new tokens a turn:
    per turn (TTFT ms, prompt tokens, cached tokens)."""
    # a first request of its own: whatever a fresh process pays once is not turn 1's
    sim.json("POST", CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    msgs = [{"role": "system", "content": _words(4000, salt + "s")}]
    out = []
    for turn in range(4):
        msgs.append({"role": "user", "content": _words(3000, f"{salt}u{turn}-")})
        body = {
            "messages": msgs,
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.monotonic_ns()
        s = sim.stream(CHAT, body)
        assert s.status == 200, s.raw[:300]
        chunks = s.json_events()
        first = next(t for t, e in s.events if e.data != "[DONE]" and _text(e.data))
        usage = chunks[-1]["usage"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
        msgs.append({"role": "assistant", "content": text})
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        out.append(((first - t0) / 1e6, usage["prompt_tokens"], cached))
    return out


def test_conversation_ttft_with_and_without_the_cache(start_sim: StartSim) -> None:
    off = _conversation(start_sim(*MODEL, *CACHE_OFF), "a")
    on = _conversation(start_sim(*MODEL), "a")
    contexts = [p for _, p, _ in off]
    assert contexts == [p for _, p, _ in on]
    assert contexts == sorted(contexts) and contexts[-1] > 16_000
    # Off: nothing cached, and each turn's prefill is the whole, longer context:
    # about 407, 610, 830 and 1,070 ms.
    assert [c for _, _, c in off] == [0, 0, 0, 0]
    ttft_off = [t for t, _, _ in off]
    assert all(b > a + 100 for a, b in itertools.pairwise(ttft_off)), ttft_off
    # On: each later turn is served its predecessor's prompt and answer, so its cached
    # share rises and only its new ~3,000 tokens are computed (about 210, 230 and 250 ms
    # against turn 1's cold 407 ms and the uncached turns' 610-1,070 ms).
    share = [c / p for _, p, c in on]
    assert share[0] == 0 and share[1:] == sorted(share[1:]) and share[1] > 0.6, share
    ttft_on = [t for t, _, _ in on]
    assert ttft_on[0] > 1.25 * max(ttft_on[1:]), ttft_on
    for k in (1, 2, 3):
        assert ttft_on[k] < ttft_off[k] - 200, (k, ttft_on, ttft_off)


def test_ttft_falls_as_the_cached_share_rises(start_sim: StartSim) -> None:
    sim = start_sim(*MODEL)
    base, other = prompt_ids(8000, salt=77), prompt_ids(8000, salt=78)
    sim.json("POST", LLAMA, {"prompt": base, "n_predict": 1})  # caches base's 500 blocks
    got = []
    for cached in (0, 4000, 7200):
        prompt = base[:cached] + other[cached:]
        body = {"prompt": prompt, "n_predict": 2, "stream": True, "ignore_eos": True}
        ttft, final = _ttft_ms(sim, LLAMA, body)
        assert final["timings"]["cache_n"] == cached
        got.append(ttft)
    # the model: 472, 256 and 60 ms
    assert got[0] > got[1] + 100 > got[2] + 200, got


def test_without_the_cache_a_repeated_prompt_pays_its_whole_prefill(
    start_sim: StartSim,
) -> None:
    on, off = start_sim(*MODEL), start_sim(*MODEL, *CACHE_OFF)
    body = {"prompt": prompt_ids(8000, salt=5), "n_predict": 2, "stream": True}
    for sim in (on, off):
        sim.json("POST", LLAMA, {**body, "stream": False})
    ttft_on, final_on = _ttft_ms(on, LLAMA, body)
    ttft_off, final_off = _ttft_ms(off, LLAMA, body)
    assert final_on["timings"]["cache_n"] == 7984 and final_off["timings"]["cache_n"] == 0
    # 472 ms of prefill against 9 ms
    assert ttft_off > ttft_on + 300, (ttft_on, ttft_off)
