"""The client's self-check (calculet_load.locust.accuracy): cells where it fell behind
are named from its own records, across workers, against the run's budget; a real
Locust run against a server that writes its tokens in bursts passes, and fails when
the client is starved."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from calculet_load.locust.accuracy import Accuracy, check_reports
from calculet_load.schema.records import ClientNs, Ext, RequestRecord
from tests.support.locustproc import REPO, LocustRun
from tests.support.starver import STARVER

EXACT_SERVER = REPO / "benchmarks" / "exact_server.py"


S = 1_000_000_000  # ns


def _record(
    cell: str,
    wait: float | None,
    lag: float | None = None,
    span: tuple[float, float] = (1.0, 1.5),
    **ext: Any,
) -> RequestRecord:
    """A request of `cell` from t0 to its last token (`span`, s on the monotonic clock)
    whose first token's late bound is `wait` ms."""
    t0, end = (int(x * S) for x in span)
    return RequestRecord(
        run_id="r",
        request_id="x",
        client_ns=ClientNs(request_start=t0, headers_sent=t0 + 100_000, last_token=end),
        ext=Ext(cell=cell, stamp_late_bound_ms=wait, send_lag_ms=lag, **ext),
    )


def _p99(problem: str) -> float:
    return float(problem.split("P99 ")[1].split(" ms")[0])


def test_a_cell_over_budget_is_named_with_its_figure() -> None:
    """Requests under a self-watch sample that saw loop lag count their late bound."""
    acc = Accuracy()
    acc.observe_sample(0, 0.0, warmup=True)  # the warm-up's end
    acc.observe_sample(2 * S, 12.0)  # (0, 2 s]: the loop lagged 12 ms
    for i in range(200):
        acc.observe(_record("short", 0.2 + i / 1000))  # kept up: P99 < 1 ms
        acc.observe(_record("long", 30.0 if i % 10 == 0 else 0.5))  # 10 % waited 30 ms
    problems = acc.problems(10.0)
    assert problems == [problems[0]]
    assert problems[0].startswith("long: first-token late bound under loop lag P99 ")
    assert 29.0 < _p99(problems[0]) < 31.0


def test_a_late_bound_outside_loop_lag_counts_0() -> None:
    """A server that writes its first tokens in one burst (vLLM's multi-step scheduling,
    SGLang's stream interval) puts them in one read however soon the client reads: the
    bound is then its prefill while the stamp is exact. Without a sample that saw the
    loop lag over the request, its bound counts 0; with one, what it is. The samples
    come before or after the request's record alike."""
    acc = Accuracy()
    acc.observe_sample(0, 50.0, warmup=True)  # the warm-up is not judged
    acc.observe_sample(1 * S, 0.4)
    # (1, 2 s] will lag, (2, 3 s] will not, (3, 4 s] will
    for span in ((1.2, 1.9), (1.5, 2.5), (2.1, 2.9), (2.5, 3.5)):
        acc.observe(_record("burst", 50.0, span=span))
    acc.observe_sample(2 * S, 8.0)
    acc.observe_sample(3 * S, 0.3)
    acc.observe(_record("burst", 50.0, span=(1.95, 2.05)))  # ended under samples seen
    acc.observe(_record("burst", 50.0, span=(2.2, 2.8)))  # ended before (3, 4 s]
    acc.observe_sample(4 * S, 6.0)
    acc.observe(_record("burst", 50.0, span=(4.5, 4.9)))  # after the last sample
    h = acc.cells["burst"]["late_bound_under_lag_ms"]
    assert h.count == 6  # the one after the last sample still waits
    wire = acc.to_wire()["burst"]["late_bound_under_lag_ms"]
    assert h.count == 7 and acc._waiting == []
    # (1.2, 1.9), (1.5, 2.5), (1.95, 2.05) lagged; (2.5, 3.5) reaches the lagging (3, 4 s];
    # (2.1, 2.9) and (2.2, 2.8) are under (2, 3 s] alone; (4.5, 4.9) under none seen
    assert (h.sum, h.min, h.max) == (200.0, 0.0, 50.0)  # four of 50 ms, three of 0
    assert wire == h.to_wire()
    assert acc.problems(10.0) == ["burst: first-token late bound under loop lag P99 50.0 ms"]
    quiet = Accuracy()
    quiet.observe_sample(0, 0.0, warmup=True)
    for i in range(100):
        quiet.observe(_record("burst", 50.0, span=(1.0 + i / 100, 1.5 + i / 100)))
        quiet.observe_sample(int((1.0 + i / 100) * S), 4.9)  # under the 5-ms limit
    quiet.observe(_record("burst", 0.0))
    wire = quiet.to_wire()
    assert quiet.cells["burst"]["late_bound_under_lag_ms"].count == 101
    assert quiet.cells["burst"]["late_bound_under_lag_ms"].max == 0.0
    assert quiet.problems(10.0) == []
    assert wire["burst"]["late_bound_under_lag_ms"]["n"] == 101


