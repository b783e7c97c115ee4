"""The run over time (analysis.tables.series, `timeseries.parquet`/`.csv`): windows, the
figures of each one checked by hand, the rate changes of a Locust plan, events split
across parts, and the files `analyze` writes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from analysis.analyze import analyze, write_outputs
from analysis.tables.join import load_run
from analysis.tables.load import TokenParts
from analysis.tables.quality import apply_quality
from analysis.tables.series import (
    MAX_WINDOWS,
    SERIES_SCHEMA,
    itl_bin,
    itl_bin_value,
    rate_changes,
    series_table,
)
from calculet_load.schema.arrow import SelfWatchRow, token_events_table
from tests.support.runs import MS, WALL0, RunBuilder, request, tokens_for

S = 1000 * MS


def _run(root: Path) -> str:
    """Three 1-s windows from r0's start (wall WALL0):
    w0  r0 t0 0, TTFT 100, TPOT 10 ms, 5 tokens (100..140 ms, ends 140.1)
        r1 t0 500, TTFT 300, TPOT 20 ms (800..880 ms, ends 880.1)
    w1  r2 t0 1,000, TTFT 200, TPOT 10 (1,200..1,240); r3 t0 1,200 failed
    w2  r4 t0 2,000, TTFT 50, TPOT 10, not streamed: 5 tokens spread 2,050..2,090 ms;
        the run ends at its end, 2,090.1 ms
    self-watch: w00 in flight 1 then 3 in w0, 2 in w1; w01 (its arrival dropped: not
        sent) in flight 4 in w0
    plan: poisson at 2/s from WALL0, 4/s from 1.5 s."""
    b = RunBuilder(root)
    b.add(request("r0", t0=0, ttft=100 * MS))
    b.add(request("r1", t0=500 * MS, ttft=300 * MS, tpot=20 * MS), tpot=20 * MS)
    b.add(request("r2", t0=S, ttft=200 * MS))
    b.add(request("r3", t0=1200 * MS, error="http_5xx"))
    b.add(request("r4", t0=2 * S, ttft=50 * MS, stream=False), tokens=False)
    # w01 sent nothing (its one arrival dropped) but watched itself
    b.add(request("d0", t0=300 * MS, worker="w01", ext={"dropped": True}), tokens=False)
    b.watch += [
        SelfWatchRow("w00", t, WALL0 + t, 1.0, 10.0, None, n, None)
        for t, n in ((100 * MS, 1), (600 * MS, 3), (1100 * MS, 2))
    ]
    b.watch.append(SelfWatchRow("w01", 300 * MS, WALL0 + 300 * MS, 1.0, 10.0, None, 4, None))
    b.complete_index()
    assert b.index is not None
    b.index["plan"] = {"arrival": "poisson", "rate": 2.0, "origin_wall_ns": WALL0,
                       "rate_changes": [[1500 * MS, 4.0]]}  # fmt: skip
    return b.write()


def _series(run: str, tokens: TokenParts | None = None) -> dict[str, list[Any]]:
    data = load_run(run)
    table, _ = apply_quality(data)
    t = series_table(
        table, tokens or data.tokens, selfwatch=data.selfwatch, index=data.index,
        client_offsets_ns=data.client_offsets_ns,
    )  # fmt: skip
    assert t is not None
    return {name: t.column(name).to_pylist() for name in t.column_names}


def test_every_window_by_hand(tmp_path: Path) -> None:
    s = _series(_run(tmp_path / "run"))
    assert s["window"] == [0, 1, 2]
    assert s["start_wall_ns"] == [WALL0, WALL0 + S, WALL0 + 2 * S]
    assert s["width_s"] == [1.0, 1.0, pytest.approx(0.0901)]  # the last ends with the run
    assert (s["started"], s["ok"], s["failed"]) == ([2, 2, 1], [2, 1, 1], [0, 1, 0])
    # P50 by numpy "higher" of [100, 300] is x_(⌈0.5⌉+1) = 300; P99 too
    assert (s["ttft_n"], s["ttft_p50_ms"], s["ttft_p99_ms"]) == ([2, 1, 1], [300, 200, 50],
                                                                   [300, 200, 50])  # fmt: skip
    assert s["tpot_p50_ms"] == [20, 10, 10]
    # ITL: r0 four gaps of 10 ms and r1 four of 20 ms in w0; r2's four in w1; r4 none
    assert s["itl_n"] == [8, 4, 0]
    assert s["itl_p50_ms"][0] == pytest.approx(20, rel=1.2e-3)  # x_(⌈3.5⌉+1) = x_(5)
    assert s["itl_p99_ms"][1] == pytest.approx(10, rel=1.2e-3)
    assert s["itl_p50_ms"][2] is None  # no value is null, never 0
    # tokens: 10 in w0, 5 in w1, r4's 5 spread over 2,050..2,090 inside w2 (90.1 ms)
    assert s["output_tokens_per_s"] == [10.0, 5.0, pytest.approx(5 / 0.0901)]
    # in flight: r0 140.1 + r1 380.1 ms in w0; r2 240.1 ms + r3 (t0 1,200, its stamps
    # to t6 = 1,200 + 50 + 40 + 0.1) 90.1 ms in w1; r4 90.1 ms over w2's 90.1 ms
    assert s["in_flight_mean"] == [pytest.approx(0.5202), pytest.approx(0.3302), pytest.approx(1)]
    # self-watch: w00's highest 3 plus w01's 4 in w0; w00's 2 alone in w1; none in w2
    assert s["in_flight_max"] == [7.0, 2.0, None]
    assert s["target_rate"] == [2.0, 2.0, 4.0]


def test_tokens_count_to_each_requests_confirmed_total(tmp_path: Path) -> None:
    """A request whose server's usage says 10 tokens over 5 events of 1 (a token ended
    inside a character came with the next): the window counts 10, as the cells do."""
    b = RunBuilder(tmp_path / "run")
    rec = request("r0", t0=0, ext={"token_total_source": "usage"})
    b.add(rec)  # events of 1 token each, 5 in all
    b.records[-1] = dataclasses.replace(
        rec, workload=dataclasses.replace(rec.workload, actual_output_tokens=10)
    )
    b.add(request("r1", t0=500 * MS, ext={"token_total_source": "usage"}))
    b.complete_index()
    s = _series(b.write())
    # r1 ends at 500 + 50 + 4 x 10 ms + 0.1: the one window is 590.1 ms
    assert s["output_tokens_per_s"] == [pytest.approx(15 / 0.5901)]


def test_the_files_analyze_writes(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    result = analyze(run)
    write_outputs(result, run)
    assert {"timeseries.parquet", "timeseries.csv"} <= set(result.document["outputs"])
    t = pq.read_table(Path(run) / "timeseries.parquet")
    meta = t.schema.metadata
    assert meta[b"schema"] == SERIES_SCHEMA.encode() and meta[b"width_s"] == b"1"
    assert json.loads(meta[b"rate_changes"]) == [[WALL0 + 1500 * MS, 4.0]]
    assert json.loads(meta[b"initial_rate"]) == [WALL0, 2.0]
    csv = pacsv.read_csv(Path(run) / "timeseries.csv")
    assert csv.column_names == t.column_names and csv.num_rows == 3
    # an analysis of a folder where no request was sent removes files an earlier one left
    b = RunBuilder(tmp_path / "empty")
    b.add(request("d0", t0=0, ext={"dropped": True}))
    empty = b.write()
    (Path(empty) / "timeseries.csv").write_text("stale")
    gone = analyze(empty)
    assert gone.timeseries is None and "timeseries.csv" not in gone.document["outputs"]
    write_outputs(gone, empty)
    assert not (Path(empty) / "timeseries.csv").exists()


def test_events_split_across_parts_give_the_same_series(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    whole = _series(run)
    events = [e for r in ("r0", "r1", "r2") for e in tokens_for(_rec(run, r), _tpot(r))]
    # r0's and r1's events alternate between two parts (a restarted worker reusing ids)
    a = [e for i, e in enumerate(events) if e.request_id == "r2" or i % 2]
    b = [e for i, e in enumerate(events) if e.request_id != "r2" and not i % 2]
    paths = []
    for i, chunk in enumerate((a, b)):
        path = tmp_path / f"part-{i:05d}.tokens.parquet"
        pq.write_table(token_events_table(chunk), path)
        paths.append(str(path))
    split = _series(run, TokenParts(pafs.LocalFileSystem(), tuple(paths)))
    for name in ("itl_n", "itl_p50_ms", "itl_p99_ms", "output_tokens_per_s"):
        assert split[name] == whole[name], name


def _tpot(rid: str) -> int:
    return 20 * MS if rid == "r1" else 10 * MS


def _rec(run: str, rid: str) -> Any:
    t0 = {"r0": 0, "r1": 500 * MS, "r2": S}[rid]
    ttft = {"r0": 100, "r1": 300, "r2": 200}[rid] * MS
    return request(rid, t0=t0, ttft=ttft, tpot=_tpot(rid))


def test_windows_stay_few_and_bins_stay_close() -> None:
    from analysis.tables.series import _width_s

    for span_s in (1, 30, 149.9, 150, 151, 3600, 86_400, 72 * 3600, 10**6):
        span = int(span_s * 1e9)
        w = _width_s(span)
        assert span // (w * 1_000_000_000) + 1 <= MAX_WINDOWS, span_s
    # a value's bin stands for it within 0.12% (1 µs below 1 µs)
    ms = np.geomspace(1e-3, 1e5, 10_001)
    back = itl_bin_value(itl_bin(ms))
    assert np.all(np.abs(back / ms - 1) <= 1.2e-3)
    assert itl_bin_value(itl_bin(np.array([0.0, 4e-4]))).tolist() == [0.0, 0.0]


def test_rate_changes_only_for_an_open_loop_plan() -> None:
    plan = {"arrival": "constant", "rate": 1.5, "origin_wall_ns": 10, "rate_changes": [[5, 3]]}
    first, changes = rate_changes({"plan": plan})
    assert first is not None and (first.wall_ns, first.rate) == (10, 1.5)
    assert [(c.wall_ns, c.rate) for c in changes] == [(15, 3.0)]
    assert rate_changes({"plan": {**plan, "arrival": "closed"}}) == (None, [])
    assert rate_changes(None) == (None, [])


def test_the_report_draws_the_series_with_each_rate_change_marked(tmp_path: Path) -> None:
    from analysis.report import build_view, render
    from tests.analysis.test_report import Page

    run = _run(tmp_path / "run")
    before = build_view(run)  # not analysed yet: the series from the records, said so
    (section,) = [s for s in before.lead if s.id == "overtime"]
    assert "computed from the records (timeseries.parquet is missing" in section.intro[0]
    write_outputs(analyze(run), run)
    html = render(build_view(run))
    text = Page(html).sections["overtime"]
    assert "3 windows of 1 s from timeseries.parquet" in text
    assert "rate changes (client/index.json plan): rate → 4/s at 1.5 s" in text
    figure = html[html.index('<figure data-figure="overtime"') :]
    figure = figure[: figure.index("</figure>")]
    assert "rate → 4/s" in figure  # the mark, drawn on the panels
    for label in ("TTFT ms", "TPOT ms", "ITL ms", "output tokens/s", "requests in flight",
                  "requests/s", "plan's rate"):  # fmt: skip
        assert label in figure, label


def test_a_figure_no_window_has_is_said_not_drawn_empty(tmp_path: Path) -> None:
    from analysis.report import build_view

    b = RunBuilder(tmp_path / "run")
    for i in range(4):  # whole (not streamed) responses: no token event, so no ITL
        b.add(request(f"r{i}", t0=i * 300 * MS, stream=False), tokens=False)
    run = b.write()
    write_outputs(analyze(run), run)
    (section,) = [s for s in build_view(run).lead if s.id == "overtime"]
    assert section.notes == [
        "ITL: no value in any window (no token events: the responses were not streamed, "
        "or their events not kept)"
    ]
    assert "ITL ms" not in section.figures[0].svg and "TTFT ms" in section.figures[0].svg
