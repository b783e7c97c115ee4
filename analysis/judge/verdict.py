"""Verdicts (STYLE 7), the exit code (spec §15), `verdict.json` and the console summary.

Each verdict says which rule, what was observed, what was allowed, on how many values,
the status (pass | fail | inconclusive | not_evaluated) and a reason that says what was
seen and what to do next. "No data" is `not_evaluated`, never `pass`.

Exit code, most fundamental first: 2 (artifact or config invalid: raised before any
verdict), then 3 (an infrastructure verdict failed: the measurement is not valid,
rerun), then 1 (a correctness/reliability rule failed), then 4 (a performance rule
failed), else 0. So a run with both a correctness failure and a regression exits 1.
Inconclusive and not-evaluated verdicts do not change it unless the rules file says
`fail_on_inconclusive: true` (then inconclusive counts as failed, for its class).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from analysis.errors import ExitCode

__all__ = [
    "VERDICT_SCHEMA",
    "RuleClass",
    "RuleVerdict",
    "Status",
    "TooShort",
    "clean",
    "exit_code",
    "is_too_short",
    "render_summary",
    "status_word",
    "to_json",
    "too_short_lines",
    "verdict_dict",
]

VERDICT_SCHEMA = "calculet-verdict/v1"


class Status(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    NOT_EVALUATED = "not_evaluated"


class RuleClass(StrEnum):
    CORRECTNESS = "correctness"
    PERFORMANCE = "performance"
    INFRASTRUCTURE = "infrastructure"


_EXIT_BY_CLASS = {
    RuleClass.INFRASTRUCTURE: ExitCode.INFRASTRUCTURE,
    RuleClass.CORRECTNESS: ExitCode.CORRECTNESS,
    RuleClass.PERFORMANCE: ExitCode.REGRESSION,
}


@dataclass(frozen=True, slots=True)
class TooShort:
    """Why an inconclusive verdict could not be decided: the run was too short for it.
    `need` says what it lacked ("≥ 20 bins"), `run_s` how long a run (wall seconds)
    would give it, where that can be said."""

    need: str
    run_s: float | None = None


@dataclass(frozen=True, slots=True)
class RuleVerdict:
    """The outcome of one rule (or one infrastructure check) on the run."""

    rule: str
    kind: str
    rule_class: RuleClass
    status: Status
    observed: float | int | str | None
    threshold: float | int | str | None
    n: int
    reason: str
    details: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    too_short: TooShort | None = None


def _failing(v: RuleVerdict, fail_on_inconclusive: bool) -> bool:
    if v.status is Status.FAIL:
        return True
    return fail_on_inconclusive and v.status is Status.INCONCLUSIVE


def exit_code(verdicts: Sequence[RuleVerdict], *, fail_on_inconclusive: bool = False) -> ExitCode:
    """Spec §15 from the verdicts: 3 before 1 before 4 (module docstring)."""
    failed = {v.rule_class for v in verdicts if _failing(v, fail_on_inconclusive)}
    for cls in (RuleClass.INFRASTRUCTURE, RuleClass.CORRECTNESS, RuleClass.PERFORMANCE):
        if cls in failed:
            return _EXIT_BY_CLASS[cls]
    return ExitCode.PASS


_STATUS_WORD = {
    ExitCode.PASS: "pass",
    ExitCode.CORRECTNESS: "correctness_fail",
    ExitCode.INFRASTRUCTURE: "infrastructure_invalid",
    ExitCode.REGRESSION: "performance_regression",
    ExitCode.INVALID_ARTIFACT: "artifact_invalid",
}


def status_word(code: ExitCode) -> str:
    return _STATUS_WORD[code]


def clean(value: Any) -> Any:
    """JSON-safe: NaN/±inf become null (no data), tuples lists, enums their value."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def verdict_dict(v: RuleVerdict) -> dict[str, Any]:
    return {
        "rule": v.rule,
        "kind": v.kind,
        "class": v.rule_class.value,
        "status": v.status.value,
        "observed": clean(v.observed),
        "threshold": clean(v.threshold),
        "n": v.n,
        "reason": v.reason,
        "details": clean(list(v.details)),
        "too_short": None
        if v.too_short is None
        else {"need": v.too_short.need, "run_s": clean(v.too_short.run_s)},
    }


def is_too_short(v: dict[str, Any]) -> bool:
    """An inconclusive verdict (as in verdict.json) the run was too short to decide."""
    return v.get("status") == Status.INCONCLUSIVE.value and isinstance(v.get("too_short"), dict)


_KIND_WORD = {"leaks": "leak", "capacity": "capacity", "slo": "SLO"}


def _duration(seconds: float) -> str:
    """A run length rounded up: "45 s", "4.5 min", "12 min", "3.2 h"."""
    if seconds < 120:
        return f"{math.ceil(seconds)} s"
    minutes = seconds / 60
    if minutes < 10:
        return f"{math.ceil(minutes * 10) / 10:g} min"
    if minutes < 120:
        return f"{math.ceil(minutes)} min"
    return f"{math.ceil(minutes / 6) / 10:g} h"


