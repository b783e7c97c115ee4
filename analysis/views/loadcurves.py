"""Report sections on load response: TTFT/TPOT against concurrency and against the
arrival rate (points from `summary.parquet`, the offered rate of an open-loop cell from
its records' intended send times), and the layout of `verdict.json`'s capacity (spec
§14.3, `analysis.judge.capacity`) and batch (spec §7, `analysis.judge.batch`) sections.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from analysis.views import plots
from analysis.views.cells import summary_rows
from analysis.views.model import (
    NO_DATA,
    RunView,
    Section,
    figure,
    fmt_ci,
    fmt_int,
    fmt_ms,
    fmt_num,
    fmt_pct,
    quantile_why,
    table,
)

__all__ = ["batch_section", "capacity_section", "curves_section", "offered_rates", "shapes"]

CLOSED = ("closed", "single")
_NOT_OPEN = ("closed", "single", "burst")


def shapes(rv: RunView) -> dict[str, str]:
    """Per cell label: its request shape `pP-oO`, or "mix" when its requests differ."""
    if rv.table is None:
        return {}
    p = rv.col("workload.prompt_tokens")
    o = rv.col("workload.requested_output_tokens")
    out = {}
    for label, rows in rv.groups(~rv.partition_in("warmup", "dropped")).items():
        pairs = {(a, b) for a, b in zip(p[rows].tolist(), o[rows].tolist(), strict=True)}
        if len(pairs) == 1:
            a, b = next(iter(pairs))
            out[label] = f"p{fmt_int(a)}-o{fmt_int(b)}".replace(",", "")
        else:
            out[label] = "mix"
    return out


def offered_rates(rv: RunView) -> dict[str, float]:
    """Per open-loop cell: arrivals per second of its schedule, (n − 1) / span of the
    intended send times (dropped arrivals included: they were offered)."""
    if rv.table is None:
        return {}
    t = rv.col("ext.intended_start_ns")
    out = {}
    for label, rows in rv.groups(np.isfinite(t) & ~rv.partition_in("warmup")).items():
        v = t[rows]
        span = (v.max() - v.min()) / 1e9
        if v.size >= 2 and span > 0:
            out[label] = (v.size - 1) / span
    return out


def _stats(rv: RunView) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["cell"], r["metric"]): r for r in summary_rows(rv) if r["partition"] == "measured"}


def _golden(label: str) -> bool:
    return label.startswith("golden")


def _lines(points: dict[str, list[tuple[float, dict[str, Any]]]], metric: str) -> list[plots.Line]:
    out = []
    for i, (key, pts) in enumerate(sorted(points.items())):
        pts = sorted(((x, r) for x, r in pts if r is not None), key=lambda p: p[0])
        if not pts:
            continue
        x = [p[0] for p in pts]
        for stat, style in (("p50", "-"), ("p99", "--")):
            y = [np.nan if p[1][stat] is None else p[1][stat] for p in pts]
            lo = [np.nan if p[1][f"{stat}_lo"] is None else p[1][f"{stat}_lo"] for p in pts]
            hi = [np.nan if p[1][f"{stat}_hi"] is None else p[1][f"{stat}_hi"] for p in pts]
            out.append(plots.Line(f"{key} {stat.upper()}", x, y, lo, hi, style=style, color=i))
    return out


def curves_section(rv: RunView) -> Section:
    s = Section("curves", "TTFT and TPOT vs concurrency and vs arrival rate")
    stats = _stats(rv)
    if not stats:
        return s.empty("summary.parquet is missing")
    shape = shapes(rv)
    rates = offered_rates(rv)
    by_conc: dict[str, dict[str, list[Any]]] = {
        "ttft_ms": defaultdict(list),
        "tpot_ms": defaultdict(list),
    }
    by_rate: dict[str, dict[str, list[Any]]] = {
        "ttft_ms": defaultdict(list),
        "tpot_ms": defaultdict(list),
    }
    rows = []
    for (label, metric), r in sorted(stats.items()):
        if metric != "ttft_ms" or _golden(label):
            continue
        arrival, conc = r["arrival"], r["concurrency"]
        x: float | None
        if arrival in _NOT_OPEN and conc is not None:
            family = "closed loop" if arrival in CLOSED else "burst"
            target, x = by_conc, float(conc)
        elif label in rates:
            family, target, x = str(arrival), by_rate, rates[label]
        else:
            continue
        key = f"{shape.get(label, '?')} {family}"
        for m in target:
            target[m][key].append((x, stats.get((label, m))))
        tp = stats.get((label, "tpot_ms")) or {}
        rows.append(
            (
                label,
                key,
                fmt_num(x),
                fmt_int(r["count"]),
                fmt_ms(r["p50"]),
                fmt_ms(r["p99"]),
                fmt_ms(tp.get("p50")),
                fmt_ms(tp.get("p99")),
                fmt_num(r["steady_output_tokens_per_s"]),
            )
        )
    if not rows:
        return s.empty("no closed-loop, burst or open-loop cell besides the golden set")
    panels = []
    for name, data, xlabel in (
        ("concurrency", by_conc, "in-flight requests (closed loop / burst size)"),
        ("arrival rate", by_rate, "offered arrivals per second (open loop)"),
    ):
        for metric, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
            lines = _lines(data[metric], metric)
            if lines:
                panels.append((f"{title} vs {name}", xlabel, lines))
    s.intro.append(
        "P50 (solid) and P99 (dashed) of the measured partition per cell, with their "
        "intervals; lines join cells of one request shape and load kind. The golden cells "
        "are correctness probes and are left out. Closed loop hides overload: capacity is "
        "read from the open-loop cells (next section)."
    )
    for i in range(0, len(panels), 2):
        s.figures.append(
            figure(
                plots.curve_figure(panels[i : i + 2]),
                " and ".join(p[0] for p in panels[i : i + 2]),
                name=f"curves-{i // 2}",
            )
        )
    s.tables.append(
        table(
            (
                "cell",
                "line",
                "x (concurrency or arrivals/s)",
                "n",
                "TTFT P50",
                "TTFT P99",
                "TPOT P50",
                "TPOT P99",
                "tokens/s",
            ),
            rows,
            name="curves",
            numeric=(False, False, True, True, True, True, True, True, True),
        )
    )
    return s


def _verdict_rows(rv: RunView, pred: Any) -> Any:
    rows = [v for v in (rv.verdict or {}).get("verdicts") or [] if pred(v)]
    if not rows:
        return None
    return table(
        ("rule", "status", "reason"),
        [(str(v.get("rule")), str(v.get("status")), str(v.get("reason"))) for v in rows],
        name="verdicts",
        row_class=[str(v.get("status")) for v in rows],
    )


def _p99(d: dict[str, Any], key: str, n_key: str, level: float) -> str:
    """A P99 with its interval, or why it has none (from the n it rests on)."""
    why = quantile_why(0.99, d.get(n_key), level)
    return f"{fmt_ms(d.get(key + '_ms'))} {fmt_ci(d.get(key + '_lo'), d.get(key + '_hi'), why=why)}"


def _level(rv: RunView) -> float:
    return float((((rv.verdict or {}).get("methods") or {}).get("confidence_level")) or 0.95)


def capacity_section(rv: RunView) -> Section:
    """verdict.json's `capacity` section (analysis.judge.capacity) laid out, with its curve."""
    s = Section("capacity", "Capacity (spec §14.3)")
    judged = _verdict_rows(rv, lambda v: v.get("kind") == "capacity")
    if judged is not None:
        s.tables.append(judged)
    cap = (rv.verdict or {}).get("capacity")
    if not isinstance(cap, dict) or not cap.get("points"):
        why = "no open-loop cell: capacity and P99 must be confirmed open-loop (§6.2)"
        if rv.verdict is not None and "capacity" not in rv.verdict:
            why = "verdict.json has no capacity section (run `calculet-load analyze` again)"
        return s.empty(why)
    pts = sorted(cap["points"], key=lambda p: p.get("rate") or 0)
    crit = cap.get("criteria") or {}
    s.intro.append(
        f"Stable max QPS: {fmt_num(cap.get('stable_max_qps'))} "
        f"({cap.get('stable_cell') or 'no rate point qualifies'}): the highest rate held "
        f"≥ {fmt_num(cap.get('window_s'))} s with every limit met and the queue shown not "
        f"growing; a short peak never counts. Latency: {crit.get('latency_metric', '?')}. "
        f"Method: {cap.get('method', '?')}."
    )
    rows = [
        (
            str(p.get("cell")),
            fmt_num(p.get("rate_nominal")),
            fmt_num(p.get("rate_offered")),
            fmt_num(p.get("window_s")),
            fmt_int(p.get("sent")),
            fmt_int(p.get("dropped")),
            fmt_pct(_100(p.get("error_rate"))),
            fmt_pct(_100(p.get("reject_rate"))),
            f"{_p99(p, 'queue_p99', 'queue_n', _level(rv))} n={fmt_int(p.get('queue_n'))}",
            f"{_p99(p, 'latency_p99', 'latency_n', _level(rv))} n={fmt_int(p.get('latency_n'))}",
            fmt_pct(_100(p.get("utilisation"))),
            f"{p.get('queue_growth')} {fmt_num(p.get('queue_slope_ms_per_min'))} ms/min",
            "yes" if p.get("stable") else "no: " + "; ".join(p.get("not_stable_because") or []),
        )
        for p in pts
    ]
    s.tables.append(
        table(
            (
                "cell",
                "nominal /s",
                "offered /s",
                "held s",
                "sent",
                "dropped",
                "error rate",
                "reject rate",
                "queue P99 [CI]",
                "latency P99 [CI]",
                "utilisation",
                "queue growth",
                "stable",
            ),
            rows,
            name="capacity",
            numeric=(False, *([True] * 11), False),
            row_class=["pass" if p.get("stable") else "" for p in pts],
        )
    )
    s.notes += [str(n) for n in cap.get("notes") or []]
    rates = [p.get("rate") for p in pts if p.get("rate") is not None]
    if len(set(rates)) < 2:
        s.notes.append(f"{NO_DATA}: the capacity curve needs open-loop cells at ≥ 2 rates")
        return s
    x = [float(p["rate"]) for p in pts if p.get("rate") is not None]
    sel = [p for p in pts if p.get("rate") is not None]

    def ys(key: str) -> list[float]:
        return [np.nan if p.get(key) is None else float(p[key]) for p in sel]

    lines = [
        plots.Line(
            "server queue P99",
            x,
            ys("queue_p99_ms"),
            ys("queue_p99_lo"),
            ys("queue_p99_hi"),
            color=0,
        ),
        plots.Line(
            f"{crit.get('latency_metric', 'latency')} P99",
            x,
            ys("latency_p99_ms"),
            ys("latency_p99_lo"),
            ys("latency_p99_hi"),
            style="--",
            color=2,
        ),
    ]
    s.figures.append(
        figure(
            plots.curve_figure([("capacity curve", "arrivals per second", lines)]),
            "P99 server queue and latency against the arrival rate",
            name="capacity",
        )
    )
    return s


