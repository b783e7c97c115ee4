"""Head-of-line blocking (spec §6.3: "a long prefill arriving together with short decodes,
to expose head-of-line blocking"): the `head-of-line` mix and its `short-only` control,
analysed together.

The head-of-line cells are the measured cells whose name matches HOL_CELLS (accept
names a mix cell after its mix: `poisson2-head-of-line`); their control cells match
CONTROL_CELLS (`poisson2-short-only`). In a head-of-line cell a request with at least
LONG_PROMPT_TOKENS prompt tokens is a long prefill, every other one a short request.
On the client's wall clock (join.wall_start_ns, NTP offsets applied):

    a long prefill is in flight    from its send (t0) to its first token (t4), or to
                                   its end when it never had one
    a short request's TTFT         overlaps one when its wait [t0, t4] meets such an
                                   interval; its TPOT when its decode [t4, t6] does

The short requests' TTFT and TPOT (successes) are then compared, P50 and P99, with the
exact bootstrap of each side's order statistic (analysis.stats.compare.compare_quantile):
those overlapping a long prefill against the control's (the penalty), and against the
same cell's short requests that overlapped none. A positive delta is the penalty; its
interval says whether it is shown (the interval lies above 0), none is shown (it lies
at or below 0) or it is undecided.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.judge.evidence import Context, Evidence, column_np
from analysis.stats.compare import (
    QUANTILE_DELTA_METHOD,
    Comparison,
    Direction,
    Thresholds,
    Verdict,
    compare_quantile,
)
from analysis.tables.join import BoolArray, IntArray

__all__ = [
    "CONTROL_CELLS",
    "HOL_CELLS",
    "HOL_METHOD",
    "LONG_PROMPT_TOKENS",
    "analyze_head_of_line",
    "cached_head_of_line",
]

HOL_CELLS = ("*head-of-line*",)
CONTROL_CELLS = ("*short-only*",)
LONG_PROMPT_TOKENS = 8192
_METRICS = (("ttft_ms", "durations_ms.ttft"), ("tpot_ms", "durations_ms.tpot"))
_STATS = (0.5, 0.99)

HOL_METHOD = (
    f"short requests (prompt < {LONG_PROMPT_TOKENS} tokens) of the head-of-line cells: "
    "whose wait (TTFT) or decode (TPOT) overlapped a long prefill in flight (its send to "
    "its first token, client wall clock) or not, against the control cells' short "
    "requests; TTFT/TPOT P50 and P99, "
    f"{QUANTILE_DELTA_METHOD}"
)


def _rows(ev: Evidence, patterns: tuple[str, ...]) -> tuple[IntArray, list[str]]:
    """Measured rows of the cells whose name matches `patterns`, and their labels."""
    rows, labels = [], []
    for key, cell in ev.cell_data().items():
        if key.name is not None and any(fnmatch.fnmatchcase(key.name, p) for p in patterns):
            rows.append(cell.rows)
            labels.append(key.label)
    return (np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)), labels


def _overlaps(start: IntArray, end: IntArray, lstart: IntArray, lend: IntArray) -> BoolArray:
    """Per interval [start, end]: whether it meets any [lstart, lend] (O((n + m) log m))."""
    if lstart.size == 0:
        return np.zeros(start.size, dtype=bool)
    order = np.argsort(lstart, kind="stable")
    ls, le = lstart[order], np.maximum.accumulate(lend[order])
    # the long intervals starting at or before `end`: the latest end among them
    k = np.searchsorted(ls, end, side="right")
    reach = np.where(k > 0, le[np.maximum(k - 1, 0)], np.iinfo(np.int64).min)
    return np.asarray(reach >= start, dtype=bool)


def analyze_head_of_line(ev: Evidence, level: float) -> dict[str, Any] | None:
    """The head-of-line section (see the module docstring); None without a head-of-line
    cell in the run."""
    t = ev.table
    hol, hol_cells = _rows(ev, HOL_CELLS)
    if hol.size == 0:
        return None
    control, control_cells = _rows(ev, CONTROL_CELLS)
    prompt = column_np(t.column("workload.prompt_tokens"), 0, np.int64)
    ok = column_np(pc.is_null(t.column("ext.error_class")), False, bool)
    start = column_np(t.column("join.wall_start_ns"), -1, np.int64)
    end = column_np(t.column("join.wall_end_ns"), -1, np.int64)
    t0 = column_np(t.column("client_ns.request_start"), 0, np.int64)
    first = t.column("client_ns.first_token")
    has_first = column_np(pc.is_valid(first), False, bool)
    first_wall = start + (column_np(first, 0, np.int64) - t0)
    timed = start >= 0
    long = hol[(prompt[hol] >= LONG_PROMPT_TOKENS) & timed[hol]]
    short = hol[(prompt[hol] < LONG_PROMPT_TOKENS) & timed[hol]]
    lend = np.where(has_first[long], first_wall[long], end[long])
    # TTFT meets a prefill in flight during its own wait [t0, t4]; TPOT during [t4, t6]
    sfirst = np.where(has_first[short], first_wall[short], end[short])
    phases = {
        "ttft_ms": _overlaps(start[short], sfirst, start[long], lend),
        "tpot_ms": _overlaps(sfirst, end[short], start[long], lend),
    }
    ctrl = control[prompt[control] < LONG_PROMPT_TOKENS]
    values = {
        m: column_np(pc.cast(t.column(col), pa.float64()), np.nan, np.float64)
        for m, col in _METRICS
    }
    counts: dict[str, int] = {"control": int(np.count_nonzero(ok[ctrl]))}
    comparisons: list[Comparison] = []
    for metric, _ in _METRICS:
        over = phases[metric]
        groups = {
            "overlapping": short[over & ok[short]],
            "not_overlapping": short[~over & ok[short]],
            "control": ctrl[ok[ctrl]],
        }
        counts[f"{metric}_overlapping"] = int(groups["overlapping"].size)
        counts[f"{metric}_not_overlapping"] = int(groups["not_overlapping"].size)
        for ref in ("control", "not_overlapping"):
            for q in _STATS:
                comparisons.append(
                    compare_quantile(
                        values[metric][groups[ref]],
                        values[metric][groups["overlapping"]],
                        q,
                        direction=Direction.LOWER_IS_BETTER,
                        thresholds=Thresholds(0.0, None, level),
                        metric=metric,
                        cell=f"overlapping vs {ref.replace('_', ' ')}",
                    )
                )
    notes = []
    if not control_cells:
        notes.append(
            "no control cell (a cell named like *short-only*): the penalty is measured "
            "against the head-of-line cell's own short requests that overlapped no prefill"
        )
    if long.size == 0:
        notes.append(f"no long prefill (prompt ≥ {LONG_PROMPT_TOKENS} tokens) in the cells")
    return {
        "cells": hol_cells,
        "control_cells": control_cells,
        "long_prompt_tokens": LONG_PROMPT_TOKENS,
        "counts": {"long_prefills": int(long.size), "short": int(short.size), **counts},
        "comparisons": [{**dataclasses.asdict(c), "penalty": _penalty(c)} for c in comparisons],
        "notes": notes,
        "method": HOL_METHOD,
    }


def _penalty(c: Comparison) -> str:
    """ "shown" when the interval of the change lies above 0 (slower beside a long
    prefill), "none shown" when it lies at or below 0, else "undecided" (also when a
    side has too few values for the statistic's interval)."""
    return {Verdict.REGRESSION: "shown", Verdict.PASS: "none shown"}.get(c.verdict, "undecided")


def cached_head_of_line(ctx: Context) -> dict[str, Any] | None:
    """The section, computed once per analysis (the `head_of_line` key of verdict.json)."""
    key = ("head_of_line",)
    if key not in ctx.cache:
        ctx.cache[key] = analyze_head_of_line(ctx.candidate, ctx.settings.confidence_level)
    result: dict[str, Any] | None = ctx.cache[key]
    return result
