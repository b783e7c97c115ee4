"""The end of a run: its analysis, its report and its signature (the `analysis` wing's
`analyze`, `report` and `sign`), as steps of a driver."""

from __future__ import annotations

import functools
from pathlib import Path

from analysis.cli import analyze_run
from analysis.errors import AnalysisError
from analysis.report import write_report
from analysis.sign import sign_run
from calculet_drivers.skeleton.progress import Progress
from calculet_drivers.skeleton.steps import StepResult
from calculet_load.target.api import off_loop

__all__ = ["analyze", "report", "sign"]


def analyze(
    run_dir: Path, *, baseline: str | None = None, rules: str | None = None, quiet: bool = False
) -> StepResult:
    """The run's analysis (`calculet-load analyze`, off the gevent loop): ok with its exit
    code as `code`."""
    run = functools.partial(analyze_run, str(run_dir), baseline=baseline, rules=rules,
                            quiet=quiet)  # fmt: skip
    return StepResult.ok(code=int(off_loop(run)))


def report(run_dir: Path, say: Progress, *, baseline: str | None = None) -> StepResult:
    """The HTML report, rendered from the folder's files: ok with its `path`."""
    path = write_report(str(run_dir), baseline=baseline)
    say(f"report: {path}")
    return StepResult.ok(path=path)


def sign(run_dir: Path, say: Progress) -> str | None:
    """The signed bundle, the last write to the run folder (it lists every file as it is
    now). None, or why it could not be signed (a bad key: the run is invalid, exit 2);
    without a key the bundle is written unsigned and says so."""
    try:
        result = sign_run(str(run_dir))
    except AnalysisError as exc:
        return f"sign: {exc}"
    state = "signed" if result.signed else "UNSIGNED: no key"
    say(f"signed bundle: {run_dir / 'bundle.intoto.json'} ({state})")
    return None
