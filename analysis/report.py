"""`calculet-load report RUN [--baseline RUN] [--out FILE]`: the HTML acceptance report.

One self-contained HTML file (inline CSS and SVG figures; no script, no external
request), rendered from the run folder's files alone: `verdict.json` and
`summary.parquet` (from `calculet-load analyze`), the records joined with the server
traces, the pipeline's event log and plan, the manifest. The view model
(`analysis.views.model` and the section builders) decides and formats everything; the
Jinja2 templates (autoescape on, StrictUndefined) only lay it out.

A report renders for any run folder that exists: what a file would have told is shown
as "no data in this run", and a missing verdict.json gives a banner that says so.
Exit codes of the command: 0 written, 2 no such run folder (or an unreadable baseline).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from analysis.views.model import ReportView, RunView, Section

__all__ = [
    "REPORT_NAME",
    "add_arguments",
    "build_view",
    "load_view",
    "render",
    "run",
    "write_report",
]

REPORT_NAME = "report.html"
_RUNTIME_SCAN_LIMIT = 20_000


def load_view(uri: str) -> RunView:
    """Read what the report shows from one run folder (ArtifactError: no folder)."""
    import numpy as np
    import pyarrow.parquet as pq
    import yaml

    from analysis.errors import AnalysisError, ArtifactError
    from analysis.tables.join import load_run
    from analysis.tables.quality import apply_quality
    from analysis.tables.runfiles import RunFiles, redact
    from analysis.views.model import RunView, label_column

    files = RunFiles(uri)
    if not files.is_dir():
        raise ArtifactError(f"{uri}: not a run folder (no such directory)")
    rv = RunView(files)
    verdict = files.read_json("verdict.json")
    rv.verdict = verdict if isinstance(verdict, dict) and "exit_code" in verdict else None
    if verdict is not None and rv.verdict is None:
        files.notes.append("verdict.json: not a verdict document; shown as no data")
    if files.exists("summary.parquet"):
        try:
            rv.summary = pq.read_table(files.path("summary.parquet"), filesystem=files.fs)
        except (OSError, ValueError) as exc:
            files.notes.append(f"summary.parquet: unreadable ({exc}); shown as no data")
    text = files.read_text("manifest.yaml")
    if text is not None:
        try:
            doc = yaml.safe_load(text)
            rv.manifest = redact(doc) if isinstance(doc, dict) else None
        except yaml.YAMLError:
            files.notes.append("manifest.yaml: invalid YAML; shown as no data")
    plan = files.read_json("plan.json")
    rv.plan = redact(plan) if isinstance(plan, dict) else None
    rv.events = files.read_jsonl("events.jsonl")
    index = files.read_json("client/index.json")
    rv.index = redact(index) if isinstance(index, dict) else None
    try:
        data = load_run(uri)
        rv.table, _ = apply_quality(data)
        rv.cell_code, rv.cell_labels = label_column(rv.table)
        rv.selfwatch, rv.steps = data.selfwatch, data.steps
        rv.resources, rv.vendor = data.resources, data.vendor
        rv.tokens = data.tokens
        rv.client_offsets_ns, rv.server_offset_ns = data.client_offsets_ns, data.server_offset_ns
    except AnalysisError as exc:
        rv.load_error = f"the records could not be read: {exc}"
        files.notes.append(rv.load_error)
    rv.device = files.device_rows()
    starts = [e["wall_ns"] for e in rv.events or [] if isinstance(e.get("wall_ns"), int)]
    if starts:
        rv.t0_wall_ns = min(starts)
    elif rv.table is not None:
        anchor = rv.col("join.wall_start_ns")
        rv.t0_wall_ns = int(np.nanmin(anchor)) if np.isfinite(anchor).any() else None
    return rv


def build_view(
    run_dir: str, baseline: str | None = None, *, legacy: str | None = None
) -> ReportView:
    """The whole report's view model from the run folder (and the baseline's; and a
    legacy CSV import's trend line, spec §1, non-authoritative)."""
    from analysis.tables.runfiles import LIFECYCLE_EVENTS, RUNTIME_EVENTS
    from analysis.views import cells as cellviews
    from analysis.views import (
        conversations,
        counterexamples,
        headline,
        headofline,
        loadcurves,
        overtime,
        provenance,
        soakgaps,
        timelines,
    )
    from analysis.views import endurance as enduranceviews
    from analysis.views import vendor as vendorviews
    from analysis.views.model import ReportView

    rv = load_view(run_dir)
    notes: list[str] = []
    recorded = ((rv.verdict or {}).get("baseline") or {}).get("uri")
    if baseline is None and recorded:
        from analysis.tables.runfiles import RunFiles

        if RunFiles(recorded).is_dir():
            baseline = recorded
            notes.append(f"baseline {recorded}: the one verdict.json was judged against")
        else:
            notes.append(
                f"verdict.json was judged against baseline {recorded}, which is not "
                "readable here: only the judged comparisons are shown"
            )
    elif baseline is not None and recorded and recorded.rstrip("/") != baseline.rstrip("/"):
        notes.append(f"verdict.json was judged against baseline {recorded}, not {baseline}")
    base = None
    if baseline is not None:
        from analysis.errors import ArtifactError

        try:
            base = load_view(baseline)
        except ArtifactError as exc:  # the candidate's report still renders, and says so
            notes.append(f"baseline: {exc}; shown without it")
    scan = rv.files.scan_server_events(RUNTIME_EVENTS + LIFECYCLE_EVENTS, _RUNTIME_SCAN_LIMIT)
    # the first screen answers "did it pass, and how fast": the banner, then these
    lead = (headline.headline_section(rv), overtime.overtime_section(rv))
    sections = (
        provenance.verdicts_section(rv),
        provenance.provenance_section(rv, base),
        provenance.plan_section(rv),
        cellviews.cells_section(rv, base),
        cellviews.comparison_section(rv, base),
        counterexamples.slowest_section(rv),
        counterexamples.nonsuccess_section(rv),
        counterexamples.runtime_section(rv, scan),
        counterexamples.resets_section(rv, scan),
        counterexamples.excluded_section(rv),
        counterexamples.long_context_section(rv),
        conversations.conversations_section(rv),
        loadcurves.curves_section(rv),
        loadcurves.capacity_section(rv),
        loadcurves.batch_section(rv),
        headofline.head_of_line_section(rv),
        timelines.device_section(rv),
        timelines.selfwatch_section(rv),
        timelines.server_section(rv),
        soakgaps.soak_verdict_section(rv),
        timelines.soak_section(rv),
        enduranceviews.endurance_section(rv),
        timelines.faults_section(rv),
        provenance.signature_section(rv),
        vendorviews.vendor_section(rv),
    )
    legacy_trend = (_legacy(legacy, rv),) if legacy is not None else ()
    notes += soakgaps.gap_notes(rv)
    notes += list((rv.verdict or {}).get("run", {}).get("notes") or []) + rv.files.notes
    if base is not None:
        notes += [f"baseline: {n}" for n in base.files.notes]
    b = provenance.banner(rv)
    return ReportView(
        title=f"calculet-load acceptance report: {b.run_id} ({b.status})",
        banner=b,
        sections=tuple(s for s in sections if s is not None) + legacy_trend,
        notes=tuple(notes),
        tool=_tool(),
        lead=lead,
    )


