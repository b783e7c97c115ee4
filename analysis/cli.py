"""`calculet-load analyze RUN [--baseline RUN] [--rules FILE]`: verdicts and exit code.

Exit codes (spec §15): 0 pass; 1 correctness/reliability fail; 2 artifact or config
invalid (corrupt part, bad rules, newer schema); 3 infrastructure invalid (rerun);
4 performance regression. When several apply: 2, then 3, then 1, then 4.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

__all__ = ["add_arguments", "add_import_legacy", "analyze_run", "run", "run_import_legacy"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", help="run folder to judge (path or URI)")
    p.add_argument("--baseline", help="baseline run folder: compare the run with it")
    p.add_argument(
        "--rules", help="acceptance rules YAML (default configs/acceptance/default.yaml)"
    )
    p.add_argument("--out", help="where to write verdict.json and summary.* (default: RUN)")
    p.add_argument(
        "--progress",
        action="store_true",
        help="report progress on stderr (the default when stderr is a terminal)",
    )
    p.add_argument("--quiet", action="store_true", help="print only the verdict line")
    p.add_argument(
        "--rules-schema", action="store_true", help="print the rules file's JSON Schema and exit"
    )


def _progress(enabled: bool) -> Callable[[str], None] | None:
    if not enabled:
        return None
    start = time.monotonic()

    def say(msg: str) -> None:
        print(f"analyze [{time.monotonic() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return say


def analyze_run(
    run_dir: str,
    *,
    baseline: str | None = None,
    rules: str | None = None,
    out: str | None = None,
    progress: bool = False,
    quiet: bool = False,
) -> int:
    """Analyse, write the outputs, print the summary; the exit code (for the pipeline).

    An artifact or rules error prints one line on stderr and returns its code (2)."""
    from analysis.analyze import analyze, write_outputs
    from analysis.errors import AnalysisError
    from analysis.judge.verdict import render_summary

    say = _progress(progress or sys.stderr.isatty())
    try:
        result = analyze(run_dir, baseline=baseline, rules_path=rules, progress=say)
        write_outputs(result, out or run_dir)
    except AnalysisError as exc:
        print(f"analyze: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    text = render_summary(result.document)
    print(text.splitlines()[-1] if quiet else text)
    return int(result.exit_code)


def run(args: argparse.Namespace) -> int:
    from analysis.errors import ExitCode

    if args.rules_schema:
        from analysis.judge.rules import rules_json_schema

        print(json.dumps(rules_json_schema(), indent=2))
        return 0
    if not args.run_dir:
        print("analyze: the run folder is required", file=sys.stderr)
        return int(ExitCode.INVALID_ARTIFACT)
    return analyze_run(
        args.run_dir,
        baseline=args.baseline,
        rules=args.rules,
        out=args.out,
        progress=args.progress,
        quiet=args.quiet,
    )


def add_import_legacy(p: argparse.ArgumentParser) -> None:
    p.add_argument("csv", help="the old benchmark CSV (spec §1)")
    p.add_argument("--out", required=True, help="a new folder for the trend-only import")
    p.add_argument("--run-id", help="the import's id (default: legacy-<csv name>)")


def run_import_legacy(args: argparse.Namespace) -> int:
    """`calculet-load import-legacy CSV --out DIR`: 0 when imported, 2 when the CSV or
    the folder is unusable (one line on stderr)."""
    from analysis.errors import AnalysisError
    from analysis.legacy import import_legacy

    try:
        done = import_legacy(args.csv, args.out, run_id=args.run_id)
    except AnalysisError as exc:
        print(f"import-legacy: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    print(f"imported {done.rows} legacy rows into {done.out} (trend reference only)")
    for note in done.notes:
        print(f"  note: {note}")
    print("  not authoritative: analyze refuses it as a run or a --baseline")
    return 0
