"""The LLM figures in Locust's outputs: the LLM CSV beside `--csv`, the LLM section of
`--html` (and of the web UI's "Download report"), and Locust's "Reset stats".

What the files hold is calculet_load.locust.llmreport; the figures are
calculet_load.locust.llmstats.
Only the master (or the one local process) writes: with `--processes N` Locust turns
CSV and HTML off in the children, and so does this.

Locust has no hook for its HTML report: it writes the file after the run and before it
fires `quit`, so the `quit` listener adds the LLM section to the written file; the web
UI's `/stats/report` answer gets the same section in an `after_request` hook
(calculet_load.locust.webui).
"""

from __future__ import annotations

import csv
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import gevent
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from calculet_load.locust import llmreport
from calculet_load.locust.llmstats import LLMTable

log = logging.getLogger("calculet_load")

CSV_INTERVAL_S = 1.0  # as Locust's CSV_STATS_INTERVAL_SEC
RESET_MESSAGE = "calculet_reset"


def install(
    env: Environment,
    table: Callable[[], LLMTable | None],
    reset_local: Callable[[], None],
) -> None:
    """Wire the outputs and the resets of this process. `table` gives the run's LLM
    table (merged on a master); `reset_local` resets this process's own figures."""
    runner = env.runner
    if isinstance(runner, WorkerRunner):
        runner.register_message(RESET_MESSAGE, lambda *_a, **_k: reset_local())
        return
    opts = env.parsed_options

    def reset(**_kw: Any) -> None:
        reset_local()
        if isinstance(env.runner, MasterRunner):
            env.runner.send_message(RESET_MESSAGE, None)

    env.events.reset_stats.add_listener(reset)

    def after_spawning(**_kw: Any) -> None:
        if env.reset_stats:  # --reset-stats: Locust resets its own table here too
            reset()

    env.events.spawning_complete.add_listener(after_spawning)
    prefix = getattr(opts, "csv_prefix", None)
    writer = CsvWriter(env, str(prefix), table) if prefix else None
    if writer is not None:
        gevent.spawn(writer.loop)

    def on_quit(**_kw: Any) -> None:
        t = table()
        if writer is not None and t is not None:
            writer.write(t, final=True)
        if writer is not None:
            # Locust rewrites its own _stats.csv every second and closes it after
            # `quit` without a last write: its final rows could miss the last second
            # of requests. One more turn of its writer makes them the final figures.
            gevent.sleep(CSV_INTERVAL_S + 0.25)
        html_file = getattr(opts, "html_file", None)
        if html_file and t is not None:
            add_html_section(str(html_file), t)

    env.events.quit.add_listener(on_quit)


def add_html_section(path: str, table: LLMTable) -> None:
    """Put the LLM section into the report Locust wrote at `path`."""
    try:
        with open(path, encoding="utf-8") as f:
            report = f.read()
    except OSError as exc:
        log.error("calculet: cannot add the LLM section to %s: %s", path, exc)
        return
    _write_atomic(path, llmreport.inject(report, llmreport.html_section(table)))


class CsvWriter:
    """`<prefix>_llm_stats.csv` (rewritten) and `<prefix>_llm_stats_history.csv`
    (appended) every second, and once more at the end."""

    def __init__(self, env: Environment, prefix: str, table: Callable[[], LLMTable | None]):
        self.env = env
        self.stats_path = f"{prefix}_llm_stats.csv"
        self.history_path = f"{prefix}_llm_stats_history.csv"
        self.table = table
        self.full = bool(getattr(env.parsed_options, "stats_history_enabled", False))
        if base := os.path.dirname(self.stats_path):
            os.makedirs(base, exist_ok=True)
        with open(self.history_path, "w", newline="") as f:
            csv.writer(f).writerow(llmreport.HISTORY_COLUMNS)

    def loop(self) -> None:
        while True:
            gevent.sleep(CSV_INTERVAL_S)
            t = self.table()
            if t is not None:
                try:
                    self.write(t)
                except OSError as exc:  # a full disk must not end the run
                    log.error("calculet: cannot write the LLM CSV: %s", exc)

    def write(self, table: LLMTable, *, final: bool = False) -> None:
        rows = [llmreport.CSV_COLUMNS, *llmreport.csv_rows(table)]
        _write_atomic(self.stats_path, _csv_text(rows))
        runner = self.env.runner
        users = runner.user_count if runner is not None else 0
        history = llmreport.history_rows(table, int(time.time()), users, self.full)
        if history and (final or self._running()):
            with open(self.history_path, "a", newline="") as f:
                csv.writer(f).writerows(history)

    def _running(self) -> bool:
        runner = self.env.runner
        return runner is not None and runner.state in ("spawning", "running")


def _csv_text(rows: list[list[str]]) -> str:
    import io

    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()


def _write_atomic(path: str, text: str) -> None:
    """A reader never sees a half-written file: write beside it, then rename."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    os.replace(tmp, path)
