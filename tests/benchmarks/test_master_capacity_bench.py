"""A smoke of benchmarks/master_capacity.py: one point, a master and 2 light workers.

Checks the machinery, not the figures (those need a quiet machine and their own run):
the probe loaded beside the master counts what the workers send, by type, as Locust's
own intervals say it should arrive (a heartbeat a second and a report every 3 s from
each worker), and the master's CPU and memory are read over the run's steady middle.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.simproc import SimProcess

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_S, REPORT_S = 1.0, 3.0  # locust.runners' HEARTBEAT_INTERVAL, WORKER_REPORT_INTERVAL


def _bench() -> ModuleType:
    path = REPO / "benchmarks" / "master_capacity.py"
    spec = importlib.util.spec_from_file_location("master_capacity", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["master_capacity"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.quiet  # a run of fixed length that must see its reports arrive
def test_one_point_counts_what_the_workers_send(tmp_path: Path) -> None:
    bench = _bench()
    sim = SimProcess(tmp_path, "--profile", "b16", "--time-scale", "0.01")
    try:
        point = bench.run_point(tmp_path, sim.url, 2, 1.0, 20)
    finally:
        sim.stop()
    assert "error" not in point, point
    assert point["span_s"] >= 8, point
    by_type = point["by_type"]
    # two workers: 2 heartbeats a second and 2 reports every 3 s, within a busy
    # machine's slack; nothing else arrives steadily
    assert 2 / HEARTBEAT_S * 0.6 <= by_type["heartbeat"] <= 2 / HEARTBEAT_S * 1.4, by_type
    assert 2 / REPORT_S * 0.5 <= by_type["stats"] <= 2 / REPORT_S * 1.5, by_type
    assert point["messages_s"] == pytest.approx(sum(by_type.values()), abs=0.05)
    # a report carries Locust's statistics and calculet-load's histograms: some KiB,
    # bounded, not a record per request
    assert 200 < point["stats_bytes"] < 64 * 1024, point
    assert 0 < point["cpu_pct"] < 100 and 30 < point["rss_mb"] < 1024, point


def test_the_fit_is_least_squares() -> None:
    bench = _bench()
    a, b = bench.fit([1, 2, 4, 8], [1.5, 2.0, 3.0, 5.0])  # y = 1 + 0.5·x exactly
    assert a == pytest.approx(1.0) and b == pytest.approx(0.5)
