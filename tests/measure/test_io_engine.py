"""The thread I/O engine (measure.thread_engine) end to end: a real Locust process, open loop,
`--io-engine thread`, against a real time-scaled simulator on loopback; its records
against the simulator's own trace (same host, same monotonic clock).

The hostile-server cases and the TLS proxy's run on both engines in their own files
(tests/measure/test_hostile.py, tests/measure/test_tls_proxy.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import numpy as np
import pytest

from calculet_load.locust.accuracy import Accuracy
from calculet_load.measure import thread_engine
from calculet_load.measure.connections import Endpoint
from calculet_load.measure.gevent_engine import GeventPool
from calculet_load.measure.io_engines import open_engine
from calculet_load.measure.outcome import Outcome
from calculet_load.measure.prompts import Prompt
from calculet_load.measure.session import RequestSpec, RunContext, Session, turnaround
from calculet_load.measure.sink import PartSink
from calculet_load.measure.thread_engine import ThreadPool
from calculet_load.measure.thread_loop import LoopThread
from calculet_load.measure.threads import ENGINE_THREAD, SINK_THREAD
from calculet_load.schema.records import ClientNs, RequestRecord
from tests.measure.test_hostile import CHUNKED_HEAD, L1, chunk
from tests.support.hostile import Sleep, serve
from tests.support.locustproc import LocustRun
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(120)

# Same host, one clock: each token event's arrival against the server's flush of its
# last token. On an idle machine the engine's arrivals trail the flush by 0.1-0.5 ms;
# the bound leaves room for a suite running beside it.
TOKEN_DELAY_MS = 50.0
# The kernel's receive time is CLOCK_REALTIME moved onto the monotonic clock by two
# readings at most 20 µs apart (measure/rxstamps.py: clock_pair): the arrival may seem to
# precede the start of the server's write by that much.
CLOCK_MOVE_MS = 1.0


def _server_rows(sim: SimProcess, want: set[str]) -> dict[str, list[dict[str, Any]]]:
    """The simulator's rows per request once every request in `want` has finished (its
    trace writer flushes in the background)."""
    deadline = time.monotonic() + 15
    while True:
        rows: dict[str, list[dict[str, Any]]] = {}
        for r in sim.traces("server_events"):
            rows.setdefault(str(r.get("request_id")), []).append(r)
        done = {rid for rid, rs in rows.items() if any(r["event"] == "finished" for r in rs)}
        if want <= done or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


@pytest.mark.serial  # ms stamps against the server's: a busy machine delays its flush stamp
def test_a_locust_open_loop_on_the_thread_engine_matches_the_simulator(
    start_sim: Callable[..., SimProcess], tmp_path: Path
) -> None:
    sim = start_sim("--time-scale", "0.5")
    run = LocustRun(
        tmp_path,
        sim.url,
        [
            *("--arrival", "poisson", "--rate", "20", "--seed", "11", "--io-engine", "thread"),
            *("--prompt-tokens", "32", "--max-tokens", "12", "--start-delay", "1"),
            *("-u", "1", "-r", "1"),
        ],
        workers=0,
        run_time_s=5.0,
    ).start()
    try:
        assert run.wait() == 0, run.log_text()
        t = run.requests().to_pylist()
    finally:
        run.stop()
    sent = [r for r in t if not r["ext.dropped"] and r["ext.cancelled_at"] != "run_stop"]
    assert len(sent) >= 40, len(sent)  # ~20/s for ~4 s
    assert all(r["ext.error_class"] is None for r in sent), [
        (r["ext.error_class"], r["ext.error_detail"]) for r in sent
    ]
    truth = _server_rows(sim, {r["request_id"] for r in sent})
    delays: list[float] = []
    for r in sent:
        assert r["ext.stamp_source"] == "kernel"  # the engine's reads carry the kernel's time
        assert r["ext.intended_start_ns"] is not None and r["ext.send_lag_ms"] is not None
        # sent at its intended time by the engine's timer, not before it
        assert r["client_ns.request_start"] >= r["ext.intended_start_ns"]
        # the start of the server's write of each token: no byte of it left before then
        flushes = sorted(
            (int(x["step_index"]), int(x["detail"]["write_start_mono_ns"]))
            for x in truth[r["request_id"]]
            if x["event"] == "token_flushed"
        )
        # the tokens the server flushed are the tokens the client counted
        assert len(flushes) == r["ext.client_output_tokens"] == r["ext.server_output_tokens"] == 12
        first, last = flushes[0][1], flushes[-1][1]
        for stamp, flush in (
            (r["client_ns.first_token"], first),
            (r["client_ns.last_token"], last),
        ):
            delays.append((stamp - flush) / 1e6)
    assert min(delays) > -CLOCK_MOVE_MS, min(delays)
    assert max(delays) < TOKEN_DELAY_MS, max(delays)
    lag = np.array([r["ext.send_lag_ms"] for r in sent])
    print(
        f"{len(sent)} requests; token delay p50 {np.median(delays):.3f} max {max(delays):.3f}"
        f" ms; send lag p50 {np.median(lag):.3f} p99 {np.percentile(lag, 99):.3f} ms"
    )
    assert np.percentile(lag, 99) < 250  # as the gevent engine's open loop (test_locust_dist)


@pytest.mark.parametrize("engine", ["gevent", "thread"])
def test_a_request_cut_when_the_run_stops_keeps_its_record(engine: str) -> None:
    """Locust kills a user's greenlet mid-request at a stop: on either engine the request
    is recorded as cancelled at run_stop with what it measured, and its connection is not
    kept."""
    spec = RequestSpec(prompt=Prompt("s", 4, "a b c d"), max_tokens=8, reuse=True)
    records: list[RequestRecord] = []
    with serve([CHUNKED_HEAD + chunk(L1), Sleep(5.0)]) as server:
        session = Session(RunContext("stop", "w00"), server.url, "llama", io_engine=engine)
        session.hooks.append(lambda record, _out: records.append(record))
        g = gevent.spawn(session.send, spec)
        # the head and one token are in: the server has sent them (it holds the rest 5 s),
        # and the client gets a second to read them, past any descheduling
        deadline = time.monotonic() + 10
        while not server.requests and time.monotonic() < deadline:
            gevent.sleep(0.01)
        gevent.sleep(1.0)
        start = time.monotonic()
        g.kill(timeout=5)
        assert time.monotonic() - start < 1.0
        assert session.pool.open == 0
        session.close()
    assert len(records) == 1
    ext = records[0].ext
    assert (ext.error_class, ext.cancelled_at, ext.client_output_tokens) == (
        "cancelled",
        "run_stop",
        1,
    )
    assert records[0].client_ns.first_token is not None


def _send_in_turn(sim: SimProcess, n: int) -> list[RequestRecord]:
    """`n` requests one after the other on the thread engine, as a closed-loop user
    sends them; their records in order."""
    session = Session(RunContext("turn", "w00"), sim.url, "llama", io_engine="thread")
    records: list[RequestRecord] = []
    session.hooks.append(lambda record, _out: records.append(record))
    spec = RequestSpec(prompt=Prompt("s", 4, "a b c d"), max_tokens=4, reuse=True)
    try:
        for _ in range(n):
            gevent.spawn(session.send, spec).get(timeout=30)
    finally:
        session.close()
    return records


def test_the_engine_thread_waiting_after_the_start_stamp_is_flagged(
    fast_sim: SimProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread held up between t0 and the write (as when it waits for the
    interpreter lock the greenlets hold): TTFT carries the wait, and the self-check's
    start-to-sent figure names the cell (calculet_load.locust.accuracy)."""
    real = thread_engine._send_all
    calls = []

    async def held_up(*args: Any) -> None:
        calls.append(1)
        if len(calls) > 1:  # the first request connects; the others reuse its connection
            time.sleep(0.03)  # blocks the engine's loop, as a lock it waits for would
        await real(*args)

    monkeypatch.setattr(thread_engine, "_send_all", held_up)
    records = _send_in_turn(fast_sim, 4)
    assert [r.ext.error_class for r in records] == [None] * 4
    assert [r.ext.connection_reused for r in records] == [False, True, True, True]
    gaps = [(r.client_ns.headers_sent - r.client_ns.request_start) / 1e6 for r in records]
    assert all(g >= 30.0 for g in gaps[1:]), gaps
    acc = Accuracy()
    for r in records:
        acc.observe(r)
    (problem,) = acc.problems(10.0)
    # the figure is the held-up sends' (each 30 ms and up; a loaded machine adds to them)
    found = re.search(r"start to sent P99 ([\d.]+) ms", problem)
    assert found, problem
    p99 = float(found[1])
    assert min(gaps[1:]) * 0.98 <= p99 <= max(gaps[1:]) * 1.02, (p99, gaps)


