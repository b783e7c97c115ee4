"""Admission like the device: the 40960 context limit, slots, KV budget, bounded queue."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.simhelpers import COMPLETIONS, LLAMA, llama, parallel, prompt_ids, wait_steps
from tests.support.simproc import SimProcess, Stream

StartSim = Callable[..., SimProcess]
FULL = 40_959


def _metric(sim: SimProcess, name: str, **labels: str) -> float:
    _, _, raw = sim.request("GET", "/metrics")
    for fam in text_string_to_metric_families(raw.decode()):
        for s in fam.samples:
            if s.name in (name, f"{name}_total") and all(
                s.labels.get(k) == v for k, v in labels.items()
            ):
                return float(s.value)
    raise AssertionError(f"no sample {name} {labels}")


def _open_request(sim: SimProcess, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a request and leave the connection open without reading (a client that waits)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((sim.host, sim.port))
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_context_limit_reject_policy(start_sim: StartSim) -> None:
    sim = start_sim("--time-scale", "0.002")
    fits = llama(sim, prompt_ids(FULL), 1).json_events()
    assert fits[-1]["tokens_predicted"] == 1 and fits[-1]["tokens_evaluated"] == FULL
    status, body = sim.json("POST", LLAMA, {"prompt": prompt_ids(FULL), "n_predict": 2})
    assert status == 400
    assert body["error"]["type"] == "context_length_exceeded"
    assert "40960" in body["error"]["message"]
    status, body = sim.json("POST", COMPLETIONS, {"prompt": prompt_ids(FULL), "max_tokens": 2})
    assert status == 400 and body["error"]["message"].startswith("max_tokens")
    # n_predict -1 (until the context is full) leaves room for exactly one token.
    status, body = sim.json("POST", LLAMA, {"prompt": prompt_ids(FULL), "n_predict": -1})
    assert status == 200 and body["tokens_predicted"] == 1


def test_context_limit_truncate_policy(start_sim: StartSim) -> None:
    sim = start_sim("--time-scale", "0.002", "--set", "scheduling.context_overflow=truncate")
    status, body = sim.json(
        "POST", COMPLETIONS, {"prompt": prompt_ids(FULL), "max_tokens": 2, "ignore_eos": True}
    )
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": FULL,
        "completion_tokens": 1,
        "total_tokens": 40960,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # A prompt alone over the limit is still refused.
    status, body = sim.json("POST", COMPLETIONS, {"prompt": prompt_ids(40_961), "max_tokens": 1})
    assert status == 400 and body["error"]["message"].startswith("prompt")


def test_queue_full_429_and_admission_timeout_503(start_sim: StartSim) -> None:
    sim = start_sim(
        "--time-scale", "0.05",
        "--set", "scheduling.slots=1",
        "--set", "scheduling.queue_max=2",
        # 0.5 s real: the three requests arrive within it of each other, however a loaded
        # machine staggers their threads (the third must find the queue full)
        "--set", "scheduling.admission_timeout_s=10",
    )  # fmt: skip
    blocker: list[Stream] = []
    # 4000 steps, about 2.5 s real: the blocker holds the slot through the admission wait
    # of the two queued requests (1000 steps were 0.6 s, less than a loaded machine can
    # take to see it admitted and send the three)
    t = threading.Thread(target=lambda: blocker.append(llama(sim, prompt_ids(8), 4000)))
    t.start()
    sim.wait_for(lambda: _metric(sim, "calculet_sequences_active") == 1, what="blocker admitted")

    def one(i: int) -> tuple[int, str, float]:
        t0 = time.monotonic()
        status, body = sim.json("POST", LLAMA, {"prompt": prompt_ids(8, i), "n_predict": 2})
        return status, body["error"]["type"], time.monotonic() - t0

    results = sorted(parallel(one, 3))
    assert [(s, code) for s, code, _ in results] == [
        (429, "queue_full"),
        (503, "admission_timeout"),
        (503, "admission_timeout"),
    ]
    # The 503s waited for the bounded admission time; the 429 did not wait at all.
    assert results[1][2] > 0.45 and results[2][2] > 0.45
    assert results[0][2] < results[1][2]
    assert _metric(sim, "calculet_requests_rejected", reason="queue_full") == 1
    assert _metric(sim, "calculet_requests_rejected", reason="admission_timeout") == 2
    rejected = [e for e in sim.traces("server_events") if e["event"] == "rejected"]
    assert sorted(e["detail"]["http_status"] for e in rejected) == [429, 503, 503]
    t.join()
    assert blocker[0].json_events()[-1]["tokens_predicted"] == 4000
    assert llama(sim, "after", 2).json_events()[-1]["tokens_predicted"] == 2


def test_kv_budget_limits_concurrency(start_sim: StartSim) -> None:
    def max_lanes(kv_budget: int) -> tuple[int, SimProcess]:
        sim = start_sim(
            "--profile", "b4", "--time-scale", "0.01",
            "--set", f"scheduling.kv_budget_tokens={kv_budget}",
            "--set", "scheduling.admission_timeout_s=1000",
        )  # fmt: skip
        # Each request reserves 100 prompt + 200 output = 300 KV tokens.
        parallel(lambda i: llama(sim, prompt_ids(100, i), 200, rid=f"kv-{i}"), 4)
        steps = wait_steps(sim, [f"kv-{i}" for i in range(4)])
        jobs: dict[int, int] = {}
        for r in steps:
            jobs[r["job_id"]] = jobs.get(r["job_id"], 0) + 1
        assert max(r["kv_after"] for r in steps) <= 300
        return max(jobs.values()), sim

    tight, sim = max_lanes(700)
    assert tight == 2
    assert _metric(sim, "calculet_kv_waits") > 0
    roomy, _ = max_lanes(1300)
    assert roomy == 4
    # A request that needs more KV than the whole budget is refused at once.
    status, body = sim.json("POST", LLAMA, {"prompt": prompt_ids(100), "n_predict": 700})
    assert status == 400 and body["error"]["type"] == "kv_budget_exceeded"
    assert body["error"]["message"].startswith("n_predict")
    assert _metric(sim, "calculet_kv_rejects") == 1


def test_disconnect_while_queued_frees_the_queue_at_once(start_sim: StartSim) -> None:
    sim = start_sim(
        "--time-scale", "0.05",
        "--set", "scheduling.slots=1",
        "--set", "scheduling.queue_max=1",
        "--set", "scheduling.admission_timeout_s=600",  # 30 s real: never reached here
    )  # fmt: skip
    body = {"prompt": prompt_ids(8), "n_predict": 10_000, "stream": True, "ignore_eos": True}
    blocker = _open_request(sim, LLAMA, body)
    sim.wait_for(lambda: _metric(sim, "calculet_sequences_active") == 1, what="blocker")
    queued = _open_request(sim, LLAMA, {**body, "prompt": prompt_ids(8, 1)})
    sim.wait_for(lambda: _metric(sim, "calculet_requests_queued") == 1, what="queued")
    status, _ = sim.json("POST", LLAMA, {"prompt": "no room", "n_predict": 1})
    assert status == 429
    t0 = time.monotonic()
    queued.close()
    sim.wait_for(lambda: _metric(sim, "calculet_requests_queued") == 0, what="queue freed")
    assert time.monotonic() - t0 < 5  # far sooner than the 30 s admission wait
    cancelled = [e for e in sim.traces("server_events") if e["event"] == "cancelled"]
    assert [e["detail"]["where"] for e in cancelled] == ["waiting"]
    assert cancelled[0]["detail"]["released"] is True
    # The freed place in the queue is usable at once.
    again = _open_request(sim, LLAMA, {**body, "prompt": prompt_ids(8, 2)})
    sim.wait_for(lambda: _metric(sim, "calculet_requests_queued") == 1, what="re-queued")
    again.close()
    blocker.close()  # cancels the running request; its slot comes back
    sim.wait_for(lambda: _metric(sim, "calculet_slots_in_use") == 0, what="slot released")
    assert llama(sim, "after", 3).json_events()[-1]["tokens_predicted"] == 3
