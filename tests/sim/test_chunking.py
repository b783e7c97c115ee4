"""Events are not tokens: k tokens per event, and UTF-8 hold-back merges events."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.simhelpers import CHAT, COMPLETIONS, LLAMA, prompt_ids
from tests.support.simproc import SimProcess

FFFD = "\ufffd"


def _stream(sim: SimProcess, path: str, n: int, salt: int = 0) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"stream": True, "ignore_eos": True}
    if path == LLAMA:
        body |= {"prompt": prompt_ids(10, salt), "n_predict": n}
    else:
        body |= {"max_tokens": n, "stream_options": {"continuous_usage_stats": True}}
        if path == CHAT:
            body["messages"] = [{"role": "user", "content": f"chunking test {salt}"}]
        else:
            body["prompt"] = prompt_ids(10, salt)
    s = sim.stream(path, body)
    assert s.status == 200
    return s.json_events()


def _counts(path: str, events: list[dict[str, Any]]) -> list[int]:
    """Cumulative output tokens the server reported, per content-bearing event."""
    if path == LLAMA:
        return [e["tokens_predicted"] for e in events if not e["stop"]]
    key = "delta" if path == CHAT else "text"
    out = []
    for e in events:
        ch = e["choices"]
        if ch and ch[0]["finish_reason"] is None:
            payload = ch[0][key]
            if (payload.get("content") if key == "delta" else payload) is not None:
                out.append(e["usage"]["completion_tokens"])
    return out


def _texts(path: str, events: list[dict[str, Any]]) -> list[str]:
    if path == LLAMA:
        return [e["content"] for e in events if not e["stop"]]
    if path == CHAT:
        return [
            e["choices"][0]["delta"]["content"]
            for e in events
            if e["choices"] and e["choices"][0]["delta"].get("content") is not None
        ]
    return [e["choices"][0]["text"] for e in events if e["choices"] and
            e["choices"][0]["finish_reason"] is None]  # fmt: skip


@pytest.mark.parametrize("path", [LLAMA, CHAT, COMPLETIONS])
def test_three_tokens_per_event(start_sim: Callable[..., SimProcess], path: str) -> None:
    sim = start_sim(
        "--time-scale", "0.005",
        "--set", "output.tokens_per_event=3",
        "--set", "output.multibyte_rate=0",
    )  # fmt: skip
    events = _stream(sim, path, 11)
    counts = _counts(path, events)
    # 11 = 3 + 3 + 3 + a final partial group of 2.
    assert counts == [3, 6, 9, 11]
    if path == LLAMA:
        assert [len(e["tokens"]) for e in events if not e["stop"]] == [3, 3, 3, 2]
        assert events[-1]["tokens_predicted"] == 11


def test_utf8_holdback_merges_events(start_sim: Callable[..., SimProcess]) -> None:
    sim = start_sim("--time-scale", "0.005", "--set", "output.multibyte_rate=0.4")
    n = 80
    for path in (LLAMA, CHAT, COMPLETIONS):
        for salt in range(2):
            events = _stream(sim, path, n, salt)
            counts = _counts(path, events)
            texts = _texts(path, events)
            assert counts[-1] == n  # the client's count from server fields is exact
            assert len(counts) < n  # events < tokens
            jumps = [b - a for a, b in itertools.pairwise([0, *counts])]
            assert all(j >= 1 for j in jumps)
            assert max(jumps) >= 2
            assert all(texts), "no empty content event: a held token waits for the next"
            assert not any(FFFD in t for t in texts[:-1]), texts
            if path == LLAMA:
                # After a held-back token the event lists only the newer token.
                merged = [e for e, j in zip(events, jumps, strict=False) if j > 1]
                assert merged and all(len(e["tokens"]) == 1 for e in merged)
            # The streamed text is the whole response's text.
            body: dict[str, Any]
            if path == LLAMA:
                body = {"prompt": prompt_ids(10, salt), "n_predict": n, "ignore_eos": True}
                whole = sim.json("POST", path, body)[1]["content"]
            elif path == CHAT:
                msgs = [{"role": "user", "content": f"chunking test {salt}"}]
                body = {"messages": msgs, "max_tokens": n, "ignore_eos": True}
                whole = sim.json("POST", path, body)[1]["choices"][0]["message"]["content"]
            else:
                body = {"prompt": prompt_ids(10, salt), "max_tokens": n, "ignore_eos": True}
                whole = sim.json("POST", path, body)[1]["choices"][0]["text"]
            assert "".join(texts) == whole
            assert any(ord(c) > 0x2FFF for c in whole)  # multi-byte characters made it


def test_no_holdback_emits_replacement_chars(start_sim: Callable[..., SimProcess]) -> None:
    sim = start_sim(
        "--time-scale", "0.005",
        "--set", "output.multibyte_rate=0.4",
        "--set", "output.utf8_holdback=false",
    )  # fmt: skip
    events = _stream(sim, LLAMA, 60)
    counts = _counts(LLAMA, events)
    assert counts == list(range(1, 61))  # one event per token
    texts = _texts(LLAMA, events)
    assert sum(FFFD in t for t in texts[:-1]) >= 3


def test_large_and_tiny_outputs_count_exactly(fast_sim: SimProcess) -> None:
    for path in (LLAMA, CHAT, COMPLETIONS):
        for n in (1, 2, 257):
            counts = _counts(path, _stream(fast_sim, path, n, salt=n))
            assert counts[-1] == n, (path, n)
