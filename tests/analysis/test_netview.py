"""Spec §5 with a VPN in the path, and the report's clocks-and-network tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from analysis.errors import ArtifactError
from analysis.tables.join import load_run
from analysis.views.network import burst_spreads, bursts_table, master_offsets, network_table
from tests.support.runs import MS, RunBuilder, request

REPO = Path(__file__).resolve().parents[2]


def _round(mean_ms: float, jitter_ms: float, n: int = 8) -> dict[str, Any]:
    return {"n": n, "min_ms": mean_ms - jitter_ms, "p50_ms": mean_ms, "mean_ms": mean_ms,
            "max_ms": mean_ms + jitter_ms, "jitter_ms": jitter_ms}  # fmt: skip


def _worker_entry(**extra: Any) -> dict[str, Any]:
    return {"worker": "w00", "status": "reported", "parts": [], **extra}


TARGET_RTT = {
    "before": {"connect": _round(0.3, 0.05), "health": _round(100.0, 20.0)},
    "during_medians": {"connect": _round(0.3, 0.0, 2), "health": _round(101.0, 1.0, 2)},
    "rounds": [],
}


def _run(tmp_path: Path, vpn: bool, worker: dict[str, Any]) -> str:
    b = RunBuilder(tmp_path).add(request("a", t0=10 * MS)).complete_index()
    assert b.index is not None
    b.index["workers"] = [worker]
    run_dir = b.write()
    manifest = yaml.safe_load((REPO / "configs" / "manifest.sim.yaml").read_text())
    manifest["environment"]["vpn_in_path"] = vpn
    (tmp_path / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    return run_dir


def test_vpn_in_path_without_measured_rtt_is_an_artifact_error(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, True, _worker_entry())
    with pytest.raises(ArtifactError, match=r"environment\.vpn_in_path") as err:
        load_run(run_dir)
    assert err.value.exit_code == 2
    assert "\n" not in str(err.value)


def test_vpn_in_path_with_measured_rtt_loads(tmp_path: Path) -> None:
    run = load_run(_run(tmp_path, True, _worker_entry(target_rtt=TARGET_RTT)))
    assert run.requests.num_rows == 1


def test_no_vpn_needs_no_rtt(tmp_path: Path) -> None:
    assert load_run(_run(tmp_path, False, _worker_entry())).requests.num_rows == 1


def test_network_and_burst_tables_show_what_the_index_recorded() -> None:
    sync = {"master_offset_ns": -200_001_000, "master_rtt_ns": 310_000}
    index = {
        "workers": [
            _worker_entry(master_clock_sync=sync, target_rtt=TARGET_RTT),
            {"worker": "w01", "status": "reported"},  # recorded nothing: no row
        ],
        "bursts": [
            {"id": "r.b0001", "size": 2, "workers_sent": 2, "spread_ms": 0.77},
            {"id": "r.b0002", "size": 2, "workers_sent": 0, "spread_ms": None},  # after stop
        ],
    }
    net = network_table(index)
    assert net is not None
    assert net.rows == (
        ("w00", "-200.001 ms", "0.310 ms", "0.3000 ms", "100.0 ms", "20.00 ms", "101.0 ms", "8"),
    )
    bursts = bursts_table(index)
    assert bursts is not None and bursts.rows == (("r.b0001", "2", "2", "0.7700 ms"),)
    assert network_table({"workers": [{"worker": "w00"}]}) is None
    assert bursts_table({}) is None


def test_burst_spread_from_records_puts_each_send_on_the_masters_clock() -> None:
    # w01's clock runs 200 ms ahead (master − w01 = −200 ms). Burst b1: w00 sends at
    # T and T + 1 ms; w01 at its T + 200.5 ms, i.e. the master's T + 0.5 ms. Spread 1 ms,
    # not 200 ms. Burst b2 is one request: spread 0.
    t = 1_800_000_000_000_000_000
    ids = ["b1", "b1", "b1", "b2", ""]
    workers = ["w00", "w00", "w01", "w01", "w00"]
    anchors = np.array([t, t + MS, t + 200 * MS + MS // 2, t + 5_000 * MS, t], dtype=np.int64)
    offsets = master_offsets({"workers": [_worker_entry(worker="w01", master_clock_sync={
        "master_offset_ns": -200 * MS, "master_rtt_ns": 300_000})]})  # fmt: skip
    assert offsets == {"w01": -200 * MS}
    rows = burst_spreads(ids, workers, anchors, offsets)
    assert rows == [("b1", 3, 2, 1.0), ("b2", 1, 1, 0.0)]
    table = bursts_table({"bursts": []}, rows)  # an accept run: no bursts in the index
    assert table is not None
    assert table.rows == (("b1", "3", "2", "1.000 ms"), ("b2", "1", "1", "0 ms"))
