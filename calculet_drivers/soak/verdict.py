"""The end of a soak stage: the golden set before and after, the client index, and the
verdict (soak.judge) written to `soak.json` and said."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from calculet_drivers.soak import state as soakstate
from calculet_drivers.soak.judge import (
    Judgement,
    StageResult,
    judge,
)
from calculet_drivers.soak.load import SoakLoad
from calculet_load.measure.session import golden_spec

__all__ = ["SoakJudged"]


class SoakJudged(SoakLoad):
    """The golden set, the index and the verdict."""

    def _golden(self, when: str) -> dict[str, Any]:
        assert self.golden is not None
        failures = []
        for case in self.golden.cases:
            prompt = self.client.prompt(case.prompt_tokens, case.sample)
            spec = golden_spec(case, prompt, f"golden_{when}:{case.name}")
            _, out = self.session.send(spec)
            if out.error_class is not None:
                failures.append(f"{case.name}: {out.http_status} {out.error_code}")
            elif case.token_hash is not None and out.token_hash != case.token_hash:
                failures.append(f"{case.name}: token hash differs")
        self.say(
            f"golden {when}: {len(self.golden.cases) - len(failures)}/"
            f"{len(self.golden.cases)} match"
        )
        return {"cases": len(self.golden.cases), "failures": failures}

    def _write_index(self, status: str) -> None:
        assert self.state is not None
        self.attempt["sink"] = dataclasses.asdict(self.sink.stats)
        soakstate.write_client_index(
            self.run_dir,
            self.state,
            status=status,
            run_id=self.manifest.run_id,
            source=f"calculet-load soak --stage {self.stage.name}",
            target=self.url,
        )

    def _verdict(
        self, golden_before: dict[str, Any] | None, golden_after: dict[str, Any] | None
    ) -> int:
        """Judge the stage (calculet_drivers.soak.judge), write `soak.json` and say it."""
        assert self.state is not None
        gaps: list[dict[str, Any]] = self.state["gaps"]
        attempts: list[dict[str, Any]] = self.state["attempts"]
        j: Judgement = judge(
            StageResult(
                run_dir=self.run_dir,
                conditions=self.stage.pass_,
                scale=self.scale,
                planned_real_s=float(self.plan["run_duration_real_s"]),
                hung_at_end=int(self.plan.get("hung_at_end", 0)),
                rules=self.opts["rules"] or self.stage.rules,
                attempts=attempts,
                gaps=gaps,
                golden_before=golden_before,
                golden_after=golden_after,
            )
        )
        self.notes.extend(j.notes)
        doc = {**self.plan, "verdict": j.verdict, "exit_code": j.code,
               "conditions": j.conditions, "gaps": gaps, "attempts": [{k: a.get(k) for k in (
                   "worker", "pid", "host", "status", "started_wall_ns", "ended_wall_ns",
                   "load_ended_wall_ns", "loaded_real_s", "signal")} for a in attempts],
               "planned_start_wall_ns": self.state.get("planned_start_wall_ns"),
               "planned_end_wall_ns": self.state.get("planned_end_wall_ns"),
               "notes": self.notes}  # fmt: skip
        (self.run_dir / "soak.json").write_text(json.dumps(doc, indent=1, default=str))
        self.say(f"soak {self.stage.name}: {j.verdict} (exit {j.code})")
        for g in gaps:
            self.say(
                f"  GAP  {g['index']}: {g['start']} .. {g['end']} ({g['duration_s']:.1f} s real, "
                f"{g['duration_target_s']:.0f} target s): {g['reason']}"
            )
        for c in j.conditions:
            mark = {True: "ok  ", False: "FAIL", None: "n/a "}[c["ok"]]
            self.say(f"  {mark} {c['condition']}: {json.dumps(c['observed'], default=str)[:240]}")
        return j.code
