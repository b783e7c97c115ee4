"""The LLM figures on the console, beside Locust's own table, and the self-check's verdict.

Locust prints its request table every `CONSOLE_STATS_INTERVAL_SEC` (2 s) with
`--headless` or `--print-stats` (not with `--only-summary`), and once more when the run
ends, through its `locust.stats_logger` logger, which writes plain lines to stderr and
to `--logfile`; it has no event for that printer. So a handler on that logger watches
for the end of Locust's request table (its header, then the blank line that closes it)
and prints the compact LLM table (calculet_load.locust.llmreport.console_lines) right
after it, through the same logger: the same interval, the same stream, the same
conditions as Locust's own (no table where Locust prints none, as with `--json-file` at
the end). While a run goes on its tokens/s are over the last 10 s; once it has stopped,
since the start, as Locust's table turns from current to total.

When the process quits, the self-check's verdict line follows
(calculet_load.locust.accuracy.verdict_line): whether the client kept up in every cell,
or where it was saturated and its timings are the client's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from calculet_load.locust.accuracy import BUDGET_MS, verdict_line
from calculet_load.locust.llmreport import console_lines
from calculet_load.locust.llmstats import LLMTable

if TYPE_CHECKING:
    from locust.env import Environment

STATS_LOGGER = "locust.stats_logger"
RUNNING = ("spawning", "running")


def is_table_header(line: str) -> bool:
    """The first line of Locust's request table (locust.stats.get_stats_summary)."""
    return line.startswith("Type") and "# reqs" in line and "# fails" in line


class BesideLocust(logging.Handler):
    """Prints the LLM table after each of Locust's request tables."""

    def __init__(self, lines: Callable[[], list[str]]) -> None:
        super().__init__(level=logging.INFO)
        self.lines = lines
        self._in_table = False
        self._printing = False

    def emit(self, record: logging.LogRecord) -> None:
        if self._printing:
            return  # our own lines, through the same logger
        text = record.getMessage()
        if is_table_header(text):
            self._in_table = True
        elif text == "" and self._in_table:
            self._in_table = False
            self._printing = True
            try:
                out = logging.getLogger(STATS_LOGGER)
                for line in self.lines():
                    out.info(line)
                out.info("")
            finally:
                self._printing = False


def install(
    env: Environment,
    table: Callable[[], LLMTable | None],
    reports: Callable[[], Iterable[dict[str, Any]]],
) -> None:
    """On the master (or the one local process): the LLM table beside Locust's, and the
    verdict line when the process quits."""

    def lines() -> list[str]:
        t = table()
        if t is None:
            return []
        runner = env.runner
        current = runner is not None and runner.state in RUNNING
        return console_lines(t, current=current)

    logging.getLogger(STATS_LOGGER).addHandler(BesideLocust(lines))

    def on_quit(**_kw: Any) -> None:
        done = list(reports())
        if not done:
            return  # no run ended in this process
        budget = float(getattr(env.parsed_options, "accuracy_ms", BUDGET_MS))
        logging.getLogger(STATS_LOGGER).info(verdict_line(done, budget))

    env.events.quit.add_listener(on_quit)
