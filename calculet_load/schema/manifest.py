"""The run manifest `calculet-perf-run/v1` (spec §5): YAML validated by pydantic.

Fields marked REQUIRED in the spec must be present and valid or the run does not start
(exit 2, one line naming the field path). The JSON Schema comes from the declaration.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator, model_validator

from calculet_load.configfile import read_yaml, validate
from calculet_load.schema.access import parse_header, secret_header
from calculet_load.schema.profiles import ProfileName

MANIFEST_SCHEMA = "calculet-perf-run/v1"
_SHA256 = re.compile(r"[0-9a-f]{64}")
REHEARSAL_BANNER = "rehearsal: not an acceptance"
_REHEARSAL = re.compile(r"\brehears", re.IGNORECASE)


def is_rehearsal(purpose: str | None) -> bool:
    """Whether a manifest's `purpose` says rehearsal ("rehearsal", "rehearse", any case):
    such a run may go below spec §8's repetitions, and its verdict and report say
    REHEARSAL_BANNER. The one test of it (accept, the analysis, the report)."""
    return bool(purpose and _REHEARSAL.search(purpose))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Model(_Section):
    alias: str = Field(min_length=1)
    generation: int = Field(ge=0)
    calbin_sha256: str

    @field_validator("calbin_sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        if not _SHA256.fullmatch(v):
            raise ValueError("must be 64 lowercase hex digits (sha256)")
        return v


class Software(_Section):
    server_commit: str = Field(min_length=1)
    image_digest: str = Field(min_length=1)
    calrt: str | None = None
    driver: str = Field(min_length=1)
    firmware: str = Field(min_length=1)


class Hardware(_Section):
    board: str = Field(min_length=1)
    chips: int = Field(default=2, gt=0)
    power_mode: str = Field(min_length=1)


class Environment(_Section):
    ambient_c: float
    vpn_in_path: bool = False


class Client(_Section):
    host: str = Field(min_length=1)
    transport: Literal["http-sse"] = "http-sse"


class Target(_Section):
    """Where the load goes; not in spec §5, which leaves the target to the deployment."""

    url: str = Field(pattern=r"^https?://")  # may carry a base path (schema.access)
    protocol: Literal["openai-chat", "openai-completions", "llama"] = "llama"
    model: str | None = None
    # what kind of server it is (calculet_load.schema.profiles): how prompts are sized,
    # which of Calculet's own endpoints it has
    profile: ProfileName = "calculet"
    tokenizer: str | None = None  # a local tokenizer.json that sizes prompts instead
    prompt_reuse: bool = False  # send prompts as built (cache studies); default: unique
    # how to reach it (calculet_load.schema.access): TLS, headers and the API key; the key
    # only by the file or environment variable that holds it, never inline
    ca_file: str | None = None
    insecure: bool = False  # https without certificate verification: shown in the report
    headers: list[str] = Field(default_factory=list)  # "Name: value", not secret-named
    api_key_file: str | None = None
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    @field_validator("headers")
    @classmethod
    def _headers(cls, v: list[str]) -> list[str]:
        for line in v:
            name, _ = parse_header(line)
            if secret_header(name):
                raise ValueError(
                    f"header {name}: a secret is never written inline; "
                    "use api_key_file or api_key_env (or --header on the command line)"
                )
        return v

    @model_validator(mode="after")
    def _access(self) -> Target:
        if self.api_key_file and self.api_key_env:
            raise ValueError("give api_key_file or api_key_env, not both")
        if self.insecure and self.ca_file:
            raise ValueError("give ca_file or insecure, not both")
        return self


MaintenanceAction = Literal["device_reset", "reload", "shutdown"]


class MaintenanceWindow(_Section):
    """When maintenance actions may be performed: `start` and `end` (wall times with a
    time zone), or `duration_s` from the start of the run."""

    start: AwareDatetime | None = None
    end: AwareDatetime | None = None
    duration_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_form(self) -> MaintenanceWindow:
        if self.duration_s is not None:
            if self.start is not None or self.end is not None:
                raise ValueError("give start and end, or duration_s, not both")
        elif self.start is None or self.end is None:
            raise ValueError("give start and end (with a time zone), or duration_s")
        elif self.end <= self.start:
            raise ValueError("end must be after start")
        return self

    def bounds_ns(self, run_start_wall_ns: int) -> tuple[int, int]:
        """[start, end) in wall ns; a duration counts from `run_start_wall_ns`."""
        if self.duration_s is not None:
            return run_start_wall_ns, run_start_wall_ns + int(self.duration_s * 1e9)
        assert self.start is not None and self.end is not None
        return _wall_ns(self.start), _wall_ns(self.end)


def _wall_ns(t: dt.datetime) -> int:
    return int(t.timestamp()) * 1_000_000_000 + t.microsecond * 1000


class Maintenance(_Section):
    """Spec §12.4: the explicit authorization for maintenance actions on the target
    (device reset, reload of an artifact, shutdown). Without it, a fault scenario that
    performs one is not run. Not among spec §5's fields: §12.4 asks for it."""

    # who is accountable: sent as X-Operator with every admin call, kept in the audit log
    operator: str = Field(pattern=r"^[A-Za-z0-9._@-]{1,64}$")
    window: MaintenanceWindow
    actions: list[MaintenanceAction] = Field(min_length=1)
    ticket: str | None = None  # the change ticket or vendor contract that allows it


