"""What an `LLMTable` looks like outside: the web UI tab's rows, the LLM CSV files
beside Locust's `--csv` files, and the LLM section of Locust's `--html` report.

    <prefix>_llm_stats.csv          rewritten every second: one row per cell and an
                                    Aggregated row (CSV_COLUMNS), since the last reset
    <prefix>_llm_stats_history.csv  appended every second: the Aggregated row (every
                                    cell's too with --csv-full-history), its percentiles
                                    over the last 10 s (HISTORY_COLUMNS)

Latencies are in ms, as the column names say; an empty field is "no data", never 0.
Everything here formats; the figures are calculet_load.locust.llmstats'.
"""

from __future__ import annotations

import html as html_mod
from typing import Any

from calculet_load.locust.livestats import LiveStats
from calculet_load.locust.llmstats import (
    AGGREGATED,
    FIGURES,
    METRICS,
    OPTIONAL_METRICS,
    TITLES,
    EntryStats,
    LLMTable,
)

# --- the web UI tab ---------------------------------------------------------------------
TAB_COLUMNS = [
    {"key": "figure", "title": "Figure"},
    {"key": "p50", "title": "p50"},
    {"key": "p90", "title": "p90"},
    {"key": "p95", "title": "p95"},
    {"key": "p99", "title": "p99"},
    {"key": "max", "title": "max"},
    {"key": "mean", "title": "mean"},
    {"key": "value", "title": "Value"},
    {"key": "recent_p50", "title": "last 10 s p50"},
    {"key": "recent_p99", "title": "last 10 s p99"},
    {"key": "recent", "title": "last 10 s"},
]


def fmt(value: float | int | None) -> str:
    """About 3 significant digits for the eye; "no data" for None."""
    if value is None:
        return "no data"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _metric_row(label: str, e: EntryStats, w: EntryStats, metric: str) -> dict[str, Any]:
    f, r = e.figures(metric), w.figures(metric)
    row: dict[str, Any] = {"figure": label}
    for key in ("p50", "p90", "p95", "p99", "max", "mean"):
        row[key] = fmt(f[key])
    row["value"] = f"n={f['n']}"
    row["recent_p50"] = fmt(r["p50"])
    row["recent_p99"] = fmt(r["p99"])
    row["recent"] = f"n={r['n']}"
    return row


def _plain(label: str, value: Any, recent: Any = "") -> dict[str, Any]:
    row = {c["key"]: "" for c in TAB_COLUMNS}
    row.update(figure=label, value=value, recent=recent)
    return row


def tab_rows(table: LLMTable, live: LiveStats | None = None) -> list[dict[str, Any]]:
    """The LLM tab: every metric of Aggregated, the client's loop lag, the counts, then
    each cell's metrics when there are several cells. `live` gives the gauges
    (in flight, CPU), which a reset does not touch."""
    total, recent = table.entries(), table.entries(recent=True)
    agg, agg_w = total[AGGREGATED], recent[AGGREGATED]
    # a reasoning model's figure, where the run has one (it is "no data" elsewhere)
    shown = [m for m in METRICS if m not in OPTIONAL_METRICS or agg.hist[m].count]
    rows = [_metric_row(TITLES[m], agg, agg_w, m) for m in shown]
    lag = EntryStats()
    lag.hist["e2e_ms"] = table.loop_lag  # the same figures, one histogram
    row = _metric_row("client loop lag ms", lag, EntryStats(), "e2e_ms")
    row.update(recent_p50="", recent_p99="", recent="")
    rows.append(row)
    c = agg.counts
    rows += [
        _plain(
            "output tokens/s",
            fmt(table.per_s(agg, "output_tokens")),
            fmt(table.per_s(agg_w, "output_tokens", recent=True)),
        ),
        _plain(
            "requests/s",
            fmt(table.per_s(agg, "requests")),
            fmt(table.per_s(agg_w, "requests", recent=True)),
        ),
        _plain("requests in flight", sum(live.in_flight.values()) if live else ""),
        _plain("requests done", c["requests"], agg_w.counts["requests"]),
        _plain("ok", c["requests"] - c["failures"] - c["cancelled"]),
        _plain("failed", c["failures"], agg_w.counts["failures"]),
        _plain(
            "cancelled (by the user, or at the stop)", c["cancelled"], agg_w.counts["cancelled"]
        ),
        _plain("late arrivals", c["late"], agg_w.counts["late"]),
        _plain("dropped arrivals", c["dropped"], agg_w.counts["dropped"]),
        _plain("token count mismatches", c["count_mismatch"]),
        _plain(
            "client CPU % (max process)",
            fmt(max(live.cpu_percent.values(), default=None)) if live else "no data",
        ),
    ]
    rows += [_plain(f"errors: {cls}", n) for cls, n in sorted(table.errors.items())]
    cells = [name for name in total if name != AGGREGATED]
    if len(cells) > 1:
        for name in cells:
            for m in shown:
                rows.append(
                    _metric_row(
                        f"{name}: {TITLES[m]}", total[name], recent.get(name, EntryStats()), m
                    )
                )
    return rows


