"""Per-cell tables (analysis.tables.cells): keys, counts, ITL, steady throughput, the summary
files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from analysis.analyze import analyze, write_outputs
from analysis.tables.cells import CellKey, summarize_cells
from analysis.tables.join import load_run
from analysis.tables.quality import apply_quality
from analysis.tables.summary import summary_table
from calculet_load.schema.records import RequestRecord, TokenEvent
from tests.support.runs import MS, RunBuilder, request


def _summaries(run_dir: str, trim: float = 0.0):  # type: ignore[no-untyped-def]
    run = load_run(run_dir)
    table, _ = apply_quality(run)
    summaries, _ = summarize_cells(table, run.tokens, trim_fraction=trim)
    return summaries


def test_cell_label() -> None:
    assert CellKey("p16-o32", 1, "closed", True).label == "p16-o32|c1|closed|stream"
    assert CellKey(None, None, "poisson", False).label == "-|-|poisson|whole"


def test_cells_partitions_and_error_classes(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    b.add(request("a1", t0=0, cell="a")).add(request("a2", t0=MS, cell="a", error="http_5xx"))
    b.add(request("a3", t0=2 * MS, cell="a", error="total_timeout"))
    b.add(request("a4", t0=3 * MS, cell="a", error="cancelled", ext={"cancelled_at": "mid_stream"}))
    b.add(request("a5", t0=4 * MS, cell="a", error="dropped", ext={"dropped": True}))
    b.add(request("a6", t0=5 * MS, cell="a", quality={"throttled": True}))
    b.add(request("b1", t0=0, cell="a", concurrency=4))  # another cell: concurrency differs
    got = {(s.key.label, s.partition): s for s in _summaries(b.write())}
    assert set(got) == {
        ("a|c1|closed|stream", "measured"),
        ("a|c1|closed|stream", "throttled"),
        ("a|c4|closed|stream", "measured"),
    }
    m = got[("a|c1|closed|stream", "measured")]
    assert (m.records, m.ok, m.errors, m.cancelled, m.dropped) == (4, 1, 2, 1, 1)
    assert m.errors_by_class == {"http_5xx": 1, "total_timeout": 1}
    assert m.error_rate == pytest.approx(2 / 3)  # the deliberate cancel is not an attempt
    assert m.metrics["ttft_ms"].count == 1  # failures never enter latency statistics
    assert got[("a|c1|closed|stream", "throttled")].ok == 1


def test_itl_per_token_from_events(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    rec = request("r", t0=0, n=4)  # t4 = 50 ms
    b.add(rec, tokens=False)
    # events: 1 token at 50 ms, 2 tokens at 60 ms, 1 token at 90 ms →
    # gaps 10 ms / 2 tokens = 5, 5; 30 ms / 1 token = 30
    b.tokens += [
        TokenEvent("r", 0, 50 * MS, 1, 1),
        TokenEvent("r", 1, 55 * MS, 0, 1),  # a usage-only event carries no token: skipped
        TokenEvent("r", 2, 60 * MS, 2, 3),
        TokenEvent("r", 3, 90 * MS, 1, 4),
    ]
    (s,) = _summaries(b.write())
    itl = s.metrics["itl_ms"]
    assert itl.count == 3
    assert (itl.min, itl.max) == (5.0, 30.0)
    assert itl.p50.value == 5.0  # sorted 5, 5, 30: k = ceil(0.5 · 2) + 1 = 2 → 5


def test_steady_throughput_known_answer(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    # r1: t0 0, tokens at 50, 60, 70, 80, 90 ms, ends 90.1 ms
    # r2: t0 100 ms, tokens at 150 … 190 ms, ends 190.1 ms
    b.add(request("r1", t0=0)).add(request("r2", t0=100 * MS))
    run_dir = b.write()
    (s,) = _summaries(run_dir, trim=0.0)
    # window [0, 190.1 ms]: 10 tokens / 0.1901 s; both requests end inside it
    assert s.steady_output_tokens_per_s == pytest.approx(10 / 0.1901)
    assert s.steady_requests_per_s == pytest.approx(2 / 0.1901)
    (s,) = _summaries(run_dir, trim=0.1)
    # trim 19.01 ms a side → [19.01, 171.09] ms: tokens 50 … 90, 150, 160, 170 = 8,
    # one request ends inside; length 152.08 ms
    assert s.steady_output_tokens_per_s == pytest.approx(8 / 0.15208)
    assert s.steady_requests_per_s == pytest.approx(1 / 0.15208)
    assert s.output_tokens == 10


def test_whole_responses_spread_their_tokens(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    b.add(request("r", t0=0, n=5, stream=False), tokens=False)
    (s,) = _summaries(b.write())
    # no token events: 5 tokens spread over t4 50 ms → t5 90 ms, window [0, 90.1 ms]
    assert s.steady_output_tokens_per_s == pytest.approx(5 / 0.0901)


def test_open_loop_latency_from_intended_time(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    ext = {"intended_start_ns": 0, "send_lag_ms": 2.0, "ttft_from_intended_ms": 52.0}
    b.add(request("r", t0=2 * MS, concurrency=None, arrival="poisson", ext=ext))
    (s,) = _summaries(b.write())
    assert s.key.label == "c|-|poisson|stream"
    assert s.metrics["ttft_from_intended_ms"].p50.value == 52.0
    assert s.metrics["ttft_ms"].p50.value == 50.0
    assert s.metrics["send_lag_ms"].p50.value == 2.0


def test_summary_files(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    for i in range(20):
        b.add(request(f"r{i}", t0=i * 100 * MS, ttft=(40 + i) * MS))
    run_dir = b.write()
    result = analyze(run_dir)
    write_outputs(result, run_dir)
    table = pq.read_table(tmp_path / "summary.parquet")
    csv = pacsv.read_csv(tmp_path / "summary.csv")
    assert table.num_rows == csv.num_rows == 4  # ttft, tpot, e2e, itl
    assert table.schema.metadata[b"schema"] == b"calculet-summary/v1"
    row = {r["metric"]: r for r in table.to_pylist()}["ttft_ms"]
    # TTFT 40 … 59 ms: p50 = x_(ceil(0.5 · 19) + 1 = 11) = 50 ms, mean 49.5 ms
    assert row["p50"] == 50.0 and row["mean"] == pytest.approx(49.5)
    assert row["count"] == 20 and row["cell"] == "c|c1|closed|stream"
    assert row["percentile_method"] == "higher"
    assert row["p50_lo"] is not None and row["p50_lo"] <= 50.0 <= row["p50_hi"]
    assert "p99 rests on n=20" in row["warnings"]


def test_summary_table_of_nothing() -> None:
    assert summary_table([]).num_rows == 0


def _counted_by_events(
    rid: str, t0: int, ext: dict[str, object]
) -> tuple[RequestRecord, list[TokenEvent]]:
    """A request whose server confirmed 5 tokens while its 5 events counted 2 each (a
    local tokenizer re-counting each event's text), at 50 … 90 ms after t0."""
    rec = request(rid, t0=t0)
    rec = dataclasses.replace(
        rec, ext=dataclasses.replace(rec.ext, **{"client_output_tokens": 10, **ext})
    )
    t4 = t0 + 50 * MS
    return rec, [TokenEvent(rid, i, t4 + i * 10 * MS, 2, 2 * (i + 1)) for i in range(5)]


@pytest.mark.parametrize(
    "ext",
    [
        {"token_count_source": "tokenizer+usage_total", "token_total_source": "server"},
        # written before the total's source was recorded: the events' sum was not kept
        # (client_output_tokens took the server's total), so it is summed from the events
        {"token_count_source": "tokenizer+usage_total", "client_output_tokens": 5},
    ],
    ids=["recorded", "older"],
)
def test_tokens_count_to_each_requests_confirmed_total(
    tmp_path: Path, ext: dict[str, object]
) -> None:
    """r1's events place its tokens in time, its server's total (5) counts: each event
    weighs 5 / 10 of its own count. The figures are then those of two requests of 5
    tokens (test_steady_throughput_known_answer), not 15 tokens."""
    b = RunBuilder(tmp_path)
    rec, events = _counted_by_events("r1", 0, ext)
    b.add(rec, tokens=False).add(request("r2", t0=100 * MS))
    b.tokens += events
    run_dir = b.write()
    (s,) = _summaries(run_dir, trim=0.0)
    assert s.output_tokens == 10
    assert s.steady_output_tokens_per_s == pytest.approx(10 / 0.1901)
    (s,) = _summaries(run_dir, trim=0.1)
    assert s.steady_output_tokens_per_s == pytest.approx(8 / 0.15208)
    # ITL keeps the events' own counts: r1's 4 gaps of 10 ms over 2 tokens each (8
    # values of 5 ms), r2's 4 of 10 ms over 1
    itl = s.metrics["itl_ms"]
    assert (itl.count, itl.min, itl.max) == (12, 5.0, 10.0)
