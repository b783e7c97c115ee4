"""Fault scenarios of spec §12 and the injector that arms them (spec §11).

A scenario is armed through the admin API only. Each has a designed behaviour, which the
engine follows by default, and a `broken` mode that violates it, so the harness's
verdicts can be shown to fail. Injection points mirror `CalrtFaultInjector`:
`before_submit`, `override_wait`, `override_status`, `corrupt_output`; the other
scenarios are modes consulted when the client or an operator acts (cancel, shutdown,
load, reset).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

# scenario -> (spec section, what it does when armed)
SCENARIOS: dict[str, tuple[str, str]] = {
    "illegal_length": ("12.1", "mode: broken submits lengths it should reject"),
    "kv_full": ("12.1", "canAllocate=false for duration_ms: bounded wait then 429/503"),
    "buffer_pool_full": ("12.1", "all OutputBuf leases held for duration_ms"),
    "cancel_waiting": ("12.1", "mode: broken leaks the slot of a request cancelled in queue"),
    "cancel_submitted": ("12.1", "mode: broken frees buffers before the Wait drains"),
    "device_busy": ("12.2", "submit returns rc=17 for the next `count` submits"),
    "device_unavailable": ("12.2", "submit returns rc=18 for duration_ms"),
    "wait_timeout": ("12.2", "Wait returns rc=13 after wait_timeout_ms for `count` jobs"),
    "ccu_exception": ("12.2", "output status CCU exception for `count` jobs"),
    "invalid_shape": ("12.2", "submit returns rc=21 (or rc=22 dtype) for prefill jobs"),
    "stale_completion": ("12.2", "a job completes delay_ms late, after a reset"),
    "output_nan": ("12.2", "corrupt_output writes NaN/Inf into `count` jobs' logits"),
    "shutdown_with_queue": ("12.3", "mode: broken drops submitted jobs on shutdown"),
    "load_while_ready": ("12.3", "mode: broken switches generation without draining"),
    "configure_failure": ("12.3", "the next load fails; broken loses the old generation"),
    "reset_failure": ("12.3", "the next reset fails: instance Failed, supervisor restarts"),
    "repeated_faults": ("12.3", "`count` consecutive Wait timeouts; resets back off"),
    "maintenance_window": ("12.4", "mode: broken truncates the audit log at the next reset"),
}

RC_TIMEOUT = 13
RC_BUSY = 17
RC_UNAVAILABLE = 18
RC_INVALID_SHAPE = 21
RC_INVALID_DTYPE = 22


class FaultSpecError(ValueError):
    """An arm request names an unknown scenario or a bad parameter."""


@dataclasses.dataclass
class ArmedFault:
    scenario: str
    broken: bool = False
    count: int | None = None  # remaining firings; None = unlimited while armed
    probability: float = 1.0
    rc: int | None = None
    delay_ms: float = 0.0
    duration_ms: float | None = None
    armed_mono_ns: int = 0
    fired: int = 0

    def active(self, now_ns: int, time_scale: float) -> bool:
        if self.count is not None and self.count <= 0:
            return False
        if self.duration_ms is None:
            return True
        return now_ns - self.armed_mono_ns < self.duration_ms * 1e6 * time_scale

    def public(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_PARAM_TYPES: dict[str, tuple[type[Any], ...]] = {
    "broken": (bool,),
    "count": (int,),
    "probability": (int, float),
    "rc": (int,),
    "delay_ms": (int, float),
    "duration_ms": (int, float),
}


class FaultInjector:
    """The armed scenarios. Only the admin API calls `arm`/`clear`."""

    def __init__(self, seed: int) -> None:
        self._armed: dict[str, ArmedFault] = {}
        self._rng = random.Random(seed ^ 0xFA17)

    def arm(self, spec: dict[str, Any]) -> ArmedFault:
        scenario = spec.get("scenario")
        if not isinstance(scenario, str) or scenario not in SCENARIOS:
            raise FaultSpecError(f"scenario: unknown {scenario!r}; one of {sorted(SCENARIOS)}")
        kwargs: dict[str, Any] = {}
        for key, value in spec.items():
            if key == "scenario":
                continue
            types = _PARAM_TYPES.get(key)
            if types is None:
                raise FaultSpecError(f"{key}: unknown parameter")
            if not isinstance(value, types) or (bool in types) != isinstance(value, bool):
                raise FaultSpecError(f"{key}: expected {types[0].__name__}")
            number = float(value)
            if key in ("count", "delay_ms", "duration_ms") and number < 0:
                raise FaultSpecError(f"{key}: must be >= 0")
            if key == "probability" and not 0 <= number <= 1:
                raise FaultSpecError("probability: must be within [0, 1]")
            kwargs[key] = value
        if scenario == "invalid_shape" and kwargs.get("rc", RC_INVALID_SHAPE) not in (
            RC_INVALID_SHAPE,
            RC_INVALID_DTYPE,
        ):
            raise FaultSpecError("rc: invalid_shape takes 21 (shape) or 22 (dtype)")
        fault = ArmedFault(scenario=scenario, armed_mono_ns=time.monotonic_ns(), **kwargs)
        self._armed[scenario] = fault
        return fault

    def clear(self, scenario: str | None = None) -> list[str]:
        if scenario is None:
            names = list(self._armed)
            self._armed.clear()
            return names
        return [scenario] if self._armed.pop(scenario, None) else []

    def armed(self) -> list[ArmedFault]:
        return list(self._armed.values())

    def broken(self, scenario: str) -> bool:
        fault = self._armed.get(scenario)
        return fault is not None and fault.broken

    def is_active(self, scenario: str, time_scale: float) -> ArmedFault | None:
        """The armed fault if it is within its window and count, without firing it."""
        fault = self._armed.get(scenario)
        if fault is None or not fault.active(time.monotonic_ns(), time_scale):
            return None
        return fault

    def fire(self, scenario: str, time_scale: float) -> ArmedFault | None:
        """The armed fault if it fires now (consuming one count), else None."""
        fault = self.is_active(scenario, time_scale)
        if fault is None or self._rng.random() >= fault.probability:
            return None
        fault.fired += 1
        if fault.count is not None:
            fault.count -= 1
        return fault
