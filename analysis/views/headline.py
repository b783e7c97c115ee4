"""The report's first table, under the verdict: per cell, how fast it was. TTFT, TPOT
and E2E P50 and P99 with their order-statistic intervals (or why there is none), goodput
(requests/s that met the SLOs, and their share), steady output tokens/s with its
interval, and errors: the measured partition of `summary.parquet`, and verdict.json's
`goodput` section (analysis.judge.goodput). Nothing is computed here.
"""

from __future__ import annotations

import json
from typing import Any

from analysis.views.cells import summary_rows
from analysis.views.model import (
    DASH,
    Cell,
    RunView,
    Section,
    fmt_ci,
    fmt_int,
    fmt_ms,
    fmt_num,
    fmt_pct,
    quantile_why,
    table,
)

__all__ = ["MAX_CELLS", "headline_section"]

MAX_CELLS = 30
"""Cells the headline lists at most (those with most records); all are in "Per-cell
statistics"."""
_METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E"))


def _latency(r: dict[str, Any] | None, p: str) -> Cell:
    if r is None or r.get(p) is None:
        return Cell(DASH)
    q = float(p[1:]) / 100
    why = quantile_why(q, r.get("count"), float(r.get("level") or 0.95))
    # the column names the percentile and the caption the level: the reason says only n
    short = why.split(" for ")[0]
    return Cell(fmt_ms(r[p]), fmt_ci(r.get(p + "_lo"), r.get(p + "_hi"), why=short))


def _goodput(g: dict[str, Any] | None, judged: bool) -> Cell:
    if g is None:
        return Cell(DASH, "no SLO for this cell" if judged else "")
    rate = g.get("goodput_rps")
    main = DASH if rate is None else f"{fmt_num(rate)}/s"
    share = g.get("share")
    if share is None:
        return Cell(main, "no attempt")
    lo, hi = g.get("share_lo"), g.get("share_hi")
    interval = fmt_ci(None if lo is None else 100 * lo, None if hi is None else 100 * hi, "%")
    counts = f"{fmt_int(g.get('good'))} of {fmt_int(g.get('attempts'))}"
    return Cell(main, f"{fmt_pct(100 * share)} {interval} ({counts})")


def _records(metrics: dict[str, dict[str, Any]]) -> int:
    return int(next(iter(metrics.values())).get("records") or 0)


def _errors(r: dict[str, Any]) -> Cell:
    n = r.get("errors") or 0
    if not n:
        return Cell("0")
    classes = json.loads(r.get("errors_by_class") or "{}")
    top = sorted(classes.items(), key=lambda kv: -kv[1])[:2]
    rate = r.get("error_rate")
    head = f"{fmt_int(n)} ({fmt_pct(None if rate is None else 100 * rate)})"
    return Cell(head, ", ".join(f"{k} {v}" for k, v in top))


def _slos(rv: RunView) -> str:
    section = (rv.verdict or {}).get("goodput")
    if not isinstance(section, dict):
        return (
            "goodput: no SLO set (the goodput rule's max_ttft_ms and max_tpot_ms in the rules "
            "file: docs/acceptance.md)"
        )
    seen: dict[str, str] = {}
    for c in section.get("cells") or []:
        parts = [f"TTFT ≤ {c['max_ttft_ms']:g} ms" if c.get("max_ttft_ms") else "",
                 f"TPOT ≤ {c['max_tpot_ms']:g} ms" if c.get("max_tpot_ms") else ""]  # fmt: skip
        seen.setdefault(str(c.get("rule")), " and ".join(p for p in parts if p))
    rules = "; ".join(f"{k}: {v}" for k, v in seen.items()) or "no cell selected"
    return (
        f"goodput: successes within the SLOs ({rules}) per second of the steady window, and "
        "their share of the attempts with its Clopper–Pearson interval"
    )


def headline_section(rv: RunView) -> Section:
    s = Section("headline", "How fast: per cell")
    rows = [r for r in summary_rows(rv) if r["partition"] == "measured"]
    if not rows:
        why = "summary.parquet is missing (run `calculet-load analyze RUN`)"
        if rv.summary is not None:
            why = "no cell has a measured partition"
        return s.empty(why)
    by_cell: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_cell.setdefault(r["cell"], {})[r["metric"]] = r
    level = float(rows[0].get("level") or 0.95)
    goodput = {
        str(g.get("cell")): g
        for g in ((rv.verdict or {}).get("goodput") or {}).get("cells") or []
        if isinstance(g, dict)
    }
    judged = isinstance((rv.verdict or {}).get("goodput"), dict)
    # most records first: the matrix's cells before the golden set's and the like
    order = sorted(by_cell, key=lambda c: (-_records(by_cell[c]), c))
    out: list[tuple[str | Cell, ...]] = []
    failing = []
    for cell in order[:MAX_CELLS]:
        metrics = by_cell[cell]
        any_row = next(iter(metrics.values()))
        lo = any_row.get("steady_output_tokens_per_s_lo")
        hi = any_row.get("steady_output_tokens_per_s_hi")
        failing.append(bool(any_row.get("errors")))
        out.append(
            (
                Cell(cell, f"{fmt_int(any_row.get('ok'))} ok of {fmt_int(any_row.get('records'))}"),
                *(_latency(metrics.get(m), p) for m, _ in _METRICS for p in ("p50", "p99")),
                _goodput(goodput.get(cell), judged),
                Cell(
                    fmt_num(any_row.get("steady_output_tokens_per_s")),
                    fmt_ci(lo, hi, why="fewer than 2 batches"),
                ),
                _errors(any_row),
            )
        )
    note = ""
    if len(order) > MAX_CELLS:
        note = (
            f"showing the {MAX_CELLS} cells with most records of {len(order)}; every cell is "
            "in 'Per-cell statistics' below"
        )
    s.tables.append(
        table(
            (
                "cell",
                *(f"{name} {p} ms" for _, name in _METRICS for p in ("P50", "P99")),
                "goodput",
                "output tokens/s",
                "errors",
            ),
            out,
            name="headline",
            caption=f"measured partition; P50 and P99 with their {level * 100:g}% binomial "
            "order-statistic intervals (what the rules read; 'n = 4 < 368': that bound needs 368 "
            f"values at this percentile and level); {_slos(rv)}; output tokens/s "
            "over the steady window with its batch-means interval; errors: failed requests "
            "(cancellations are not errors)",
            note=note,
            numeric=(False, *([True] * 9)),
            row_class=["fail" if failed else "" for failed in failing],
        )
    )
    return s
