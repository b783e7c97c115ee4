"""Cross-talk under concurrency (spec §14.1, exit 1): every greedy request sent under
concurrency in a `crosstalk:<case>` cell generated the tokens of the same request sent
alone in the run (the pairing: calculet_load.schema.crosstalk.compare)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import numpy as np

from analysis.judge.evidence import Context, column_np, not_evaluated, sent_mask, verdict_for
from analysis.judge.rules import CrosstalkRule
from analysis.judge.verdict import RuleVerdict, Status
from calculet_load.schema.crosstalk import Sent, compare

__all__ = ["HANDLERS"]


def _crosstalk(rule: CrosstalkRule, ctx: Context) -> list[RuleVerdict]:
    t = ctx.candidate.table
    cells = column_np(t.column("ext.cell"), "", object)
    names = {str(n) for n in np.unique(cells) if n}
    chosen = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in rule.cells)}
    rows = np.flatnonzero(np.isin(cells, list(chosen)) & sent_mask(t))
    if rows.size == 0:
        return [
            not_evaluated(
                rule,
                f"no data: no sent record in a cell matching {rule.cells}; `calculet-load "
                "accept` with a golden set sends them (--crosstalk-concurrency, spec §14.1)",
            )
        ]
    col: dict[str, Any] = {
        name: column_np(t.column(name), fill, dtype)[rows]
        for name, fill, dtype in (
            ("request_id", "", object),
            ("ext.arrival", "", object),
            ("workload.concurrency", 0, np.int64),
            ("result.token_hash", "", object),
            ("ext.error_class", "", object),
            ("ext.burst_id", "", object),
        )
    }
    result = compare(
        Sent(
            request_id=str(col["request_id"][i]),
            cell=str(cells[rows[i]]),
            arrival=str(col["ext.arrival"][i]) or None,
            concurrency=int(col["workload.concurrency"][i]) or None,
            token_hash=str(col["result.token_hash"][i]) or None,
            ok=col["ext.error_class"][i] == "",
            burst_id=str(col["ext.burst_id"][i]) or None,
        )
        for i in range(len(rows))
    )
    details = [d.detail() for d in result.differences[:20]]
    n = result.compared
    if result.differences:
        first = result.differences[0]
        return [
            verdict_for(
                rule,
                Status.FAIL,
                len(result.differences),
                0,
                n,
                f"{len(result.differences)} of {n} requests sent under concurrency generated "
                f"other tokens than the same request sent alone; first: {first.describe()}: "
                "tokens of one request reach another (logits/KV/buffer reuse); look at the "
                "server's events for both ids",
                details,
            )
        ]
    if n == 0 or result.without_reference:
        lacking = ", ".join(result.without_reference) or "every cell"
        return [
            verdict_for(
                rule,
                Status.INCONCLUSIVE,
                None,
                0,
                n,
                f"{n} concurrent copies compared; no reference for {lacking} (the request "
                f"sent alone failed or is missing; {result.failed} copies failed): rerun",
            )
        ]
    return [
        verdict_for(
            rule,
            Status.PASS,
            0,
            0,
            n,
            f"{n} requests sent under concurrency (up to "
            f"{int(col['workload.concurrency'].max())}) generated the tokens of the same "
            f"request sent alone ({len(result.references)} references)",
        )
    ]


HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {"crosstalk": _crosstalk}
