"""Boundary cells (spec §6.1): requests whose prompt + output exceed the context, judged
only by the target's declared overflow policy (analysis.judge.rules.BoundaryPolicyRule), one
verdict per cell; never a performance cell (analysis.judge.evidence sets them apart).

Per sent record of a boundary cell (dropped and cut-at-stop records were never
answered and are not judged):

- prompt + requested output > max_context, policy `reject`: refused as the rule's
  `reject` says (HTTP status, error class, optionally the error body's type);
- the same, policy `truncate`: a success with a `truncate` finish reason whose prompt
  (the server's count when it gave one) + output tokens ≤ max_context, no NaN/Inf;
- a request of the cell that fits the context: a success with at most the requested
  output tokens.

Anything else breaks the policy: accepted and run past the context, a 5xx, a timeout,
a reset, another refusal than the one declared. A cell passes when every record
follows it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from analysis.judge.evidence import (
    Context,
    Evidence,
    column_np,
    not_evaluated,
    sent_mask,
    verdict_for,
)
from analysis.judge.rules import BoundaryPolicyRule
from analysis.judge.verdict import RuleVerdict, Status

__all__ = ["HANDLERS", "BoundaryCell", "analyze_boundary", "boundary_section", "cached_boundary"]

_TIMEOUTS = ("connect_timeout", "first_byte_timeout", "idle_timeout", "total_timeout")
_SERVER_FAILED = ("http_5xx", "server_error_event")
_MAX_DETAILS = 20

_NEXT = {
    "accepted": "the target served a request over its context: fix its length check, or "
    "set `policy: truncate` if truncation is the intended policy",
    "past_context": "the target generated past its context: its length limit is not "
    "enforced; check the server's max context and KV reservation for these ids",
    "server_failed": "the target failed instead of refusing: look at its failed events and "
    "log for these request ids",
    "timeout": "the target did not answer in time: a boundary request must be refused or "
    "truncated at once; look at the server's queue and events for these ids",
    "other_refusal": "refused, but not as the rule declares: if this is the intended "
    "refusal, list its status/class/code under `reject`; else fix the server's error mapping",
    "refused": "the target refused: if refusal is the intended policy, set `policy: reject`",
    "finish_reason": "served without a truncation finish reason: a client cannot tell the "
    "cut output from a complete one; fix the finish reason the server reports",
    "nonfinite": "the truncated response carried NaN/Inf: look at the numeric check (§12.2)",
    "over_requested": "the target generated more tokens than max_tokens asked for: check "
    "its length accounting for these ids",
    "fits_failed": "a request of the cell that fits the context failed: see its "
    "ext.error_detail (calculet-load export --full)",
    "failed": "see the records' ext.error_detail (calculet-load export --full) and the "
    "server's events for these ids",
}


@dataclass(frozen=True, slots=True)
class BoundaryCell:
    """What one boundary cell's sent records did, and whether that follows the policy."""

    cell: str
    records: int
    followed: int
    over_context: int
    accepted: int
    max_output_tokens: int | None
    by_status: dict[str, int]
    by_class: dict[str, int]
    by_code: dict[str, int]
    by_finish: dict[str, int]
    problems: dict[str, int]
    details: list[dict[str, Any]] = field(default_factory=list)

    @property
    def share(self) -> float | None:
        return self.followed / self.records if self.records else None


def _expected(rule: BoundaryPolicyRule) -> str:
    if rule.policy == "reject":
        r = rule.reject
        codes = f", error code {'/'.join(r.error_code)}" if r.error_code else ""
        status = "/".join(str(s) for s in r.http_status)
        return f"reject: HTTP {status}, error class {'/'.join(r.error_class)}{codes}"
    reasons = "/".join(rule.truncate.finish_reason)
    return f"truncate: finish reason {reasons}, prompt + output ≤ {rule.max_context}"