def test_send_lag_counts_and_dropped_arrivals_do_not() -> None:
    acc = Accuracy()
    for _ in range(100):
        acc.observe(_record("open", None, lag=25.0))
        acc.observe(_record("dropped", 500.0, lag=500.0, dropped=True))
    assert acc.problems(10.0) == ["open: send lag P99 25.0 ms"]


def test_workers_reports_add_up_through_json() -> None:
    """The master judges the sum of its workers' histograms, as sent over the wire."""
    a, b = Accuracy(), Accuracy()
    a.observe_sample(2 * S, 0.5)
    b.observe_sample(2 * S, 30.0)  # one worker fell behind
    for _ in range(100):
        a.observe(_record("c", 50.0))  # a burst's bound, its loop on time: counts 0
    for _ in range(100):
        b.observe(_record("c", 50.0))  # half the cell's requests
    reports = [json.loads(json.dumps({"accuracy": w.to_wire()})) for w in (a, b)]
    (problem,) = check_reports(reports, 10.0)
    # within the histogram's 1 % of 50
    assert problem.startswith("c: first-token late bound under loop lag P99 ")
    assert 49.4 <= _p99(problem) <= 50.6
    assert check_reports(reports, 100.0) == []
    assert check_reports([{"worker": "w00"}], 10.0) == []  # a report without it


def _written(
    cell: str, start_to_sent_ms: float, reused: bool, connect_ms: float | None = None
) -> RequestRecord:
    t0 = 1_000_000_000
    return RequestRecord(
        run_id="r",
        request_id="x",
        client_ns=ClientNs(request_start=t0, headers_sent=t0 + int(start_to_sent_ms * 1e6)),
        ext=Ext(cell=cell, connection_reused=reused, connect_ms=connect_ms),
    )


def test_a_wait_between_the_start_stamp_and_the_write_is_named() -> None:
    """On a kept-alive connection t0 → t1 is one non-blocking write: more is the client's
    own wait, which TTFT would carry. A new connection's connect is the request's."""
    acc = Accuracy()
    for _ in range(100):
        acc.observe(_written("c", 40.0, reused=False))  # a 40 ms connect: not counted
        acc.observe(_written("c", 0.05, reused=True))
    assert acc.problems(10.0) == []
    for _ in range(10):
        acc.observe(_written("c", 30.0, reused=True))  # 9 % of the kept-alive sends waited
    (problem,) = acc.problems(10.0)
    assert problem.startswith("c: start to sent P99 ")
    assert 29.0 < float(problem.split("P99 ")[1].split(" ms")[0]) < 31.0


def test_a_new_connections_wait_beyond_its_connect_is_named() -> None:
    """A new connection's connect (`ext.connect_ms`) is the request's; the rest of its
    start-to-sent is the client's, as on a kept-alive connection. A record without
    connect_ms (written before it existed) says nothing of it."""
    acc = Accuracy()
    for _ in range(100):
        acc.observe(_written("c", 40.05, reused=False, connect_ms=40.0))  # its connect
        acc.observe(_written("c", 40.0, reused=False))  # no connect_ms: not counted
    assert acc.problems(10.0) == []
    assert acc.cells["c"]["start_to_sent_ms"].count == 100
    assert acc.cells["c"]["start_to_sent_ms"].max <= 0.06
    for _ in range(10):
        acc.observe(_written("c", 70.0, reused=False, connect_ms=40.0))  # 30 ms after it
    (problem,) = acc.problems(10.0)
    assert problem.startswith("c: start to sent P99 ")
    assert 29.0 < float(problem.split("P99 ")[1].split(" ms")[0]) < 31.0