# --- the CSV files ----------------------------------------------------------------------
CSV_COLUMNS = [
    "name",
    "requests",
    "failures",
    "cancelled",
    "late",
    "dropped",
    "output_tokens",
    *(f"{m}_{f}" for m in METRICS for f in FIGURES),
]
HISTORY_COLUMNS = [
    "timestamp",
    "user_count",
    "name",
    "requests",
    "failures",
    "requests_per_s",
    "output_tokens_per_s",
    *(f"{m}_{f}" for m in METRICS for f in FIGURES),
]


def _csv_value(value: float | int | None) -> str:
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    return f"{value:.6g}"


def _metric_fields(e: EntryStats) -> list[str]:
    return [_csv_value(e.figures(m)[f]) for m in METRICS for f in FIGURES]


def csv_rows(table: LLMTable) -> list[list[str]]:
    """`_llm_stats.csv`: Aggregated and one row per cell, since the last reset."""
    out = []
    for name, e in table.entries().items():
        c = e.counts
        counts = [
            c["requests"], c["failures"], c["cancelled"], c["late"], c["dropped"],
            c["output_tokens"],
        ]  # fmt: skip
        out.append([name, *(str(v) for v in counts), *_metric_fields(e)])
    return out


def history_rows(table: LLMTable, timestamp: int, user_count: int, full: bool) -> list[list[str]]:
    """`_llm_stats_history.csv` rows of one instant: cumulative counts, the rates and
    percentiles of the last 10 s; Aggregated only unless `full` (--csv-full-history)."""
    total, recent = table.entries(), table.entries(recent=True)
    out = []
    for name, e in total.items():
        if name != AGGREGATED and not full:
            continue
        w = recent.get(name, EntryStats())
        out.append(
            [
                str(timestamp),
                str(user_count),
                name,
                str(e.counts["requests"]),
                str(e.counts["failures"]),
                _csv_value(table.per_s(w, "requests", recent=True)),
                _csv_value(table.per_s(w, "output_tokens", recent=True)),
                *_metric_fields(w),
            ]
        )
    return out


# --- the --html report --------------------------------------------------------------------
SECTION_ID = "calculet-llm"
_STYLE = (
    "font-family:Roboto,Helvetica,Arial,sans-serif;max-width:1200px;margin:24px auto;"
    "padding:0 24px;color:#222;background:#fff"
)


