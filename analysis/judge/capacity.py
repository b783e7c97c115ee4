# size: §14.3: the rate points, the stability rule and its section
"""Capacity (spec §14.3): per arrival rate, the queue, the rejects and the device's
utilisation; whether the queue keeps growing; and the stable max QPS.

A **rate point** is one open-loop cell (arrival poisson, constant or gamma): its
nominal rate from the cell name the matrix gives it (`poisson4-…` → 4/s) or the Locust
plan in client/index.json, and its offered rate measured from the schedule:

    rate_offered  = (arrivals − 1) / (last − first intended send time)    every arrival,
                    sent or dropped; intended = wall anchor − send lag
    window_s      = last − first intended send time
    reject_rate   = answers 429/503 / sent requests
    error_rate    = other failures / sent requests (deliberate cancellations and
                    requests cut at the run's end are neither)
    queue P99     = P99 of server_ms.queue (accepted → first job prepared), measured
                    partition, with its binomial order-statistic interval
    latency P99   = P99 of `latency_metric` (default TTFT from the intended send time:
                    coordinated omission included), measured successes
    utilisation   = Σ device wait of the distinct device jobs (steps.jsonl) inside the
                    cell's server-clock window / the window; null without steps.jsonl

**Queue growth**: the server queue time of each request against its arrival time, after
the warmup, is tested like a leak (analysis.stats.trend: bin means, Theil–Sen slope,
Mann–Kendall with the Hamed–Rao correction, α = 0.01) with the rule's
`queue_growth_ms_per_min` as the magnitude gate: a significant slope at or above it is
"growing"; too few bins is "insufficient data", which is not "not growing".

**Goodput** (the rule's `goodput` criterion, analysis.stats.goodput): the share of the
point's measured attempts that succeeded within its TTFT and TPOT objectives, with its
Clopper–Pearson interval; without the criterion, not computed.

**Stable max QPS** (§14.3): the highest rate whose point was held for at least
`window_s` (30 minutes by the spec; shorter for rehearsals) with error rate ≤
`max_error_rate`, reject rate ≤ `max_reject_rate`, queue P99 and latency P99 shown
within their limits (the interval's upper bound; a limit not set is not checked), with
`goodput`, a goodput share shown at or above its `min_share` (the interval's lower
bound), and a queue shown not growing. A short peak is never the stable max.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.judge.evidence import Context, Evidence, column_np, not_evaluated, verdict_for
from analysis.judge.goodput import cell_goodput
from analysis.judge.limits import limit_verdict
from analysis.judge.rules import CapacityRule, CellSelector
from analysis.judge.verdict import RuleVerdict, Status, TooShort
from analysis.stats.quantiles import quantile, quantile_ci
from analysis.stats.trend import MIN_BINS, LeakStatus, detect_leak
from analysis.tables.cellkey import CellKey, rows_by_cell
from analysis.tables.cells import client_wall_span
from analysis.tables.quality import Partition

__all__ = [
    "CAPACITY_METHOD",
    "HANDLERS",
    "OPEN_LOOP",
    "CapacityAnalysis",
    "RatePoint",
    "analyze_capacity",
    "cached_capacity",
    "capacity_section",
]

OPEN_LOOP = ("poisson", "constant", "gamma")
CAPACITY_METHOD = (
    "per open-loop cell: offered rate from intended send times; reject rate 429/503 of "
    "sent; queue/latency P99 with binomial order-statistic intervals; utilisation = device "
    "wait of distinct jobs / window; queue growth = leak test on queue time vs arrival; "
    "stable max QPS = highest rate held ≥ window_s meeting every limit, queue not growing"
)
_RATE_IN_NAME = re.compile(r"^(?:poisson|constant|gamma)(\d+(?:\.\d+)?)(?:-|$)")
_REJECT = (429, 503)


@dataclass(frozen=True, slots=True)
class RatePoint:
    cell: str
    arrival: str | None
    rate_nominal: float | None
    rate_offered: float | None
    window_s: float | None
    arrivals: int
    sent: int
    dropped: int
    ok: int
    errors: int
    error_rate: float | None
    rejects: int
    reject_rate: float | None
    queue_p99_ms: float | None
    queue_p99_lo: float | None
    queue_p99_hi: float | None
    queue_n: int
    latency_metric: str
    latency_p99_ms: float | None
    latency_p99_lo: float | None
    latency_p99_hi: float | None
    latency_n: int
    utilisation: float | None
    queue_growth: str  # growing | not_growing | insufficient_data | no_data
    queue_slope_ms_per_min: float | None
    queue_growth_p: float | None
    queue_growth_reason: str
    stable: bool
    not_stable_because: list[str]
    # with the rule's goodput criterion: the measured share that met its SLOs (else None)
    goodput_share: float | None = None
    goodput_share_lo: float | None = None
    goodput_share_hi: float | None = None
    goodput_rps: float | None = None
    # queue growth undecided for too few bins: how long the rate must be held for them
    queue_growth_min_s: float | None = None

    @property
    def rate(self) -> float | None:
        return self.rate_nominal if self.rate_nominal is not None else self.rate_offered


@dataclass(frozen=True, slots=True)
class CapacityAnalysis:
    points: list[RatePoint]
    stable_max_qps: float | None
    stable_cell: str | None
    window_s: float
    criteria: dict[str, Any]
    notes: list[str]
    method: str = CAPACITY_METHOD


def _cell_rows(t: pa.Table) -> dict[CellKey, Any]:
    """Every row (all partitions) of each open-loop cell."""
    arrival = column_np(t.column("ext.arrival"), "", object)
    open_rows = np.flatnonzero(np.isin(arrival, OPEN_LOOP))
    if open_rows.size == 0:
        return {}
    return {key: rows for (key, _), rows in rows_by_cell(t, open_rows).items()}


def _nominal(key: CellKey, index: dict[str, Any] | None) -> float | None:
    m = _RATE_IN_NAME.match(key.name or "")
    if m:
        return float(m.group(1))
    plan = (index or {}).get("plan")
    if isinstance(plan, dict) and plan.get("arrival") == key.arrival:
        rate = plan.get("rate")
        if isinstance(rate, int | float) and not plan.get("rate_changes"):
            return float(rate)
    return None


def _offered(t: pa.Table, rows: Any) -> tuple[float | None, float | None]:
    anchor = column_np(t.column("ext.wall_anchor_ns"), -1, np.int64)[rows]
    lag = column_np(t.column("ext.send_lag_ms"), 0.0, np.float64)[rows]
    ok = anchor >= 0
    if np.count_nonzero(ok) < 2:
        return None, None
    intended = anchor[ok] - np.round(lag[ok] * 1e6).astype(np.int64)
    span = int(intended.max()) - int(intended.min())
    if span <= 0:
        return None, None
    return float(np.count_nonzero(ok) - 1) / (span / 1e9), span / 1e9


def _job_device(ev: Evidence) -> tuple[Any, Any] | None:
    """Per distinct device job: (server wall ns, device wait ms)."""
    st = ev.run.steps
    if st is None or st.num_rows == 0:
        return None
    job = column_np(st.column("job_id"), -1, np.int64)
    wall = column_np(st.column("wall_ns"), -1, np.int64)
    dev = column_np(pc.cast(st.column("device_wait_ms"), pa.float64()), np.nan, np.float64)
    keep = (job >= 0) & (wall >= 0) & ~np.isnan(dev)
    ids, first = np.unique(job[keep], return_index=True)
    if ids.size == 0:
        return None
    return wall[keep][first], dev[keep][first]


def _p99(values: Any, level: float) -> tuple[float | None, float | None, float | None, int]:
    v = values[~np.isnan(values)]
    lo, hi = quantile_ci(v, 0.99, level)
    return quantile(v, 0.99), lo, hi, int(v.size)


def _within(hi: float | None, lo: float | None, limit: float | None) -> str:
    if limit is None:
        return "unchecked"
    if hi is not None and hi <= limit:
        return "meets"
    if lo is not None and lo > limit:
        return "exceeds"
    return "unproven"


def _point(
    ev: Evidence,
    key: CellKey,
    rows: Any,
    rule: CapacityRule,
    jobs: tuple[Any, Any] | None,
    level: float,
    ends: Any,
) -> RatePoint:
    t = ev.table
    part = column_np(t.column("quality.partition"), "", object)[rows]
    sent_rows = rows[(part != Partition.DROPPED.value) & (part != Partition.CUT_AT_STOP.value)]
    status = column_np(t.column("result.http_status"), 0, np.int64)[sent_rows]
    err = column_np(t.column("ext.error_class"), "", object)[sent_rows]
    reject = np.isin(status, _REJECT) & (err != "")
    cancelled = err == "cancelled"
    failed = (err != "") & ~cancelled & ~reject
    attempts = sent_rows.size - int(np.count_nonzero(cancelled))
    offered, window = _offered(t, rows)
    measured = ev.cell_data().get(key)
    empty = np.empty(0)
    values = measured.values if measured is not None else {}
    q99, qlo, qhi, qn = _p99(values.get("server_queue_ms", empty), level)
    l99, llo, lhi, ln = _p99(values.get(rule.latency_metric, empty), level)

    util = None
    start = column_np(t.column("join.wall_start_ns"), -1, np.int64)[sent_rows]
    end = column_np(t.column("join.wall_end_ns"), -1, np.int64)[sent_rows]
    has = (start >= 0) & (end >= start)
    if jobs is not None and has.any():
        w0, w1 = int(start[has].min()), int(end[has].max())
        inside = (jobs[0] >= w0) & (jobs[0] <= w1)
        if w1 > w0:
            util = float(jobs[1][inside].sum()) / ((w1 - w0) / 1e6)

    growth, slope, p, why = "no_data", None, None, "no server queue times (no server trace)"
    min_s = None
    if measured is not None:
        q = column_np(pc.cast(t.column("server_ms.queue"), pa.float64()), np.nan, np.float64)
        at = column_np(t.column("join.wall_start_ns"), -1, np.int64)
        r = measured.rows
        sel = r[~np.isnan(q[r]) & (at[r] >= 0)]
        if sel.size:
            res = detect_leak(
                (at[sel] - at[sel].min()) / 1e9,
                q[sel],
                min_slope_per_h=rule.queue_growth_ms_per_min * 60.0,
                unit="ms",
                resource="server queue time",
            )
            why = res.reason.removesuffix(": leak").removesuffix(": no leak")
            min_s = res.min_span_s
            slope = None if res.slope_per_h is None else res.slope_per_h / 60.0
            p = res.p_value
            growth = {
                LeakStatus.LEAK: "growing",
                LeakStatus.NO_LEAK: "not_growing",
                LeakStatus.INSUFFICIENT_DATA: "insufficient_data",
            }[res.status]

    error_rate = int(np.count_nonzero(failed)) / attempts if attempts > 0 else None
    reject_rate = int(np.count_nonzero(reject)) / sent_rows.size if sent_rows.size else None
    because = []
    if window is None or window < rule.window_s:
        because.append(f"held {0 if window is None else window:.1f} s < window {rule.window_s:g} s")
    if error_rate is None or error_rate > rule.max_error_rate:
        because.append(f"error rate {error_rate} > {rule.max_error_rate:g}")
    if rule.max_reject_rate is not None and (
        reject_rate is None or reject_rate > rule.max_reject_rate
    ):
        because.append(f"reject rate {reject_rate} > {rule.max_reject_rate:g}")
    for name, (hi, lo), limit in (
        ("queue P99", (qhi, qlo), rule.max_queue_p99_ms),
        (f"{rule.latency_metric} P99", (lhi, llo), rule.max_latency_p99_ms),
    ):
        state = _within(hi, lo, limit)
        if state in ("exceeds", "unproven"):
            because.append(f"{name} {state} the {limit:g} ms limit")
    good = None
    if rule.goodput is not None:
        crit = rule.goodput
        good = cell_goodput(ev, key, rule.id, crit.max_ttft_ms, crit.max_tpot_ms,
                            level=level, ends=ends)  # fmt: skip
        lo = None if good is None else good.share_lo
        if lo is None or lo < crit.min_share:
            shown = "no measured request" if good is None else f"{good.good}/{good.attempts}"
            because.append(f"goodput share not shown ≥ {crit.min_share:g} ({shown})")
    if growth != "not_growing":
        because.append(f"queue {growth.replace('_', ' ')}")
    return RatePoint(
        cell=key.label,
        arrival=key.arrival,
        rate_nominal=_nominal(key, ev.run.index),
        rate_offered=offered,
        window_s=window,
        arrivals=int(rows.size),
        sent=int(sent_rows.size),
        dropped=int(np.count_nonzero(part == Partition.DROPPED.value)),
        ok=int(np.count_nonzero(err == "")),
        errors=int(np.count_nonzero(failed)),
        error_rate=error_rate,
        rejects=int(np.count_nonzero(reject)),
        reject_rate=reject_rate,
        queue_p99_ms=q99,
        queue_p99_lo=qlo,
        queue_p99_hi=qhi,
        queue_n=qn,
        latency_metric=rule.latency_metric,
        latency_p99_ms=l99,
        latency_p99_lo=llo,
        latency_p99_hi=lhi,
        latency_n=ln,
        utilisation=util,
        queue_growth=growth,
        queue_slope_ms_per_min=slope,
        queue_growth_p=p,
        queue_growth_reason=why,
        queue_growth_min_s=min_s,
        stable=not because,
        not_stable_because=because,
        goodput_share=None if good is None else good.share,
        goodput_share_lo=None if good is None else good.share_lo,
        goodput_share_hi=None if good is None else good.share_hi,
        goodput_rps=None if good is None else good.goodput_rps,
    )


def analyze_capacity(
    ev: Evidence, rule: CapacityRule | None = None, *, level: float = 0.95
) -> CapacityAnalysis:
    """Every open-loop rate point of the run (the rule's select narrows the verdicts,
    not this list), and the stable max QPS among those the rule selects."""
    rule = rule or CapacityRule(id="capacity", kind="capacity", select=CellSelector())
    cells = _cell_rows(ev.table)
    jobs = _job_device(ev) if cells else None
    notes = []
    if cells and jobs is None:
        notes.append("no server/steps.jsonl: utilisation is no data")
    ends = None
    if cells and rule.goodput is not None:
        ends = client_wall_span(ev.table, ev.run.client_offsets_ns)[1]
    points = [
        _point(ev, key, rows, rule, jobs, level, ends)
        for key, rows in sorted(cells.items(), key=lambda kv: kv[0].label)
    ]
    points.sort(key=lambda p: (p.rate is None, p.rate or 0.0, p.cell))
    keys = {k.label: k for k in cells}
    stable = [
        p for p in points if p.stable and p.rate is not None and rule.select.matches(keys[p.cell])
    ]
    best = max(stable, key=lambda p: p.rate or 0.0) if stable else None
    criteria = {
        "window_s": rule.window_s,
        "max_error_rate": rule.max_error_rate,
        "max_reject_rate": rule.max_reject_rate,
        "max_queue_p99_ms": rule.max_queue_p99_ms,
        "latency_metric": rule.latency_metric,
        "max_latency_p99_ms": rule.max_latency_p99_ms,
        "queue_growth_ms_per_min": rule.queue_growth_ms_per_min,
        "goodput": None if rule.goodput is None else rule.goodput.model_dump(),
        "select": rule.select.describe(),
    }
    return CapacityAnalysis(
        points=points,
        stable_max_qps=None if best is None else best.rate,
        stable_cell=None if best is None else best.cell,
        window_s=rule.window_s,
        criteria=criteria,
        notes=notes,
    )


def capacity_section(result: CapacityAnalysis) -> dict[str, Any] | None:
    """The `capacity` section of verdict.json (None: the run has no open-loop cell)."""
    if not result.points:
        return None
    doc = dataclasses.asdict(result)
    for p, d in zip(result.points, doc["points"], strict=True):
        d["rate"] = p.rate
    return doc


def cached_capacity(ctx: Context, rule: CapacityRule | None) -> CapacityAnalysis:
    key = ("capacity", None if rule is None else rule.model_dump_json())
    if key not in ctx.cache:
        ctx.cache[key] = analyze_capacity(ctx.candidate, rule, level=ctx.settings.confidence_level)
    result: CapacityAnalysis = ctx.cache[key]
    return result


def _not(
    rule: CapacityRule, suffix: str, why: str, threshold: Any = None, seen: Any = None
) -> RuleVerdict:
    return not_evaluated(rule, why, observed=seen, threshold=threshold, suffix=suffix)


def _reject_rate(rule: CapacityRule, ctx: Context) -> RuleVerdict:
    suffix = ".reject_rate"
    if rule.max_reject_rate is None:
        return _not(rule, suffix, "not configured: set max_reject_rate")
    t = ctx.candidate.table
    status = column_np(t.column("result.http_status"), 0, np.int64)
    worst: tuple[float, str, int] | None = None
    n_all = 0
    for key, cell in ctx.candidate.cell_data().items():
        if not rule.select.matches(key) or cell.rows.size == 0:
            continue
        rejected = int(np.count_nonzero(np.isin(status[cell.rows], _REJECT)))
        n_all += cell.rows.size
        rate = rejected / cell.rows.size
        if worst is None or rate > worst[0]:
            worst = (rate, key.label, cell.rows.size)
    if worst is None:
        return _not(
            rule,
            suffix,
            f"no data: no cell matches {rule.select.describe()}",
            rule.max_reject_rate,
        )
    ok = worst[0] <= rule.max_reject_rate
    return verdict_for(
        rule,
        Status.PASS if ok else Status.FAIL,
        worst[0],
        rule.max_reject_rate,
        n_all,
        f"worst {worst[1]}: {worst[0]:.2%} of {worst[2]} answered 429/503; allowed "
        f"{rule.max_reject_rate:.2%}" + ("" if ok else ": lower the rate or raise capacity"),
        suffix=suffix,
    )


def _selected(rule: CapacityRule, ctx: Context, result: CapacityAnalysis) -> list[RatePoint]:
    keys = {k.label: k for k in _cell_rows(ctx.candidate.table)}
    return [p for p in result.points if rule.select.matches(keys[p.cell])]


def _utilisation(rule: CapacityRule, points: list[RatePoint]) -> RuleVerdict:
    suffix = ".utilisation"
    seen = [p for p in points if p.utilisation is not None]
    worst = max(seen, key=lambda p: p.utilisation or 0.0) if seen else None
    if rule.max_utilisation is None:
        observed = None if worst is None else worst.utilisation
        return _not(rule, suffix, "not configured: set max_utilisation", None, observed)
    if worst is None or worst.utilisation is None:
        return _not(
            rule,
            suffix,
            "no data: no selected open-loop cell with device steps (server/steps.jsonl)",
            rule.max_utilisation,
        )
    ok = worst.utilisation <= rule.max_utilisation
    return verdict_for(
        rule,
        Status.PASS if ok else Status.FAIL,
        worst.utilisation,
        rule.max_utilisation,
        sum(p.sent for p in seen),
        f"highest device utilisation {worst.utilisation:.1%} at {worst.cell}; allowed "
        f"{rule.max_utilisation:.1%}"
        + ("" if ok else ": no headroom at this rate; lower it or add capacity"),
        [dataclasses.asdict(p) for p in seen],
        suffix=suffix,
    )


def _queue_growth(rule: CapacityRule, points: list[RatePoint]) -> RuleVerdict:
    suffix = ".queue_growth"
    gate = f"queue time slope < {rule.queue_growth_ms_per_min:g} ms/min (or not significant)"
    tested = [p for p in points if p.queue_growth != "no_data"]
    if not tested:
        return _not(rule, suffix, "no data: no selected open-loop cell with server queue times")
    details = [
        {"cell": p.cell, "rate": p.rate, "queue_growth": p.queue_growth,
         "slope_ms_per_min": p.queue_slope_ms_per_min, "p": p.queue_growth_p,
         "reason": p.queue_growth_reason}
        for p in tested
    ]  # fmt: skip
    n = sum(p.queue_n for p in tested)
    growing = [p for p in tested if p.queue_growth == "growing"]
    if growing:
        g = growing[0]
        return verdict_for(
            rule,
            Status.FAIL,
            g.queue_slope_ms_per_min,
            gate,
            n,
            f"{g.cell}: {g.queue_growth_reason}: the queue keeps growing at this rate "
            "(overload); this rate is above capacity",
            details,
            suffix=suffix,
        )
    unknown = [p for p in tested if p.queue_growth != "not_growing"]
    if unknown:
        spans = [p.queue_growth_min_s for p in unknown if p.queue_growth_min_s is not None]
        return verdict_for(
            rule,
            Status.INCONCLUSIVE,
            None,
            gate,
            n,
            f"{unknown[0].cell}: {unknown[0].queue_growth_reason}: run the rate longer",
            details,
            suffix=suffix,
            too_short=TooShort(
                f"≥ {MIN_BINS} bins of queue times at each rate", max(spans) if spans else None
            ),
        )
    return verdict_for(
        rule,
        Status.PASS,
        max((p.queue_slope_ms_per_min or 0.0) for p in tested),
        gate,
        n,
        f"no selected rate shows a growing queue ({len(tested)} rate point(s))",
        details,
        suffix=suffix,
    )


def _stable_max(
    rule: CapacityRule, result: CapacityAnalysis, points: list[RatePoint]
) -> RuleVerdict:
    suffix = ".stable_max_qps"
    details = [
        {"cell": p.cell, "rate": p.rate, "window_s": p.window_s, "stable": p.stable,
         "not_stable_because": p.not_stable_because}
        for p in points
    ]  # fmt: skip
    got = result.stable_max_qps
    seen = "none" if got is None else f"{got:g}/s ({result.stable_cell})"
    if rule.min_stable_qps is None:
        return not_evaluated(
            rule,
            f"not configured: set min_stable_qps (stable max QPS observed: {seen})",
            observed=got,
            details=details,
            suffix=suffix,
        )
    target = rule.min_stable_qps
    threshold = f"stable max QPS ≥ {target:g} over {rule.window_s:g} s windows"
    n = sum(p.sent for p in points)
    if got is not None and got >= target:
        return verdict_for(
            rule,
            Status.PASS,
            got,
            threshold,
            n,
            f"stable max QPS {seen} ≥ {target:g}",
            details,
            suffix=suffix,
        )
    held = [
        p
        for p in points
        if p.rate is not None
        and p.rate >= target
        and p.window_s is not None
        and p.window_s >= rule.window_s
    ]
    decided = [p for p in held if p.queue_growth in ("growing", "not_growing")]
    if decided:
        p = decided[0]
        return verdict_for(
            rule,
            Status.FAIL,
            got,
            threshold,
            n,
            f"stable max QPS {seen} < {target:g}: at {p.rate:g}/s ({p.cell}) "
            f"{'; '.join(p.not_stable_because)}",
            details,
            suffix=suffix,
        )
    return verdict_for(
        rule,
        Status.INCONCLUSIVE,
        got,
        threshold,
        n,
        f"stable max QPS {seen}: no rate ≥ {target:g}/s was held for {rule.window_s:g} s "
        "with a decided queue-growth test; run the target rate for the full window",
        details,
        suffix=suffix,
        too_short=TooShort(f"a rate ≥ {target:g}/s held {rule.window_s:g} s", rule.window_s),
    )


def _capacity(rule: CapacityRule, ctx: Context) -> list[RuleVerdict]:
    out = []
    if rule.max_queue_p99_ms is None:
        out.append(_not(rule, ".queue_p99", "not configured: set max_queue_p99_ms"))
    else:
        out.append(
            limit_verdict(
                rule,
                ctx,
                rule.select,
                "server_queue_ms",
                "p99",
                rule.max_queue_p99_ms,
                ".queue_p99",
            )
        )
    out.append(_reject_rate(rule, ctx))
    result = cached_capacity(ctx, rule)
    points = _selected(rule, ctx, result)
    out.append(_utilisation(rule, points))
    out.append(_queue_growth(rule, points))
    out.append(_stable_max(rule, result, points))
    return out


HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {"capacity": _capacity}
