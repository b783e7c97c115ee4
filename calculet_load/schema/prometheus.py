"""Prometheus text exposition, read: the one parser, and the resource figures (spec §13)
a target's `/metrics` gives (`ResourceRow` fields by metric name). Pure: text in, numbers
out; the sampler (calculet_load.target.resources) and the analysis both use it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

__all__ = [
    "FLOAT_FIELDS",
    "METRIC_NAMES",
    "chip_gauges",
    "device_sample",
    "parse_exposition",
    "parse_metrics",
    "resource_fields",
    "samples",
]

# ResourceRow field -> Prometheus series (first present wins; chip series are summed).
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "rss_bytes": ("calculet_process_rss_bytes", "process_resident_memory_bytes"),
    "fds": ("calculet_process_open_fds", "process_open_fds"),
    "threads": ("calculet_process_threads",),
    "kv_allocated_tokens": ("calculet_kv_allocated_tokens",),
    "kv_quarantined_tokens": ("calculet_kv_quarantined_tokens",),
    "leases": ("calculet_buffer_pool_leased",),
    "leases_free": ("calculet_buffer_pool_free",),
    "leases_total": ("calculet_buffer_pool_total",),
    "device_memory_mib": ("calculet_chip_memory_used_mib",),
    "sequences_active": ("calculet_sequences_active",),
    "requests_queued": ("calculet_requests_queued",),
    "time_scale": ("calculet_sim_time_scale",),
    "kv_free_blocks": ("calculet_kv_free_blocks",),
    "kv_largest_free_extent_tokens": ("calculet_kv_largest_free_extent_tokens",),
}
FLOAT_FIELDS = {"device_memory_mib", "time_scale"}


def samples(text: str) -> Iterator[tuple[str, float | None]]:
    """Every sample of a Prometheus text (or OpenMetrics) exposition, in order: the series
    as written (`name{labels}`) and its value; a timestamp after the value is ignored,
    NaN and ±Inf are None, comments and lines that do not parse are passed over."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        # a label value may hold spaces; the value never holds a '}'
        end = line.rfind("}") + 1 if brace != -1 and (space == -1 or brace < space) else space
        if end <= 0:
            continue
        fields = line[end:].split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        yield line[:end], value if math.isfinite(value) else None


def parse_exposition(text: str, *, buckets: bool = True) -> dict[str, float | None]:
    """Every sample of an exposition: series -> value (`samples`). `buckets=False` leaves
    out `*_bucket` series."""
    return {
        series: value
        for series, value in samples(text)
        if buckets or not series.split("{", 1)[0].endswith("_bucket")
    }


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition → {metric name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for series, value in samples(text):
        if value is not None:
            name = series.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + value
    return out


def resource_fields(metrics: dict[str, float]) -> dict[str, Any]:
    """ResourceRow fields from parsed /metrics (METRIC_NAMES: the first name present)."""
    values: dict[str, Any] = {}
    for field, names in METRIC_NAMES.items():
        found = next((metrics[n] for n in names if n in metrics), None)
        if found is not None:
            values[field] = found if field in FLOAT_FIELDS else int(found)
    return values


def chip_gauges(text: str) -> dict[str, list[float]]:
    """The §10.3 chip gauges of Prometheus text, each a list over the chips."""
    from prometheus_client.parser import text_string_to_metric_families

    keys = ("temperature_c", "power_w", "frequency_mhz", "throttled")
    values: dict[str, list[float]] = {k: [] for k in keys}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name.removeprefix("calculet_chip_")
            if key in values:
                values[key].append(float(sample.value))
    return values


def device_sample(text: str) -> tuple[float, float, float] | None:
    """(hottest chip C, total power W, lowest frequency MHz) from Prometheus text."""
    values = chip_gauges(text)
    if not (values["temperature_c"] and values["power_w"] and values["frequency_mhz"]):
        return None
    return max(values["temperature_c"]), sum(values["power_w"]), min(values["frequency_mhz"])