def _problem(rule: BoundaryPolicyRule, rec: dict[str, Any]) -> str | None:
    """None when the record follows the policy; else the problem's key in _NEXT."""
    err, over = rec["error_class"], rec["over"]
    served = err == ""
    if not over:
        if not served:
            return "fits_failed"
        return "over_requested" if rec["output"] > rec["requested"] else None
    if rule.policy == "reject":
        if served:
            return "past_context" if rec["used"] > rule.max_context else "accepted"
        r = rule.reject
        if (
            err in r.error_class
            and rec["status"] in r.http_status
            and (r.error_code is None or rec["code"] in r.error_code)
        ):
            return None
    elif served:
        if rec["used"] > rule.max_context:
            return "past_context"
        if rec["finish"] not in rule.truncate.finish_reason:
            return "finish_reason"
        return "nonfinite" if rec["nonfinite"] else None
    if err in _SERVER_FAILED:
        return "server_failed"
    if err in _TIMEOUTS:
        return "timeout"
    if err == "http_4xx":
        return "other_refusal" if rule.policy == "reject" else "refused"
    return "failed"


def _records(ev: Evidence, rows: Any, max_context: int) -> list[dict[str, Any]]:
    t = ev.table

    def col(name: str, fill: Any, dtype: Any = object) -> Any:
        return column_np(t.column(name), fill, dtype)[rows]

    prompt = col("workload.prompt_tokens", 0, np.int64)
    server_prompt = col("ext.server_prompt_tokens", -1, np.int64)
    requested = col("workload.requested_output_tokens", 0, np.int64)
    output = col("workload.actual_output_tokens", 0, np.int64)
    # the server's prompt count where it gave one: the context it actually used
    used = np.where(server_prompt >= 0, server_prompt, prompt) + output
    columns = {
        "request_id": col("request_id", ""),
        "error_class": col("ext.error_class", ""),
        "status": col("result.http_status", 0, np.int64),
        "code": col("result.error_code", ""),
        "finish": col("result.finish_reason", ""),
        "nonfinite": col("ext.nonfinite_field", False, bool),
    }
    return [
        {
            "prompt": int(prompt[i]),
            "requested": int(requested[i]),
            "output": int(output[i]),
            "over": int(prompt[i]) + int(requested[i]) > max_context,
            "used": int(used[i]),
            "request_id": str(columns["request_id"][i]),
            "error_class": str(columns["error_class"][i]),
            "status": int(columns["status"][i]),
            "code": str(columns["code"][i]),
            "finish": str(columns["finish"][i]),
            "nonfinite": bool(columns["nonfinite"][i]),
        }
        for i in range(rows.size)
    ]


def _count(items: Any) -> dict[str, int]:
    return dict(sorted(Counter(items).items()))


def analyze_boundary(ev: Evidence, rule: BoundaryPolicyRule) -> list[BoundaryCell]:
    """One BoundaryCell per boundary cell of the run (by name), in name order."""
    if not ev.boundary_names:
        return []
    t = ev.table
    names = column_np(t.column("ext.cell"), "", object)
    sent = sent_mask(t)
    out = []
    for name in sorted(ev.boundary_names):
        rows = np.flatnonzero((names == name) & sent)
        recs = _records(ev, rows, rule.max_context)
        problems = [_problem(rule, r) for r in recs]
        bad = [(r, p) for r, p in zip(recs, problems, strict=True) if p is not None]
        served = [r for r in recs if r["error_class"] == ""]
        out.append(
            BoundaryCell(
                cell=name,
                records=len(recs),
                followed=len(recs) - len(bad),
                over_context=sum(r["over"] for r in recs),
                accepted=len(served),
                max_output_tokens=max((r["output"] for r in served), default=None),
                by_status=_count(str(r["status"]) for r in recs if r["status"]),
                by_class=_count(r["error_class"] for r in recs if r["error_class"]),
                by_code=_count(r["code"] for r in recs if r["code"]),
                by_finish=_count(r["finish"] for r in served if r["finish"]),
                problems=_count(p for _, p in bad),
                details=[
                    {
                        "request_id": r["request_id"],
                        "problem": p,
                        "http_status": r["status"] or None,
                        "error_class": r["error_class"] or None,
                        "error_code": r["code"] or None,
                        "finish_reason": r["finish"] or None,
                        "prompt_tokens": r["prompt"],
                        "requested_output_tokens": r["requested"],
                        "output_tokens": r["output"],
                    }
                    for r, p in bad[:_MAX_DETAILS]
                ],
            )
        )
    return out


