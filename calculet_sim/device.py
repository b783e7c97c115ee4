"""Device telemetry model: two chips whose temperature follows load (spec §4, §10.3).

Power rises with utilisation; temperature relaxes toward ambient + R*power with a time
constant, from the idle equilibrium (a device idle for a while); above the throttle
limit a chip drops to its throttled frequency (steps slow down and the sample is
flagged) until it cools below the release temperature. With `device.power_swing_w` the
power also swings sinusoidally, so the device never settles (an idle that fails spec
§8.2's stability check).
"""

from __future__ import annotations

import math

from calculet_load.schema import ChipSample
from calculet_sim.profile import Device


class Chip:
    __slots__ = ("index", "power_w", "temperature_c", "throttled")

    def __init__(self, index: int, temperature_c: float, idle_power_w: float) -> None:
        self.index = index
        self.temperature_c = temperature_c
        self.power_w = idle_power_w
        self.throttled = False


class DeviceModel:
    """Advances the thermal state by simulated time and reports chip samples."""

    def __init__(self, cfg: Device) -> None:
        self.cfg = cfg
        # each chip starts where a device idle for a while sits: at its idle equilibrium
        self.chips = [
            Chip(i, cfg.ambient_c + self._resistance(i) * cfg.idle_power_w, cfg.idle_power_w)
            for i in range(cfg.chips)
        ]
        self.extra_memory_mib = 0.0
        self._unreadable = set(cfg.unreadable)
        self.sim_time_s = 0.0

    def advance(self, dt_s: float, utilisation: float) -> None:
        cfg = self.cfg
        u = min(max(utilisation, 0.0), 1.0)
        decay = math.exp(-dt_s / cfg.thermal_time_constant_s) if dt_s > 0 else 1.0
        self.sim_time_s += max(dt_s, 0.0)
        phase = 2 * math.pi * self.sim_time_s / cfg.power_swing_period_s
        swing = cfg.power_swing_w * math.sin(phase) if cfg.power_swing_w else 0.0
        for chip in self.chips:
            r = self._resistance(chip.index)
            load_w = cfg.idle_power_w + (cfg.active_power_w - cfg.idle_power_w) * u
            chip.power_w = max(load_w + swing, 0.0)
            target = cfg.ambient_c + r * chip.power_w
            chip.temperature_c = target + (chip.temperature_c - target) * decay
            if chip.temperature_c >= cfg.throttle_temp_c:
                chip.throttled = True
            elif chip.temperature_c <= cfg.throttle_release_c:
                chip.throttled = False

    def _resistance(self, chip: int) -> float:
        """C per W at equilibrium: the second chip sits downstream in the airflow, a
        little hotter."""
        return self.cfg.thermal_resistance_c_per_w * (1.0 + 0.05 * chip)

    @property
    def throttled(self) -> bool:
        return any(c.throttled for c in self.chips)

    def speed_factor(self) -> float:
        """Multiplier on step time: nominal/actual frequency of the slowest chip."""
        if not self.throttled:
            return 1.0
        return self.cfg.nominal_frequency_mhz / self.cfg.throttled_frequency_mhz

    def _readable(self, chip: int, field: str) -> bool:
        return field not in self._unreadable and f"chip{chip}.{field}" not in self._unreadable

    def samples(self, kv_allocated_tokens: int) -> list[ChipSample]:
        cfg = self.cfg
        kv_mib = kv_allocated_tokens * cfg.kv_bytes_per_token / 2**20 / len(self.chips)
        out = []
        for c in self.chips:
            mem = cfg.memory_base_mib + kv_mib + self.extra_memory_mib / len(self.chips)
            freq = cfg.throttled_frequency_mhz if c.throttled else cfg.nominal_frequency_mhz
            values = {
                "temperature_c": round(c.temperature_c, 2),
                "power_w": round(c.power_w, 2),
                "frequency_mhz": freq,
                "memory_used_mib": round(mem, 2),
                "memory_total_mib": cfg.memory_total_mib,
                "throttled": c.throttled,
            }
            shown = {k: (v if self._readable(c.index, k) else None) for k, v in values.items()}
            out.append(ChipSample(chip=c.index, **shown))  # type: ignore[arg-type]
        return out
