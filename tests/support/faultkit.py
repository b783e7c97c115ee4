"""Helpers of the fault-scenario tests: arming, whole requests, trace views, background work."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import psutil

from calculet_load.measure.sse import SSEParser
from tests.support.simhelpers import LLAMA, prompt_ids
from tests.support.simproc import SimProcess

T = TypeVar("T")

# 20x faster than real time: a decode step is ~0.6 ms, the admission timeout 1.5 s.
FAST = ("--time-scale", "0.05")
PROMPT = prompt_ids(8)

# Events of a request's device work: none may exist for a request refused before submit.
JOB_EVENTS = {
    "slot_assigned",
    "admitted",
    "job_prepared",
    "submit_start",
    "submit_ok",
    "wait_done",
    "logits_ready",
    "sampled",
    "token_flushed",
}


def arm(sim: SimProcess, scenario: str, **params: Any) -> dict[str, Any]:
    status, body = sim.admin("POST", "/admin/faults", {"scenario": scenario, **params})
    assert status == 200, body
    armed: dict[str, Any] = body["armed"][0]
    return armed


def clear(sim: SimProcess) -> None:
    status, body = sim.admin("DELETE", "/admin/faults")
    assert status == 200, body


def whole(
    sim: SimProcess, n: int, rid: str, prompt: Any = None, **kw: Any
) -> tuple[int, dict[str, Any]]:
    """A non-streaming greedy llama.cpp request: (status, body); all output ids in `tokens`."""
    body = {"prompt": PROMPT if prompt is None else prompt, "n_predict": n, "ignore_eos": True}
    status, out = sim.json("POST", LLAMA, {**body, **kw}, headers={"X-Request-Id": rid})
    return status, out


def ok_ids(sim: SimProcess, n: int, rid: str, prompt: Any = None) -> list[int]:
    status, body = whole(sim, n, rid, prompt)
    assert status == 200, body
    ids: list[int] = body["tokens"]
    assert len(ids) == n
    return ids


def error_type(body: dict[str, Any]) -> str:
    kind: str = body["error"]["type"]
    return kind


def events(
    sim: SimProcess, name: str | None = None, rid: str | None = None
) -> list[dict[str, Any]]:
    rows = sim.traces("server_events")
    return [
        r
        for r in rows
        if (name is None or r["event"] == name) and (rid is None or r["request_id"] == rid)
    ]


def first(rows: list[dict[str, Any]], name: str, rid: str | None = None) -> dict[str, Any]:
    for r in rows:
        if r["event"] == name and (rid is None or r["request_id"] == rid):
            return r
    raise AssertionError(f"no {name!r} event" + (f" for {rid}" if rid else ""))


def background(fn: Callable[[], T]) -> Future[T]:
    """Run fn on its own thread; the executor is not kept, the thread ends with fn."""
    pool = ThreadPoolExecutor(1)
    fut = pool.submit(fn)
    pool.shutdown(wait=False)
    return fut


def open_request(
    sim: SimProcess, body: dict[str, Any], rid: str, path: str = LLAMA
) -> socket.socket:
    """Send a request on a raw socket and return it unread: closing it is a client going away."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {sim.host}\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {rid}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection((sim.host, sim.port), timeout=30)
    sock.sendall(head.encode() + data)
    return sock


def cpu_seconds(sim: SimProcess) -> float:
    t = psutil.Process(sim.pid).cpu_times()
    return float(t.user + t.system)


def wait_state(sim: SimProcess, pred: Callable[[dict[str, Any]], bool], what: str) -> Any:
    """Poll /admin/state until pred(state) holds; return that state."""

    def check() -> dict[str, Any] | None:
        st = sim.state()
        return st if pred(st) else None

    return sim.wait_for(check, what=what)


def wait_event(sim: SimProcess, name: str, rid: str | None = None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = sim.wait_for(
        lambda: events(sim, name, rid), what=f"{name} event" + (f" of {rid}" if rid else "")
    )
    return rows[0]


def stream_events(
    sim: SimProcess, n: int, rid: str, prompt: Any = None
) -> tuple[int, list[dict[str, Any]], bool]:
    """A streamed greedy llama.cpp request: (status, JSON events, whether it ended cleanly).

    Unlike `SimProcess.stream` it survives a connection the server cuts mid-stream.
    """
    body = {
        "prompt": PROMPT if prompt is None else prompt,
        "n_predict": n,
        "ignore_eos": True,
        "stream": True,
    }
    c = sim.conn()
    c.request("POST", LLAMA, body=json.dumps(body).encode(), headers={"X-Request-Id": rid})
    r = c.getresponse()
    parser = SSEParser()
    out = []
    clean = True
    try:
        while data := r.read1(65536):
            out += parser.feed(data)
    except (http.client.IncompleteRead, ConnectionError):
        clean = False
    finally:
        c.close()
    return r.status, [json.loads(e.data) for e in out], clean
