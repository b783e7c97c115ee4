# size: the per-cell statistics section: a table and its plots per metric
"""Report sections per cell (spec §9): the cell tables with their intervals and sample
sizes, the latency CDFs, and the paired comparison with a baseline (wins and losses).

The statistics come from `summary.parquet` (written by `calculet-load analyze`); the
CDFs and the all-cells comparison read the measured values of the records directly,
through the analysis' own `compare` module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from analysis.stats.compare import (
    THROUGHPUT_DELTA_METHOD,
    MetricRule,
    Thresholds,
    Verdict,
    compare_cells,
    compare_throughput,
)
from analysis.views import plots
from analysis.views.model import (
    DASH,
    Figure,
    RunView,
    Section,
    cap_rows,
    comparison_why,
    figure,
    fmt_ci,
    fmt_int,
    fmt_ms,
    fmt_num,
    fmt_pct,
    quantile_why,
    spread_why,
    table,
)

__all__ = [
    "METRIC_TITLES",
    "PRIMARY",
    "cdf_points",
    "cells_section",
    "comparison_section",
    "measured_values",
    "short_warnings",
    "summary_rows",
]

PRIMARY = ("ttft_ms", "tpot_ms", "e2e_ms")
METRIC_TITLES = {
    "ttft_ms": "TTFT (ms)",
    "ttft_answer_ms": "TTFT to the first answer token (ms, reasoning models; TTFT counts "
    "the first token of any kind)",
    "tpot_ms": "TPOT (ms)",
    "e2e_ms": "E2E (ms)",
    "itl_ms": "inter-token latency (ms, per token)",
    "server_queue_ms": "server queue (ms)",
    "slot_wait_ms": "slot wait (ms, accepted → slot assigned)",
    "admission_wait_ms": "admission wait (ms, slot assigned → admitted)",
    "unattributed_ttft_ms": "unattributed TTFT: client + network (ms)",
    "ttft_from_intended_ms": "TTFT from the intended start (ms, open loop)",
    "e2e_from_intended_ms": "E2E from the intended start (ms, open loop)",
    "send_lag_ms": "send lag (ms, open loop)",
    "turnaround_ms": "client turnaround (ms: its send to t0, t6 to the outcome back)",
}
_COLUMNS = {
    "ttft_ms": "durations_ms.ttft",
    "tpot_ms": "durations_ms.tpot",
    "e2e_ms": "durations_ms.e2e",
}
# shown open beside the primary metrics: a reasoning model's answer can come long after t4
_OPEN = (*PRIMARY, "ttft_answer_ms")
_PART_ORDER = {"measured": 0, "throttled": 1, "warmup": 2}
_MAX_CDF_CELLS = 12
_NEED = re.compile(r"(p[\d.]+) rests on n=\d+ < (\d+): no finite (\w+ )?bounds?( at [\d.]+%)?")


def short_warnings(text: str | None) -> str:
    """summary.parquet's warnings, shortened: "p99 upper bound needs n ≥ 368"."""
    if not text:
        return ""
    return _NEED.sub(lambda m: f"{m[1]} {m[3] or ''}bound needs n ≥ {m[2]}", text)


_MAX_COMPARISON_ROWS = 300


def summary_rows(rv: RunView) -> list[dict[str, Any]]:
    if rv.summary is None:
        return []
    rows: list[dict[str, Any]] = rv.summary.to_pylist()
    rows.sort(key=lambda r: (r["cell"], _PART_ORDER.get(r["partition"], 9)))
    return rows


def measured_values(rv: RunView, metric: str) -> dict[str, npt.NDArray[np.float64]]:
    """The metric's finite values per cell, successes of the measured partition."""
    if rv.table is None:
        return {}
    v = rv.col(_COLUMNS[metric])
    groups = rv.groups(rv.success() & rv.partition_in("measured") & np.isfinite(v))
    return {label: v[rows] for label, rows in groups.items()}