def too_short_lines(verdicts: Sequence[dict[str, Any]]) -> list[str]:
    """One line per (rule kind, what they need) for the verdicts the run was too short
    to decide: "6 leak rules need ≥ 20 bins: run ≥ 4.5 min"."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for v in verdicts:
        if is_too_short(v):
            groups.setdefault((str(v.get("kind")), str(v["too_short"]["need"])), []).append(v)
    lines = []
    for (kind, need), vs in groups.items():
        word = _KIND_WORD.get(kind, kind)
        runs = [float(v["too_short"]["run_s"]) for v in vs if v["too_short"].get("run_s")]
        head = f"{len(vs)} {word} rule{'s' if len(vs) > 1 else ''} need{'' if len(vs) > 1 else 's'}"
        lines.append(f"{head} {need}" + (f": run ≥ {_duration(max(runs))}" if runs else ""))
    return lines


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(clean(doc), indent=1, allow_nan=False, ensure_ascii=False) + "\n"


_MARK = {
    Status.PASS: "PASS",
    Status.FAIL: "FAIL",
    Status.INCONCLUSIVE: "INCONCLUSIVE",
    Status.NOT_EVALUATED: "not evaluated",
}


def render_summary(doc: dict[str, Any], *, width: int = 100) -> str:
    """The short human summary printed by `calculet-load analyze`."""
    lines = []
    head = f"analyze {doc['run']['uri']}"
    if doc.get("baseline"):
        head += f"  (baseline {doc['baseline']['uri']})"
    lines.append(head)
    if doc.get("banner"):  # "rehearsal: not an acceptance"
        lines.append(f"  {doc['banner'].upper()}")
    q = doc["quality"]
    parts = q["by_partition"]
    excluded = {k: v for k, v in q["by_reason"].items() if v and k in _EXCLUDING_REASONS}
    lines.append(
        f"  records {q['records']}: measured {parts.get('measured', 0)}, "
        f"throttled {parts.get('throttled', 0)}, warmup {parts.get('warmup', 0)}, "
        f"excluded {parts.get('excluded', 0)}"
        + (f" ({', '.join(f'{k} {v}' for k, v in excluded.items())})" if excluded else "")
        + f"; dropped {parts.get('dropped', 0)}, cut at stop {parts.get('cut_at_stop', 0)}"
    )
    lines.append(f"  server traces joined to {doc['run']['joined']} records")
    vendor = doc.get("vendor") or {}
    if vendor.get("present"):
        lines.append(
            f"  vendor trace ({vendor['file']}): {vendor['op_rows']} op rows, "
            f"{len(vendor['chips'])} chip(s), joined to {vendor['joined_records']} records"
        )
    elif vendor:
        lines.append(f"  {vendor['note']}")
    measured = [c for c in doc["cells"] if c["partition"] == "measured" and not c.get("boundary")]
    good = {g["cell"]: g for g in (doc.get("goodput") or {}).get("cells") or []}
    for c in measured[:_MAX_CELLS]:
        p50 = c["p50_ms"]
        figures = ", ".join(
            f"{m.removesuffix('_ms').upper()} p50 {p50[m]:.1f} ms"
            for m in ("ttft_ms", "tpot_ms", "e2e_ms")
            if p50.get(m) is not None
        )
        rate = c["steady_output_tokens_per_s"]
        lines.append(
            f"  cell {c['cell']}: {c['ok']} ok, {c['errors']} errors"
            + (f"; {figures}" if figures else "")
            + (f"; {rate:.1f} tokens/s" if rate is not None else "")
            + _goodput_text(good.get(c["cell"]))
        )
    if len(measured) > _MAX_CELLS:
        lines.append(f"  … {len(measured) - _MAX_CELLS} more cells in summary.csv")
    for status in (Status.FAIL, Status.INCONCLUSIVE):
        for v in doc["verdicts"]:
            if v["status"] == status.value and not is_too_short(v):
                lines.append(f"  {_MARK[status]:<12} {v['rule']}: {v['reason']}")
    for line in too_short_lines(doc["verdicts"]):
        lines.append(f"  {'TOO SHORT':<12} {line}")
    for v in doc["verdicts"]:
        if v["status"] == Status.PASS.value:
            text = f"  {_MARK[Status.PASS]:<12} {v['rule']}: {v['reason']}"
            lines.append(text if len(text) <= width else text[: width - 1] + "…")
    skipped = [
        f"{v['rule']} ({v['reason'].split(':')[0]})"
        for v in doc["verdicts"]
        if v["status"] == Status.NOT_EVALUATED.value
    ]
    if skipped:
        lines.append(f"  not evaluated: {', '.join(skipped)}")
    lines.append(
        f"verdict: {doc['status']} (exit {doc['exit_code']}); written: {', '.join(doc['outputs'])}"
    )
    return "\n".join(lines)


def _goodput_text(g: dict[str, Any] | None) -> str:
    if g is None or g.get("share") is None:
        return ""
    rate = "" if g.get("goodput_rps") is None else f"{g['goodput_rps']:.3g} req/s, "
    return f"; goodput {rate}{100 * g['share']:.1f}% met the SLOs"


_MAX_CELLS = 8
_EXCLUDING_REASONS = (
    "clock_incomplete",
    "network_break",
    "client_saturated",
    "interrupted_attempt",
)
