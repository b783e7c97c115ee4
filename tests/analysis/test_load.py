"""Loading and joining a run folder: known answers on a hand-written run (analysis.tables.load,
analysis.tables.join)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.errors import ArtifactError
from analysis.tables.join import load_run
from tests.support.runs import MS, RunBuilder, device_row, request, server_chain, step_row

A = 1_002_000_000  # server `accepted` of r1, monotonic ns


def _joined_run(tmp_path: Path) -> str:
    b = RunBuilder(tmp_path)
    # r1: t0 = 1000 ms, TTFT 50 ms, 3 tokens 10 ms apart → t6 = 1070.1 ms, E2E 70.1 ms
    b.add(request("r1", t0=1_000 * MS, n=3))
    b.add(request("r2", t0=400 * MS, n=3, worker="w01"))  # no server trace
    b.add(request("r3", t0=600 * MS, n=3, worker="w01"))  # no server trace
    steps = [
        (A + 5 * MS, A + 45 * MS, A + 46 * MS),  # P0, S0, F0
        (A + 46_500_000, A + 55 * MS, A + 56 * MS),
        (A + 56_500_000, A + 65 * MS, A + 66 * MS),  # SL = A + 65 ms, FL = A + 66 ms
    ]
    b.trace("server_events", server_chain("r1", accepted=A, steps=steps))
    b.trace("server_events", server_chain("other-run", accepted=0, steps=steps))
    b.trace(
        "steps",
        [
            step_row("r1", 0, h2d=0.5, wait=38.0, d2h=0.25, sampling=0.125),
            step_row("r1", 1, h2d=0.25, wait=8.0, d2h=0.125, sampling=0.0625),
            step_row("r1", 2, h2d=0.25, wait=8.0, d2h=0.125, sampling=0.0625),
        ],
    )
    b.trace(
        "device",
        [
            device_row(500 * MS, (40.0, 41.0)),
            device_row(1_000 * MS, (50.0, 55.0), throttled=True),
            device_row(1_500 * MS, (45.0, None), power=None),
        ],
    )
    return b.write()


def _row(run_dir: str, rid: str) -> dict[str, Any]:
    t = load_run(run_dir).requests
    rows: list[dict[str, Any]] = [r for r in t.to_pylist() if r["request_id"] == rid]
    assert len(rows) == 1
    return rows[0]


def test_server_breakdown_known_answer(tmp_path: Path) -> None:
    r = _row(_joined_run(tmp_path), "r1")
    assert r["quality.server_trace_joined"] is True
    assert r["server_ms.queue"] == pytest.approx(5.0)  # P0 − A = 5 ms
    assert r["server_ms.prefill"] == pytest.approx(40.0)  # S0 − P0 = 45 − 5
    assert r["server_ms.decode_total"] == pytest.approx(19.0)  # SL − F0 = 65 − 46
    assert r["server_ms.postprocess"] == pytest.approx(2.0)  # (46 − 45) + (66 − 65)
    assert r["join.server_span_ms"] == pytest.approx(66.0)  # FL − A
    assert r["join.server_steps"] == 3
    # TTFT 50 − (F0 − A = 46) = 4 ms; E2E 70.1 − 66 = 4.1 ms: never folded into a phase
    assert r["join.unattributed_ttft_ms"] == pytest.approx(4.0)
    assert r["join.unattributed_e2e_ms"] == pytest.approx(4.1)
    assert r["durations_ms.ttft"] == pytest.approx(
        r["server_ms.queue"] + r["server_ms.prefill"] + 1.0 + r["join.unattributed_ttft_ms"]
    )


def test_runtime_phases_are_summed_per_kind(tmp_path: Path) -> None:
    r = _row(_joined_run(tmp_path), "r1")
    assert r["runtime_ms.h2d_prefill"] == 0.5
    assert r["runtime_ms.infer_prefill"] == 38.0
    assert r["runtime_ms.d2h_prefill"] == 0.25
    assert r["runtime_ms.h2d_decode"] == 0.5  # 0.25 + 0.25
    assert r["runtime_ms.infer_decode"] == 16.0  # 8 + 8
    assert r["runtime_ms.d2h_decode"] == 0.25
    assert r["server_ms.sampling"] == 0.25  # 0.125 + 0.0625 + 0.0625


def test_device_as_of_join(tmp_path: Path) -> None:
    run_dir = _joined_run(tmp_path)
    # r1 starts at the server's `accepted` (1.002 s): as-of row 1.0 s: hottest 55 °C,
    # power 2 × 20 W, chip 0 throttled at 800 MHz
    r1 = _row(run_dir, "r1")
    assert r1["device.temperature_c_max"] == 55.0
    assert r1["device.power_w_total"] == 40.0
    assert r1["device.frequency_mhz_min"] == 800.0
    assert r1["device.throttled"] is True
    assert r1["quality.throttled"] is True
    # r3 (client wall 0.6 s → 0.6901 s): row 0.5 s only, not throttled
    r3 = _row(run_dir, "r3")
    assert r3["device.temperature_c_max"] == 41.0
    assert r3["device.throttled"] is False
    # r2 starts at 0.4 s, before the first device row: no data, never 0
    r2 = _row(run_dir, "r2")
    assert r2["device.temperature_c_max"] is None
    assert r2["device.throttled"] is None
    assert r2["quality.throttled"] is False


def test_record_without_server_trace_is_kept_and_flagged(tmp_path: Path) -> None:
    run = load_run(_joined_run(tmp_path))
    assert run.requests.num_rows == 3  # both workers' parts
    r2 = next(r for r in run.requests.to_pylist() if r["request_id"] == "r2")
    assert r2["quality.server_trace_joined"] is False
    assert r2["server_ms.queue"] is None
    assert r2["join.unattributed_ttft_ms"] is None
    assert "2 of 3 records have no server trace (kept, flagged)" in run.notes


def test_unreadable_power_is_null_not_zero(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path).add(request("r", t0=1_600 * MS))
    b.trace("device", [device_row(1_500 * MS, (45.0, None), power=None)])
    r = _row(b.write(), "r")
    assert r["device.power_w_total"] is None
    assert r["device.temperature_c_max"] == 45.0


def test_no_traces_at_all(tmp_path: Path) -> None:
    run = load_run(RunBuilder(tmp_path).add(request("r", t0=0)).write())
    assert run.requests.column("quality.server_trace_joined").to_pylist() == [False]
    assert any("no server/server_events.jsonl" in n for n in run.notes)


def test_corrupt_part_names_the_file(tmp_path: Path) -> None:
    run_dir = RunBuilder(tmp_path).add(request("a", t0=0)).add(request("b", t0=MS)).write()
    part = tmp_path / "client" / "w00" / "part-00002.requests.parquet"
    part.write_bytes(part.read_bytes()[:40])
    with pytest.raises(ArtifactError, match=r"part-00002\.requests\.parquet: unreadable Parquet"):
        load_run(run_dir)


def test_newer_part_schema_is_refused(tmp_path: Path) -> None:
    run_dir = RunBuilder(tmp_path).add(request("a", t0=0)).add(request("b", t0=MS)).write()
    part = tmp_path / "client" / "w00" / "part-00001.requests.parquet"
    t = pq.read_table(part)
    pq.write_table(t.replace_schema_metadata({"schema": "calculet-perf-request/v9"}), part)
    with pytest.raises(ArtifactError, match=r"part-00001\.requests\.parquet: .*newer"):
        load_run(run_dir)


def test_part_listed_in_the_index_but_missing(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path).add(request("a", t0=0)).complete_index()
    assert b.index is not None
    b.index["workers"][0]["parts"] = ["part-00001.requests.parquet", "part-00007.tokens.parquet"]
    with pytest.raises(ArtifactError, match=r"part-00007\.tokens\.parquet: listed in client/index"):
        load_run(b.write())


def test_newer_index_schema_is_refused(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path).add(request("a", t0=0)).complete_index()
    assert b.index is not None
    b.index["schema"] = "calculet-client-index/v2"
    with pytest.raises(ArtifactError, match=r"index\.json: .*newer"):
        load_run(b.write())


def test_partial_last_trace_line_is_ignored_with_a_note(tmp_path: Path) -> None:
    run_dir = _joined_run(tmp_path)
    path = tmp_path / "server" / "server_events.jsonl"
    path.write_text(path.read_text() + '{"wall_ns": 1, "mono_')
    run = load_run(run_dir)
    assert any("partial last line" in n for n in run.notes)
    r1 = next(r for r in run.requests.to_pylist() if r["request_id"] == "r1")
    assert r1["server_ms.queue"] == pytest.approx(5.0)


def test_invalid_trace_line_is_an_artifact_error(tmp_path: Path) -> None:
    run_dir = _joined_run(tmp_path)
    path = tmp_path / "server" / "steps.jsonl"
    path.write_text("not json\n" + path.read_text())
    with pytest.raises(ArtifactError, match=r"steps\.jsonl: not valid JSON lines"):
        load_run(run_dir)


def test_no_records_is_an_artifact_error(tmp_path: Path) -> None:
    (tmp_path / "client").mkdir()
    with pytest.raises(ArtifactError, match=r"no request records"):
        load_run(str(tmp_path))


def test_host_offsets_move_client_wall_times(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path).add(request("a", t0=2_000 * MS)).complete_index()
    assert b.index is not None
    # this host's wall clock runs 0.7 s fast: reference − local = −0.7 s (schema.clocks)
    b.index["workers"][0]["ntp_offset_ns"] = -700 * MS
    b.trace("device", [device_row(1_000 * MS, (30.0,)), device_row(1_500 * MS, (60.0,))])
    run_dir = b.write()
    (tmp_path / "server" / "clock.json").write_text(json.dumps({"ntp_offset_ns": 0}))
    r = load_run(run_dir).requests.to_pylist()[0]
    # wall 2.0 s − 0.7 s = 1.3 s on the device's clock → as-of row 1.0 s (30 °C), not 1.5 s
    assert r["join.wall_start_ns"] == 1_700_000_000_000_000_000 + 1_300 * MS
    assert r["device.temperature_c_max"] == 30.0


def test_uri_run_folder(tmp_path: Path) -> None:
    run_dir = _joined_run(tmp_path)
    run = load_run(f"file://{run_dir}")
    assert run.requests.num_rows == 3
    assert isinstance(run.requests, pa.Table)


def test_a_stale_device_row_is_no_data(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path).add(request("r", t0=5_000 * MS))
    # one row (interval taken as 1 s: tolerance 2.5 s), 4.5 s before the request
    b.trace("device", [device_row(500 * MS, (90.0,), throttled=True)])
    r = _row(b.write(), "r")
    assert r["device.temperature_c_max"] is None
    assert r["device.throttled"] is None
    assert r["quality.throttled"] is False
