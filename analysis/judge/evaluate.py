"""Evaluating the acceptance rules (analysis.judge.rules) on a run, or a baseline/candidate
pair, into verdicts (analysis.judge.verdict): the infrastructure checks of both runs, then
one handler per rule kind (HANDLERS), in the rules file's order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from analysis.judge import batch, boundary, capacity, comparisons, correctness, limits, resources
from analysis.judge.evidence import Context, not_evaluated
from analysis.judge.infra import check_infrastructure
from analysis.judge.rules import RULE_CLASS, RulesFile
from analysis.judge.verdict import RuleVerdict

__all__ = ["HANDLERS", "Context", "evaluate"]

HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {
    **correctness.HANDLERS,
    **comparisons.HANDLERS,
    **limits.HANDLERS,
    **capacity.HANDLERS,
    **batch.HANDLERS,
    **resources.HANDLERS,
    **boundary.HANDLERS,
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
    return out
