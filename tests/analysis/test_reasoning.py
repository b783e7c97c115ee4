"""Reasoning models in the analysis and the report: `ttft_answer_ms` beside `ttft_ms`,
and the reasoning and answer token totals per cell (analysis.tables.cells), checked by
hand against a tiny run folder and rendered through the real templates."""

from __future__ import annotations

from pathlib import Path

from analysis.analyze import analyze, write_outputs
from analysis.report import build_view, render
from tests.analysis.test_report import check_self_contained
from tests.support.runs import MS, RunBuilder, request


def _reasoning_run(root: Path) -> str:
    """Cell "think": three successes whose answer came after reasoning (TTFT 50 ms, to the
    answer 300, 250, 400 ms) and one failure that must not count; cell "plain": none."""
    b = RunBuilder(root)
    for i, (answer_ms, reasoning, answer) in enumerate(
        ((300, 100, 20), (250, 80, 20), (400, 120, 20))
    ):
        ext = {
            "ttft_answer_ms": float(answer_ms),
            "first_answer_ns": i * 1000 * MS + answer_ms * MS,
            "reasoning_tokens": reasoning,
            "answer_tokens": answer,
        }
        b.add(request(f"t{i}", t0=i * 1000 * MS, cell="think", n=reasoning + answer, ext=ext))
    bad = {"ttft_answer_ms": 900.0, "reasoning_tokens": 500, "answer_tokens": 5}
    b.add(request("tx", t0=4000 * MS, cell="think", error="http_5xx", ext=bad))
    b.add(request("p0", t0=5000 * MS, cell="plain"))
    return b.write()


def test_ttft_answer_and_token_totals_per_cell(tmp_path: Path) -> None:
    run = _reasoning_run(tmp_path)
    result = analyze(run)
    by = {(r["cell_name"], r["metric"]): r for r in result.summary.to_pylist()}
    think = by[("think", "ttft_answer_ms")]
    # successes only: 250, 300, 400 → p50 = x_(2) = 300, max 400; the failure's 900 is out
    assert (think["count"], think["p50"], think["max"]) == (3, 300.0, 400.0)
    assert by[("think", "ttft_ms")]["p50"] == 50.0  # t4: the first token of any kind
    # totals over the successes: reasoning 100 + 80 + 120, answer 3 × 20
    assert (think["reasoning_requests"], think["reasoning_tokens"], think["answer_tokens"]) == (
        3,
        300,
        60,
    )
    assert ("plain", "ttft_answer_ms") not in by  # only where a record has it
    plain = by[("plain", "ttft_ms")]
    assert (plain["reasoning_requests"], plain["reasoning_tokens"], plain["answer_tokens"]) == (
        0,
        None,
        None,
    )


def test_the_report_shows_time_to_answer_and_reasoning_tokens(tmp_path: Path) -> None:
    run = _reasoning_run(tmp_path)
    write_outputs(analyze(run), run)
    html = render(build_view(run))
    page = check_self_contained(html)
    answer = page.tables["metric-ttft_answer_ms"]
    assert [r[:3] for r in answer] == [["think|c1|closed|stream", "measured", "3"]]
    assert answer[0][3].startswith("300.0")
    assert page.tables["reasoning"] == [
        ["think|c1|closed|stream", "measured", "3", "3", "300", "60", "83.3%"]
    ]
    # shown open beside TTFT, not folded away
    head = html[: html.index('data-table="metric-ttft_answer_ms"')]
    assert head.rfind("<details>") < head.rfind("</details>") or "<details>" not in head
