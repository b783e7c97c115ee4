"""Bad requests get a 4xx JSON error naming the field, and the simulator keeps serving."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.simhelpers import CHAT, COMPLETIONS, LLAMA
from tests.support.simproc import SimProcess

MSG = [{"role": "user", "content": "hello"}]

# (path, body given as raw bytes or as a JSON value, status, text the message must contain)
CASES: list[tuple[str, Any, int, str]] = [
    (LLAMA, b'{"prompt": "x", ', 400, "body"),
    (LLAMA, b"\xff\xfe{}", 400, "body"),
    (LLAMA, b"[" * 100_000, 400, "body"),
    (LLAMA, b'{"prompt": "x", "n_predict": ' + b"7" * 5000 + b"}", 400, "body"),
    (LLAMA, b"", 400, "body"),
    (LLAMA, [1, 2, 3], 400, "body"),
    (LLAMA, "just a string", 400, "body"),
    (LLAMA, {"n_predict": 4}, 400, "prompt"),
    (LLAMA, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (LLAMA, {"prompt": "x", "n_predict": "5"}, 400, "n_predict"),
    (LLAMA, {"prompt": "x", "n_predict": 2**40}, 400, "n_predict"),
    (LLAMA, {"prompt": "x", "n_predict": 0}, 400, "n_predict"),
    (LLAMA, {"prompt": "x", "n_predict": -7}, 400, "n_predict"),
    (LLAMA, {"prompt": [5, 99_999], "n_predict": 1}, 400, "prompt[1]"),
    (LLAMA, {"prompt": [5, -1], "n_predict": 1}, 400, "prompt[1]"),
    (LLAMA, {"prompt": [5, 1.5], "n_predict": 1}, 400, "prompt"),
    (LLAMA, {"prompt": [], "n_predict": 1}, 400, "prompt"),
    (LLAMA, {"prompt": "", "n_predict": 1}, 400, "prompt"),
    (LLAMA, {"prompt": "x", "temperature": 1e308}, 400, "temperature"),
    (LLAMA, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (LLAMA, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (LLAMA, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    (LLAMA, {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos"),
    (LLAMA, {"prompt": "x", "n_predict": 40960}, 400, "n_predict"),
    (LLAMA, {"prompt": list(range(300, 300 + 40961)), "n_predict": 1}, 400, "prompt"),
    (CHAT, {"messages": "hello", "max_tokens": 4}, 400, "messages"),
    (CHAT, {"messages": [], "max_tokens": 4}, 400, "messages"),
    (CHAT, {"max_tokens": 4}, 400, "messages"),
    (CHAT, {"messages": ["hello"]}, 400, "messages[0]"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 2**40}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 2**40}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": "5"}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 5.0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": MSG, "stream": True, "stream_options": []}, 400, "stream_options"),
    (
        CHAT,
        {"messages": MSG, "stream": True, "stream_options": {"include_usage": "yes"}},
        400,
        "stream_options.include_usage",
    ),
    (CHAT, {"messages": MSG, "model": 7}, 400, "model"),
    (COMPLETIONS, {"prompt": ["a", "b"], "max_tokens": 2}, 400, "prompt"),
    (COMPLETIONS, {"prompt": {"text": "a"}}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [300, 32_000]}, 400, "prompt[1]"),
    ("/tokenize", {"content": 5}, 400, "content"),
    ("/tokenize", {"messages": "x"}, 400, "messages"),
    ("/tokenize", b"{", 400, "body"),
]


def _send(sim: SimProcess, path: str, body: Any) -> tuple[int, dict[str, str], bytes]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return sim.request("POST", path, raw=raw, headers={"X-Request-Id": "bad-1"})


@pytest.mark.parametrize(("path", "body", "status", "names"), CASES, ids=range(len(CASES)))
def test_bad_request_is_a_json_error(
    fast_sim: SimProcess, path: str, body: Any, status: int, names: str
) -> None:
    got, headers, raw = _send(fast_sim, path, body)
    assert got == status, raw[:300]
    assert headers["content-type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert set(err) == {"code", "type", "message"}
    assert err["code"] == status and err["type"] and isinstance(err["type"], str)
    assert err["message"].startswith(names), err["message"]
    assert headers.get("x-request-id") == "bad-1"


def test_server_keeps_serving_after_bad_input(fast_sim: SimProcess) -> None:
    for path, body, _, _ in CASES:
        _send(fast_sim, path, body)
    s = fast_sim.stream(LLAMA, {"prompt": "still alive", "n_predict": 3, "stream": True,
                                "ignore_eos": True})  # fmt: skip
    assert s.status == 200 and s.json_events()[-1]["tokens_predicted"] == 3
    assert fast_sim.json("GET", "/health")[0] == 200
    assert fast_sim.proc.poll() is None
    # No bad request reached the device: no trace row names it.
    rows = fast_sim.traces("server_events") + fast_sim.traces("steps")
    assert not [r for r in rows if r.get("request_id") == "bad-1"]


def test_unknown_endpoint_and_wrong_method(fast_sim: SimProcess) -> None:
    for method, path, status in (
        ("GET", "/v2/nothing", 404),
        ("POST", "/v1/embeddings", 404),
        ("GET", "/completion", 405),
        ("DELETE", "/v1/chat/completions", 405),
        ("POST", "/health", 405),
    ):
        got, _, raw = fast_sim.request(method, path)
        assert got == status, (method, path, raw)
        err = json.loads(raw)["error"]
        assert err["code"] == status and path in err["message"]


def test_huge_body_is_refused(fast_sim: SimProcess) -> None:
    pad = b" " * (9 * 2**20)  # over the 8 MiB limit; valid JSON whitespace
    got, _, raw = fast_sim.request("POST", LLAMA, raw=b'{"prompt": "x"' + pad + b"}")
    assert got == 413, raw[:200]
    assert json.loads(raw)["error"]["message"].startswith("body")
    ok, _, _ = fast_sim.request("POST", LLAMA, {"prompt": "x", "n_predict": 1})
    assert ok == 200


def test_malformed_request_id_is_replaced(fast_sim: SimProcess) -> None:
    status, headers, _ = fast_sim.request(
        "POST", LLAMA, {"prompt": "x", "n_predict": 1}, headers={"X-Request-Id": "bad id;<>"}
    )
    assert status == 200 and headers["x-request-id"] != "bad id;<>"
    status, headers, _ = fast_sim.request(
        "POST", LLAMA, {"prompt": "x", "n_predict": 0}, headers={"X-Request-Id": "bad id;<>"}
    )
    assert status == 400 and "x-request-id" not in headers


def test_unknown_model_is_refused_only_when_asked(
    fast_sim: SimProcess, start_sim: Callable[..., SimProcess]
) -> None:
    body = {"prompt": "x", "max_tokens": 1, "model": "<b>other</b>"}
    ok, _, raw = fast_sim.request("POST", COMPLETIONS, body)
    assert ok == 200, raw  # by default any model name is served
    strict = start_sim("--time-scale", "0.02", "--set", "output.reject_unknown_models=true")
    got, _, raw = strict.request("POST", COMPLETIONS, body)
    assert got == 404, raw
    err = json.loads(raw)["error"]
    assert err["type"] == "model_not_found"
    assert err["message"] == "The model `<b>other</b>` does not exist."  # echoed as sent
    for name in ("qwen3", "calculet-sim-qwen3", None):
        ok, _, raw = strict.request("POST", COMPLETIONS, {**body, "model": name})
        assert ok == 200, (name, raw)