# ------------------------------------------------------------- a real Locust run


@pytest.fixture
def burst_server() -> Iterator[str]:
    """benchmarks/exact_server.py writing two tokens at a time: a 30-ms TTFT, then a
    pair every 10 ms (as vLLM's multi-step scheduling or SGLang's stream interval)."""
    proc = subprocess.Popen(
        [sys.executable, str(EXACT_SERVER), "--ttft-ms", "30", "--itl-ms", "10", "--burst", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("exact-server listening on "), line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def _truth(url: str) -> dict[str, tuple[int, list[int]]]:
    return {rid: (recv, sends) for rid, recv, sends, _ in _get(f"{url}/truth")}


ARGS = ["--protocol", "openai-completions", "--prompt-tokens", "64", "--max-tokens", "8"]
ARGS += ["--arrival", "poisson", "--rate", "10", "-u", "1", "-r", "1", "--only-summary"]
ARGS += ["--accuracy-ms", "10"]  # the default budget (the suite's is off: tests/conftest.py)


@pytest.mark.serial  # the calm run's budget holds on a quiet machine
@pytest.mark.timeout(180)
def test_a_server_that_writes_tokens_in_bursts_passes_and_a_starved_client_does_not(
    tmp_path: Path, burst_server: str
) -> None:
    """The first two tokens of each request arrive in one write after the TTFT, so
    every request's first-token late bound is about the TTFT (30 ms, over the 10-ms
    budget) while its stamp is exact: the run passes (exit 0), its TTFTs within 2 ms of
    the server's own send times. The same run with its process stopped 100 ms in every
    110 (tests.support.starver) reads late: its stamps and sends are late, and it exits 3.
    (Which figures name it depends on where the 1-Hz self-watch samples fell: the late
    bound counts only under one that saw the stall.)"""
    calm = LocustRun(tmp_path, burst_server, ARGS, workers=0, run_time_s=5).start()
    assert calm.wait() == 0, calm.log_text()
    truth = _truth(burst_server)
    d = calm.requests()
    bounds = [b for b in d.column("ext.stamp_late_bound_ms").to_pylist() if b is not None]
    assert len(bounds) >= 20 and sorted(bounds)[len(bounds) // 2] > 25.0, bounds
    assert set(d.column("ext.stamp_source").to_pylist()) == {"kernel"}
    errors = []
    for rid, t0, t4 in zip(
        d.column("request_id").to_pylist(),
        d.column("client_ns.request_start").to_pylist(),
        d.column("client_ns.first_token").to_pylist(),
        strict=True,
    ):
        recv, sends = truth[rid]
        errors.append((t4 - t0) / 1e6 - (sends[0] - recv) / 1e6)
    assert errors and max(errors) < 2.0, errors  # t0 is before the server read: > 0
    assert "did not keep up" not in calm.log_text()

    starved = LocustRun(tmp_path, burst_server, ARGS, workers=0, run_time_s=6).start()
    deadline = time.monotonic() + 60
    sent = _get(f"{burst_server}/count")["received"]
    while _get(f"{burst_server}/count")["received"] == sent:  # until the load starts
        assert starved.master.poll() is None and time.monotonic() < deadline, starved.log_text()
        time.sleep(0.05)
    starver = subprocess.Popen(
        [sys.executable, "-c", STARVER, str(starved.master.pid)], stdout=subprocess.PIPE, text=True
    )
    try:
        time.sleep(5)
    finally:
        starver.terminate()
        cycles = starver.communicate(timeout=10)[0]
    assert starved.wait() == 3, f"{cycles}\n{starved.log_text()}"
    log = starved.log_text()
    assert "the client did not keep up (budget 10 ms, --accuracy-ms) in 1 cell(s): p64-o8: " in log
    ttft = starved.requests().column("durations_ms.ttft").to_pylist()
    assert max(ttft) > 45.0, ttft  # tokens read together after a stop: stamped as the last