def html_section(table: LLMTable) -> str:
    """A self-contained block: per cell and metric, n and the percentiles since the
    last reset (the same figures as the LLM CSV)."""
    e = html_mod.escape
    head = "".join(f"<th>{e(h)}</th>" for h in ("cell", "metric", *FIGURES))
    body = []
    entries = table.entries()
    for name, entry in entries.items():
        c = entry.counts
        body.append(
            f'<tr class="cell"><th colspan="{2 + len(FIGURES)}" style="text-align:left">'
            f"{e(name)}: {c['requests']} requests, {c['failures']} failed, "
            f"{c['cancelled']} cancelled, "
            f"{c['output_tokens']} output tokens</th></tr>"
        )
        for m in METRICS:
            f = entry.figures(m)
            cells = "".join(f"<td>{e(_csv_value(f[k]) or 'no data')}</td>" for k in FIGURES)
            body.append(f'<tr data-cell="{e(name)}" data-metric="{m}"><td>{e(name)}</td>'
                        f"<td>{e(TITLES[m])}</td>{cells}</tr>")  # fmt: skip
    return (
        f'<section id="{SECTION_ID}" style="{_STYLE}">'
        "<h2>LLM (calculet)</h2>"
        "<p>Per cell (mix entry) since the last reset. Latencies in ms; percentiles are "
        "the <code>higher</code> order statistic read from log buckets (within 1 %), as "
        "<code>calculet-load analyze</code> computes them from the records. Locust's "
        "table above counts each request once, by its end-to-end time.</p>"
        '<table border="1" cellspacing="0" cellpadding="4" style="border-collapse:collapse">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></section>"
    )


def inject(report: str, section: str) -> str:
    """Locust's report with `section` placed after its page (before the last
    `</body>`); a report that already has one gets it replaced."""
    start = report.find(f'<section id="{SECTION_ID}"')
    if start >= 0:
        end = report.index("</section>", start) + len("</section>")
        report = report[:start] + report[end:]
    at = report.rfind("</body>")
    if at < 0:
        return report + section
    return report[:at] + section + report[at:]


# --- the headless console ---------------------------------------------------------------
CONSOLE_NAME_WIDTH = 34
CONSOLE_METRICS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"))


def console_lines(table: LLMTable, *, current: bool) -> list[str]:
    """The compact LLM table printed beside Locust's on the console: per cell (when
    there are several) and Aggregated, the counts, TTFT, TPOT and ITL p50/p99 in ms
    since the last reset, and output tokens/s over the last 10 s (`current`) or since
    the reset (at the end, as Locust's own table does); then the errors by class."""
    w = CONSOLE_NAME_WIDTH
    when = "over the last 10 s" if current else "since the start"
    head = f"{'LLM (calculet)':<{w}} {'# reqs':>7} {'# fails':>8} {'# cancel':>8}"
    for label, _ in CONSOLE_METRICS:
        head += f" | {label + ' p50':>8} {'p99':>7}"
    head += f" | {'tok/s':>8}"
    sep = "-" * len(head)
    metrics = [m for _, m in CONSOLE_METRICS]
    total = table.entries(metrics=metrics)
    recent = table.entries(recent=True, metrics=()) if current else total
    rows = [name for name in total if name != AGGREGATED]
    lines = [head, sep]
    for name in [*(rows if len(rows) > 1 else []), AGGREGATED]:
        if name == AGGREGATED and len(rows) > 1:
            lines.append(sep)
        e = total[name]
        c = e.counts
        line = f"{name[:w]:<{w}} {c['requests']:>7} {c['failures']:>8} {c['cancelled']:>8}"
        for _, metric in CONSOLE_METRICS:
            f = e.figures(metric)
            line += f" | {_cell(f['p50']):>8} {_cell(f['p99']):>7}"
        rate_of = recent.get(name, EntryStats()) if current else e
        line += f" | {_cell(table.per_s(rate_of, 'output_tokens', recent=current)):>8}"
        lines.append(line)
    lines.append(sep)
    errors = ", ".join(f"{cls} {n}" for cls, n in sorted(table.errors.items())) or "none"
    lines.append(f"ms since the last reset; output tokens/s {when}. Errors by class: {errors}")
    return lines


def _cell(value: float | int | None) -> str:
    return "-" if value is None else fmt(value)
