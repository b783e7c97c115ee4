"""Greedy output is a pure function of the prompt; seeded sampling is reproducible."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from calculet_sim.tokens import token_hash
from tests.support.simhelpers import CHAT, COMPLETIONS, LLAMA, llama, llama_ids, prompt_ids
from tests.support.simproc import SimProcess

PROMPT = "The quick brown fox jumps over the lazy dog"


def _greedy(sim: SimProcess, prompt: Any, n: int = 24, **kw: Any) -> list[int]:
    """All output ids (non-streaming: a streamed event drops the ids of held-back tokens)."""
    body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, **kw}
    status, whole = sim.json("POST", LLAMA, body)
    assert status == 200, whole
    assert whole["tokens_predicted"] == len(whole["tokens"]) == n
    ids: list[int] = whole["tokens"]
    return ids


def _is_subsequence(small: list[int], big: list[int]) -> bool:
    it = iter(big)
    return all(x in it for x in small)


def _text(sim: SimProcess, prompt: Any, n: int) -> str:
    _, whole = sim.json("POST", LLAMA, {"prompt": prompt, "n_predict": n, "ignore_eos": True})
    text: str = whole["content"]
    return text


def test_greedy_same_prompt_same_tokens(fast_sim: SimProcess) -> None:
    a = _greedy(fast_sim, PROMPT)
    b = _greedy(fast_sim, PROMPT)
    other = _greedy(fast_sim, PROMPT + " again")
    assert a == b
    assert token_hash(a) == token_hash(b)
    assert a != other
    # Streaming gives the same ids, except that an event after a held-back token lists
    # only the newer token (llama.cpp does the same).
    events = llama(fast_sim, PROMPT, 24).json_events()
    streamed = llama_ids(events)
    assert events[-1]["tokens_predicted"] == 24
    assert _is_subsequence(streamed, a) and len(streamed) >= 12
    assert "".join(e["content"] for e in events) == _text(fast_sim, PROMPT, 24)
    # Token-id prompt == the same prompt as text.
    _, tok = fast_sim.json("POST", "/tokenize", {"content": PROMPT})
    assert _greedy(fast_sim, tok["tokens"]) == a


def test_greedy_same_across_protocols(fast_sim: SimProcess) -> None:
    body: dict[str, Any] = {"max_tokens": 12, "ignore_eos": True}
    msgs = [{"role": "user", "content": PROMPT}]
    _, chat = fast_sim.json("POST", CHAT, {**body, "messages": msgs})
    _, tok = fast_sim.json("POST", "/tokenize", {"messages": msgs})
    # The chat template's token ids, sent as a completions prompt, give the same text.
    _, comp = fast_sim.json("POST", COMPLETIONS, {**body, "prompt": tok["tokens"]})
    assert chat["choices"][0]["message"]["content"] == comp["choices"][0]["text"]
    _, whole = fast_sim.json("POST", LLAMA, {"prompt": tok["tokens"], "n_predict": 12,
                                             "ignore_eos": True})  # fmt: skip
    assert whole["content"] == comp["choices"][0]["text"]
    streamed = fast_sim.stream(COMPLETIONS, {**body, "prompt": PROMPT, "stream": True})
    text = "".join(c["choices"][0]["text"] for c in streamed.json_events() if c["choices"])
    _, plain = fast_sim.json("POST", COMPLETIONS, {**body, "prompt": PROMPT})
    assert text == plain["choices"][0]["text"]


def test_greedy_same_across_restarts_and_seeds(
    start_sim: Callable[..., SimProcess], fast_sim: SimProcess
) -> None:
    expected = _greedy(fast_sim, prompt_ids(40, salt=3), 16)
    other = start_sim("--time-scale", "0.01", "--seed", "7")
    assert _greedy(other, prompt_ids(40, salt=3), 16) == expected


def test_seeded_sampling(fast_sim: SimProcess) -> None:
    greedy = _greedy(fast_sim, PROMPT, 16)
    s1 = _greedy(fast_sim, PROMPT, 16, temperature=0.8, seed=1234)
    s1_again = _greedy(fast_sim, PROMPT, 16, temperature=0.8, seed=1234)
    s2 = _greedy(fast_sim, PROMPT, 16, temperature=0.8, seed=1235)
    assert s1 == s1_again
    assert s1 != s2
    assert s1 != greedy and s2 != greedy
    # Unseeded sampling differs from request to request.
    u1 = _greedy(fast_sim, PROMPT, 16, temperature=0.8)
    u2 = _greedy(fast_sim, PROMPT, 16, temperature=0.8)
    assert u1 != u2


def test_max_tokens_and_ignore_eos(start_sim: Callable[..., SimProcess]) -> None:
    sim = start_sim("--time-scale", "0.005", "--set", "output.eos_probability=0.05")
    reasons = []
    for salt in range(8):
        _, body = sim.json("POST", COMPLETIONS, {"prompt": prompt_ids(8, salt), "max_tokens": 60})
        n = body["usage"]["completion_tokens"]
        reason = body["choices"][0]["finish_reason"]
        assert (reason == "length") == (n == 60), body["usage"]
        assert 0 <= n <= 60
        reasons.append(reason)
        _, forced = sim.json(
            "POST",
            COMPLETIONS,
            {"prompt": prompt_ids(8, salt), "max_tokens": 60, "ignore_eos": True},
        )
        assert forced["usage"]["completion_tokens"] == 60
        assert forced["choices"][0]["finish_reason"] == "length"
        s = sim.stream(LLAMA, {"prompt": prompt_ids(8, salt), "n_predict": 60, "stream": True})
        last = s.json_events()[-1]
        assert last["tokens_predicted"] == n
        assert last["stop_type"] == ("limit" if reason == "length" else "eos")
    # P(no EOS in 60 steps) = 0.95**60 ~ 5%: most requests stop early.
    assert reasons.count("stop") >= 4, reasons
    # eos_probability=0 (the default): every greedy output reaches max tokens.
    plain = start_sim("--time-scale", "0.005")
    for salt in range(3):
        _, body = plain.json("POST", COMPLETIONS, {"prompt": prompt_ids(8, salt),
                                                   "max_tokens": 60})  # fmt: skip
        assert body["usage"]["completion_tokens"] == 60