class Batch(_Section):
    """Spec §7: the calbin's compiled batch and the vendor's statement of how lanes that
    are not filled are handled (masked, padded, ...): §7 requires the vendor to state it
    before a batch artifact is measured at active lanes 1..B. Not among spec §5's fields;
    `accept` requires it when the matrix declares `compiled_batch`."""

    compiled_batch: int = Field(gt=0)
    # e.g. "masked: every decode step computes all B lanes; empty lanes are padding"
    partial_lanes: str = Field(min_length=1)
    reference: str | None = None  # the vendor document or ticket that states it


class RunManifest(_Section):
    schema_: Literal["calculet-perf-run/v1"] = Field(alias="schema")
    run_id: str = Field(pattern=r"^[A-Za-z0-9._-]{1,128}$")
    purpose: str = Field(min_length=1)
    model: Model
    software: Software
    hardware: Hardware
    environment: Environment
    client: Client
    target: Target | None = None
    matrix: str
    warmup_requests: int = Field(default=10, ge=0)
    measured_requests: int = Field(default=100, gt=0)
    timeout_s: float = Field(default=900, gt=0)
    maintenance: Maintenance | None = None
    batch: Batch | None = None

    @property
    def rehearsal(self) -> bool:
        """The purpose says rehearsal (is_rehearsal): not an acceptance."""
        return is_rehearsal(self.purpose)


class ManifestError(ValueError):
    """The manifest is invalid; `str()` is one line naming the field path."""


def parse_manifest(data: Any, source: str = "manifest") -> RunManifest:
    if not isinstance(data, dict):
        raise ManifestError(f"{source}: top level must be a mapping")
    placeholder = _find_placeholder(data, ())
    if placeholder is not None:
        raise ManifestError(f"{source}: {placeholder}: REQUIRED field not filled in")
    return validate(RunManifest, data, source, ManifestError)


def _find_placeholder(node: Any, path: tuple[str, ...]) -> str | None:
    """The path of the first value still reading REQUIRED (a template not filled in)."""
    if isinstance(node, str) and node.strip() == "REQUIRED":
        return ".".join(path) or "(top level)"
    if isinstance(node, dict):
        for key, value in node.items():
            found = _find_placeholder(value, (*path, str(key)))
            if found is not None:
                return found
    return None


def load_manifest(path: str | Path) -> RunManifest:
    return parse_manifest(read_yaml(path, ManifestError), str(path))


def manifest_json_schema() -> dict[str, Any]:
    return RunManifest.model_json_schema(by_alias=True)
