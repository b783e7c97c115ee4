"""The schema of a soak stage (spec §13): `configs/soak/<name>.yaml`, read by `load_stage`.

Durations and rates are the *target's* seconds (see calculet_drivers/soak/run.py for how a
time-scaled simulator stretches them). The run (calculet_drivers/soak/run.py), its resumable
state (calculet_drivers/soak/state.py) and its judging (calculet_drivers/soak/judge.py) all read
a stage from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from calculet_load.configfile import validate

SOAK_SCHEMA = "calculet-soak-stage/v1"
STAGE_DIR = Path(__file__).resolve().parents[2] / "configs" / "soak"


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SoakLoad(_M):
    kind: Literal["open", "closed"] = "open"
    arrival: Literal["poisson", "constant", "gamma"] = "poisson"
    rate_fraction: float = Field(default=1.0, gt=0)  # of the stage's target rate
    concurrency: int = Field(default=1, ge=1)  # closed loop
    mix: str | None = None  # a mix (configs/mixes) instead of one shape
    prompt_tokens: int = Field(default=128, ge=1, le=40959)
    max_tokens: int = Field(default=32, ge=1)
    stream: bool = True
    max_in_flight: int = Field(default=256, ge=1)
    # connections opened before the load starts: the server's FD count then measures
    # the server, not the client's connection pool filling up
    prewarm_connections: int = Field(default=32, ge=0)


class Bursts(_M):
    every_s: float = Field(gt=0)  # target seconds between bursts
    size: int = Field(ge=1)
    prompt_tokens: int = Field(default=128, ge=1, le=40959)
    max_tokens: int = Field(default=32, ge=1)


class Sampling(_M):
    resources_every_s: float = Field(default=10.0, gt=0)  # target seconds
    traces_every_s: float = Field(default=60.0, gt=0)
    client_every_s: float = Field(default=10.0, gt=0)


class PassConditions(_M):
    max_error_rate: float = Field(default=0.0, ge=0, le=1)
    no_leak: bool = True  # the analysis' leak rule (server/resources.jsonl) passes
    max_request_s: float = Field(default=900.0, gt=0)  # target seconds: longer is a hang
    no_abort: bool = True  # /health answers 200 at every sample
    golden: bool = False  # the golden set before and after (needs --golden)
    # client RSS growth above this (MiB per hour of real time, Theil–Sen) fails
    client_rss_max_slope_mib_per_h: float | None = Field(default=256.0, ge=0)
    # ... unless the fitted rise over the judged span is under this (MiB): allocators grow
    # in steps of this order for minutes after start (Python's arenas, Arrow's pool), so a
    # short stage's per-hour slope of a 1-2 MiB creep is not a trend (measured: a 36 s dev
    # rehearsal's creep was 80-265 MiB/h between runs of the same tree)
    client_rss_min_rise_mib: float = Field(default=8.0, ge=0)
    analysis: bool = True  # `calculet-load analyze` must exit 0


class SoakStage(_M):
    schema_: Literal["calculet-soak-stage/v1"] = Field(alias="schema")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    title: str = Field(min_length=1)
    spec: str = ""  # what spec §13 asks of the stage
    duration_s: float = Field(gt=0)  # target seconds
    target_rate_qps: float = Field(default=1.0, gt=0)  # the target load; --target-rate
    load: SoakLoad = Field(default_factory=SoakLoad)
    bursts: Bursts | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    pass_: PassConditions = Field(default_factory=PassConditions, alias="pass")
    # acceptance rules for the analysis (default: the default); a relative path is the
    # stage file's neighbour (configs/soak/candidate.yaml: ../acceptance/soak-candidate.yaml)
    rules: str | None = None


class StageError(ValueError):
    pass


def load_stage(name_or_path: str) -> SoakStage:
    p = Path(name_or_path)
    if not p.exists():
        p = STAGE_DIR / f"{name_or_path}.yaml"
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError:
        known = sorted(x.stem for x in STAGE_DIR.glob("*.yaml"))
        raise StageError(f"stage {name_or_path!r}: no such file; known stages {known}") from None
    except yaml.YAMLError:
        raise StageError(f"{p}: invalid YAML") from None
    stage = validate(SoakStage, data, str(p), StageError)
    if stage.rules is not None and not Path(stage.rules).is_absolute():
        stage = stage.model_copy(update={"rules": str((p.parent / stage.rules).resolve())})
    return stage


def stage_json_schema() -> dict[str, Any]:
    return SoakStage.model_json_schema(by_alias=True)
