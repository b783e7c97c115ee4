"""The simulator's profile: timing model, scheduling, limits, telemetry and knobs.

A profile is YAML validated by pydantic; every field has a default, so an empty file
is the default NPU. Durations are milliseconds of *simulated* time; the server sleeps
`duration * time_scale` of real time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Slowdown(_Strict):
    """Decode and prefill cost multiplier once the context reaches `from_context` tokens."""

    from_context: int = Field(gt=0)
    factor: float = Field(gt=0)


class Timing(_Strict):
    prefill_base_ms: float = Field(default=8.0, ge=0)
    prefill_per_token_ms: float = Field(default=0.05, ge=0)
    # Attention makes long prefills super-linear.
    prefill_per_token_sq_ms: float = Field(default=1.0e-6, ge=0)
    decode_base_ms: float = Field(default=12.0, ge=0)
    decode_per_context_token_ms: float = Field(default=0.0002, ge=0)
    # Extra per-step cost of a compiled batch of B lanes: base * (1 + batch_overhead*(B-1)).
    batch_overhead: float = Field(default=0.12, ge=0)
    # The history shows a drop near 33K and 40K context (spec §16).
    slowdowns: list[Slowdown] = Field(
        default_factory=lambda: [
            Slowdown(from_context=33_000, factor=1.35),
            Slowdown(from_context=39_000, factor=1.8),
        ]
    )
    prepare_ms: float = Field(default=0.15, ge=0)
    h2d_ms_per_mtoken: float = Field(default=20.0, ge=0)
    h2d_base_ms: float = Field(default=0.05, ge=0)
    d2h_ms: float = Field(default=0.2, ge=0)
    bf16_ms: float = Field(default=0.1, ge=0)
    sampling_ms_per_lane: float = Field(default=0.05, ge=0)
    # Relative standard deviation of a step's device time (seeded, lognormal).
    jitter: float = Field(default=0.02, ge=0, lt=1)
    # The first `warmup_requests` after start or load pay `warmup_extra_ms` once.
    warmup_requests: int = Field(default=1, ge=0)
    warmup_extra_ms: float = Field(default=250.0, ge=0)


class Scheduling(_Strict):
    slots: int = Field(default=16, gt=0)
    kv_budget_tokens: int = Field(default=131_072, gt=0)
    compiled_batch: int = Field(default=1, gt=0)
    ping_pong: bool = False
    queue_max: int = Field(default=64, ge=0)
    # Bounded admission wait (simulated seconds) before 503.
    admission_timeout_s: float = Field(default=30.0, gt=0)
    max_context: int = Field(default=40_960, gt=1)
    # What a request whose prompt + output exceeds max_context gets.
    context_overflow: Literal["reject", "truncate"] = "reject"
    buffer_pool_size: int = Field(default=32, gt=0)
    # Backoff for DeviceBusy (rc=17) resubmits.
    busy_retries: int = Field(default=3, ge=0)
    busy_backoff_ms: float = Field(default=2.0, ge=0)
    # Recovery from DeviceUnavailable / CCU exception / timeouts.
    reset_ms: float = Field(default=200.0, ge=0)
    reset_min_interval_ms: float = Field(default=1000.0, ge=0)
    reset_backoff_max_ms: float = Field(default=16_000.0, ge=0)
    supervisor_restart_ms: float = Field(default=500.0, ge=0)
    wait_timeout_ms: float = Field(default=2000.0, gt=0)


class Output(_Strict):
    vocab_size: int = Field(default=32_000, ge=600)
    tokens_per_event: int = Field(default=1, gt=0)
    # llama.cpp holds back a token that ends inside a UTF-8 character.
    utf8_holdback: bool = True
    # Share of generated units that are multi-byte characters split over byte tokens.
    multibyte_rate: float = Field(default=0.04, ge=0, le=1)
    # Probability that a greedy step yields EOS (0: outputs always reach max tokens).
    eos_probability: float = Field(default=0.0, ge=0, le=1)
    model_alias: str = "qwen3"
    model_name: str = "calculet-sim-qwen3"
    # As vLLM and OpenAI do: a request naming another model than model_name or
    # model_alias gets 404 `model_not_found`, its message naming the requested model.
    # Off by default: the simulator serves whatever model a request names.
    reject_unknown_models: bool = False


class PrefixCache(_Strict):
    """Automatic prefix caching: a prompt's cached prefix costs no prefill."""

    enabled: bool = True
    # Cached KV is KV memory: vLLM keeps cached blocks in its KV pool and llama.cpp in its
    # slots' cells, reclaimed when running requests need them. So the cache holds at most
    # this (None: scheduling.kv_budget_tokens) and never more than the KV budget that
    # running requests leave unreserved.
    capacity_tokens: int | None = Field(default=None, gt=0)
    # Hits are whole blocks, as vLLM's (16 tokens by default there too).
    block_tokens: int = Field(default=16, gt=0)