def cdf_points(values: npt.NDArray[np.float64], max_points: int = 200) -> tuple[Any, Any]:
    """(x, F(x)) of the empirical CDF, at most ~max_points points: every value when
    few, else a quantile grid that keeps the tail (the top 10% on a log grid) and the
    maximum."""
    v = np.sort(values)
    n = v.size
    if n <= max_points:
        return v, np.arange(1, n + 1) / n
    grid = np.concatenate(
        [
            np.linspace(0, 0.9, max_points * 3 // 4),
            1 - np.logspace(-1, np.log10(1 / n), max_points // 4),
        ]
    )
    k = np.unique(np.clip(np.ceil(grid * (n - 1)).astype(np.int64), 0, n - 1))
    return v[k], (k + 1) / n


def _from_cache(r: dict[str, Any]) -> str:
    """Requests served from the server's prefix cache (beyond the shared template): a
    flag, since their TTFT is not a cold prefill."""
    n = r.get("served_from_cache") or 0
    if not n:
        return fmt_int(0) if r.get("served_from_cache") is not None else DASH
    return f"⚠ {fmt_int(n)} ({fmt_int(r.get('cached_prompt_tokens') or 0)} tokens)"


def _overview(rows: list[dict[str, Any]]) -> Any:
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        seen.setdefault((r["cell"], r["partition"]), r)
    out = []
    for (cell, part), r in seen.items():
        errors = json.loads(r["errors_by_class"] or "{}")
        excluded = json.loads(r["excluded_by_reason"] or "{}")
        out.append(
            (
                cell,
                part,
                fmt_int(r["records"]),
                fmt_int(r["ok"]),
                fmt_int(r["errors"]),
                fmt_pct(None if r["error_rate"] is None else 100 * r["error_rate"]),
                ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or DASH,
                fmt_int(r["cancelled"]),
                fmt_int(r["dropped"]),
                fmt_int(r["cut_at_stop"]),
                _from_cache(r),
                ", ".join(f"{k} {v}" for k, v in sorted(excluded.items()) if v) or DASH,
                fmt_num(r["steady_output_tokens_per_s"]),
                fmt_num(r["steady_requests_per_s"]),
                fmt_num(r["steady_window_s"]),
            )
        )
    return table(
        (
            "cell",
            "partition",
            "records (n)",
            "ok",
            "errors",
            "error rate",
            "errors by class",
            "cancelled",
            "dropped",
            "cut at stop",
            "from cache",
            "excluded",
            "tokens/s",
            "requests/s",
            "window s",
        ),
        out,
        name="cells",
        caption="counts per cell and partition; throughput over the steady-state window "
        "(not a mean of per-request rates); ⚠ from cache: requests the server served partly "
        "from its prefix cache beyond the prompt's shared part (their TTFT is no cold prefill)",
        numeric=(
            False,
            False,
            True,
            True,
            True,
            True,
            False,
            True,
            True,
            True,
            False,
            False,
            True,
            True,
            True,
        ),
        row_class=["fail" if (r[4] not in ("0", DASH)) else "" for r in out],
    )


def _percentile_cell(r: dict[str, Any], p: str) -> str:
    """The percentile, its order-statistic interval (what the rules read; or why there
    is none) and, where there is one, its bootstrap interval (spec §9), which exists only
    beside a two-sided order-statistic one."""
    if r[p] is None:
        return DASH
    why = quantile_why(float(p[1:]) / 100, r["count"], float(r["level"] or 0.95))
    text = f"{fmt_ms(r[p])} {fmt_ci(r[p + '_lo'], r[p + '_hi'], why=why)}"
    if r.get(p + "_boot_lo") is None or r.get(p + "_boot_hi") is None:
        return text  # none, or a summary written before the bootstrap interval
    return f"{text} boot {fmt_ci(r[p + '_boot_lo'], r[p + '_boot_hi'])}"


def _estimate_cell(r: dict[str, Any], name: str) -> str:
    """Mean, std or MAD with its interval, or why it has none."""
    if r[name] is None:
        return DASH
    why = spread_why(r["count"], {"mad": "MAD"}.get(name, name))
    return f"{fmt_ms(r[name])} {fmt_ci(r[name + '_lo'], r[name + '_hi'], why=why)}"


def _metric_table(metric: str, rows: list[dict[str, Any]], level: float) -> Any:
    sel = [r for r in rows if r["metric"] == metric]
    out = [
        (
            r["cell"],
            r["partition"],
            fmt_int(r["count"]),
            *(_percentile_cell(r, p) for p in ("p50", "p90", "p95", "p99")),
            fmt_ms(r["max"]),
            *(_estimate_cell(r, name) for name in ("mean", "std", "mad")),
            short_warnings(r["warnings"]),
        )
        for r in sel
    ]
    return table(
        (
            "cell",
            "partition",
            "n",
            "P50 [CI]",
            "P90 [CI]",
            "P95 [CI]",
            "P99 [CI]",
            "max",
            "mean [CI]",
            "std [CI]",
            "MAD [CI]",
            "warnings",
        ),
        out,
        name=f"metric-{metric}",
        caption=f"{METRIC_TITLES.get(metric, metric)}: {level * 100:g}% intervals; a "
        "percentile's first interval is the binomial order-statistic one (the rules read "
        "it), 'boot' the percentile bootstrap's (given only beside a two-sided first one); "
        "a missing bound says what n it needs",
        numeric=(False, False, True, True, True, True, True, True, True, True, True, False),
        folded=metric not in _OPEN,
    )


def _reasoning_table(rows: list[dict[str, Any]]) -> Any:
    """Reasoning and answer tokens per cell and partition, where a success streamed
    reasoning apart from its answer; None for a run without any."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        if r.get("reasoning_requests"):
            seen.setdefault((r["cell"], r["partition"]), r)
    if not seen:
        return None
    out = []
    for (cell, part), r in seen.items():
        reasoning, answer = r["reasoning_tokens"], r["answer_tokens"]
        both = reasoning is not None and answer is not None and reasoning + answer > 0
        out.append(
            (
                cell,
                part,
                fmt_int(r["ok"]),
                fmt_int(r["reasoning_requests"]),
                fmt_int(reasoning),
                fmt_int(answer),
                fmt_pct(100 * reasoning / (reasoning + answer)) if both else DASH,
            )
        )
    return table(
        (
            "cell",
            "partition",
            "ok",
            "with reasoning",
            "reasoning tokens",
            "answer tokens",
            "reasoning share",
        ),
        out,
        name="reasoning",
        caption="reasoning models: generated tokens of each phase, summed over the "
        "successes whose stream carried reasoning apart from the answer (reasoning_content "
        "deltas, or <think>…</think> leading the text); reasoning share = reasoning / "
        "(reasoning + answer)",
        numeric=(False, False, True, True, True, True, True),
    )


def _counts(d: Any) -> str:
    return ", ".join(f"{k}: {v}" for k, v in (d or {}).items()) or DASH


def _boundary_table(rv: RunView) -> Any:
    """The boundary cells (spec §6.1) with their policy verdict, from verdict.json."""
    section = (rv.verdict or {}).get("boundary")
    if not isinstance(section, dict):
        return None
    cells = section.get("cells") or []
    out = [
        (
            str(c.get("cell")),
            str(c.get("status")).replace("_", " "),
            fmt_int(c.get("records")),
            fmt_int(c.get("followed")),
            fmt_int(c.get("over_context")),
            _counts(c.get("http_status")),
            _counts(c.get("error_class")),
            _counts(c.get("error_code")),
            fmt_int(c.get("accepted")),
            fmt_int(c.get("max_output_tokens")),
            _counts(c.get("finish_reason")),
            str(c.get("reason")),
        )
        for c in cells
    ]
    policy = section.get("policy") or "no enabled boundary_policy rule"
    return table(
        (
            "cell",
            "policy verdict",
            "records (n)",
            "followed",
            "over context",
            "HTTP status",
            "error class",
            "error code",
            "served",
            "max output",
            "finish reason",
            "reason",
        ),
        out,
        name="boundary",
        caption=f"boundary cells (spec §6.1: prompt + output over the context), judged only "
        f"by the overflow policy ({policy}); not in the statistics above or in other rules",
        numeric=(False, False, True, True, True, False, False, False, True, True, False, False),
        row_class=[str(c.get("status")) for c in cells],
    )


def cells_section(rv: RunView, base: RunView | None) -> Section:
    s = Section("cells", "Per-cell statistics (spec §9)")
    rows = summary_rows(rv)
    methods = (rv.verdict or {}).get("methods") or {}
    level = float(methods.get("confidence_level") or 0.95)
    boundary = _boundary_table(rv)
    if not rows:
        if boundary is not None:
            s.tables.append(boundary)
        return s.empty("summary.parquet is missing (run `calculet-load analyze RUN`)")
    r0 = rows[0]
    s.intro.append(
        f"Percentiles: numpy method '{r0['percentile_method']}' (always an observed value, "
        f"MLPerf-compatible); their intervals: {r0['quantile_ci_method']}, which the "
        f"rules read, and beside it ('boot') {r0.get('bootstrap_ci_method') or 'none'}; mean: "
        f"{r0['mean_ci_method']}; std and MAD: {r0['spread_ci_method']}. Confidence level "
        f"{level * 100:g}%. Latencies are over successes only; 'measured' is what the rules "
        "read, 'throttled' and 'warmup' are reported apart (spec §8.7)."
    )
    s.tables.append(_overview(rows))
    metrics = [m for m in METRIC_TITLES if any(r["metric"] == m for r in rows)]
    for m in metrics:
        s.tables.append(_metric_table(m, rows, level))
    reasoning = _reasoning_table(rows)
    if reasoning is not None:
        s.tables.append(reasoning)
    if boundary is not None:
        s.tables.append(boundary)
    fig = _cdf_figure(rv, base)
    if fig is not None:
        s.figures.append(fig)
    return s


def _cdf_figure(rv: RunView, base: RunView | None) -> Figure | None:
    panels = []
    note = ""
    for metric in PRIMARY:
        values = {k: v for k, v in measured_values(rv, metric).items() if v.size >= 2}
        bvalues = measured_values(base, metric) if base is not None else {}
        ranked = sorted(values, key=lambda k: -values[k].size)
        if len(ranked) > _MAX_CDF_CELLS:
            note = f"; the {_MAX_CDF_CELLS} cells with most requests of {len(ranked)}"
        lines: list[plots.Line] = []
        for i, label in enumerate(sorted(ranked[:_MAX_CDF_CELLS])):
            x, y = cdf_points(values[label])
            lines.append(plots.Line(label, x.tolist(), y.tolist(), color=i))
            if label in bvalues and bvalues[label].size >= 2:
                bx, by = cdf_points(bvalues[label])
                lines.append(
                    plots.Line(f"{label} (baseline)", bx.tolist(), by.tolist(), style="--", color=i)
                )
        if lines:
            panels.append((METRIC_TITLES[metric], lines))
    if not panels:
        return None
    return figure(
        plots.cdf_figure(panels),
        "latency CDFs per cell (measured successes; dashed: the baseline's same cell)" + note,
        name="cdf",
    )


# ------------------------------------------------------------------- comparison
def comparison_section(rv: RunView, base: RunView | None) -> Section:
    s = Section("comparison", "Paired comparison with the baseline")
    v = rv.verdict or {}
    if base is None and not v.get("baseline"):
        return s.empty("no baseline run (calculet-load analyze/report RUN --baseline BASE)")
    s.intro.append(
        "delta = candidate − baseline; delta % = (candidate / baseline − 1)·100. For "
        "latencies (ms) lower is better, so a negative delta is a win; for throughput "
        "(/s) higher is better, so a positive delta is a win. Intervals are within-run: "
        "they do not cover run-to-run variance."
    )
    judged = _rule_comparisons(v)
    if judged:
        s.tables.append(judged)
    if base is not None and rv.table is not None and base.table is not None:
        level = float(((v.get("methods") or {}).get("confidence_level")) or 0.95)
        s.tables.extend(_wins_and_losses(rv, base, level, s))
    elif base is None:
        s.notes.append(
            "the baseline folder was not given to the report: wins and losses "
            "over every cell need it (--baseline)"
        )
    return s


def _rule_comparisons(v: dict[str, Any]) -> Any:
    rows, classes = [], []
    level = float(((v.get("methods") or {}).get("confidence_level")) or 0.95)
    for r in v.get("verdicts") or []:
        for d in r.get("details") or []:
            if not isinstance(d, dict) or "metric" not in d or "verdict" not in d:
                continue
            why = comparison_why(
                str(d.get("statistic")),
                int(d.get("n_baseline") or 0),
                int(d.get("n_candidate") or 0),
                level,
            )
            rows.append(
                (
                    str(r.get("rule")),
                    str(d.get("cell")),
                    str(d.get("metric")),
                    str(d.get("statistic")),
                    fmt_ms(d.get("baseline")),
                    fmt_ms(d.get("candidate")),
                    fmt_ms(d.get("delta_abs")),
                    f"{fmt_pct(d.get('delta_pct'), signed=True)} {_ci_pct(d.get('ci_pct'), why)}",
                    _direction_text(str(d.get("direction"))),
                    str(d.get("verdict")),
                    str(d.get("reason")),
                )
            )
            classes.append(
                {"regression": "fail", "improvement": "pass"}.get(str(d.get("verdict")), "")
            )
    if not rows:
        return None
    rank = {"fail": 0, "pass": 1, "": 2}
    order = sorted(range(len(rows)), key=lambda i: rank[classes[i]])
    rows, classes = [rows[i] for i in order], [classes[i] for i in order]
    shown, note = cap_rows(rows, _MAX_COMPARISON_ROWS, "comparisons", "verdict.json")
    return table(
        (
            "rule",
            "cell",
            "metric",
            "statistic",
            "baseline",
            "candidate",
            "delta",
            "delta % [CI]",
            "better when",
            "verdict",
            "reason",
        ),
        shown,
        name="rule-comparisons",
        caption=f"comparisons the rules judged (verdict.json) against their allowances: "
        f"{classes.count('fail')} regression(s), {classes.count('pass')} improvement(s) "
        f"of {len(rows)}; regressions first",
        folded=len(shown) > 40,
        note=note,
        numeric=(False, False, False, False, True, True, True, True, False, False, False),
        row_class=classes[: len(shown)],
    )


def _ci_pct(ci: Any, why: str = "") -> str:
    if isinstance(ci, list | tuple) and len(ci) == 2:
        return fmt_ci(ci[0], ci[1], "%")
    return fmt_ci(None, None, why=why)


def _direction_text(direction: str) -> str:
    return "lower" if direction == "lower_is_better" else "higher"


def _wins_and_losses(rv: RunView, base: RunView, level: float, s: Section) -> list[Any]:
    """Every matched cell, P50 and P99 of TTFT/TPOT/E2E: a win or a loss only when the
    interval of the difference excludes zero; otherwise 'no clear difference'."""
    rules = [
        MetricRule(m, st, Thresholds(0.0, 0.0, level)) for m in PRIMARY for st in ("p50", "p99")
    ]
    cand = {m: measured_values(rv, m) for m in PRIMARY}
    bas = {m: measured_values(base, m) for m in PRIMARY}
    labels = sorted(
        set().union(*(set(c) for c in cand.values())) & set().union(*(set(b) for b in bas.values()))
    )
    cmap = {lab: {m: cand[m][lab] for m in PRIMARY if lab in cand[m]} for lab in labels}
    bmap = {lab: {m: bas[m][lab] for m in PRIMARY if lab in bas[m]} for lab in labels}
    comps = compare_cells(bmap, cmap, rules)
    word = {Verdict.IMPROVEMENT: "win", Verdict.REGRESSION: "loss"}
    rank = {"loss": 0, "win": 1}
    comps.sort(key=lambda c: (rank.get(word.get(c.verdict, ""), 2), -(c.badness_pct or 0)))
    rows = [
        (
            c.cell,
            c.metric,
            c.statistic,
            fmt_int(c.n_baseline),
            fmt_int(c.n_candidate),
            fmt_ms(c.baseline),
            fmt_ms(c.candidate),
            fmt_ms(c.delta_abs),
            f"{fmt_pct(c.delta_pct, signed=True)} "
            + _ci_pct(c.ci_pct, comparison_why(c.statistic, c.n_baseline, c.n_candidate, level)),
            word.get(c.verdict, "no clear difference"),
        )
        for c in comps
    ]
    wins = sum(r[-1] == "win" for r in rows)
    losses = sum(r[-1] == "loss" for r in rows)
    s.intro.append(
        f"Over every cell both runs measured ({len(labels)} cells, P50 and P99 of TTFT, TPOT "
        f"and E2E): the candidate wins {wins} and loses {losses} of {len(rows)} comparisons "
        f"at {level * 100:g}% confidence; the rest show no clear difference."
    )
    decided = [r for r in rows if r[-1] != "no clear difference"]
    unclear = [r for r in rows if r[-1] == "no clear difference"]
    columns = (
        "cell",
        "metric",
        "statistic",
        "n base",
        "n cand",
        "baseline",
        "candidate",
        "delta",
        "delta % [CI]",
        "outcome",
    )
    numeric = (False, False, False, True, True, True, True, True, True, False)
    out = []
    for part, caption, folded, name in (
        (
            decided,
            "wins and losses (lower latency is better: a negative delta is a win); losses first",
            False,
            "wins-losses",
        ),
        (
            unclear,
            "no clear difference: the interval of the change includes 0",
            True,
            "no-difference",
        ),
    ):
        shown, note = cap_rows(part, _MAX_COMPARISON_ROWS, "comparisons", "the two runs' records")
        out.append(
            table(
                columns,
                shown,
                name=name,
                caption=caption,
                note=note,
                numeric=numeric,
                folded=folded and bool(shown),
                row_class=[{"loss": "fail", "win": "pass"}.get(r[-1], "") for r in shown],
            )
        )
    out.append(_throughput(rv, base, labels, level))
    return out


def _throughput(rv: RunView, base: RunView, labels: Sequence[str], level: float) -> Any:
    """Steady-state output tokens/s of every matched cell, the gain with its interval
    (THROUGHPUT_DELTA_METHOD on the batch rates summary.parquet keeps): a win or a loss
    only when the interval excludes 0."""

    def batches(x: RunView) -> dict[str, list[float]]:
        return {
            r["cell"]: json.loads(r.get("throughput_batches") or "[]")
            for r in summary_rows(x)
            if r["partition"] == "measured" and r["steady_output_tokens_per_s"] is not None
        }

    c, b = batches(rv), batches(base)
    rows, classes = [], []
    for lab in labels:
        if lab not in c or lab not in b:
            continue
        comp = compare_throughput(b[lab], c[lab], thresholds=Thresholds(0.0, 0.0, level))
        word = {Verdict.IMPROVEMENT: "higher (win)", Verdict.REGRESSION: "lower (loss)"}
        outcome = word.get(comp.verdict, "no clear difference")
        rows.append(
            (
                lab,
                fmt_num(comp.baseline),
                fmt_num(comp.candidate),
                f"{fmt_pct(comp.delta_pct, signed=True)} "
                + _ci_pct(comp.ci_pct, "fewer than 2 batches on a side"),
                outcome,
            )
        )
        classes.append({"higher (win)": "pass", "lower (loss)": "fail"}.get(outcome, ""))
    return table(
        ("cell", "baseline tokens/s", "candidate tokens/s", "delta % [CI]", "candidate is"),
        rows,
        name="throughput-delta",
        caption=f"steady-state output tokens/s: higher is better; {level * 100:g}% interval "
        f"of the change by {THROUGHPUT_DELTA_METHOD} (within-run)",
        numeric=(False, True, True, True, False),
        row_class=classes,
    )
