"""The per-cell summary table (spec §9) as written to `summary.parquet` and
`summary.csv`: long format, one row per (cell, partition, metric), with the cell's
counts repeated on each row so that any row read alone is complete."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from analysis.stats.quantiles import THROUGHPUT_CI_METHOD, THROUGHPUT_METHOD, CellStats
from analysis.tables.cellkey import CELL_KEY_COLUMNS
from analysis.tables.cells import ERROR_GROUPS, CellSummary

__all__ = ["SUMMARY_SCHEMA", "summary_table"]

SUMMARY_SCHEMA = "calculet-summary/v1"


def _stats_columns(s: CellStats) -> dict[str, Any]:
    out: dict[str, Any] = {"count": s.count, "missing": s.missing, "level": s.level}
    for p in s.percentiles:
        out[p.name] = p.value
        out[f"{p.name}_lo"] = p.lo
        out[f"{p.name}_hi"] = p.hi
        out[f"{p.name}_boot_lo"] = p.boot_lo
        out[f"{p.name}_boot_hi"] = p.boot_hi
    out["min"], out["max"] = s.min, s.max
    for name, est in (("mean", s.mean), ("std", s.std), ("mad", s.mad)):
        out[name], out[f"{name}_lo"], out[f"{name}_hi"] = est.value, est.lo, est.hi
    out["warnings"] = "; ".join(s.warnings) or None
    out["percentile_method"] = s.percentile_method
    out["quantile_ci_method"] = s.quantile_ci_method
    out["bootstrap_ci_method"] = s.bootstrap_ci_method
    out["mean_ci_method"] = s.mean_ci_method
    out["spread_ci_method"] = s.spread_ci_method
    return out


def _error_group_counts(by_class: dict[str, int]) -> dict[str, int]:
    groups = {g: sum(by_class.get(c, 0) for c in classes) for g, classes in ERROR_GROUPS.items()}
    known = {c for classes in ERROR_GROUPS.values() for c in classes}
    groups["other_errors"] = sum(v for c, v in by_class.items() if c not in known)
    return groups


def summary_table(summaries: list[CellSummary]) -> pa.Table:
    """Long format: one row per (cell, partition, metric); cell-level counts repeated."""
    rows = []
    for s in summaries:
        ci = s.steady_output_tokens_per_s_ci
        base: dict[str, Any] = {
            "cell": s.key.label,
            "cell_name": s.key.name,
            "concurrency": s.key.concurrency,
            "arrival": s.key.arrival,
            "stream": s.key.stream,
            "partition": s.partition,
            "records": s.records,
            "ok": s.ok,
            "errors": s.errors,
            "error_rate": s.error_rate,
            "cancelled": s.cancelled,
            **_error_group_counts(s.errors_by_class),
            "errors_by_class": json.dumps(s.errors_by_class, sort_keys=True),
            "dropped": s.dropped,
            "cut_at_stop": s.cut_at_stop,
            "served_from_cache": s.served_from_cache,
            "cached_prompt_tokens": s.cached_prompt_tokens,
            "reasoning_requests": s.reasoning_requests,
            "reasoning_tokens": s.reasoning_tokens,
            "answer_tokens": s.answer_tokens,
            "excluded_by_reason": json.dumps(s.excluded_by_reason, sort_keys=True),
            "output_tokens": s.output_tokens,
            "steady_output_tokens_per_s": s.steady_output_tokens_per_s,
            "steady_output_tokens_per_s_lo": ci[0] if ci else None,
            "steady_output_tokens_per_s_hi": ci[1] if ci else None,
            # the batch rates the interval and the throughput comparisons read
            "throughput_batches": json.dumps(list(s.throughput_batches)),
            "steady_requests_per_s": s.steady_requests_per_s,
            "steady_window_s": s.steady_window_s,
            "throughput_method": THROUGHPUT_METHOD,
            "throughput_ci_method": THROUGHPUT_CI_METHOD,
        }
        for name, stats in s.metrics.items():
            rows.append({**base, "metric": name, **_stats_columns(stats)})
    return pa.Table.from_pylist(rows, schema=_summary_schema())


def _summary_schema() -> pa.Schema:
    f64, i64, s = pa.float64(), pa.int64(), pa.string()
    fields: list[tuple[str, pa.DataType]] = [
        *CELL_KEY_COLUMNS,
        ("partition", s),
        ("records", i64),
        ("ok", i64),
        ("errors", i64),
        ("error_rate", f64),
        ("cancelled", i64),
        *((g, i64) for g in (*ERROR_GROUPS, "other_errors")),
        ("errors_by_class", s),
        ("dropped", i64),
        ("cut_at_stop", i64),
        ("served_from_cache", i64),
        ("cached_prompt_tokens", i64),
        ("reasoning_requests", i64),
        ("reasoning_tokens", i64),
        ("answer_tokens", i64),
        ("excluded_by_reason", s),
        ("output_tokens", i64),
        ("steady_output_tokens_per_s", f64),
        ("steady_output_tokens_per_s_lo", f64),
        ("steady_output_tokens_per_s_hi", f64),
        ("throughput_batches", s),
        ("steady_requests_per_s", f64),
        ("steady_window_s", f64),
        ("throughput_method", s),
        ("throughput_ci_method", s),
        ("metric", s),
        ("count", i64),
        ("missing", i64),
        ("level", f64),
    ]
    for p in ("p50", "p90", "p95", "p99"):
        fields += [(p, f64), (f"{p}_lo", f64), (f"{p}_hi", f64)]
        fields += [(f"{p}_boot_lo", f64), (f"{p}_boot_hi", f64)]
    fields += [("min", f64), ("max", f64)]
    for name in ("mean", "std", "mad"):
        fields += [(name, f64), (f"{name}_lo", f64), (f"{name}_hi", f64)]
    fields += [(n, s) for n in ("warnings", "percentile_method", "quantile_ci_method")]
    fields += [("bootstrap_ci_method", s)]
    fields += [(n, s) for n in ("mean_ci_method", "spread_ci_method")]
    return pa.schema(fields, metadata={"schema": SUMMARY_SCHEMA})
