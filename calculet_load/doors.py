"""What a driver (accept, soak) may ask of the analysis, passed in from above.

The drivers never import `analysis`: `calculet_drivers.commands` builds an `AnalysisDoor`
from it and hands it down (docs/architecture.md), so the import arrows point one way
and a driver can run, and be tested, without the analysis installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["AnalysisDoor"]


@dataclasses.dataclass(frozen=True, slots=True)
class AnalysisDoor:
    """`analyze_run(run_dir, *, baseline=None, rules=None, quiet=False) -> exit code`;
    `write_report(run_dir, *, baseline=None) -> path`; `sign_run(run_dir) -> result`;
    `leak_segments(run_dir, rules_path, attempts) -> [segment]` (the leak rule on each
    attempt's stretch of server/resources.jsonl); `joined_records(run_dir) -> table`
    (the request records as an Arrow table, joined with the server traces: server_ms,
    runtime_ms and the quality flags filled where a record joined);
    `theil_sen(t, y) -> fit` (the one Theil–Sen slope, `.slope`: the capacity search's
    backlog growth, the soak's client RSS); `meets_slos(ok, ttft_ms, tpot_ms,
    output_tokens, *, max_ttft_ms, max_tpot_ms) -> bool array` (the one definition of a
    request that counts towards goodput: analysis.stats.goodput; the capacity search's
    goodput criterion); `idle_criterion(rules_path, window_s=,
    timeout_s=) -> criterion` (the rules file's §8.2 idle criterion,
    analysis.judge.idle.IdleCriterion: `.window_s`, `.timeout_s`, `.describe()`,
    `.check(t, series) -> IdleCheck`; an invalid rules file raises with `exit_code` 2)."""

    analyze_run: Callable[..., int]
    write_report: Callable[..., str]
    sign_run: Callable[..., Any]
    leak_segments: Callable[[Path, str | None, list[dict[str, Any]]], list[dict[str, Any]]]
    joined_records: Callable[[str], Any]
    theil_sen: Callable[[Sequence[float], Sequence[float]], Any]
    idle_criterion: Callable[..., Any]
    meets_slos: Callable[..., Any]
