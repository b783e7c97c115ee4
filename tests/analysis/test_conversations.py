"""Conversations and prefix caching in the analysis and the report: TTFT by turn and by
cached share (analysis.tables.conversations, `conversations.*`) and the TTFT-vs-context
plot.

Every figure is checked by hand against tiny run folders (tests/support/runs.py); the
report is rendered through the real templates.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from analysis.analyze import analyze, write_outputs
from analysis.report import build_view, render
from analysis.tables.conversations import SHARE_GROUPS, share_groups
from analysis.views import plots
from tests.analysis.test_report import check_self_contained
from tests.support.runs import MS, RunBuilder, request

CELL = "chat|c2|closed|stream"

# (request id, session, turn, context tokens, cached tokens or None, TTFT ms)
TURNS: list[tuple[str, str, int, int, int | None, int]] = [
    ("a0", "s1", 0, 100, 0, 40),  # share 0          → "0"
    ("a1", "s1", 1, 200, 100, 30),  # 50%            → (25, 50%]
    ("a2", "s1", 2, 400, 300, 20),  # 75%: an edge   → (50, 75%]
    ("b0", "s2", 0, 100, None, 44),  # not said      → not reported
    ("b1", "s2", 1, 200, 150, 28),  # 75%            → (50, 75%]
    ("b2", "s2", 2, 400, 380, 16),  # 95%            → (75, 100%]
    ("c0", "s3", 0, 100, 25, 36),  # 25%: an edge    → (0, 25%]
    ("c1", "s3", 1, 200, 201, 12),  # 100.5%         → over 100%
]


def _conversation_run(root: Path) -> str:
    """TURNS, plus what must not count: a failed turn, a warmup turn, and a request of
    another cell without a turn index."""
    b = RunBuilder(root)
    for i, (rid, session, turn, context, cached, ttft) in enumerate(TURNS):
        ext = {"session_id": session, "turn": turn, "cached_prompt_tokens": cached}
        b.add(
            request(
                rid,
                t0=i * 200 * MS,
                ttft=ttft * MS,
                cell="chat",
                concurrency=2,
                prompt_tokens=context,
                ext=ext,
            )
        )
    failed = {"session_id": "s2", "turn": 3, "cached_prompt_tokens": 790}
    b.add(request("b3", t0=9 * 200 * MS, cell="chat", concurrency=2, error="http_5xx", ext=failed))
    warm = {"session_id": "w", "turn": 0, "cached_prompt_tokens": 0}
    b.add(
        request(
            "w0", t0=10 * 200 * MS, cell="chat", concurrency=2, quality={"warmup": True}, ext=warm
        )
    )
    b.add(request("p0", t0=11 * 200 * MS, cell="plain", ttft=500 * MS))
    return b.write()


def _rows(table: Any, by: str) -> dict[str, dict[str, Any]]:
    return {r["group"]: r for r in table.to_pylist() if r["by"] == by}


def test_ttft_by_turn_counts_measured_successful_turns(tmp_path: Path) -> None:
    run = _conversation_run(tmp_path)
    result = analyze(run)
    assert result.conversations is not None
    turns = _rows(result.conversations, "turn")
    assert list(turns) == ["0", "1", "2"]  # turn 3 failed: no row
    t0, t1, t2 = turns["0"], turns["1"], turns["2"]
    assert {r["cell"] for r in turns.values()} == {CELL}
    # turn 0: TTFT 40, 44, 36 (the warmup turn 0 is left out) → sorted 36, 40, 44;
    # p50 = x_(ceil(0.5·2) + 1 = 2) = 40, p90 = x_(ceil(0.9·2) + 1 = 3) = 44
    assert (t0["count"], t0["sessions"], t0["turn"]) == (3, 3, 0)
    assert (t0["p50"], t0["p90"], t0["p99"]) == (40.0, 44.0, 44.0)
    assert t0["p50_lo"] is None and t0["p50_hi"] is None  # n = 3: no interval at 95%
    # context 100 each; shares reported 0 and 0.25 (b0's null is not a 0): x_(2) = 0.25
    assert (t0["prompt_tokens_p50"], t0["cached_reported"], t0["cached_share_p50"]) == (
        100.0,
        2,
        0.25,
    )
    # turn 1: TTFT 30, 28, 12 → p50 x_(2) = 28; shares 0.5, 0.75, 1.005 → x_(2) = 0.75
    assert (t1["count"], t1["p50"], t1["p90"], t1["cached_share_p50"]) == (3, 28.0, 30.0, 0.75)
    # turn 2: TTFT 20, 16 → p50 = x_(ceil(0.5) + 1 = 2) = 20
    assert (t2["count"], t2["sessions"], t2["p50"], t2["cached_share_p50"]) == (2, 2, 20.0, 0.95)


def test_ttft_by_cached_share_bins_and_nulls(tmp_path: Path) -> None:
    result = analyze(_conversation_run(tmp_path))
    assert result.conversations is not None
    bins = _rows(result.conversations, "cached_share")
    assert list(bins) == list(SHARE_GROUPS)  # every group has a request here, in order
    assert {g: r["count"] for g, r in bins.items()} == {
        "0": 1,
        "(0, 25%]": 1,
        "(25, 50%]": 1,
        "(50, 75%]": 2,
        "(75, 100%]": 1,
        "over 100%": 1,
        "not reported": 1,
    }
    assert {g: r["p50"] for g, r in bins.items()} == {
        "0": 40.0,  # a0
        "(0, 25%]": 36.0,  # c0, exactly 25%
        "(25, 50%]": 30.0,  # a1
        "(50, 75%]": 28.0,  # a2 20, b1 28: x_(2) = 28
        "(75, 100%]": 16.0,  # b2
        "over 100%": 12.0,  # c1: never clipped into (75, 100%]
        "not reported": 44.0,  # b0
    }
    assert bins["not reported"]["cached_reported"] == 0
    assert bins["not reported"]["cached_share_p50"] is None
    assert all(r["turn"] is None for r in bins.values())


def test_share_groups_decide_edges_in_integers() -> None:
    import pyarrow as pa

    cached = [0, 1, 25, 26, 50, 75, 76, 100, 101, None, 5, 1]
    prompt = [100, 100, 100, 100, 100, 100, 100, 100, 100, 100, None, 3]
    t = pa.table(
        {
            "ext.cached_prompt_tokens": pa.array(cached, pa.int64()),
            "workload.prompt_tokens": pa.array(prompt, pa.int64()),
        }
    )
    got = [SHARE_GROUPS[g] for g in share_groups(t)]
    assert got == [
        "0",
        "(0, 25%]",
        "(0, 25%]",
        "(25, 50%]",
        "(25, 50%]",
        "(50, 75%]",
        "(75, 100%]",
        "(75, 100%]",
        "over 100%",
        "not reported",  # the server did not say
        "not reported",  # no prompt length: no share
        "(25, 50%]",  # 1/3 = 33.3%: 4·1 ≤ 2·3
    ]


def test_quantile_intervals_are_the_projects(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    for i in range(20):  # 20 sessions' turn 0, TTFT 1 … 20 ms
        ext = {"session_id": f"s{i}", "turn": 0, "cached_prompt_tokens": 0}
        b.add(request(f"r{i}", t0=i * 100 * MS, ttft=(i + 1) * MS, ext=ext))
    result = analyze(b.write())
    assert result.conversations is not None
    row = _rows(result.conversations, "turn")["0"]
    # p50 = x_(ceil(0.5·19) + 1 = 11) = 11; binomial order-statistic interval for n = 20:
    # l = F⁻¹(0.025) = 6, u = F̄⁻¹(0.025) + 1 = 15 → [x_(6), x_(15)] = [6, 15]
    assert (row["p50"], row["p50_lo"], row["p50_hi"]) == (11.0, 6.0, 15.0)
    # p90 = x_(ceil(0.9·19) + 1 = 19) = 19: no upper bound at n = 20
    assert (row["p90"], row["p90_hi"]) == (19.0, None)
    assert row["warnings"] == (
        "p90 rests on n=20 < 36: no finite upper bound at 95%; "
        "p99 rests on n=20 < 368: no finite upper bound at 95%"
    )
    assert row["quantile_ci_method"].startswith("binomial order-statistic")
    assert row["level"] == 0.95


def test_conversation_files_are_written_and_named(tmp_path: Path) -> None:
    run = _conversation_run(tmp_path)
    result = analyze(run)
    write_outputs(result, run)
    table = pq.read_table(tmp_path / "conversations.parquet")
    csv = pacsv.read_csv(tmp_path / "conversations.csv")
    assert table.schema.metadata[b"schema"] == b"calculet-conversations/v1"
    assert table.num_rows == csv.num_rows == 3 + 7  # three turns, seven share groups
    assert table.column("by").to_pylist() == ["turn"] * 3 + ["cached_share"] * 7
    doc = json.loads((tmp_path / "verdict.json").read_text())
    assert doc["outputs"][-2:] == ["conversations.parquet", "conversations.csv"]


def test_a_run_without_conversations_has_no_file_and_no_section(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    b.add(request("r0", t0=0)).add(request("r1", t0=100 * MS))
    run = b.write()
    # a file left by an earlier analysis must not outlive the records it described
    (tmp_path / "conversations.csv").write_text("stale\n")
    result = analyze(run)
    assert result.conversations is None
    write_outputs(result, run)
    assert not (tmp_path / "conversations.csv").exists()
    assert not (tmp_path / "conversations.parquet").exists()
    assert "conversations.csv" not in json.loads((tmp_path / "verdict.json").read_text())["outputs"]
    page = check_self_contained(render(build_view(run)))
    assert "conversations" not in page.sections
    assert 'href="#conversations"' not in render(build_view(run))


def test_the_report_shows_the_conversations_section(tmp_path: Path) -> None:
    run = _conversation_run(tmp_path)
    write_outputs(analyze(run), run)
    html = render(build_view(run))
    page = check_self_contained(html)
    assert "conversations" in page.sections
    turns = page.tables["conversation-turn"]
    assert [r[:4] for r in turns] == [
        [CELL, "0", "3", "3"],
        [CELL, "1", "3", "3"],
        [CELL, "2", "2", "2"],
    ]
    assert turns[0][6] == "25.0%"  # cached share P50 of turn 0
    assert turns[0][7] == "40.00 [no interval: n\xa0=\xa03\xa0<\xa06 for P50 at 95%]"
    # and what an interval needs (min_n_for_ci at 95%: P50 6, P90 36, P99 368); at
    # n = 3 the P90 and P99 have their lower bound x_(1), not their upper one
    assert turns[0][-1] == (
        "p50 bound needs n ≥ 6; p90 upper bound needs n ≥ 36; p99 upper bound needs n ≥ 368"
    )
    shares = {r[1]: r for r in page.tables["conversation-cached-share"]}
    assert list(shares) == list(SHARE_GROUPS)
    assert shares["(50, 75%]"][2] == "2" and shares["(50, 75%]"][7].startswith("28.00")
    assert shares["not reported"][5:7] == ["0", "–"]
    # the plot: every turn a point, the not-reported one a grey cross with its legend
    assert 'data-figure="ttft-context"' in html
    svg = html[html.index('data-figure="ttft-context"') :]
    svg = svg[: svg.index("</figure>")]
    assert "8 successful measured turns" in svg and "(1 not reported)" in svg
    assert "cached tokens not reported" in svg and "cached share of the context" in svg


def test_a_turn_run_without_the_analysis_says_what_is_missing(tmp_path: Path) -> None:
    run = _conversation_run(tmp_path)
    html = render(build_view(run))
    page = check_self_contained(html)
    text = page.sections["conversations"]
    assert "no data in this run: conversations.parquet is missing" in text
    assert 'data-figure="ttft-context"' in html  # the plot is a view of the records


def _ticks(svg: str) -> list[str]:
    """The texts of an SVG's tick labels (fonttype none keeps them as text)."""
    return [t.strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]


def test_the_scatter_has_plain_number_axes() -> None:
    # contexts up to 3 million: matplotlib's default would write "1e6" beside the axis
    svg = plots.shaded_scatter(
        [1_000_000.0, 2_000_000.0, 3_000_000.0],
        [0.001, 0.002, 0.0015],
        [0.0, 0.5, float("nan")],
        title="t",
        xlabel="x",
        ylabel="y",
        shade_label="share",
        missing_label="not reported",
    )
    texts = _ticks(svg)
    assert "3,000,000" in texts and "0.002" in texts
    assert not any(re.search(r"\de[+-]?\d|×|\^|\$", t) for t in texts), texts
    assert "100%" in texts  # the colour bar is in %


@pytest.mark.parametrize("cached", [None, 0])
def test_null_cached_tokens_are_never_a_zero_share(tmp_path: Path, cached: int | None) -> None:
    b = RunBuilder(tmp_path)
    b.add(request("r", t0=0, ext={"session_id": "s", "turn": 0, "cached_prompt_tokens": cached}))
    result = analyze(b.write())
    assert result.conversations is not None
    (row,) = _rows(result.conversations, "cached_share").values()
    assert row["group"] == ("not reported" if cached is None else "0")
