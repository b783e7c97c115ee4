"""The run's live series (calculet_load.locust.series, schema.liveseries): one point of
the LLM table's window, its file in the run folder, read back as declared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calculet_load.locust.livestats import LiveStats
from calculet_load.locust.llmstats import LLMTable
from calculet_load.locust.series import LiveSeries, point_of
from calculet_load.schema.liveseries import (
    LIVE_SERIES_FILE,
    LIVE_SERIES_SCHEMA,
    LiveSeriesPoint,
    read_live_series,
)
from calculet_load.schema.records import SchemaVersionError, TokenEvent
from tests.support.runs import MS, request

S = 1_000_000_000


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table() -> tuple[LLMTable, FakeClock]:
    clock = FakeClock()
    return LLMTable(clock=clock), clock


def test_a_point_holds_the_window_and_the_counts_since_the_reset() -> None:
    table, clock = _table()
    # second 100: 4 successes (TTFT 10..40 ms, TPOT 5 ms, 5 tokens each), 1 failure
    for i in range(4):
        ttft = (i + 1) * 10 * MS
        events = [TokenEvent(f"a{i}", k, ttft + k * 5 * MS, 1, None) for k in range(5)]
        table.observe(request(f"a{i}", t0=0, ttft=ttft, tpot=5 * MS, n=5), events)
    table.observe(request("f", t0=0, error="http_5xx"))
    clock.now = 104.0  # 4 s later: the window covers them all
    live = LiveStats()
    live.in_flight.update({"w00": 3, "w01": 2})
    p = point_of(table, live, wall_ns=7 * S, started_wall_ns=2 * S, users=6, rate=4.0, final=False)
    assert (p.t_s, p.window_s) == (5.0, 4.0)
    # the higher order statistic of 10, 20, 30, 40 ms: p50 is x(3) = 30, p99 x(4) = 40
    assert p.ttft_p50_ms == pytest.approx(30.0, rel=0.01)
    assert p.ttft_p99_ms == pytest.approx(40.0, rel=0.01)
    assert p.tpot_p50_ms == pytest.approx(5.0, rel=0.01)
    assert p.itl_p50_ms == p.itl_p99_ms == pytest.approx(5.0, rel=0.01)
    # 4 x 5 output tokens (the failure's too: it counts what it received) over 4 s
    assert p.window_requests == 5
    assert p.requests_per_s == pytest.approx(5 / 4.0)
    assert (p.requests, p.failures, p.cancelled) == (5, 1, 0)
    assert (p.in_flight, p.users, p.rate) == (5, 6, 4.0)
    # 11 s later nothing is in the window: no data is null, never 0; counts stay
    clock.now = 115.0
    q = point_of(table, None, wall_ns=8 * S, started_wall_ns=2 * S, users=0, rate=None)
    assert (q.ttft_p50_ms, q.tpot_p99_ms, q.itl_p50_ms, q.in_flight) == (None, None, None, None)
    assert q.window_requests == 0 and q.requests == 5


def test_the_series_is_bounded_in_memory_and_whole_in_its_file(tmp_path: Path) -> None:
    table, _ = _table()
    series = LiveSeries(keep=3)
    series.start(str(tmp_path))
    for i in range(5):
        series.add(point_of(table, None, wall_ns=i * S, started_wall_ns=0, users=1, rate=None))
    assert [p["seq"] for p in series.since(0)] == [3, 4, 5]  # the last `keep`
    assert [p["seq"] for p in series.since(4)] == [5]
    series.add(
        point_of(table, None, wall_ns=9 * S, started_wall_ns=0, users=1, rate=None, final=True)
    )
    series.close()
    descriptor = series.descriptor()
    assert descriptor == {"file": LIVE_SERIES_FILE, "schema": LIVE_SERIES_SCHEMA, "points": 6}
    points = read_live_series(str(tmp_path), descriptor)
    assert [p.wall_ns for p in points] == [0, S, 2 * S, 3 * S, 4 * S, 9 * S]
    assert [p.final for p in points] == [False] * 5 + [True]
    # a new run in the same folder starts its own file
    series.start(str(tmp_path))
    series.add(point_of(table, None, wall_ns=S, started_wall_ns=0, users=1, rate=None))
    series.close()
    assert len(read_live_series(str(tmp_path), series.descriptor())) == 1
    assert series.since(0)[0]["seq"] == 1


def test_a_file_that_cannot_be_written_leaves_the_points_on_view(tmp_path: Path) -> None:
    blocked = tmp_path / "run"
    blocked.write_text("a file where the run folder should be")
    table, _ = _table()
    series = LiveSeries()
    series.start(str(blocked))
    series.add(point_of(table, None, wall_ns=S, started_wall_ns=0, users=1, rate=None))
    series.close()
    assert len(series.since(0)) == 1
    assert series.descriptor()["points"] == 0 and "error" in series.descriptor()


def test_the_reader_refuses_a_newer_schema_and_names_a_bad_line(tmp_path: Path) -> None:
    with pytest.raises(SchemaVersionError):
        read_live_series(str(tmp_path), {"schema": "calculet-live-series/v2"})
    assert read_live_series(str(tmp_path), None) == []
    path = tmp_path / LIVE_SERIES_FILE
    path.parent.mkdir(parents=True)
    good = LiveSeriesPoint(
        wall_ns=1, t_s=0.0, window_s=1.0, ttft_p50_ms=None, ttft_p99_ms=None,
        tpot_p50_ms=None, tpot_p99_ms=None, itl_p50_ms=None, itl_p99_ms=None,
        output_tokens_per_s=None, requests_per_s=None, window_requests=0, in_flight=None,
        requests=0, failures=0, cancelled=0, users=1, rate=None,
    ).to_dict()  # fmt: skip
    bad = {k: v for k, v in good.items() if k != "requests"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="line 2: live series point: missing field requests"):
        read_live_series(str(tmp_path), {"schema": LIVE_SERIES_SCHEMA})
