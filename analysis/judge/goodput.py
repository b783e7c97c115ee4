"""Goodput per cell (spec §14.3: the rate and share of requests that met their TTFT and
TPOT objectives; analysis.stats.goodput has the formula), the `goodput` rule's verdict
and the `goodput` section of verdict.json that the report's headline table reads.

A cell's goodput is over its measured partition: `good` among its successes, `attempts`
its records less the requests cancelled on purpose (as the error rate counts them), and
the rate over the cell's steady window (the one its throughput is measured over). A cell
takes the objectives of the first enabled goodput rule that selects it and sets one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from analysis.judge.evidence import Context, Evidence, column_np, not_evaluated, verdict_for
from analysis.judge.rules import GoodputRule, RulesFile
from analysis.judge.verdict import RuleVerdict, Status
from analysis.stats.goodput import GOODPUT_METHOD, PROPORTION_CI_METHOD, goodput, meets_slos
from analysis.tables.cellkey import CellKey
from analysis.tables.cells import client_wall_span
from analysis.tables.columns import floats

__all__ = ["HANDLERS", "CellGoodput", "cell_goodput", "goodput_section", "share_status"]


@dataclass(frozen=True, slots=True)
class CellGoodput:
    """One measured cell's goodput under one rule's objectives."""

    cell: str
    rule: str
    max_ttft_ms: float | None
    max_tpot_ms: float | None
    good: int
    attempts: int
    share: float | None
    share_lo: float | None
    share_hi: float | None
    good_in_window: int
    window_s: float | None
    goodput_rps: float | None


def _ends(ctx: Context) -> Any:
    """The candidate's record ends on the client's wall clock, computed once."""
    key = ("client_wall_end",)
    if key not in ctx.cache:
        ev = ctx.candidate
        ctx.cache[key] = client_wall_span(ev.table, ev.run.client_offsets_ns)[1]
    return ctx.cache[key]


def cell_goodput(
    ev: Evidence,
    key: CellKey,
    rule_id: str,
    max_ttft_ms: float | None,
    max_tpot_ms: float | None,
    *,
    level: float,
    ends: Any = None,
) -> CellGoodput | None:
    """The measured cell's goodput under these objectives; None when the cell has no
    measured partition. `ends`: every record's end on the client's wall clock
    (client_wall_span), computed here when not given."""
    data = ev.cell_data().get(key)
    summary = ev.summary(key)
    if data is None or summary is None:
        return None
    if ends is None:
        ends = client_wall_span(ev.table, ev.run.client_offsets_ns)[1]
    t, rows = ev.table, data.rows
    ok = column_np(t.column("ext.error_class"), "", object)[rows] == ""
    good = meets_slos(
        ok,
        floats(t, "durations_ms.ttft")[rows],
        floats(t, "durations_ms.tpot")[rows],
        floats(t, "workload.actual_output_tokens")[rows],
        max_ttft_ms=max_ttft_ms,
        max_tpot_ms=max_tpot_ms,
    )
    g = goodput(
        good, summary.records - summary.cancelled, ends[rows], summary.steady_window_ns,
        level=level,
    )  # fmt: skip
    return CellGoodput(
        key.label, rule_id, max_ttft_ms, max_tpot_ms, g.good, g.attempts, g.share,
        g.share_lo, g.share_hi, g.good_in_window, g.window_s, g.rps,
    )  # fmt: skip


def share_status(c: CellGoodput, min_share: float) -> Status:
    """PASS when the share's interval lies at or above `min_share`, FAIL when it lies
    wholly below, else INCONCLUSIVE (no attempt: INCONCLUSIVE)."""
    if c.share_lo is not None and c.share_lo >= min_share:
        return Status.PASS
    if c.share_hi is not None and c.share_hi < min_share:
        return Status.FAIL
    return Status.INCONCLUSIVE


def _cells(rule: GoodputRule, ctx: Context) -> list[CellGoodput]:
    key = ("goodput", rule.model_dump_json())
    if key not in ctx.cache:
        level, ends = ctx.settings.confidence_level, _ends(ctx)
        slo = (rule.max_ttft_ms, rule.max_tpot_ms)
        found = [
            cell_goodput(ctx.candidate, k, rule.id, *slo, level=level, ends=ends)
            for k in sorted(ctx.candidate.cell_data(), key=lambda k: k.label)
            if rule.select.matches(k)
        ]
        ctx.cache[key] = [c for c in found if c is not None]
    cells: list[CellGoodput] = ctx.cache[key]
    return cells


def _slos(rule: GoodputRule) -> str:
    parts = [f"TTFT ≤ {rule.max_ttft_ms:g} ms" if rule.max_ttft_ms is not None else "",
             f"TPOT ≤ {rule.max_tpot_ms:g} ms" if rule.max_tpot_ms is not None else ""]  # fmt: skip
    return " and ".join(p for p in parts if p)


def _pct(x: float | None) -> str:
    return "none" if x is None else f"{100 * x:.1f}%"


def _seen(c: CellGoodput) -> str:
    rate = "no steady window" if c.goodput_rps is None else f"{c.goodput_rps:.3g} req/s"
    return (
        f"{c.cell}: {c.good} of {c.attempts} met {_pct(c.share)} "
        f"(CI {_pct(c.share_lo)}..{_pct(c.share_hi)}), {rate}"
    )


def _goodput(rule: GoodputRule, ctx: Context) -> list[RuleVerdict]:
    if not rule.configured:
        return [
            not_evaluated(
                rule,
                "not configured: set max_ttft_ms and/or max_tpot_ms, the SLOs that define "
                "goodput (the spec states no figure)",
            )
        ]
    cells = _cells(rule, ctx)
    if not cells:
        return [not_evaluated(rule, f"no data: no measured cell matches {rule.select.describe()}")]
    details = [dataclasses.asdict(c) for c in cells]
    worst = min(cells, key=lambda c: -1.0 if c.share is None else c.share)
    n = sum(c.attempts for c in cells)
    if rule.min_share is None:
        return [
            not_evaluated(
                rule,
                f"not configured: set min_share ({_slos(rule)}; worst {_seen(worst)})",
                observed=worst.share,
                n=n,
                details=details,
            )
        ]
    threshold = f"share with {_slos(rule)} ≥ {rule.min_share:g}"
    status = {c.cell: share_status(c, rule.min_share) for c in cells}
    failed = [c for c in cells if status[c.cell] is Status.FAIL]
    if failed:
        return [
            verdict_for(
                rule, Status.FAIL, failed[0].share, threshold, n,
                f"{_seen(failed[0])}: below {_pct(rule.min_share)} with "
                f"{ctx.settings.confidence_level:.0%} confidence; too few requests meet the "
                "SLOs at this load",
                details,
            )
        ]  # fmt: skip
    unsure = [c for c in cells if status[c.cell] is Status.INCONCLUSIVE]
    if unsure:
        return [
            verdict_for(
                rule, Status.INCONCLUSIVE, unsure[0].share, threshold, n,
                f"{_seen(unsure[0])}: the interval reaches below {_pct(rule.min_share)}; "
                "collect more requests",
                details,
            )
        ]  # fmt: skip
    return [verdict_for(rule, Status.PASS, worst.share, threshold, n, _seen(worst), details)]


def goodput_section(rules: RulesFile, ctx: Context) -> dict[str, Any] | None:
    """verdict.json's `goodput`: per measured cell its goodput under the objectives of
    the first enabled goodput rule that selects it and sets one; None when no such rule
    exists."""
    slos: Sequence[GoodputRule] = [
        r for r in rules.rules if isinstance(r, GoodputRule) and r.enabled and r.configured
    ]
    if not slos:
        return None
    taken: set[str] = set()
    cells: list[dict[str, Any]] = []
    for rule in slos:
        for c in _cells(rule, ctx):
            if c.cell not in taken:
                taken.add(c.cell)
                cells.append(dataclasses.asdict(c))
    cells.sort(key=lambda c: str(c["cell"]))
    return {
        "method": GOODPUT_METHOD,
        "share_ci": PROPORTION_CI_METHOD,
        "level": ctx.settings.confidence_level,
        "rules": [r.id for r in slos],
        "cells": cells,
    }


HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {"goodput": _goodput}
