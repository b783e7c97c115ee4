"""The client's self-check (calculet_load.locust.accuracy): cells where it fell behind
are named from its own records, across workers, against the run's budget."""

from __future__ import annotations

import json
from typing import Any

from calculet_load.locust.accuracy import Accuracy, check_reports
from calculet_load.schema.records import ClientNs, Ext, RequestRecord


def _record(cell: str, wait: float | None, lag: float | None = None, **ext: Any) -> RequestRecord:
    return RequestRecord(
        run_id="r",
        request_id="x",
        ext=Ext(cell=cell, stamp_late_bound_ms=wait, send_lag_ms=lag, **ext),
    )


def test_a_cell_over_budget_is_named_with_its_figure() -> None:
    acc = Accuracy()
    for i in range(200):
        acc.observe(_record("short", 0.2 + i / 1000))  # kept up: P99 < 1 ms
        acc.observe(_record("long", 30.0 if i % 10 == 0 else 0.5))  # 10 % waited 30 ms
    problems = acc.problems(10.0)
    assert len(problems) == 1
    assert problems[0].startswith("long: stamp late bound P99 ")
    assert 29.0 < float(problems[0].split("P99 ")[1].split(" ms")[0]) < 31.0


def test_send_lag_counts_and_dropped_arrivals_do_not() -> None:
    acc = Accuracy()
    for _ in range(100):
        acc.observe(_record("open", None, lag=25.0))
        acc.observe(_record("dropped", 500.0, lag=500.0, dropped=True))
    assert acc.problems(10.0) == ["open: send lag P99 25.0 ms"]


def test_workers_reports_add_up_through_json() -> None:
    """The master judges the sum of its workers' histograms, as sent over the wire."""
    a, b = Accuracy(), Accuracy()
    for _ in range(100):
        a.observe(_record("c", 0.5))
    for _ in range(100):
        b.observe(_record("c", 50.0))  # one worker fell behind: half the cell's requests
    reports = [json.loads(json.dumps({"accuracy": w.to_wire()})) for w in (a, b)]
    (problem,) = check_reports(reports, 10.0)
    assert problem.startswith("c: stamp late bound P99 ")  # within the histogram's 1 % of 50
    assert 49.4 <= float(problem.split("P99 ")[1].split(" ms")[0]) <= 50.6
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
