"""Prometheus exposition of the simulator: the runtime counters of spec §10.2 and the
process figures of §10.3, read from the engine at scrape time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psutil
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from calculet_sim.engine import Engine

_SEQ_BUCKETS = (16, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 40960)
_MS_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)


class _EngineCollector(Collector):
    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.proc = psutil.Process(os.getpid())

    def collect(self) -> Iterator[Metric]:
        e = self.eng
        sched = e.p.scheduling
        gauges = {
            "calculet_jobs_in_flight": ("Device jobs submitted and not finished", e.left_jobs),
            "calculet_jobs_pending": ("Jobs prepared and waiting for the device", e.pending_jobs),
            "calculet_requests_queued": ("Requests waiting for admission", len(e.waiting)),
            "calculet_sequences_active": ("Admitted sequences", len(e.active)),
            "calculet_slots_in_use": ("Slots held", e.slots_in_use),
            "calculet_kv_allocated_tokens": ("KV tokens reserved", e.kv_allocated),
            "calculet_kv_free_tokens": ("KV tokens free", e.kv_free()),
            "calculet_kv_quarantined_tokens": ("KV tokens quarantined", e.kv_quarantined),
            "calculet_buffer_pool_total": ("OutputBuf leases in the pool", sched.buffer_pool_size),
            "calculet_buffer_pool_free": ("OutputBuf leases free", e.free_leases()),
            "calculet_buffer_pool_leased": ("OutputBuf leases held", len(e.leases)),
            "calculet_buffer_pool_quarantine": (
                "OutputBuf leases quarantined",
                e.leases_quarantined,
            ),
            "calculet_generation": ("Model generation", e.generation),
            "calculet_prefix_cache_tokens": ("Tokens held by the prefix cache", e.cache.tokens),
            "calculet_prefix_cache_capacity_tokens": (
                "Prefix cache capacity (0: the cache is off)",
                e.cache.capacity_tokens if e.p.prefix_cache.enabled else 0,
            ),
            # a rehearsal's clock: real seconds per simulated second (the harness turns
            # resource slopes into per-hour-of-server-time with it)
            "calculet_sim_time_scale": ("Simulator time scale", e.p.time_scale),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        state = GaugeMetricFamily(
            "calculet_state", "Lifecycle state (1 = current)", labels=["state"]
        )
        for s in ("ready", "recovering", "resetting", "loading", "draining", "failed", "stopped"):
            state.add_metric([s], 1.0 if e.state == s else 0.0)
        yield state
        counters = {
            "calculet_jobs_finished": ("Device jobs finished", e.finished_jobs),
            "calculet_resets": ("Device resets", e.reset_count),
            "calculet_generation_changes": ("Generation changes", e.generation_changes),
            "calculet_kv_waits": ("Admission attempts that waited for KV", e.kv_waits),
            "calculet_kv_rejects": ("Requests refused for want of KV", e.kv_rejects),
            "calculet_buffer_pool_waits": (
                "Admission attempts that waited for an OutputBuf lease",
                e.buffer_waits,
            ),
            "calculet_ccu_exceptions": ("CCU exceptions", e.counters["ccu_exception"]),
            "calculet_runtime_timeouts": ("Wait timeouts (rc=13)", e.counters["runtime_rc13"]),
            "calculet_runtime_busy": ("DeviceBusy (rc=17)", e.counters["runtime_rc17"]),
            "calculet_runtime_unavailable": (
                "DeviceUnavailable (rc=18)",
                e.counters["runtime_rc18"],
            ),
            "calculet_requests_finished": ("Requests finished", e.counters["finished"]),
            # as vLLM's prefix_cache_queries and prefix_cache_hits: tokens, not requests
            "calculet_prefix_cache_queried_tokens": (
                "Prompt tokens looked up in the prefix cache",
                e.cache.queried_tokens,
            ),
            "calculet_prefix_cache_hit_tokens": (
                "Prompt tokens served from the prefix cache",
                e.cache.hit_tokens,
            ),
            "calculet_prefix_cache_evicted_blocks": (
                "Prefix cache blocks evicted",
                e.cache.evicted_blocks,
            ),
            "calculet_requests_cancelled": (
                "Requests cancelled by the client",
                e.counters["cancelled"],
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        rej = CounterMetricFamily(
            "calculet_requests_rejected", "Rejected requests", labels=["reason"]
        )
        rej.add_metric(["queue_full"], e.counters["rejected_queue_full"])
        rej.add_metric(["admission_timeout"], e.counters["rejected_admission_timeout"])
        yield rej
        with self.proc.oneshot():
            mem = self.proc.memory_info()
            cpu = self.proc.cpu_times()
            yield GaugeMetricFamily("calculet_process_rss_bytes", "Server RSS", value=mem.rss)
            yield GaugeMetricFamily(
                "calculet_process_threads", "Server threads", value=self.proc.num_threads()
            )
            yield GaugeMetricFamily(
                "calculet_process_open_fds", "Server open FDs", value=self.proc.num_fds()
            )
            yield CounterMetricFamily(
                "calculet_process_cpu_seconds", "Server CPU time", value=cpu.user + cpu.system
            )
        chips = e.device.samples(e.kv_allocated)
        for field, doc in (
            ("temperature_c", "Chip temperature (C)"),
            ("power_w", "Chip power (W)"),
            ("frequency_mhz", "Chip frequency (MHz)"),
            ("memory_used_mib", "Device memory used (MiB)"),
        ):
            fam = GaugeMetricFamily(f"calculet_chip_{field}", doc, labels=["chip"])
            for c in chips:
                value = getattr(c, field)
                if value is not None:  # unreadable: the series is absent, never 0
                    fam.add_metric([str(c.chip)], float(value))
            yield fam
        thr = GaugeMetricFamily(
            "calculet_chip_throttled", "Chip throttling (1 = yes)", labels=["chip"]
        )
        for c in chips:
            if c.throttled is not None:
                thr.add_metric([str(c.chip)], 1.0 if c.throttled else 0.0)
        yield thr


class SimMetrics:
    def __init__(self, eng: Engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(eng))
        self.phase_ms = Histogram(
            "calculet_runtime_phase_ms",
            "Runtime phase durations: h2d, infer (device Wait), d2h",
            ["phase", "kind"],
            buckets=_MS_BUCKETS,
            registry=self.registry,
        )
        self.seq_len = Histogram(
            "calculet_sequence_length_tokens",
            "Prompt + output tokens of finished sequences",
            buckets=_SEQ_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
