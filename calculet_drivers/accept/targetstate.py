"""The acceptance run's reads of the target's state: the idle wait before the load (spec
§8.2), the device as each cell starts and ends, and the resources back to idle after
the load (§8 step 7)."""

from __future__ import annotations

import time
from typing import Any

import gevent

from analysis.judge.idle import IdleCheck
from calculet_drivers.accept.acceptrun import AcceptRun
from calculet_drivers.skeleton.steps import StepResult
from calculet_load.errors import EXIT_FAIL, EXIT_INFRA, RunStop
from calculet_load.schema.prometheus import chip_gauges, device_sample

__all__ = ["device_now", "idle", "resources"]

DEVICE_SERIES = ("temperature_c", "power_w", "frequency_mhz")  # device_sample's order


def idle(run: AcceptRun) -> StepResult:
    """Spec §8.2: wait until the device's temperature, power and frequency are stable.

    Samples the target's `/metrics` (spec §10.3 gauges `calculet_chip_temperature_c`,
    `calculet_chip_power_w`, `calculet_chip_frequency_mhz`: the hottest chip, the
    chips summed, the slowest chip) until, over the last window, each series holds
    the rules file's `idle` limits on its range and slope (analysis.judge.idle).
    Still not stable at the time limit: exit 3, naming the series that did not hold."""
    if (lacking := run.lacks("device telemetry")) is not None:
        return lacking
    crit = run.idle
    window, limit = crit.window_s, crit.timeout_s
    run.say(f"idle sampling: waiting for a stable {window:g} s window (at most {limit:g} s)")
    t: list[float] = []
    series: dict[str, list[float]] = {k: [] for k in DEVICE_SERIES}
    started = time.monotonic()
    check: IdleCheck | None = None
    last: list[float] = []
    while check is None or not (check.stable or t[-1] >= limit):
        if t:
            gevent.sleep(min(1.0, max(window / 10, 0.1)))
        try:
            sample = device_sample(run.api.metrics_text())
        except (OSError, ValueError) as exc:
            run.notes.append(f"idle: no device telemetry from /metrics ({exc}); skipped")
            return StepResult.not_available(str(exc), stable=None, window_s=window)
        if sample is None:
            run.notes.append("idle: /metrics has no chip gauges; idle sampling skipped")
            return StepResult.not_available("no chip gauges", stable=None, window_s=window)
        t.append(time.monotonic() - started)
        last = [t[-1], *sample]
        for name, value in zip(DEVICE_SERIES, sample, strict=True):
            series[name].append(value)
        if t[-1] >= window:
            check = crit.check(t, series)
    detail = {"samples": len(t), "waited_s": round(t[-1], 3), "criterion": crit.describe(),
              "last": last, "window_s": window, **check.record()}  # fmt: skip
    run.say(f"idle sampling: {'stable' if check.stable else 'NOT stable'} ({len(t)} samples)")
    if not check.stable:
        reason = (
            f"idle: the device was not stable within {limit:g} s (spec §8.2, rules file "
            f"idle): {'; '.join(check.failing)} over the last {window:g} s"
        )
        run.log.end("idle", StepResult.failed(reason, **detail))
        raise RunStop(EXIT_INFRA, reason)
    return StepResult.ok(**detail)


def device_now(run: AcceptRun) -> dict[str, Any] | None:
    """The device as a cell starts or ends (§8: temperature and throttling per round):
    hottest chip, total power, lowest frequency, throttled chips; None when the target
    has no chip gauges."""
    if not run.target.profile.device_telemetry:
        return None
    try:
        v = chip_gauges(run.api.metrics_text())
    except (OSError, ValueError):
        return None
    if not v["temperature_c"]:
        return None
    return {
        "temperature_c": max(v["temperature_c"]),
        "power_w": sum(v["power_w"]) if v["power_w"] else None,
        "frequency_mhz": min(v["frequency_mhz"]) if v["frequency_mhz"] else None,
        "throttled_chips": int(sum(v["throttled"])),
    }


def resources(run: AcceptRun) -> StepResult:
    """KV, buffer leases and sequences back to their idle values (0) within 30 s of the
    load's end; not, a reliability failure (exit 1)."""
    if (lacking := run.lacks("admin API")) is not None:
        return lacking
    if not run.o.admin_token:
        return StepResult.not_available("no admin token", checked=False)
    deadline = time.monotonic() + 30
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = run.api.state()
        if _busy(state) == (0, 0, 0):
            break
        gevent.sleep(0.5)
    back = _busy(state) == (0, 0, 0)
    detail = {"checked": True, "back_to_baseline": back,
              "kv_allocated": state.get("kv", {}).get("allocated_tokens"),
              "leased": state.get("buffer_pool", {}).get("leased")}  # fmt: skip
    run.say(f"resources back to baseline: {back}")
    if not back:
        run.log.end("resources", StepResult.failed("did not return to idle", **detail))
        raise RunStop(EXIT_FAIL, "resources: KV/leases/sequences did not return to idle")
    return StepResult.ok(**detail)


def _busy(state: dict[str, Any]) -> tuple[Any, Any, Any]:
    return (
        state.get("kv", {}).get("allocated_tokens"),
        state.get("buffer_pool", {}).get("leased"),
        state.get("sequences_active"),
    )