class Reasoning(_Strict):
    """A reasoning model's thinking phase before its answer (qwen3)."""

    enabled: bool = False
    # Tokens of the phase, `<think>` and `</think>` included; at most `max_share` of a
    # request's max tokens, which bound reasoning and answer together (as vLLM's do).
    # A phase shorter than 2 tokens is none.
    tokens: int = Field(default=256, ge=0)
    max_share: float = Field(default=0.5, ge=0, le=1)
    # separate: chat deltas carry `reasoning_content`, then `content` (vLLM's reasoning
    # parser, llama.cpp --reasoning-format deepseek); inline: `<think>...</think>` in the
    # content (llama.cpp --reasoning-format none). Completions are always inline.
    format: Literal["separate", "inline"] = "separate"


class Device(_Strict):
    chips: int = Field(default=2, gt=0)
    ambient_c: float = 30.0
    idle_power_w: float = Field(default=18.0, ge=0)
    active_power_w: float = Field(default=55.0, ge=0)
    # Degrees per watt at equilibrium, and the thermal time constant (simulated s).
    thermal_resistance_c_per_w: float = Field(default=0.9, gt=0)
    thermal_time_constant_s: float = Field(default=40.0, gt=0)
    throttle_temp_c: float = 85.0
    throttle_release_c: float = 80.0
    nominal_frequency_mhz: float = Field(default=1200.0, gt=0)
    throttled_frequency_mhz: float = Field(default=800.0, gt=0)
    memory_total_mib: float = Field(default=16_384.0, gt=0)
    memory_base_mib: float = Field(default=6_200.0, ge=0)
    kv_bytes_per_token: int = Field(default=65_536, ge=0)
    sample_interval_s: float = Field(default=1.0, gt=0)
    # A device that never settles (spec §8.2's idle check): every chip's power swings
    # sinusoidally by this much (W, peak) with this period (simulated s), at any load,
    # and its temperature follows. 0: power follows the load alone.
    power_swing_w: float = Field(default=0.0, ge=0)
    power_swing_period_s: float = Field(default=60.0, gt=0)
    # Fields reported as null, e.g. ["power_w", "chip1.temperature_c"].
    unreadable: list[str] = Field(default_factory=list)


class Leak(_Strict):
    """Per-request resource growth, for proving the leak detector fires."""

    rss_bytes_per_request: int = Field(default=0, ge=0)
    device_mib_per_request: float = Field(default=0.0, ge=0)
    leases_per_request: int = Field(default=0, ge=0)
    fds_per_request: int = Field(default=0, ge=0)


class Knobs(_Strict):
    # Probability that a token is taken from another active sequence (cross-talk): its
    # latest token. A request alone is never affected (nothing to leak from).
    crosstalk_probability: float = Field(default=0.0, ge=0, le=1)
    # Probability that a success response carries NaN in a numeric field.
    nan_probability: float = Field(default=0.0, ge=0, le=1)
    leak: Leak = Field(default_factory=Leak)


class Traces(_Strict):
    server_events: bool = True
    steps: bool = True
    device: bool = True
    flush_interval_s: float = Field(default=0.2, gt=0)


class Profile(_Strict):
    name: str = "default"
    seed: int = 20260802
    time_scale: float = Field(default=1.0, gt=0)
    # Zero delays and many tokens per write: for measuring the client's limits.
    firehose: bool = False
    firehose_tokens_per_write: int = Field(default=16, gt=0)
    timing: Timing = Field(default_factory=Timing)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    output: Output = Field(default_factory=Output)
    prefix_cache: PrefixCache = Field(default_factory=PrefixCache)
    reasoning: Reasoning = Field(default_factory=Reasoning)
    device: Device = Field(default_factory=Device)
    knobs: Knobs = Field(default_factory=Knobs)
    traces: Traces = Field(default_factory=Traces)
    versions: dict[str, str] = Field(
        default_factory=lambda: {
            "server_commit": "sim-0000000",
            "calrt": "0.7.6",
            "driver": "sim-driver-1.0",
            "firmware": "sim-fw-1.0",
            "calbin_sha256": "0" * 64,
        }
    )


class ProfileError(ValueError):
    """A profile file or override is invalid; the message names the field."""


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ProfileError(f"override {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def load_profile(path: str | Path | None = None, overrides: list[str] | None = None) -> Profile:
    """Load a profile by path or bundled name (`default`, `b4`, `slow`, ...).

    `overrides` are `dotted.key=yaml-value` strings applied on top.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists() and (PROFILE_DIR / f"{path}.yaml").exists():
            p = PROFILE_DIR / f"{path}.yaml"
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ProfileError(f"profile {path}: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ProfileError(f"profile {path}: top level must be a mapping")
        raw = loaded or {}
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ProfileError(f"override {item!r}: expected key=value")
        _set_path(raw, key.strip(), yaml.safe_load(text))
    try:
        return Profile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ProfileError(f"profile field {where}: {err['msg']}") from None
