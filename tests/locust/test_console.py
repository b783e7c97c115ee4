"""The headless console: the LLM table after each of Locust's request tables, and the
self-check's verdict line (calculet_load.locust.console, llmreport.console_lines,
accuracy.verdict_line). A real headless run's console: tests/locust/test_locust_llm.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from calculet_load.locust.accuracy import Accuracy, verdict_line
from calculet_load.locust.console import STATS_LOGGER, BesideLocust
from calculet_load.locust.llmreport import console_lines
from calculet_load.locust.llmstats import LLMTable
from calculet_load.schema.records import TokenEvent
from tests.locust.test_accuracy import _record
from tests.support.runs import MS, request


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def stats_log() -> Iterator[tuple[logging.Logger, Lines]]:
    logger = logging.getLogger(STATS_LOGGER)
    seen = Lines()
    old = logger.handlers[:], logger.propagate, logger.level
    logger.handlers[:] = [seen]
    logger.propagate, logger.level = False, logging.INFO
    yield logger, seen
    logger.handlers[:], logger.propagate, logger.level = old


def _table() -> LLMTable:
    t = LLMTable()
    for i in range(10):  # TTFT 10..100 ms, TPOT 4 ms, ITL 4 ms per token
        ttft = (i + 1) * 10 * MS
        events = [TokenEvent(f"s{i}", k, ttft + k * 4 * MS, 1, None) for k in range(8)]
        t.observe(request(f"s{i}", t0=0, ttft=ttft, tpot=4 * MS, n=8, cell="short"), events)
    t.observe(request("x", t0=0, cell="long", error="http_5xx"))
    t.observe(request("y", t0=0, cell="long", error="total_timeout"))
    t.observe(request("z", t0=0, cell="long", ext={"cancelled_at": "run_stop"}, error="cancelled"))
    return t


def test_the_table_has_each_cell_the_percentiles_and_the_errors_by_class() -> None:
    lines = console_lines(_table(), current=False)
    rows = {line.split()[0]: line.split() for line in lines[2:] if line[:1].isalpha()}
    # name, # reqs, # fails, # cancel | TTFT p50 p99 | TPOT p50 p99 | ITL p50 p99 | tok/s
    short = rows["short"]
    assert short[1:4] == ["10", "0", "0"]
    # the higher order statistic of 10..100 ms: p50 = x(6) = 60, p99 = x(10) = 100
    assert float(short[5]) == pytest.approx(60, rel=0.01)
    assert float(short[6]) == pytest.approx(100, rel=0.01)
    assert float(short[8]) == pytest.approx(4, rel=0.01)  # TPOT p50
    assert float(short[12]) == pytest.approx(4, rel=0.01)  # ITL p99
    assert rows["long"][1:4] == ["3", "2", "1"]  # the cancelled one is no failure
    assert rows["long"][5] == "-"  # no success: no latency, never 0
    assert rows["Aggregated"][1:4] == ["13", "2", "1"]
    assert lines[-1].endswith("Errors by class: http_5xx 1, total_timeout 1")
    assert "since the start" in lines[-1]
    assert "over the last 10 s" in console_lines(_table(), current=True)[-1]
    one = LLMTable()
    one.observe(request("a", t0=0, cell="only"))
    assert [line.split()[0] for line in console_lines(one, current=True)[2:-2]] == ["Aggregated"]


def test_it_prints_right_after_locusts_request_table(
    stats_log: tuple[logging.Logger, Lines],
) -> None:
    logger, seen = stats_log
    logger.addHandler(BesideLocust(lambda: ["LLM line 1", "LLM line 2"]))

    def locust_prints(*lines: str) -> None:
        for line in lines:
            logger.info(line)

    # what locust.stats.print_stats logs every 2 s and at the end (Locust 2.47's text),
    # then print_percentile_stats: no request table, nothing after it
    locust_prints(*LOCUST_TABLE)
    locust_prints("Response time percentiles (approximated)", "Type     Name   50%", "")
    end = seen.lines.index("LLM line 1")
    assert seen.lines[: end + 3] == [*LOCUST_TABLE, "LLM line 1", "LLM line 2", ""]
    assert seen.lines.count("LLM line 1") == 1
    locust_prints(*LOCUST_TABLE)
    assert seen.lines.count("LLM line 1") == 2


LOCUST_TABLE = (
    "Type     Name   # reqs      # fails |    Avg     Min     Max    Med |   req/s  failures/s",
    "--------|------|-------|-------------|-------|-------|-------|-------|--------|-----------",
    "GET      /x          1     0(0.00%) |     12      12      12     12 |    0.00        0.00",
    "--------|------|-------|-------------|-------|-------|-------|-------|--------|-----------",
    "         Aggregated  1     0(0.00%) |     12      12      12     12 |    0.00        0.00",
    "",
)


def test_the_verdict_line_says_where_the_client_saturated() -> None:
    kept, lagged = Accuracy(), Accuracy()
    for _ in range(100):
        kept.observe(_record("short", None, lag=0.5))
        lagged.observe(_record("short", None, lag=0.5))
        lagged.observe(_record("long", None, lag=40.0))
    ok = verdict_line([{"accuracy": kept.to_wire()}], 10.0)
    assert ok.startswith("calculet self-check: the client kept up in every cell (1 cell: ")
    assert "the timings are the server's" in ok
    bad = verdict_line([{"accuracy": lagged.to_wire()}, {"worker": "w01"}], 10.0)
    assert bad.startswith("calculet self-check: CLIENT SATURATED in 1 of 2 cells")
    assert "long: send lag P99 40.0 ms" in bad and "short" not in bad.split("cells")[1]
    assert "(exit 3)" in bad
    assert verdict_line([{"worker": "w00"}], 10.0).endswith("no timing to judge")
