"""Protocol adapters on hand-written events: what counts as a token, and what does not."""

from __future__ import annotations

import json

import pytest

from calculet_load.measure.connections import Endpoint
from calculet_load.measure.exchange import prepare
from calculet_load.measure.protocols import CountState, ProtocolError, adapter_for

CHAT = adapter_for("openai-chat")
COMPLETIONS = adapter_for("openai-completions")
LLAMA = adapter_for("llama")


def chat_chunk(content: str | None = None, usage: int | None = None, **extra: object) -> str:
    delta = {"role": "assistant"} if content is None else {"content": content}
    obj: dict[str, object] = {"choices": [{"index": 0, "delta": delta, **extra}]}
    if usage is not None:
        obj["usage"] = {"prompt_tokens": 5, "completion_tokens": usage, "total_tokens": 5 + usage}
    return json.dumps(obj)


def test_role_only_and_usage_only_events_carry_no_token() -> None:
    state = CountState()
    role = CHAT.event(chat_chunk(None, usage=0), state)
    assert role.tokens == 0 and not role.done
    two = CHAT.event(chat_chunk("ab", usage=2), state)
    assert two.tokens == 2 and two.cumulative == 2 and two.text == "ab"
    summary = CHAT.event(json.dumps({"choices": [], "usage": {"completion_tokens": 2}}), state)
    assert summary.tokens == 0 and summary.final_total == 2
    assert CHAT.event("[DONE]", state).done
    assert state.source == "usage"


def test_without_usage_content_chunks_are_counted_and_flagged() -> None:
    state = CountState()
    for piece in ("a", "b", "c"):
        assert COMPLETIONS.event(json.dumps({"choices": [{"text": piece}]}), state).tokens == 1
    assert state.source == "chunks"
    final = COMPLETIONS.event(json.dumps({"choices": [], "usage": {"completion_tokens": 4}}), state)
    assert final.final_total == 4  # the reconciliation will show the mismatch


def test_without_usage_a_local_tokenizer_counts_each_events_text() -> None:
    for adapter, event in (
        (COMPLETIONS, lambda piece: json.dumps({"choices": [{"text": piece}]})),
        (CHAT, lambda piece: chat_chunk(piece)),
        (LLAMA, lambda piece: json.dumps({"content": piece})),
    ):
        state = CountState(count_text=lambda text: len(text.split()))
        counts = [adapter.event(event(p), state).tokens for p in ("a b", "c", "d e f")]
        assert counts == [2, 1, 3], adapter.name
        assert state.source == "tokenizer" and state.cumulative == 6
    # a per-event count from the server wins over the tokenizer
    state = CountState(count_text=lambda text: 99)
    assert LLAMA.event(json.dumps({"content": "x", "tokens_predicted": 1}), state).tokens == 1
    assert state.source == "tokens_predicted"


def test_a_count_that_goes_back_is_a_protocol_violation() -> None:
    state = CountState()
    LLAMA.event(json.dumps({"content": "x", "tokens_predicted": 3}), state)
    with pytest.raises(ProtocolError) as exc:
        LLAMA.event(json.dumps({"content": "y", "tokens_predicted": 2}), state)
    assert exc.value.error_class == "protocol_violation"


def test_llama_stop_event_gives_total_timings_and_finish() -> None:
    state = CountState()
    LLAMA.event(json.dumps({"content": "x", "tokens_predicted": 2, "stop": False}), state)
    stop = LLAMA.event(
        json.dumps(
            {
                "content": "",
                "stop": True,
                "stop_type": "limit",
                "tokens_predicted": 2,
                "tokens_evaluated": 9,
                "timings": {"predicted_n": 2, "prompt_ms": 1.5},
            }
        ),
        state,
    )
    assert stop.done and stop.tokens == 0 and stop.final_total == 2
    assert stop.finish_reason == "length" and stop.prompt_tokens == 9
    assert stop.timings == {"predicted_n": 2, "prompt_ms": 1.5}


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_detected(value: str) -> None:
    data = '{"content": "x", "tokens_predicted": 1, "p": ' + value + "}"
    info = LLAMA.event(data, CountState())
    assert info.nonfinite


def test_whole_response_counts_from_usage_or_says_it_cannot() -> None:
    body = {"choices": [{"message": {"content": "hi"}, "finish_reason": "length"}]}
    counted = CHAT.whole(json.dumps({**body, "usage": {"completion_tokens": 3}}).encode())
    assert counted.tokens == 3 and counted.count_source == "usage"
    missing = CHAT.whole(json.dumps(body).encode())
    assert missing.tokens == 0 and missing.count_source == "missing"
    llama = LLAMA.whole(json.dumps({"content": "hi", "tokens_predicted": 4, "stop": True}).encode())
    assert llama.tokens == 4 and llama.count_source == "tokens_predicted"


@pytest.mark.parametrize(
    ("data", "error_class"),
    [
        ("{not json", "invalid_json"),
        ("[1, 2]", "protocol_violation"),
        ('{"choices": {}}', "protocol_violation"),
        ('{"choices": [], "usage": {"completion_tokens": -1}}', "value_out_of_range"),
        (
            '{"choices": [], "usage": {"completion_tokens": 9223372036854775808}}',
            "value_out_of_range",
        ),
    ],
)
def test_bad_events_raise_classified_errors(data: str, error_class: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        CHAT.event(data, CountState())
    assert exc.value.error_class == error_class


def test_error_event_is_reported_not_raised() -> None:
    info = CHAT.event(
        json.dumps({"error": {"type": "overloaded", "message": "busy"}}), CountState()
    )
    assert info.error == "busy" and info.error_type == "overloaded"


def test_bodies_ask_for_usage_on_every_chunk_and_exact_ids() -> None:
    body = COMPLETIONS.body(
        [1, 2, 3], 8, stream=True, model="m", temperature=0.0, seed=7, ignore_eos=True
    )
    assert body["prompt"] == [1, 2, 3] and body["seed"] == 7 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    llama = LLAMA.body(
        [4, 5], 2, stream=False, model=None, temperature=0.5, seed=None, ignore_eos=False
    )
    assert llama["n_predict"] == 2 and llama["cache_prompt"] is False and "seed" not in llama
    with pytest.raises(ValueError, match="text prompt"):
        CHAT.body([1], 1, stream=True, model=None, temperature=0, seed=None, ignore_eos=False)


@pytest.mark.parametrize(
    ("prompt", "same_bytes"),
    [
        (list(range(1000, 1128)), True),  # token ids: the bytes json writes
        ("plain words " * 40, True),
        ("caf\u00e9 \u6f22\u5b57 \U0001f600", False),  # UTF-8 on the wire, not \u escapes
        ("lone \ud800 surrogate", True),  # no UTF-8 for it: json's escape, as before
    ],
)
def test_the_request_body_is_the_same_json(prompt: object, same_bytes: bool) -> None:
    a = adapter_for("openai-completions")
    body = a.body(prompt, 64, stream=True, model="m", temperature=0.7, seed=3,  # type: ignore[arg-type]
                  ignore_eos=True)  # fmt: skip
    _, headers, payload = prepare(Endpoint("http://127.0.0.1:9"), a, body, "r-1", True, None)
    assert json.loads(payload) == body
    assert (payload == json.dumps(body, separators=(",", ":")).encode()) is same_bytes
    assert dict(headers)["Content-Length"] == str(len(payload))