def _legacy(uri: str, rv: RunView) -> Section:
    """The legacy import's trend section (spec §1: trend only, non-authoritative)."""
    from analysis.errors import ArtifactError
    from analysis.legacy import legacy_index, load_legacy_trend
    from analysis.views.vendor import legacy_section

    try:
        trend = load_legacy_trend(uri)
    except ArtifactError as exc:
        return legacy_section(uri, None, None, rv, str(exc))
    return legacy_section(uri, trend, legacy_index(uri), rv)


def _tool() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"calculet-load {version('calculet-load')}"
    except PackageNotFoundError:
        return "calculet-load"


def render(view: ReportView) -> str:
    """The HTML text of the report (templates from the installed package)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("analysis", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env.get_template("report.html.j2").render(view=view)


def write_report(
    run_dir: str,
    baseline: str | None = None,
    *,
    out: str | None = None,
    legacy: str | None = None,
) -> str:
    """Render the report of `run_dir` into `out` (default RUN/report.html), written to a
    temporary name and renamed; returns its path. The pipeline calls this after the
    analysis and before signing, so the bundle covers the report."""
    from analysis.tables.runfiles import RunFiles

    html = render(build_view(run_dir, baseline, legacy=legacy)).encode("utf-8")
    files = RunFiles(run_dir)
    if out is None:
        target_fs, path = files.fs, files.path(REPORT_NAME)
    else:
        from calculet_load.schema.fs import resolve_fs

        target_fs, path = resolve_fs(out)
    with target_fs.open_output_stream(path + ".tmp") as f:
        f.write(html)
    target_fs.move(path + ".tmp", path)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run folder (path or URI) with verdict.json from `analyze`")
    p.add_argument("--baseline", help="baseline run folder (default: the one verdict.json names)")
    p.add_argument("--out", help=f"output file (default: RUN/{REPORT_NAME})")
    p.add_argument(
        "--legacy",
        metavar="DIR",
        help="a legacy CSV import (`calculet-load import-legacy`): shown as a trend line, "
        "marked non-authoritative (spec §1)",
    )


def run(args: argparse.Namespace) -> int:
    from analysis.errors import AnalysisError

    try:
        path = write_report(args.run_dir, args.baseline, out=args.out, legacy=args.legacy)
    except AnalysisError as exc:
        print(f"report: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    print(path)
    return 0