def cached_boundary(ctx: Context, rule: BoundaryPolicyRule) -> list[BoundaryCell]:
    key = ("boundary", rule.model_dump_json())
    if key not in ctx.cache:
        ctx.cache[key] = analyze_boundary(ctx.candidate, rule)
    result: list[BoundaryCell] = ctx.cache[key]
    return result


def _seen(c: BoundaryCell) -> str:
    parts = [f"HTTP {k}: {v}" for k, v in c.by_status.items()]
    parts += [f"{k} {v}" for k, v in c.by_class.items()]
    parts += [f"code {k} {v}" for k, v in c.by_code.items()]
    if c.accepted:
        parts.append(f"{c.accepted} served (max output {c.max_output_tokens} tokens)")
        parts += [f"finish {k} {v}" for k, v in c.by_finish.items()]
    return "; ".join(parts) or "no answer recorded"


def _verdict(rule: BoundaryPolicyRule, c: BoundaryCell) -> RuleVerdict:
    expected = _expected(rule)
    suffix = f".{c.cell}"
    if c.records == 0:
        return not_evaluated(
            rule,
            f"no data: no sent request in boundary cell {c.cell}; rerun the cell",
            threshold=expected,
            suffix=suffix,
        )
    seen = f"{c.followed} of {c.records} requests ({c.over_context} over the context) followed "
    if c.followed == c.records:
        return verdict_for(
            rule, Status.PASS, c.share, expected, c.records, seen + f"the policy: {_seen(c)}",
            suffix=suffix,
        )  # fmt: skip
    first = c.details[0]
    problems = ", ".join(f"{k} {v}" for k, v in c.problems.items())
    return verdict_for(
        rule,
        Status.FAIL,
        c.share,
        expected,
        c.records,
        seen + f"the policy ({problems}; first {first['request_id']}: "
        f"{first['problem']}; seen {_seen(c)}): {_NEXT[first['problem']]}",
        c.details,
        suffix=suffix,
    )


def _boundary_policy(rule: BoundaryPolicyRule, ctx: Context) -> list[RuleVerdict]:
    cells = cached_boundary(ctx, rule)
    if not cells:
        return [
            not_evaluated(
                rule,
                f"no data: no boundary cell (name matching {rule.cells}) in this run; the "
                "§6.1 matrix has them (configs/matrices/single.yaml)",
                threshold=_expected(rule),
            )
        ]
    return [_verdict(rule, c) for c in cells]


def boundary_section(ctx: Context, rule: BoundaryPolicyRule | None) -> dict[str, Any] | None:
    """verdict.json's `boundary`: each boundary cell's answers and its policy verdict
    (null without boundary cells); without an enabled rule they are not evaluated."""
    if not ctx.candidate.boundary_names:
        return None
    judged = rule if rule is not None else BoundaryPolicyRule(id="-", kind="boundary_policy")
    rows = []
    for c in cached_boundary(ctx, judged):
        v = _verdict(judged, c) if rule is not None else None
        rows.append(
            {
                "cell": c.cell,
                "records": c.records,
                "followed": c.followed,
                "over_context": c.over_context,
                "accepted": c.accepted,
                "max_output_tokens": c.max_output_tokens,
                "http_status": c.by_status,
                "error_class": c.by_class,
                "error_code": c.by_code,
                "finish_reason": c.by_finish,
                "problems": c.problems,
                "status": v.status.value if v else Status.NOT_EVALUATED.value,
                "reason": v.reason if v else "no enabled boundary_policy rule in the rules file",
            }
        )
    return {
        "rule": rule.id if rule is not None else None,
        "policy": _expected(rule) if rule is not None else None,
        "max_context": rule.max_context if rule is not None else None,
        "cells": rows,
    }


HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {
    "boundary_policy": _boundary_policy,
}