def test_the_clients_own_time_around_a_request_is_its_turnaround(
    fast_sim: SimProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ext.turnaround_ms`: from the driver's send to t0, and from t6 to the outcome back.
    The engine's loop held 30 ms before a request's start stamp is in it (a closed-loop
    user's next request waited for it), and not in the request's durations."""
    real = thread_engine._attempt
    calls = []

    async def held_up(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            time.sleep(0.03)  # blocks the engine's loop before the start stamp
        return await real(*args, **kw)

    monkeypatch.setattr(thread_engine, "_attempt", held_up)
    records = _send_in_turn(fast_sim, 3)
    assert [r.ext.error_class for r in records] == [None] * 3
    held = [r.ext.turnaround_ms for r in records]
    assert all(t is not None and t > 0 for t in held), held
    assert held[2] >= 30.0, held
    assert held[1] < 30.0, held  # the same request not held: its hand-overs only
    start = records[2].client_ns.request_start
    assert start is not None and records[2].durations_ms.ttft is not None
    assert records[2].durations_ms.ttft < 30.0 + records[1].durations_ms.ttft


def test_a_scheduled_send_is_timed_from_its_instant_and_a_failure_has_no_turnaround() -> None:
    """An open loop hands a request over before it is due: its turnaround runs from the
    schedule's instant, not from the hand-over; without a response end there is none."""
    out = Outcome("r")
    out.client_ns = ClientNs(1_000, 1_100, 1_200, 1_300, 1_300, 1_400, 1_500)
    due = RequestSpec(prompt=Prompt("s", 4, "a b c d"), max_tokens=4, intended_start_ns=900)
    assert turnaround(due, out, 100, 1_700) == (1_000 - 900) + (1_700 - 1_500)
    closed = RequestSpec(prompt=Prompt("s", 4, "a b c d"), max_tokens=4)
    assert turnaround(closed, out, 100, 1_700) == (1_000 - 100) + (1_700 - 1_500)
    out.client_ns = ClientNs(1_000, 1_100, None, None, None, None, None)
    assert turnaround(closed, out, 100, 1_700) is None


def _one_new_connection(fast_sim: SimProcess) -> RequestRecord:
    (record,) = _send_in_turn(fast_sim, 1)
    assert record.ext.error_class is None and record.ext.connection_reused is False
    return record


def test_a_new_connection_held_up_after_its_connect_is_flagged(
    fast_sim: SimProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new connection's connect is the request's (`ext.connect_ms`); the client's own
    wait after it, before the write, is not: the start-to-sent figure counts it."""
    real = thread_engine._send_all

    async def held_up(*args: Any) -> None:
        time.sleep(0.03)  # blocks the engine's loop between the connect and the write
        await real(*args)

    monkeypatch.setattr(thread_engine, "_send_all", held_up)
    record = _one_new_connection(fast_sim)
    assert record.ext.connect_ms is not None and 0 < record.ext.connect_ms < 30.0
    gap = (record.client_ns.headers_sent - record.client_ns.request_start) / 1e6
    acc = Accuracy()
    acc.observe(record)
    (problem,) = acc.problems(10.0)
    found = re.search(r"start to sent P99 ([\d.]+) ms", problem)
    assert found, problem
    assert 30.0 * 0.98 <= float(found[1]) <= (gap - record.ext.connect_ms) * 1.02 + 0.1


def test_a_slow_connect_is_the_requests_and_not_flagged(
    fast_sim: SimProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connect that waits 30 ms on the network (here: on the loop's timer, as a
    handshake's round trips would) is in `ext.connect_ms` and TTFT, not the self-check."""
    real = thread_engine._connect

    async def slow(*args: Any) -> None:
        await thread_engine.asyncio.sleep(0.03)
        await real(*args)

    monkeypatch.setattr(thread_engine, "_connect", slow)
    record = _one_new_connection(fast_sim)
    assert record.ext.connect_ms is not None and record.ext.connect_ms >= 30.0
    gap = (record.client_ns.headers_sent - record.client_ns.request_start) / 1e6
    assert gap >= record.ext.connect_ms
    acc = Accuracy()
    acc.observe(record)
    assert acc.problems(10.0) == []


def test_the_engine_and_the_sink_name_their_threads(tmp_path: Path) -> None:
    """`top -H`, `ps -L` and benchmarks/client_speed.py tell the engine's loop and the
    sink's writer from the main thread by their OS names (measure.threads)."""

    def names() -> dict[int, str]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                out[int(tid)] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        return out

    LoopThread.shared()
    assert ENGINE_THREAD in names().values()
    sink = PartSink(str(tmp_path), "w00")
    try:
        deadline = time.monotonic() + 10
        while names().get(sink.writer_tid or -1) != SINK_THREAD:
            assert time.monotonic() < deadline, names()
            time.sleep(0.01)
    finally:
        sink.close()
    assert names().get(os.getpid()) not in (ENGINE_THREAD, SINK_THREAD)  # the main one


def test_a_session_chooses_its_engine_by_name() -> None:
    """One place maps a name to its engine (measure.io_engines): each name opens that
    engine's pool, the session sends through it, and an unknown name is refused with the
    choices named."""
    endpoint = Endpoint("http://127.0.0.1:9")
    gevent_pool = open_engine("gevent", endpoint, 2)
    thread_pool = open_engine("thread", endpoint, 2)
    try:
        assert isinstance(gevent_pool, GeventPool) and isinstance(thread_pool, ThreadPool)
        assert (gevent_pool.max_connections, thread_pool.open) == (2, 0)
    finally:
        gevent_pool.close()
        thread_pool.close()
    for name, kind in (("gevent", GeventPool), ("thread", ThreadPool)):
        session = Session(RunContext("pick", "w00"), endpoint.url, "llama", io_engine=name)
        assert type(session.pool) is kind
        session.close()
    with pytest.raises(ValueError, match="io_engine 'uv': one of gevent, thread"):
        Session(RunContext("pick", "w00"), endpoint.url, "llama", io_engine="uv")
