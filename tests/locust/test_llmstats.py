"""The LLM table: analyze's definitions per cell, reset, the recent window,
the merge across workers, and the CSV/HTML/tab forms of it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from analysis.stats.quantiles import quantile
from calculet_load.locust.livestats import LogHistogram
from calculet_load.locust.llmreport import (
    CSV_COLUMNS,
    SECTION_ID,
    csv_rows,
    history_rows,
    html_section,
    inject,
    tab_rows,
)
from calculet_load.locust.llmstats import AGGREGATED, LLMTable, cell_name, itl_gaps
from calculet_load.schema.records import TokenEvent
from tests.support.runs import MS, request


def _ev(i: int, t_ms: int, tokens: int) -> TokenEvent:
    return TokenEvent("r", i, t_ms * MS, tokens, None)


def test_itl_is_per_token_gap_over_the_later_events_tokens_as_analyze_computes_it() -> None:
    # a role-only event (0 tokens) at 0 is skipped; tokens 1, 2, 1 at 5, 15, 19 ms:
    # gaps 10 ms over 2 tokens -> 5 ms twice; 4 ms over 1 token -> 4 ms once
    events = [_ev(0, 0, 0), _ev(1, 5, 1), _ev(2, 15, 2), _ev(3, 19, 1)]
    assert list(itl_gaps(events)) == [(5.0, 2), (4.0, 1)]
    t = LLMTable()
    t.observe(request("a", t0=0, cell="short"), events)
    h = t.entries()["short"].hist["itl_ms"]
    assert h.count == 3 and h.sum == pytest.approx(14.0) and h.max == 5.0


def test_the_histogram_quantile_is_analyzes_higher_order_statistic_within_one_percent() -> None:
    rng = np.random.default_rng(7)
    for n in (1, 2, 7, 24, 1000):
        x = rng.lognormal(3.5, 0.8, n)
        h = LogHistogram()
        for v in x:
            h.add(float(v))
        for q in (0.5, 0.9, 0.95, 0.99, 1.0):
            exact = quantile(x, q)
            assert exact is not None
            assert h.quantile(q) == pytest.approx(exact, rel=0.01), (n, q)
    weighted, repeated = LogHistogram(), LogHistogram()
    weighted.add(3.0, 4)
    for _ in range(4):
        repeated.add(3.0)
    assert weighted.buckets == repeated.buckets and weighted.sum == repeated.sum


def test_failures_stay_out_of_latency_and_counts_follow_the_cell() -> None:
    t = LLMTable()
    t.observe(request("a", t0=0, cell="short", ttft=40 * MS))
    t.observe(request("b", t0=0, cell="short", error="http_5xx"))
    t.observe(request("c", t0=0, cell="long", ttft=90 * MS))
    e = t.entries()
    assert list(e) == [AGGREGATED, "long", "short"]
    assert e["short"].counts["requests"] == 2 and e["short"].counts["failures"] == 1
    assert e["short"].hist["ttft_ms"].count == 1
    assert e[AGGREGATED].hist["ttft_ms"].count == 2 and e[AGGREGATED].counts["requests"] == 3
    assert t.errors == {"http_5xx": 1}
    no_cell = request("d", t0=0)
    no_cell = dataclasses.replace(no_cell, ext=dataclasses.replace(no_cell.ext, cell=None))
    assert cell_name(no_cell) == "p16-o5"


def test_reset_and_the_recent_window() -> None:
    now = [100.0]
    t = LLMTable(window_s=10, clock=lambda: now[0])
    for i in range(5):
        t.observe(request(f"a{i}", t0=0, ttft=40 * MS))
    now[0] = 108.0
    t.observe(request("b", t0=0, ttft=400 * MS))
    assert t.entries()[AGGREGATED].counts["requests"] == 6
    assert t.entries(recent=True)[AGGREGATED].counts["requests"] == 6
    now[0] = 112.0  # the first five left the window; the cumulative figures keep them
    recent = t.entries(recent=True)[AGGREGATED]
    assert recent.counts["requests"] == 1
    assert recent.hist["ttft_ms"].quantile(0.5) == pytest.approx(400.0, rel=0.01)
    assert t.entries()[AGGREGATED].hist["ttft_ms"].quantile(0.5) == pytest.approx(40, rel=0.01)
    t.reset()
    assert t.entries()[AGGREGATED].counts["requests"] == 0
    assert t.entries(recent=True)[AGGREGATED].counts["requests"] == 0


def test_workers_merge_to_the_figures_of_one_process() -> None:
    whole, master = LLMTable(), LLMTable()
    for w in range(3):
        part = LLMTable()
        for i in range(20):
            rec = request(f"w{w}-{i}", t0=0, ttft=(10 + 7 * i + w) * MS, cell=f"c{i % 2}")
            events = [_ev(k, 3 * k + i, 1) for k in range(5)]
            part.observe(rec, events)
            whole.observe(rec, events)
        master.merge_wire(part.to_wire())
    assert csv_rows(master) == csv_rows(whole)


def test_the_csv_tab_and_html_forms() -> None:
    t = LLMTable()
    t.observe(request("a", t0=0, cell="short", ttft=40 * MS))
    t.observe(request("b", t0=0, cell="long", ttft=80 * MS))
    rows = csv_rows(t)
    assert [r[0] for r in rows] == [AGGREGATED, "long", "short"]
    assert all(len(r) == len(CSV_COLUMNS) for r in rows)
    agg = dict(zip(CSV_COLUMNS, rows[0], strict=True))
    assert agg["requests"] == "2" and agg["ttft_ms_n"] == "2" and agg["ttft_ms_max"] == "80"
    assert agg["send_lag_ms_p50"] == ""  # closed loop: no data, never 0
    assert [r[2] for r in history_rows(t, 1, 4, full=False)] == [AGGREGATED]
    assert len(history_rows(t, 1, 4, full=True)) == 3
    tab = {r["figure"]: r for r in tab_rows(t)}
    assert tab["TTFT ms (from send)"]["value"] == "n=2"
    assert tab["long: TTFT ms (from send)"]["max"] == "80"
    assert tab["requests done"]["value"] == 2
    section = html_section(t)
    assert 'data-cell="short" data-metric="ttft_ms"' in section
    page = "<html><body><div id=root></div><script>'</body>'</script></body></html>"
    once = inject(page, section)
    assert once.endswith(section + "</body></html>")
    assert inject(once, section) == once  # a second injection replaces the first
    assert once.count(f'id="{SECTION_ID}"') == 1
