"""Conversations and prefix caching: TTFT by turn and by cached share, per cell, as
written to `conversations.parquet` and `conversations.csv`.

A conversation's turns (`LLMUser.llm.conversation`, the `conversation` workload) carry
`ext.session_id` and `ext.turn` (from 0); a turn's context is `workload.prompt_tokens`,
the whole history and the new message. The requests counted are the successes of the
`measured` partition that carry `ext.turn` and a TTFT, as in the cells' latency
statistics: failures, warmup, throttled and excluded records are left out.

The cached share of a turn is ext.cached_prompt_tokens / workload.prompt_tokens: the part
of its context the server said it served from its prefix cache. Its groups
(SHARE_GROUPS) are "0", then quarters (0, 25%], (25, 50%], (50, 75%], (75, 100%], each
decided in integers (4·cached ≤ k·prompt), so a share on an edge falls in the lower bin;
"over 100%" where the server counted more cached tokens than the prompt has (shown, never
clipped); "not reported" where the server did not say (null: never taken as 0) or the
prompt length is unknown.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.stats.quantiles import (
    PERCENTILE_METHOD,
    QUANTILE_CI_METHOD,
    percentile_name,
    percentile_warnings,
    percentiles,
    quantile,
)
from analysis.tables.cellkey import CELL_KEY_COLUMNS, CellKey, rows_by_cell
from analysis.tables.columns import floats, ints
from analysis.tables.join import BoolArray, FloatArray, IntArray
from analysis.tables.quality import Partition

__all__ = [
    "CONVERSATIONS_FILES",
    "CONVERSATIONS_SCHEMA",
    "NOT_REPORTED",
    "OVER",
    "QUANTILES",
    "SHARE_GROUPS",
    "cached_share",
    "conversation_rows",
    "conversations_table",
    "share_groups",
]

CONVERSATIONS_SCHEMA = "calculet-conversations/v1"
CONVERSATIONS_FILES = ("conversations.parquet", "conversations.csv")
QUANTILES = (0.5, 0.9, 0.99)
OVER = "over 100%"
NOT_REPORTED = "not reported"
SHARE_GROUPS = ("0", "(0, 25%]", "(25, 50%]", "(50, 75%]", "(75, 100%]", OVER, NOT_REPORTED)
"""The cached-share groups in order; index k ≥ 1 of a quarter is the least k with
4·cached ≤ k·prompt."""
_QUARTERS = 4


def cached_share(table: pa.Table) -> FloatArray:
    """Per record: ext.cached_prompt_tokens / workload.prompt_tokens; NaN where the
    server did not report cached tokens or the prompt length is unknown (or 0)."""
    cached, has_cached = ints(table, "ext.cached_prompt_tokens")
    prompt, has_prompt = ints(table, "workload.prompt_tokens")
    ok = has_cached & has_prompt & (prompt > 0)
    out = np.full(table.num_rows, np.nan)
    out[ok] = cached[ok] / prompt[ok]
    return out


def share_groups(table: pa.Table) -> IntArray:
    """Per record: its index into SHARE_GROUPS, decided in integers."""
    cached, has_cached = ints(table, "ext.cached_prompt_tokens")
    prompt, has_prompt = ints(table, "workload.prompt_tokens")
    ok = has_cached & has_prompt & (prompt > 0)
    safe = np.where(ok, prompt, 1)
    # the least k with QUARTERS·cached ≤ k·prompt: 0 for no cached token
    k = -((-_QUARTERS * cached) // safe)
    k = np.where(k > _QUARTERS, SHARE_GROUPS.index(OVER), k)
    return np.where(ok, k, SHARE_GROUPS.index(NOT_REPORTED)).astype(np.int64)


def conversation_rows(table: pa.Table, keep: BoolArray | None = None) -> IntArray:
    """The records counted: measured successes with ext.turn and a TTFT (and `keep`)."""
    measured = pc.equal(table.column("quality.partition"), Partition.MEASURED.value)
    ok = pc.and_(pc.is_null(table.column("ext.error_class")), pc.is_valid(table.column("ext.turn")))
    mask = np.asarray(
        pc.fill_null(pc.and_(measured, ok), False).to_numpy(zero_copy_only=False), dtype=bool
    )
    mask &= np.isfinite(floats(table, "durations_ms.ttft"))
    if keep is not None:
        mask &= keep
    return np.flatnonzero(mask).astype(np.int64)


def conversations_table(
    table: pa.Table, *, level: float = 0.95, keep: BoolArray | None = None
) -> pa.Table | None:
    """TTFT by turn and by cached share, per cell (long format, one row per group that
    has requests); None when no record counted carries ext.turn."""
    rows = conversation_rows(table, keep)
    if rows.size == 0:
        return None
    ttft = floats(table, "durations_ms.ttft")
    prompt = floats(table, "workload.prompt_tokens")
    share = cached_share(table)
    group = share_groups(table)
    turn, _ = ints(table, "ext.turn")
    session = np.asarray(
        pc.fill_null(table.column("ext.session_id"), "").to_numpy(zero_copy_only=False),
        dtype=object,
    )

    def row(key: CellKey, by: str, name: str, at: IntArray, t: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cell": key.label,
            "cell_name": key.name,
            "concurrency": key.concurrency,
            "arrival": key.arrival,
            "stream": key.stream,
            "by": by,
            "group": name,
            "turn": t,
            "count": int(at.size),
            "sessions": len(set(session[at].tolist()) - {""}),
            "prompt_tokens_p50": quantile(prompt[at], 0.5),
            "cached_reported": int(np.count_nonzero(np.isfinite(share[at]))),
            "cached_share_p50": quantile(share[at], 0.5),
        }
        warnings: list[str] = []
        for p in percentiles(ttft[at], QUANTILES, level):
            out[p.name], out[f"{p.name}_lo"], out[f"{p.name}_hi"] = p.value, p.lo, p.hi
            warnings += percentile_warnings(p, level)
        out["level"] = level
        out["warnings"] = "; ".join(warnings) or None
        out["percentile_method"] = PERCENTILE_METHOD
        out["quantile_ci_method"] = QUANTILE_CI_METHOD
        return out

    out = []
    cells = rows_by_cell(table, rows)
    for (key, _), cell_rows in sorted(cells.items(), key=lambda kv: kv[0][0].label):
        turns = turn[cell_rows]
        for t in np.unique(turns):
            out.append(row(key, "turn", str(int(t)), cell_rows[turns == t], int(t)))
        groups = group[cell_rows]
        for g in np.unique(groups):
            out.append(row(key, "cached_share", SHARE_GROUPS[g], cell_rows[groups == g], None))
    return pa.Table.from_pylist(out, schema=_schema())


def _schema() -> pa.Schema:
    f64, i64, s = pa.float64(), pa.int64(), pa.string()
    fields: list[tuple[str, pa.DataType]] = [
        *CELL_KEY_COLUMNS,
        ("by", s),
        ("group", s),
        ("turn", i64),
        ("count", i64),
        ("sessions", i64),
        ("prompt_tokens_p50", f64),
        ("cached_reported", i64),
        ("cached_share_p50", f64),
    ]
    for q in QUANTILES:
        p = percentile_name(q)
        fields += [(p, f64), (f"{p}_lo", f64), (f"{p}_hi", f64)]
    fields += [("level", f64), ("warnings", s)]
    fields += [("percentile_method", s), ("quantile_ci_method", s)]
    return pa.schema(fields, metadata={"schema": CONVERSATIONS_SCHEMA})
