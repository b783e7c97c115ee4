"""Evaluating the acceptance rules (analysis.judge.rules) on a run, or a baseline/candidate
pair, into verdicts (analysis.judge.verdict): the infrastructure checks of both runs, then
one handler per rule kind (HANDLERS), in the rules file's order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from analysis.judge import (
    batch,
    boundary,
    capacity,
    comparisons,
    correctness,
    crosstalk,
    goodput,
    limits,
    resources,
    stability,
)
from analysis.judge.evidence import Context, Evidence, not_evaluated
from analysis.judge.infra import check_infrastructure
from analysis.judge.rules import RULE_CLASS, RulesFile
from analysis.judge.verdict import RuleVerdict, Status
from calculet_load.schema.profiles import PROFILES

__all__ = ["HANDLERS", "Context", "evaluate"]

HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {
    **correctness.HANDLERS,
    **crosstalk.HANDLERS,
    **comparisons.HANDLERS,
    **limits.HANDLERS,
    **goodput.HANDLERS,
    **capacity.HANDLERS,
    **batch.HANDLERS,
    **resources.HANDLERS,
    **boundary.HANDLERS,
    **stability.HANDLERS,
}
assert set(HANDLERS) == set(RULE_CLASS), "every rule kind has exactly one handler"


def evaluate(rules: RulesFile, ctx: Context) -> list[RuleVerdict]:
    """Infrastructure checks (both runs), then every rule in file order."""
    out = check_infrastructure(ctx.candidate, rules.infrastructure)
    if ctx.baseline is not None:
        out += check_infrastructure(ctx.baseline, rules.infrastructure, prefix="baseline.")
    for rule in rules.rules:
        if not rule.enabled:
            out.append(not_evaluated(rule, "disabled: enabled is false in the rules file"))
            continue
        out += HANDLERS[rule.kind](rule, ctx)
    return [_on_this_target(v, ctx.candidate) for v in out]


# What a rule kind's data needs from the target (calculet_load.schema.profiles): a rule
# without data on a target that lacks it is not evaluated because of the target.
NEEDS = {
    "device_limits": ("device_telemetry", "device telemetry"),
    "leaks": ("admin_api", "admin API (server resources)"),
    "batch": ("traces", "traces (decode steps)"),
    "device_faults": ("traces", "traces (server events)"),
}


def _on_this_target(v: RuleVerdict, run: Evidence) -> RuleVerdict:
    """A `no data` verdict of a rule whose data the target cannot give says so: "not
    available: the llama.cpp target has no device telemetry"."""
    need = NEEDS.get(v.kind)
    if need is None or v.status is not Status.NOT_EVALUATED or not v.reason.startswith("no data"):
        return v
    target = (run.run.manifest or {}).get("target") or {}
    profile = PROFILES.get(str(target.get("profile") or "calculet"))
    if profile is None or getattr(profile, need[0]):
        return v
    reason = f"not available: the {profile.name} target has no {need[1]}; {v.reason}"
    return dataclasses.replace(v, reason=reason)
