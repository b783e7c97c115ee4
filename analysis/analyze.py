"""The analysis pipeline of one run (spec §15, from "join" on): load and join → quality
→ cell summaries → rules → verdicts → `verdict.json`, `summary.parquet`, `summary.csv`,
the run over time (`timeseries.parquet`, `timeseries.csv`), and for a run with
conversations `conversations.parquet` and `conversations.csv`.

`analyze` never reads anything but files, and writes only these outputs (into the
run folder unless told otherwise). Artifact and rules errors raise `AnalysisError`
subclasses carrying exit code 2.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from analysis.errors import ExitCode
from analysis.judge import batch, boundary, capacity, goodput, headofline, resources, stability
from analysis.judge.evaluate import Context, evaluate
from analysis.judge.evidence import Evidence, build_evidence
from analysis.judge.rules import (
    BatchRule,
    BoundaryPolicyRule,
    CapacityRule,
    LeakRule,
    RulesFile,
    load_rules,
)
from analysis.judge.verdict import (
    VERDICT_SCHEMA,
    RuleVerdict,
    Status,
    exit_code,
    status_word,
    to_json,
    verdict_dict,
)
from analysis.legacy import check_not_legacy
from analysis.stats import compare
from analysis.stats import quantiles as stats
from analysis.tables.cells import CellSummary
from analysis.tables.conversations import CONVERSATIONS_FILES, conversations_table
from analysis.tables.join import load_run
from analysis.tables.series import SERIES_FILES, series_table
from analysis.tables.summary import summary_table
from analysis.tables.vendor import vendor_summary
from calculet_load.schema.fs import resolve_fs
from calculet_load.schema.manifest import REHEARSAL_BANNER, is_rehearsal

__all__ = ["OUTPUTS", "Analysis", "analyze", "write_outputs"]

OUTPUTS = ("verdict.json", "summary.parquet", "summary.csv")


@dataclass(frozen=True, slots=True)
class Analysis:
    """The result of `analyze`: the verdict document, its exit code, the summary table,
    TTFT by turn and cached share (None: the run has no conversation), and the run over
    time (None: no request was sent)."""

    document: dict[str, Any]
    exit_code: ExitCode
    summary: pa.Table
    verdicts: list[RuleVerdict]
    candidate: Evidence
    baseline: Evidence | None
    conversations: pa.Table | None = None
    timeseries: pa.Table | None = None


def _run_info(ev: Evidence) -> dict[str, Any]:
    t = ev.table
    joined = int(pc.sum(t.column("quality.server_trace_joined")).as_py() or 0)
    manifest = ev.run.manifest or {}
    return {
        "uri": ev.run.uri,
        "run_id": ev.run.run_id,
        "purpose": manifest.get("purpose"),
        "records": t.num_rows,
        "joined": joined,
        "index_status": (ev.run.index or {}).get("status"),
        "notes": list(ev.run.notes),
    }


SATURATED_KEPT = 20


def _quality_info(ev: Evidence) -> dict[str, Any]:
    q = ev.quality
    return {
        "records": q.records,
        "sent": q.sent,
        "successes": q.successes,
        "by_reason": q.by_reason,
        "by_partition": q.by_partition,
        "selfwatch_samples": q.selfwatch_samples,
        "workers_without_selfwatch": list(q.workers_without_selfwatch),
        "thresholds": q.thresholds,
        # the judged self-watch samples that saw the client saturated: how many, and the
        # SATURATED_KEPT worst by loop lag (a saturated soak has thousands)
        "saturated_samples": {
            "count": len(q.saturated_samples),
            "worst": list(q.saturated_samples[:SATURATED_KEPT]),
        },
        # kernel-stamped records a loop-lag-only sample covered (judged by their own
        # bounds, or a closed loop's by its cell's hold, instead), and records flagged so
        "lag_judged_by_own_bounds": q.lag_judged_by_own_bounds,
        "saturated_by_own_bounds": q.saturated_by_own_bounds,
        # the closed-loop cells judged by the client's hold of their users: how many, the
        # held ones and the SATURATED_KEPT most held (analysis.tables.saturation)
        "closed_loop_holds": {
            "count": len(q.closed_loop_holds),
            "held": [h for h in q.closed_loop_holds if h["held"]][:SATURATED_KEPT],
            "most_held": list(q.closed_loop_holds[:SATURATED_KEPT]),
        },
    }


def _cell_info(s: CellSummary, *, is_boundary: bool = False) -> dict[str, Any]:
    return {
        "cell": s.key.label,
        "boundary": is_boundary,
        "partition": s.partition,
        "records": s.records,
        "ok": s.ok,
        "errors": s.errors,
        "error_rate": s.error_rate,
        "errors_by_class": s.errors_by_class,
        "cancelled": s.cancelled,
        "dropped": s.dropped,
        "cut_at_stop": s.cut_at_stop,
        "served_from_cache": s.served_from_cache,
        "excluded_by_reason": s.excluded_by_reason,
        "steady_output_tokens_per_s": s.steady_output_tokens_per_s,
        "steady_output_tokens_per_s_ci": s.steady_output_tokens_per_s_ci,
        "steady_requests_per_s": s.steady_requests_per_s,
        "p50_ms": {m: st.p50.value for m, st in s.metrics.items()},
        "p99_ms": {m: st.p99.value for m, st in s.metrics.items()},
    }


def _methods(level: float) -> dict[str, Any]:
    return {
        "confidence_level": level,
        "percentile": stats.PERCENTILE_METHOD,
        "quantile_ci": stats.QUANTILE_CI_METHOD,
        "bootstrap_ci": stats.BOOTSTRAP_CI_METHOD,
        "rules_percentile_interval": stats.RULES_INTERVAL,
        "mean_ci": stats.MEAN_CI_METHOD,
        "spread_ci": stats.SPREAD_CI_METHOD,
        "mad": stats.MAD_METHOD,
        "throughput": stats.THROUGHPUT_METHOD,
        "throughput_ci": stats.THROUGHPUT_CI_METHOD,
        "throughput_delta": compare.THROUGHPUT_DELTA_METHOD,
        "quantile_delta": compare.QUANTILE_DELTA_METHOD,
        "mean_delta": compare.MEAN_DELTA_METHOD,
        "decision_rule": compare.DECISION_RULE,
    }


def _first(rules: RulesFile, kind: type[Any]) -> Any:
    """The first enabled rule of a kind (its settings shape the section), else None."""
    return next((r for r in rules.rules if isinstance(r, kind) and r.enabled), None)


def _sections(rules: RulesFile, ctx: Context) -> dict[str, Any]:
    """The goodput and capacity (§14.3), batch (§7), leaks (§13) and boundary (§6.1)
    sections, null without data; the vendor's counters (§17), which say when the run has
    none."""
    cap = capacity.cached_capacity(ctx, _first(rules, CapacityRule))
    return {
        "goodput": goodput.goodput_section(rules, ctx),
        "boundary": boundary.boundary_section(ctx, _first(rules, BoundaryPolicyRule)),
        "batch": batch.batch_section(batch.cached_batch(ctx, _first(rules, BatchRule))),
        "capacity": capacity.capacity_section(cap),
        "leaks": resources.leak_section(ctx, _first(rules, LeakRule)),
        "head_of_line": headofline.cached_head_of_line(ctx),
        "vendor": vendor_summary(ctx.candidate.run.vendor, ctx.candidate.table),
        "endurance": stability.endurance_section(ctx.candidate.run),
    }


def _document(
    rules: RulesFile,
    rules_source: str,
    rules_text: str,
    ctx: Context,
    verdicts: list[RuleVerdict],
    code: ExitCode,
    outputs: list[str],
) -> dict[str, Any]:
    counts = {s.value: sum(v.status is s for v in verdicts) for s in Status}
    rehearsal = is_rehearsal((ctx.candidate.run.manifest or {}).get("purpose"))
    return {
        "schema": VERDICT_SCHEMA,
        "status": status_word(code),
        "exit_code": int(code),
        # §8: a rehearsal (the manifest's purpose says so) is never an acceptance
        "rehearsal": rehearsal,
        "banner": REHEARSAL_BANNER if rehearsal else None,
        "run": _run_info(ctx.candidate),
        "baseline": _run_info(ctx.baseline) if ctx.baseline is not None else None,
        "rules": {
            "file": rules_source,
            "sha256": hashlib.sha256(rules_text.encode()).hexdigest(),
            "schema": rules.schema_,
            "fail_on_inconclusive": rules.analysis.fail_on_inconclusive,
        },
        "counts": counts,
        "quality": _quality_info(ctx.candidate),
        "baseline_quality": _quality_info(ctx.baseline) if ctx.baseline is not None else None,
        "cells": [_cell_info(s) for s in ctx.candidate.summaries]
        + [_cell_info(s, is_boundary=True) for s in ctx.candidate.boundary_summaries],
        **_sections(rules, ctx),
        "verdicts": [verdict_dict(v) for v in verdicts],
        "methods": _methods(rules.analysis.confidence_level),
        "outputs": outputs,
    }


def analyze(
    run: str,
    *,
    baseline: str | None = None,
    rules_path: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Analysis:
    """Analyse `run` (and compare it with `baseline`) under the rules file."""
    rules, text = load_rules(rules_path)
    check_not_legacy(run, "run")
    if baseline is not None:
        check_not_legacy(baseline, "baseline")
    settings = rules.analysis
    say = progress or (lambda _m: None)

    def evidence(uri: str, label: str) -> Evidence:
        say(f"{label}: loading {uri}")
        data = load_run(uri, progress=progress)
        say(f"{label}: quality and cell summaries")
        return build_evidence(
            data,
            level=settings.confidence_level,
            trim_fraction=settings.steady_trim_fraction,
            n_resamples=settings.bootstrap_resamples,
            bootstrap_max_n=settings.bootstrap_max_n,
            progress=progress,
            boundary=rules.boundary_cells,
        )

    cand = evidence(run, "candidate")
    base = evidence(baseline, "baseline") if baseline is not None else None
    ctx = Context(cand, base, settings)
    say("evaluating the rules")
    verdicts = evaluate(rules, ctx)
    code = exit_code(verdicts, fail_on_inconclusive=settings.fail_on_inconclusive)
    source = str(rules_path) if rules_path is not None else "configs/acceptance/default.yaml"
    conv = conversations_table(
        cand.table, level=settings.confidence_level, keep=~cand.in_boundary()
    )
    say("the run over time")
    series = series_table(
        cand.table,
        cand.run.tokens,
        selfwatch=cand.run.selfwatch,
        index=cand.run.index,
        client_offsets_ns=cand.run.client_offsets_ns,
    )
    outputs = [
        *OUTPUTS,
        *(SERIES_FILES if series is not None else ()),
        *(CONVERSATIONS_FILES if conv is not None else ()),
    ]
    doc = _document(rules, source, text, ctx, verdicts, code, outputs)
    summary = summary_table(cand.summaries)
    return Analysis(doc, code, summary, verdicts, cand, base, conv, series)


def _table_files(table: pa.Table, stem: str) -> dict[str, bytes]:
    csv = pa.BufferOutputStream()
    pacsv.write_csv(table, csv)
    parquet = pa.BufferOutputStream()
    pq.write_table(table, parquet)
    return {
        f"{stem}.parquet": parquet.getvalue().to_pybytes(),
        f"{stem}.csv": csv.getvalue().to_pybytes(),
    }


def write_outputs(result: Analysis, out_dir: str) -> list[str]:
    """Write verdict.json, summary.parquet and summary.csv, the time series' two files and
    the conversations' (or remove those an earlier analysis left, where this one has
    none) into `out_dir` (path or URI); each is written to a temporary name and renamed,
    so a reader never sees half a file."""
    fs, root = resolve_fs(out_dir)
    fs.create_dir(root, recursive=True)
    payloads = {
        "verdict.json": to_json(result.document).encode(),
        **_table_files(result.summary, "summary"),
    }
    for table, stem, names in (
        (result.timeseries, "timeseries", SERIES_FILES),
        (result.conversations, "conversations", CONVERSATIONS_FILES),
    ):
        if table is not None:
            payloads.update(_table_files(table, stem))
            continue
        for name in names:  # a file that no longer matches the records must not outlive them
            path = f"{root.rstrip('/')}/{name}"
            if fs.get_file_info(path).type != pafs.FileType.NotFound:
                fs.delete_file(path)
    written = []
    for name, data in payloads.items():
        path = f"{root.rstrip('/')}/{name}"
        with fs.open_output_stream(path + ".tmp") as f:
            f.write(data)
        fs.move(path + ".tmp", path)
        written.append(path)
    return written
