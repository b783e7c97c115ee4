"""A request's count is its confirmed total (measure.request_state `conclude`): the server's
final total where a complete response carried one, else the per-event counts' sum; the
per-event counts are kept, and flagged where they disagree with the total beyond the
declared slack. Then the live figures (the LLM tab, Prometheus, Locust's table) count the
same totals."""

from __future__ import annotations

import pytest

from calculet_load.clock import FakeClock
from calculet_load.locust.livestats import LiveStats
from calculet_load.locust.llmstats import AGGREGATED, LLMTable
from calculet_load.measure.outcome import Outcome
from calculet_load.measure.prompts import Prompt
from calculet_load.measure.protocols import adapter_for
from calculet_load.measure.request_state import Run, conclude
from calculet_load.measure.session import RequestSpec, RunContext, make_record


def _conclude(
    events: int, total: int | None, source: str, slack: int = 0, ok: bool = True
) -> Outcome:
    out = Outcome("r")
    out.output_tokens, out.server_total, out.events = events, total, events + 1
    out.count_source = source
    if not ok:
        out.error_class = "idle_timeout"
    run = Run(adapter_for("openai-chat"), out, FakeClock(), True)
    return conclude(run, {"t0": 1, "t1": 2, "t2": 3, "t6": 9}, 64, slack)


@pytest.mark.parametrize(
    ("events", "total", "source", "slack", "count", "counted_as", "flagged"),
    [
        (32, 32, "usage", 0, 32, "usage", False),
        (31, 32, "usage", 0, 32, "usage", True),  # the server's own counts must agree
        (38, 32, "tokenizer", 0, 32, "tokenizer+usage_total", True),
        (38, 32, "tokenizer", 6, 32, "tokenizer+usage_total", False),  # a declared slack
        (26, 32, "tokenizer", 6, 32, "tokenizer+usage_total", False),
        (25, 32, "tokenizer", 6, 32, "tokenizer+usage_total", True),
        (31, 32, "chunks", 0, 32, "chunks+usage_total", False),  # a chunk: 1 token or more
        (33, 32, "chunks", 0, 32, "chunks+usage_total", True),
        (40, None, "tokenizer", 0, 40, "tokenizer", False),  # no total: the events' sum
    ],
)
def test_the_count_is_the_confirmed_total(
    events: int, total: int | None, source: str, slack: int, count: int, counted_as: str,
    flagged: bool,
) -> None:  # fmt: skip
    out = _conclude(events, total, source, slack)
    assert out.output_tokens == count
    assert out.event_tokens == events
    assert out.total_source == ("events" if total is None else "server")
    assert out.count_source == counted_as
    assert out.token_count_mismatch == flagged
    if flagged:
        assert out.count_anomaly == (
            f"per-event counts ({source}) sum to {events}, the server's total is {total}"
            f" (±{slack} slack)"
        )


def test_a_failed_request_keeps_its_events_count() -> None:
    """Its total, where one came, is not the count of what it received."""
    out = _conclude(12, 32, "usage", ok=False)
    assert (out.output_tokens, out.event_tokens, out.total_source) == (12, 12, "events")


def _record(events: int, total: int) -> object:
    out = _conclude(events, total, "tokenizer", slack=10)
    spec = RequestSpec(prompt=Prompt("s0", 3, [1, 2, 3]), max_tokens=64, cell="c")
    return make_record(RunContext("run", "w00"), spec, out, "openai-chat")


def test_the_record_says_whose_count_it_is() -> None:
    rec = _record(38, 32)
    assert rec.workload.actual_output_tokens == 32  # type: ignore[attr-defined]
    e = rec.ext  # type: ignore[attr-defined]
    assert (e.client_output_tokens, e.server_output_tokens) == (38, 32)
    assert (e.token_count_source, e.token_total_source) == ("tokenizer+usage_total", "server")
    assert not e.token_count_mismatch  # within the slack of 10


def test_live_figures_count_the_confirmed_totals() -> None:
    """The LLM tab and Prometheus's series add each request's total, not its events."""
    llm = LLMTable()
    live = LiveStats()
    for _ in range(3):
        rec = _record(38, 32)
        llm.observe(rec)  # type: ignore[arg-type]
        live.observe_series(rec)  # type: ignore[arg-type]
    assert llm.entries()[AGGREGATED].counts["output_tokens"] == 96
    assert sum(s.output_tokens for s in live.series.values()) == 96
