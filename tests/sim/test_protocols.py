"""Wire formats of every endpoint (DESIGN §3.1), compared with the real llama.cpp captures."""

from __future__ import annotations

import itertools
import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SHARED
from tests.support.simhelpers import CHAT, COMPLETIONS, LLAMA, prompt_ids
from tests.support.simproc import SimProcess

CAPTURES = SHARED / "protocol-samples" / "llama.cpp"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers of Europe."},
]


def _capture(name: str) -> list[Any]:
    lines = (CAPTURES / name).read_text(encoding="utf-8").splitlines()
    data = [x.removeprefix("data: ") for x in lines if x.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def _data(raw: bytes) -> list[str]:
    """The `data:` payloads of a stream, in order (every event here is one data line)."""
    blocks = [b for b in raw.decode().split("\n\n") if b]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks[:3]
    return [b.removeprefix("data: ") for b in blocks]


def _is_subsequence(small: list[str], big: list[str]) -> bool:
    it = iter(big)
    return all(k in it for k in small)


def test_chat_stream_events(fast_sim: SimProcess) -> None:
    body = {"messages": MESSAGES, "max_tokens": 5, "stream": True, "ignore_eos": True}
    s = fast_sim.stream(CHAT, body, headers={"X-Request-Id": "proto-chat-1"})
    assert s.status == 200
    assert s.headers["content-type"].startswith("text/event-stream")
    assert s.headers["x-request-id"] == "proto-chat-1"
    data = _data(s.raw)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    first, contents, finish = chunks[0], chunks[1:-1], chunks[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert first["choices"][0]["finish_reason"] is None
    # One chunk per token, except that a token ending inside a UTF-8 character is
    # merged into the next chunk.
    assert 1 <= len(contents) <= 5
    assert all(c["choices"][0]["delta"]["content"] for c in contents)
    _, whole = fast_sim.json("POST", CHAT, {**body, "stream": False})
    text = "".join(c["choices"][0]["delta"]["content"] for c in contents)
    assert text == whole["choices"][0]["message"]["content"]
    assert all(c["choices"][0]["finish_reason"] is None for c in contents)
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)  # not asked for
    assert len({c["id"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    real = _capture("chat-stream-no-usage.sse")
    for ours, theirs in ((first, real[0]), (contents[0], real[1]), (finish, real[-2])):
        assert set(theirs) - {"timings"} <= set(ours), (sorted(theirs), sorted(ours))
        assert set(theirs["choices"][0]) <= set(ours["choices"][0])


def test_chat_stream_include_usage(fast_sim: SimProcess) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    fast_sim.json("POST", CHAT, {"messages": MESSAGES, "max_tokens": 1})
    data = _data(fast_sim.stream(CHAT, body).raw)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    _, count = fast_sim.json("POST", "/tokenize", {"messages": MESSAGES})
    # the simulator has seen these messages just before: its prefix cache serves their
    # whole blocks, but never the prompt's last token
    cached = (count["count"] - 1) // 16 * 16
    assert usage_chunk["usage"] == {
        "prompt_tokens": count["count"],
        "completion_tokens": 4,
        "total_tokens": count["count"] + 4,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks[:-1])
    real = _capture("chat-stream.sse")[-2]
    assert set(real) - {"timings"} <= set(usage_chunk)
    assert set(real["usage"]) <= set(usage_chunk["usage"])


def test_chat_stream_continuous_usage(fast_sim: SimProcess) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 6,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = fast_sim.stream(CHAT, body).json_events()
    used = [c["usage"]["completion_tokens"] for c in chunks]
    # role chunk 0, then cumulative per content chunk (a held-back token makes a jump
    # of 2 or more), then the finish chunk and the usage chunk repeat the total.
    assert used[0] == 0 and used[-3:] == [6, 6, 6]
    assert all(b > a for a, b in itertools.pairwise(used[:-2])), used
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt) == 1
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n
        for c, n in zip(chunks, used, strict=True)
    )


def test_completions_stream_text_prompt(fast_sim: SimProcess) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 3, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    data = _data(fast_sim.stream(COMPLETIONS, body).raw)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    texts = [c["choices"][0]["text"] for c in chunks[:-2]]
    assert 1 <= len(texts) <= 3 and all(texts)
    _, whole = fast_sim.json("POST", COMPLETIONS, {**body, "stream": False})
    assert "".join(texts) == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"][0]["text"] == ""
    assert chunks[-1]["choices"] == []
    _, tok = fast_sim.json("POST", "/tokenize", {"content": "The capital of France is"})
    assert chunks[-1]["usage"]["prompt_tokens"] == tok["count"] == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    real = _capture("v1-completions-stream.sse")
    assert set(real[0]) <= set(chunks[0])
    assert set(real[0]["choices"][0]) == set(chunks[0]["choices"][0])


def test_completions_token_id_prompt_matches_text_prompt(fast_sim: SimProcess) -> None:
    text = "Once upon a time in a land far away"
    _, tok = fast_sim.json("POST", "/tokenize", {"prompt": text})
    by_text = fast_sim.json("POST", COMPLETIONS, {"prompt": text, "max_tokens": 6})[1]
    by_ids = fast_sim.json("POST", COMPLETIONS, {"prompt": tok["tokens"], "max_tokens": 6})[1]
    assert by_ids["usage"] == by_text["usage"]
    assert by_ids["usage"]["prompt_tokens"] == tok["count"] == 9
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["object"] == "text_completion"


def test_llama_stream_events_match_capture(fast_sim: SimProcess) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 7, "stream": True}
    data = _data(fast_sim.stream(LLAMA, body).raw)
    assert "[DONE]" not in data
    events = [json.loads(d) for d in data]
    real = _capture("completion-stream.sse")
    for e in events[:-1]:
        assert list(e) == list(real[0])  # same keys, same order
        assert e["stop"] is False
        assert e["tokens_evaluated"] == 4
    assert [e["tokens_predicted"] for e in events[:-1]] == list(range(1, 8))
    assert all(len(e["tokens"]) == 1 for e in events[:-1])
    last = events[-1]
    assert last["stop"] is True
    assert last["tokens_predicted"] == 7 and last["tokens"] == [] and last["content"] == ""
    assert last["stop_type"] == "limit"
    assert _is_subsequence(list(last), list(real[-1])), (list(last), list(real[-1]))
    assert list(last["timings"]) == list(real[-1]["timings"])
    assert last["timings"]["predicted_n"] == 7 and last["timings"]["prompt_n"] == 4


def test_llama_non_stream(fast_sim: SimProcess) -> None:
    ids = prompt_ids(12)
    status, body = fast_sim.json("POST", LLAMA, {"prompt": ids, "n_predict": 5,
                                                 "ignore_eos": True})  # fmt: skip
    assert status == 200
    assert body["stop"] is True and body["tokens_predicted"] == 5
    assert body["tokens_evaluated"] == 12 and len(body["tokens"]) == 5
    assert body["timings"]["predicted_n"] == 5
    real_last = _capture("completion-stream.sse")[-1]
    assert _is_subsequence(list(body), list(real_last)), list(body)


def test_openai_non_stream(fast_sim: SimProcess) -> None:
    status, chat = fast_sim.json("POST", CHAT, {"messages": MESSAGES, "max_tokens": 4})
    assert status == 200
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["message"]["content"]
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == 4


def test_tokenize_counts_match_generation(fast_sim: SimProcess) -> None:
    text = "  spaced   words and averyveryverylongword too"
    _, by_content = fast_sim.json("POST", "/tokenize", {"content": text})
    _, by_prompt = fast_sim.json("POST", "/tokenize", {"prompt": text})
    assert by_content == by_prompt
    assert by_content["count"] == len(by_content["tokens"])
    gen = fast_sim.stream(LLAMA, {"prompt": text, "n_predict": 1, "stream": True})
    assert gen.json_events()[-1]["tokens_evaluated"] == by_content["count"]
    _, chat_tok = fast_sim.json("POST", "/tokenize", {"messages": MESSAGES})
    _, chat = fast_sim.json("POST", CHAT, {"messages": MESSAGES, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == chat_tok["count"] == len(chat_tok["tokens"])


def test_health_models_and_request_id(fast_sim: SimProcess) -> None:
    assert fast_sim.json("GET", "/health") == (200, {"status": "ok", "state": "ready"})
    status, models = fast_sim.json("GET", "/v1/models")
    assert status == 200 and models["object"] == "list"
    assert models["data"][0]["id"] and models["data"][0]["max_model_len"] == 40960
    status, headers, _ = fast_sim.request(
        "POST", "/tokenize", {"content": "x"}, headers={"X-Request-Id": "tok-1"}
    )
    assert status == 200 and headers["x-request-id"] == "tok-1"
    status, headers, _ = fast_sim.request(
        "POST", LLAMA, {"prompt": "hi", "n_predict": 2}, headers={"X-Request-Id": "whole-1"}
    )
    assert status == 200 and headers["x-request-id"] == "whole-1"
    # Without one, the server names the request itself.
    status, headers, _ = fast_sim.request("POST", LLAMA, {"prompt": "hi", "n_predict": 1})
    assert status == 200 and headers["x-request-id"]


def test_request_id_in_every_trace_row(fast_sim: SimProcess) -> None:
    rid = "proto-trace-7"
    fast_sim.stream(LLAMA, {"prompt": "abc def", "n_predict": 3, "stream": True,
                            "ignore_eos": True}, headers={"X-Request-Id": rid})  # fmt: skip
    events = [r for r in fast_sim.traces("server_events") if r["request_id"] == rid]
    steps = [r for r in fast_sim.traces("steps") if r["request_id"] == rid]
    assert len(steps) == 3
    assert [r["step"] for r in steps] == [0, 1, 2]
    seq_ids = {r["seq_id"] for r in events + steps}
    assert len(seq_ids) == 1
    # every row of that sequence carries the request id
    all_rows = fast_sim.traces("server_events") + fast_sim.traces("steps")
    assert all(r["request_id"] == rid for r in all_rows if r.get("seq_id") in seq_ids)
    assert {e["event"] for e in events} >= {"accepted", "admitted", "finished", "token_flushed"}


def test_metrics_families(fast_sim: SimProcess) -> None:
    fast_sim.stream(LLAMA, {"prompt": "warm", "n_predict": 2, "stream": True})
    status, headers, raw = fast_sim.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    runtime = {
        "calculet_jobs_in_flight", "calculet_jobs_pending", "calculet_jobs_finished",
        "calculet_requests_queued", "calculet_sequences_active", "calculet_slots_in_use",
        "calculet_kv_allocated_tokens", "calculet_kv_free_tokens", "calculet_kv_waits",
        "calculet_kv_rejects", "calculet_buffer_pool_total", "calculet_buffer_pool_free",
        "calculet_buffer_pool_leased", "calculet_buffer_pool_quarantine",
        "calculet_buffer_pool_waits", "calculet_runtime_phase_ms",
        "calculet_sequence_length_tokens", "calculet_ccu_exceptions",
        "calculet_runtime_timeouts", "calculet_runtime_busy", "calculet_resets",
        "calculet_generation_changes", "calculet_requests_rejected", "calculet_state",
        "calculet_chip_temperature_c", "calculet_chip_power_w", "calculet_chip_frequency_mhz",
        "calculet_process_rss_bytes", "calculet_process_open_fds",
    }  # fmt: skip
    assert runtime <= set(families), sorted(runtime - set(families))
    phases = {
        s.labels["phase"]
        for s in families["calculet_runtime_phase_ms"].samples
        if s.name.endswith("_count") and s.value > 0
    }
    assert phases == {"h2d", "infer", "d2h"}
    chips = {s.labels["chip"] for s in families["calculet_chip_temperature_c"].samples}
    assert chips == {"0", "1"}
    finished = families["calculet_jobs_finished"].samples[0].value
    assert finished >= 2


def test_trace_endpoint_unknown_kind_and_bad_offset(fast_sim: SimProcess) -> None:
    status, body = fast_sim.json("GET", "/traces/nope")
    assert status == 404 and "nope" in body["error"]["message"]
    status, body = fast_sim.json("GET", "/traces/steps?offset=x")
    assert status == 400 and "offset" in body["error"]["message"]