def _100(v: Any) -> float | None:
    return None if v is None else 100 * float(v)


def batch_section(rv: RunView) -> Section:
    """verdict.json's `batch` section (analysis.judge.batch, spec §7) laid out."""
    s = Section("batch", "Batch artifacts: fill, waste and throughput (spec §7)")
    judged = _verdict_rows(
        rv, lambda v: v.get("kind") == "batch" or str(v.get("rule", "")).startswith("batch")
    )
    if judged is not None:
        s.tables.append(judged)
    b = (rv.verdict or {}).get("batch")
    if not isinstance(b, dict):
        why = "no decode step in server/steps.jsonl"
        if rv.verdict is not None and "batch" not in rv.verdict:
            why = "verdict.json has no batch section (run `calculet-load analyze` again)"
        return s.empty(why)
    source = {
        "rules": "from the acceptance rules",
        "manifest": "from the run manifest's batch section",
        "inferred": "inferred: the most active lanes of any decode step, a lower bound",
    }.get(str(b.get("compiled_batch_source")), str(b.get("compiled_batch_source")))
    s.intro.append(
        f"Compiled batch B{b.get('compiled_batch')} ({source}); "
        f"{fmt_int(b.get('decode_steps'))} decode and {fmt_int(b.get('prefill_steps'))} "
        f"prefill steps; fill ratio {fmt_pct(_100(b.get('fill_ratio')))}, lane waste "
        f"{fmt_pct(_100(b.get('lane_waste')))}. Aggregate tokens/s and single-request TPOT "
        "P99 side by side; one calbin per run: compare B4/B8/B16 runs with --baseline. "
        f"Method: {b.get('method', '?')}."
    )
    stated = b.get("vendor_statement")
    if isinstance(stated, dict) and stated.get("partial_lanes"):
        ref = f" (reference: {stated['reference']})" if stated.get("reference") else ""
        s.intro.append(
            f"Vendor's partial-lane policy for B{stated.get('compiled_batch')} (manifest "
            f"batch.partial_lanes){ref}: {stated['partial_lanes']}"
        )
    else:
        s.intro.append(
            "Vendor's partial-lane policy: not stated (spec §7 requires the vendor to state "
            "how lanes that are not filled are handled: the manifest's batch section)"
        )
    levels = b.get("by_active_lanes") or []
    s.tables.append(
        table(
            (
                "active lanes",
                "fill",
                "decode steps",
                "share",
                "device ms P50",
                "device ms P99",
                "step ms P50",
                "tokens/s at this fill",
            ),
            [
                (
                    fmt_int(x.get("active_lanes")),
                    fmt_pct(_100(x.get("fill_ratio"))),
                    fmt_int(x.get("decode_steps")),
                    fmt_pct(_100(x.get("share_of_steps"))),
                    fmt_ms(x.get("device_ms_p50")),
                    fmt_ms(x.get("device_ms_p99")),
                    fmt_ms(x.get("step_ms_p50")),
                    fmt_num(x.get("lane_tokens_per_s")),
                )
                for x in levels
            ],
            name="batch-lanes",
            caption="decode steps by active lanes (1..B)",
            numeric=(True,) * 8,
        )
    )
    cells = b.get("cells") or []
    s.tables.append(
        table(
            (
                "cell",
                "workload",
                "concurrency",
                "requests",
                "mean lanes",
                "fill",
                "lane waste",
                "effective tokens/s",
                "aggregate tokens/s",
                "TPOT P50",
                "TPOT P99 [CI]",
                "single-request TPOT P99",
            ),
            [
                (
                    str(c.get("cell")),
                    str(c.get("workload")),
                    fmt_int(c.get("concurrency")),
                    fmt_int(c.get("requests")),
                    fmt_num(c.get("mean_active_lanes")),
                    fmt_pct(_100(c.get("fill_ratio"))),
                    fmt_pct(_100(c.get("lane_waste"))),
                    fmt_num(c.get("effective_tokens_s")),
                    fmt_num(c.get("aggregate_tokens_s")),
                    fmt_ms(c.get("tpot_p50_ms")),
                    _p99(c, "tpot_p99", "tpot_n", _level(rv)),
                    fmt_ms(c.get("single_request_tpot_p99_ms")),
                )
                for c in cells
            ],
            name="batch",
            numeric=(False, False, *([True] * 10)),
        )
    )
    for r in b.get("recommendations") or []:
        if isinstance(r, dict) and r.get("text"):
            s.intro.append(
                f"Recommendation: {r['text']} (assumes: {'; '.join(r.get('assumptions') or [])})"
            )
    s.notes += [str(n) for n in b.get("notes") or []]
    return s
