"""Correctness and reliability rules (spec §14, exit 1): golden, NaN/Inf, token counts,
error rate."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.judge.evidence import Context, column_np, not_evaluated, sent_mask, verdict_for
from analysis.judge.rules import ErrorRateRule, GoldenRule, MaxCountRule
from analysis.judge.verdict import RuleVerdict, Status
from analysis.tables.cells import CellKey

__all__ = ["HANDLERS"]


def _golden_key(t: pa.Table) -> Any:
    cols = (
        "ext.corpus_sample_id",
        "workload.prompt_tokens",
        "workload.requested_output_tokens",
        "ext.sampling",
        "workload.seed",
    )
    parts = [pc.fill_null(pc.cast(t.column(c), pa.string()), "-") for c in cols]
    return column_np(pc.binary_join_element_wise(*parts, "/"), "", object)


def _golden_rows(t: pa.Table, patterns: list[str]) -> Any:
    names = [n for n in t.column("ext.cell").unique().drop_null().to_pylist()]
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    member = column_np(
        pc.is_in(t.column("ext.cell"), value_set=pa.array(chosen, pa.string())), False
    )
    return np.flatnonzero(member.astype(bool) & sent_mask(t))


def _majority(keys: Any, hashes: Any) -> dict[str, str]:
    ref: dict[str, str] = {}
    for k in np.unique(keys):
        h, c = np.unique(hashes[keys == k], return_counts=True)
        ref[str(k)] = str(h[np.argmax(c)])
    return ref


def _golden(rule: GoldenRule, ctx: Context) -> list[RuleVerdict]:
    t = ctx.candidate.table
    rows = _golden_rows(t, rule.cells)
    if rows.size == 0:
        return [
            not_evaluated(
                rule,
                f"no data: no sent record in a cell matching {rule.cells}; run the golden set "
                "before and after the matrix (spec §8)",
                threshold=rule.min_pass_rate,
            )
        ]
    keys = _golden_key(t)[rows]
    hashes = column_np(t.column("result.token_hash"), "", object)[rows]
    err = column_np(t.column("ext.error_class"), "", object)[rows]
    bad_num = column_np(t.column("ext.nonfinite_field"), False, bool)[rows]
    mismatch = column_np(t.column("ext.token_count_mismatch"), False, bool)[rows]
    ok = (err == "") & ~bad_num & ~mismatch & (hashes != "")
    source = "this run's majority hash per prompt"
    ref = _majority(keys[ok], hashes[ok]) if ok.any() else {}
    if ctx.baseline is not None:
        bt = ctx.baseline.table
        brows = _golden_rows(bt, rule.cells)
        bok = brows[column_np(bt.column("ext.error_class"), "", object)[brows] == ""]
        if bok.size:
            bkeys = _golden_key(bt)[bok]
            bhash = column_np(bt.column("result.token_hash"), "", object)[bok]
            ref.update(_majority(bkeys, bhash))
            source = "the baseline run's golden hashes (this run's majority where it has none)"
    expected = np.array([ref.get(str(k), "") for k in keys], dtype=object)
    pinned = ctx.candidate.run.golden  # the golden set's own expected hashes win
    if pinned:
        cells = column_np(t.column("ext.cell"), "", object)[rows]
        expected = np.array(
            [pinned.get(str(c), e) for c, e in zip(cells, expected, strict=True)], dtype=object
        )
        source = "the golden set's expected hashes (golden.json)"
    passed = ok & (hashes == expected)
    rate = float(np.count_nonzero(passed)) / rows.size
    ids = column_np(t.column("request_id"), "", object)[rows]
    why = np.where(
        err != "",
        err,
        np.where(bad_num, "NaN/Inf", np.where(mismatch, "token count mismatch", "token hash")),
    )
    details = [
        {"request_id": str(i), "prompt": str(k), "problem": str(w)}
        for i, k, w in zip(ids[~passed][:20], keys[~passed][:20], why[~passed][:20], strict=True)
    ]
    n_fail = int(rows.size - np.count_nonzero(passed))
    if rate >= rule.min_pass_rate:
        return [
            verdict_for(
                rule,
                Status.PASS,
                rate,
                rule.min_pass_rate,
                int(rows.size),
                f"{rows.size - n_fail} of {rows.size} golden requests matched ({source})",
            )
        ]
    first = details[0]
    return [
        verdict_for(
            rule,
            Status.FAIL,
            rate,
            rule.min_pass_rate,
            int(rows.size),
            f"{n_fail} of {rows.size} golden requests failed (first {first['request_id']}: "
            f"{first['problem']}; reference: {source}); a golden failure stops the run (§8): "
            "check the model generation/artifact and the server's events for these ids",
            details,
        )
    ]


_FLAG = {
    "nonfinite": ("ext.nonfinite_field", "responses carried NaN/Inf", "numeric check (§12.2)"),
    "token_count_mismatch": (
        "ext.token_count_mismatch",
        "records' per-event token counts disagree with the server's total beyond the "
        "declared slack, or count anomalies",
        "token accounting of the protocol adapter or the server's usage fields (a local "
        "--tokenizer counts each event's text alone; its sum can differ from the model's)",
    ),
    "error_output": (
        "ext.error_output_chars",
        "error responses carried generated output (uninitialized output, §14.1)",
        "server's error path: an error body or final error event must carry no tokens",
    ),
}


def _max_count(rule: MaxCountRule, ctx: Context) -> list[RuleVerdict]:
    t = ctx.candidate.table
    column, what, where = _FLAG[rule.kind]
    sent = sent_mask(t) & ~ctx.candidate.in_boundary()  # boundary cells: analysis.judge.boundary
    col = t.column(column)
    # a flag, or a count (error_output_chars: characters an error response carried)
    flag = (
        column_np(col, 0, np.int64) > 0
        if pa.types.is_integer(col.type)
        else column_np(col, False, bool)
    )
    flagged = flag & sent
    n, count = int(np.count_nonzero(sent)), int(np.count_nonzero(flagged))
    if n == 0:
        return [not_evaluated(rule, "no data", threshold=rule.max_count)]
    ids = column_np(t.column("request_id"), "", object)[flagged][:20]
    details = [{"request_id": str(i)} for i in ids]
    seen = f"{count} of {n} {what}; allowed {rule.max_count}"
    if count > rule.max_count:
        return [
            verdict_for(
                rule,
                Status.FAIL,
                count,
                rule.max_count,
                n,
                f"{seen} (first {ids[0]}): look at the {where}",
                details,
            )
        ]
    return [verdict_for(rule, Status.PASS, count, rule.max_count, n, seen)]


def _error_rate(rule: ErrorRateRule, ctx: Context) -> list[RuleVerdict]:
    per_cell: dict[CellKey, list[int]] = {}
    classes: dict[CellKey, dict[str, int]] = {}
    for s in ctx.candidate.summaries:
        if s.partition not in ("measured", "throttled") or not rule.select.matches(s.key):
            continue
        acc = per_cell.setdefault(s.key, [0, 0])
        acc[0] += s.errors
        acc[1] += s.records - s.cancelled
        for c, k in s.errors_by_class.items():
            classes.setdefault(s.key, {})[c] = classes.get(s.key, {}).get(c, 0) + k
    rows = [(k, e, a) for k, (e, a) in per_cell.items() if a > 0]
    if not rows:
        return [
            not_evaluated(
                rule,
                f"no data: no attempted request in cells matching {rule.select.describe()}",
                threshold=rule.max_error_rate,
            )
        ]
    details = [
        {"cell": k.label, "errors": e, "attempts": a, "rate": e / a, "by_class": classes.get(k, {})}
        for k, e, a in rows
    ]
    worst_key, worst_e, worst_a = max(rows, key=lambda r: r[1] / r[2])
    worst = worst_e / worst_a
    total = sum(a for _, _, a in rows)
    failing = [k for k, e, a in rows if e / a > rule.max_error_rate]
    if failing:
        by_class = ", ".join(f"{c} {k}" for c, k in sorted(classes.get(worst_key, {}).items()))
        return [
            verdict_for(
                rule,
                Status.FAIL,
                worst,
                rule.max_error_rate,
                total,
                f"{len(failing)} cell(s) over {rule.max_error_rate:.2%} errors; worst "
                f"{worst_key.label}: {worst_e}/{worst_a} ({by_class}); see the failed "
                "records' ext.error_detail (calculet-load export --full) and the server's "
                "failed/rejected events",
                details,
            )
        ]
    return [
        verdict_for(
            rule,
            Status.PASS,
            worst,
            rule.max_error_rate,
            total,
            f"worst cell {worst_key.label}: {worst_e}/{worst_a} errors; allowed "
            f"{rule.max_error_rate:.2%}",
            details,
        )
    ]


HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {
    "golden": _golden,
    "nonfinite": _max_count,
    "token_count_mismatch": _max_count,
    "error_output": _max_count,
    "error_rate": _error_rate,
}
