"""The limits a window of the capacity search must meet to count as stable (spec §14.3),
from `--sla FILE` and the command line's `--max-*` options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["SLA", "SPEC_WINDOW_S", "GoodputSLA", "load_sla"]

SPEC_WINDOW_S = 1800.0  # spec §14.3: 30-minute windows; shorter ones are a rehearsal


class GoodputSLA(BaseModel):
    """Goodput as the search's criterion: at least `min_share` of a window's measured
    arrivals succeed with TTFT ≤ `max_ttft_ms` and TPOT ≤ `max_tpot_ms` (target ms; a
    null objective is not checked, one of them must be set)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_ttft_ms: float | None = Field(default=None, gt=0)
    max_tpot_ms: float | None = Field(default=None, gt=0)
    min_share: float = Field(gt=0, le=1)

    @model_validator(mode="after")
    def _an_objective(self) -> GoodputSLA:
        if self.max_ttft_ms is None and self.max_tpot_ms is None:
            raise ValueError("set max_ttft_ms or max_tpot_ms (or both): goodput needs an SLO")
        return self


class SLA(BaseModel):
    """The limits a stable window meets; None: not checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_reject_rate: float | None = Field(default=0.01, ge=0, le=1)
    max_queue_p99_ms: float | None = Field(default=None, gt=0)  # target ms
    max_ttft_p99_ms: float | None = Field(default=None, gt=0)
    max_e2e_p99_ms: float | None = Field(default=None, gt=0)
    # allowed backlog growth over the measured span, as a share of its arrivals
    backlog_tolerance: float = Field(default=0.02, ge=0)
    goodput: GoodputSLA | None = None


def load_sla(path: str | None, overrides: dict[str, Any]) -> SLA:
    data: dict[str, Any] = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"--sla {path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--sla {path}: top level must be a mapping")
        data = loaded.get("sla", loaded)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return SLA.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ValueError(f"sla.{'.'.join(map(str, err['loc']))}: {msg}") from None
