"""The qwen3 profile's reasoning phase: how each endpoint streams it and counts it, and
the proof that the other profiles' output did not move."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from calculet_sim.tokens import (
    EOS,
    SPECIAL_TOKENS,
    OutputModel,
    TextOut,
    Tokenizer,
    key_of,
    token_hash,
)
from tests.support.simhelpers import CHAT, COMPLETIONS, LLAMA
from tests.support.simproc import SimProcess

StartSim = Callable[..., SimProcess]
FAST = ("--time-scale", "0.01")
QWEN3 = ("--profile", "qwen3", *FAST)
PROMPT = "The quick brown fox jumps over the lazy dog"
MSGS = [{"role": "user", "content": PROMPT}]


# ------------------------------------------------------- the other profiles' output
def test_the_default_profiles_output_is_unchanged(fast_sim: SimProcess) -> None:
    """Hashes taken from the simulator before the reasoning tags existed: adding a special
    token to every vocabulary would move every word id, and fail all three."""
    _, whole = fast_sim.json("POST", LLAMA, {"prompt": PROMPT, "n_predict": 24, "ignore_eos": True})
    assert token_hash(whole["tokens"]) == (
        "5beb871033106a1c6f1f89b3665bcae36e21194e38c49b8dfcd7f5c8c03f23e6"
    )
    body = {"messages": MSGS, "max_tokens": 24, "ignore_eos": True}
    _, chat = fast_sim.json("POST", CHAT, body)
    text = chat["choices"][0]["message"]["content"]
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "8dcdf20d9264b305ec82feb10379fa0efb4598ba74db455c9868069ca7c37d56"
    )
    assert "reasoning_content" not in chat["choices"][0]["message"]
    assert "completion_tokens_details" not in chat["usage"]
    body = {"prompt": list(range(300, 340)), "max_tokens": 24, "ignore_eos": True}
    _, comp = fast_sim.json("POST", COMPLETIONS, body)
    assert hashlib.sha256(comp["choices"][0]["text"].encode()).hexdigest() == (
        "c0c6f89b89649ea59594c556932392d0dadf2943fed743f40cbdee123551390d"
    )


def test_only_a_reasoning_vocabulary_has_the_tags() -> None:
    plain, thinking = Tokenizer(32_000), Tokenizer(32_000, reasoning=True)
    assert plain.think_ids is None
    assert thinking.think_ids == (31_992, 31_993)
    # the chat template's ids are the same in both; the word range shrinks by the tags
    for name in SPECIAL_TOKENS:
        assert plain.special(name) == thinking.special(name)
    assert plain.words - thinking.words == 2
    assert thinking.piece(31_992) == b"<think>" and thinking.piece(31_993) == b"</think>"
    assert thinking.special("<think>") is None  # not a chat-template token


def _model(reasoning: int, eos: float = 0.0) -> tuple[Tokenizer, OutputModel]:
    tok = Tokenizer(32_000, reasoning=True)
    key = key_of(tok.encode(PROMPT))
    return tok, OutputModel(key, tok.words, 0.5, eos, False, reasoning, tok.think_ids)


def test_the_reasoning_phase_is_tags_around_whole_words() -> None:
    tok, model = _model(10, eos=0.5)
    assert tok.think_ids is not None
    start, end = tok.think_ids
    ids = [model.token_at(i) for i in range(10)]
    assert ids[0] == start and ids[-1] == end and model.reasoning == 10
    # thoughts: words only (no byte tokens a character could span the tag with, no EOS)
    assert all(t >= 259 and t not in (start, end) for t in ids[1:-1])
    after = [model.token_at(i) for i in range(10, 60)]
    assert EOS in after  # the answer may stop; the thoughts may not
    _, none = _model(1)
    assert none.reasoning == 0  # a phase needs its two tags


def test_text_out_separates_or_inlines_the_thoughts() -> None:
    tok, model = _model(6)
    ids = [model.token_at(i) for i in range(12)]
    sep = TextOut(tok, holdback=True, separate=True)
    said, answer = sep.whole(ids)
    assert sep.reasoning_tokens == 6
    assert said.count(" ") == 4 and "<think>" not in said  # four thoughts
    inline = TextOut(tok, holdback=True, separate=False)
    said_inline, text = inline.whole(ids)
    assert said_inline == "" and inline.reasoning_tokens == 6
    assert text == "<think>" + said + "</think>" + answer
    # a tag alone makes no text when separate: it rides with the next token
    sep2 = TextOut(tok, holdback=True, separate=True)
    assert sep2.feed(ids[:1]) == ("", "")
    assert sep2.feed(ids[1:2])[0] != "" and sep2.reasoning_tokens == 2


# ----------------------------------------------------------- the qwen3 simulator
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    sim = SimProcess(tmp_path_factory.mktemp("qwen3"), *QWEN3)
    yield sim
    sim.stop()


def _stream_chat(sim: SimProcess, max_tokens: int, **kw: Any) -> list[dict[str, Any]]:
    body = {
        "messages": MSGS,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **kw,
    }
    s = sim.stream(CHAT, body)
    assert s.status == 200, s.raw[:300]
    return s.json_events()


def test_separate_reasoning_streams_reasoning_content_then_content(qwen3: SimProcess) -> None:
    chunks = _stream_chat(qwen3, 40)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:] if c["choices"]][:-1]  # no finish
    kinds = ["reasoning" if "reasoning_content" in d else "answer" for d in deltas]
    # all thoughts first, then the answer: one switch
    n_thought = kinds.index("answer")
    assert n_thought > 0 and set(kinds[n_thought:]) == {"answer"}
    assert all(set(d) == {"reasoning_content"} for d in deltas[:n_thought])
    assert all(set(d) == {"content"} and d["content"] for d in deltas[n_thought:])
    said = "".join(d["reasoning_content"] for d in deltas[:n_thought])
    answer = "".join(d["content"] for d in deltas[n_thought:])
    assert "<think>" not in said + answer and "</think>" not in said + answer
    # 20 tokens of reasoning (half of max_tokens; the profile's 256 is more), tags in
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 40
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 20}
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    # per-chunk usage: the reasoning count rises to 20 in the thoughts, then holds
    counts = [
        (
            c["usage"]["completion_tokens"],
            c["usage"]["completion_tokens_details"]["reasoning_tokens"],
        )
        for c in chunks[1:]
    ]
    assert [r for n, r in counts if n <= 20] == [n for n, r in counts if n <= 20]
    assert {r for n, r in counts if n > 20} == {20}
    # the first thought's chunk carries <think> too: 2 tokens
    assert counts[0] == (2, 2)
    # the whole response carries the same, apart
    body = {"messages": MSGS, "max_tokens": 40, "ignore_eos": True}
    _, whole = qwen3.json("POST", CHAT, body)
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == said and message["content"] == answer
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 20}


def test_inline_reasoning_is_in_the_content(start_sim: StartSim) -> None:
    sim = start_sim(*QWEN3, "--set", "reasoning.format=inline", "--set", "reasoning.tokens=8")
    chunks = _stream_chat(sim, 40)
    deltas = [c["choices"][0]["delta"] for c in chunks[1:] if c["choices"]][:-1]
    assert all(set(d) == {"content"} for d in deltas)
    text = "".join(d["content"] for d in deltas)
    assert text.startswith("<think>") and text.count("</think>") == 1
    thoughts, answer = text.removeprefix("<think>").split("</think>")
    assert len(thoughts.split()) == 6 and answer
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    _, whole = sim.json("POST", CHAT, {"messages": MSGS, "max_tokens": 40, "ignore_eos": True})
    assert whole["choices"][0]["message"]["content"] == text
    assert "reasoning_content" not in whole["choices"][0]["message"]


def test_completions_and_llama_carry_the_thoughts_inline(qwen3: SimProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = qwen3.stream(COMPLETIONS, body).json_events()
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text.startswith("<think>") and text.count("</think>") == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    events = qwen3.stream(LLAMA, {"prompt": PROMPT, "n_predict": 16, "stream": True,
                                  "ignore_eos": True}).json_events()  # fmt: skip
    content = "".join(e["content"] for e in events)
    assert content == text  # the same prompt ids, the same output
    assert events[0]["content"] == "<think>"
    assert events[-1]["tokens_predicted"] == 16
    assert "completion_tokens_details" not in events[-1]  # llama.cpp does not count them


def test_reasoning_length_is_bounded_by_tokens_and_share(start_sim: StartSim) -> None:
    sim = start_sim(*QWEN3, "--set", "reasoning.tokens=12", "--set", "reasoning.max_share=1")
    body = {"messages": MSGS, "ignore_eos": True}
    for max_tokens, reasoning in ((40, 12), (12, 12), (5, 5)):
        _, whole = sim.json("POST", CHAT, {**body, "max_tokens": max_tokens})
        usage = whole["usage"]
        assert usage["completion_tokens"] == max_tokens
        assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning}
        message = whole["choices"][0]["message"]
        assert bool(message["content"]) == (max_tokens > reasoning)
        assert len(message["reasoning_content"].split()) == reasoning - 2
    # thinking off, as vLLM's chat_template_kwargs say it
    off = {**body, "max_tokens": 6, "chat_template_kwargs": {"enable_thinking": False}}
    _, whole = sim.json("POST", CHAT, off)
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert whole["choices"][0]["message"]["reasoning_content"] is None
    status, bad = sim.json("POST", CHAT, {**off, "chat_template_kwargs": {"enable_thinking": 1}})
    assert status == 400
    assert bad["error"]["message"].startswith("chat_template_kwargs.enable_thinking")


def test_a_qwen3_turn_hits_the_turn_before(qwen3: SimProcess) -> None:
    """A client sends back the answer (the content) only: that is what is cached."""
    msgs = [{"role": "user", "content": "Why is the sea blue? " * 10}]
    chunks = _stream_chat(qwen3, 60, messages=msgs)
    answer = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    answered = [*msgs, {"role": "assistant", "content": answer}]
    _, count = qwen3.json("POST", "/tokenize", {"messages": answered})
    turn2 = [*answered, {"role": "user", "content": "And the sky?"}]
    _, whole = qwen3.json("POST", CHAT, {"messages": turn2, "max_tokens": 4})
    assert (
        whole["usage"]["prompt_tokens_details"]["cached_tokens"] == (count["count"] - 3) // 16 * 16
    )
