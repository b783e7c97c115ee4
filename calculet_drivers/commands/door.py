"""The one door into `analysis` for the drivers: `analysis_door()` builds the
`AnalysisDoor` they are given (imported on use, so the CLI's start-up stays light)."""

from __future__ import annotations

from typing import Any

from calculet_load.doors import AnalysisDoor

__all__ = ["analysis_door"]


def analysis_door() -> AnalysisDoor:
    from analysis.cli import analyze_run
    from analysis.judge.idle import idle_criterion
    from analysis.judge.resources import leak_segments
    from analysis.report import write_report
    from analysis.sign import sign_run
    from analysis.stats.goodput import meets_slos
    from analysis.stats.trend import theil_sen

    return AnalysisDoor(
        analyze_run=analyze_run,
        write_report=write_report,
        sign_run=sign_run,
        leak_segments=leak_segments,
        joined_records=_joined_records,
        theil_sen=theil_sen,
        idle_criterion=idle_criterion,
        meets_slos=meets_slos,
    )


def _joined_records(run_dir: str) -> Any:
    from analysis.tables.join import load_run

    return load_run(run_dir).requests
