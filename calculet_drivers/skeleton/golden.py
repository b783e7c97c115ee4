"""The golden set checked through a driver's session: each case sent once, its output's
token hash against the one the set expects (before and after a run's load)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from calculet_load.measure.outcome import Outcome
from calculet_load.measure.prompts import Prompt
from calculet_load.measure.session import RequestSpec, golden_spec
from calculet_load.workload.matrix import GoldenSet

__all__ = ["GoldenCheck", "check_golden"]


@dataclasses.dataclass(frozen=True, slots=True)
class GoldenCheck:
    """How the set came back: a line per case that failed (an error, or another hash),
    and `recorded`, `{name, token_hash}` of the cases compared with nothing (no expected
    hash, or every case when recording)."""

    cases: int
    failures: list[str]
    recorded: list[dict[str, Any]]

    def summary(self) -> str:
        return f"{self.cases - len(self.failures)}/{self.cases} match"

    def public(self) -> dict[str, Any]:
        return {"cases": self.cases, "failures": self.failures}


def check_golden(
    golden: GoldenSet,
    send: Callable[[RequestSpec], Outcome],
    prompt: Callable[[int, int], Prompt],
    cell: str,
    *,
    record: bool = False,
    **over: Any,
) -> GoldenCheck:
    """Send every case (cell `<cell>:<case>`; `over`: fields a driver sends otherwise, as
    golden_spec's) one at a time; `record`: compare none, record every hash."""
    failures: list[str] = []
    recorded: list[dict[str, Any]] = []
    for case in golden.cases:
        spec = golden_spec(case, prompt(case.prompt_tokens, case.sample), f"{cell}:{case.name}",
                           **over)  # fmt: skip
        out = send(spec)
        if out.error_class is not None:
            failures.append(f"{case.name}: {out.error_class} ({out.http_status} {out.error_code})")
        elif record or case.token_hash is None:
            recorded.append({"name": case.name, "token_hash": out.token_hash})
        elif out.token_hash != case.token_hash:
            failures.append(
                f"{case.name}: token hash {str(out.token_hash)[:12]}… != {case.token_hash[:12]}…"
            )
    return GoldenCheck(len(golden.cases), failures, recorded)
