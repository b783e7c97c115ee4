"""Trace files (DESIGN §3.2): schema-valid rows, the §2.3 chain, device telemetry, HTTP
collection."""

from __future__ import annotations

import itertools
import json
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import jsonschema
from prometheus_client.parser import text_string_to_metric_families

from calculet_load.schema import (
    AuditRow,
    ChipSample,
    DeviceRow,
    ServerEvent,
    ServerEventRow,
    StepRow,
    json_schema,
    row_to_dict,
)
from calculet_sim.traces import row_dict
from tests.support.simhelpers import CHAT, LLAMA, by_request, llama, parallel, prompt_ids
from tests.support.simproc import SimProcess

StartSim = Callable[..., SimProcess]
CHAIN = [
    "accepted", "slot_assigned", "admitted", "job_prepared", "submit_start", "submit_ok",
    "wait_done", "logits_ready", "sampled", "token_flushed",
]  # fmt: skip
STEP_CHAIN = CHAIN[3:]
SPEC_STEP_FIELDS = {
    "request_id", "job_id", "seq_id", "kind", "step", "queue_ms", "prepare_ms", "h2d_ms",
    "device_wait_ms", "d2h_ms", "bf16_ms", "sampling_ms", "engine", "kv_before", "kv_after",
    "output_status",
}  # fmt: skip
ROW_TYPES = {
    "server_events": ServerEventRow,
    "steps": StepRow,
    "device": DeviceRow,
    "audit": AuditRow,
}


def _file_rows(sim: SimProcess, kind: str) -> list[dict[str, Any]]:
    text = (sim.trace_dir / f"{kind}.jsonl").read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n")  # whole lines only
    return [json.loads(line) for line in text.splitlines()]


def test_every_row_validates_against_its_schema(start_sim: StartSim) -> None:
    sim = start_sim(
        "--time-scale", "0.01", "--set", "scheduling.slots=1", "--set", "scheduling.queue_max=1",
        faults=True,
    )  # fmt: skip
    parallel(lambda i: sim.request("POST", LLAMA, {"prompt": prompt_ids(20, i),
                                                   "n_predict": 30}), 4)  # fmt: skip
    sim.stream(CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                      "stream": True}, stop_after_events=2)  # fmt: skip
    sim.state()
    sim.request("GET", "/admin/state", headers={"Authorization": "Bearer wrong-token-xyz"})
    time.sleep(0.05)  # a few device rows
    sim.stop()  # closes (and flushes) every file
    counts = {}
    for kind, row_type in ROW_TYPES.items():
        schema = json_schema(row_type)
        validator = jsonschema.Draft202012Validator(schema)
        rows = _file_rows(sim, kind)
        counts[kind] = len(rows)
        for row in rows:
            errors = [e.message for e in validator.iter_errors(row)]
            assert not errors, (kind, row, errors)
            assert set(row) == set(schema["properties"]), (kind, sorted(row))
    assert counts["server_events"] > 100 and counts["steps"] >= 30
    assert counts["device"] >= 3 and counts["audit"] == 2
    events = {r["event"] for r in _file_rows(sim, "server_events")}
    assert {"rejected", "finished", "state_change"} <= events
    steps = _file_rows(sim, "steps")
    assert all(set(r) - {"wall_ns", "mono_ns"} == SPEC_STEP_FIELDS for r in steps)


def test_event_chain_in_order(fast_sim: SimProcess) -> None:
    rid = "chain-1"
    llama(fast_sim, prompt_ids(30), 4, rid=rid)
    rows = by_request(fast_sim.traces("server_events"))[rid]
    monos = [r["mono_ns"] for r in rows]
    assert monos == sorted(monos)
    names = [r["event"] for r in rows]
    firsts = [names.index(e) for e in CHAIN]
    assert firsts == sorted(firsts), names
    assert names[0] == "accepted" and names.count("finished") == 1
    for step in range(4):
        chain = [r["event"] for r in rows if r["step_index"] == step and r["event"] in CHAIN]
        assert chain == STEP_CHAIN, (step, chain)
        kinds = {r["kind"] for r in rows if r["step_index"] == step and r["kind"]}
        assert kinds == {"prefill" if step == 0 else "decode"}
    steps = [r for r in fast_sim.traces("steps") if r["request_id"] == rid]
    assert [(r["kind"], r["step"]) for r in steps] == [
        ("prefill", 0), ("decode", 1), ("decode", 2), ("decode", 3),
    ]  # fmt: skip
    assert [(r["kv_before"], r["kv_after"]) for r in steps] == [(0, 30), (30, 31), (31, 32),
                                                                (32, 33)]  # fmt: skip
    assert all(r["output_status"] == "done" and r["engine"] == "sync" for r in steps)
    assert all(r["device_wait_ms"] >= 0 and r["queue_ms"] >= 0 for r in steps)


def test_device_rows_every_simulated_second_and_temperature_follows_load(
    start_sim: StartSim,
) -> None:
    sim = start_sim(
        "--time-scale", "0.01",
        "--set", "timing.decode_base_ms=300",  # 3 ms of real device time per step
        "--set", "timing.jitter=0",
    )  # fmt: skip

    def idle_rows() -> list[dict[str, Any]] | None:
        seen = sim.traces("device")
        return seen if len(seen) >= 15 else None

    # ~15 simulated seconds idle, waited for: rows are flushed every 0.2 s and a stalled
    # sampler skips the rows it missed, so a fixed 0.3 s showed about 20 on a quiet machine
    idle = sim.wait_for(idle_rows, what="15 idle device rows")
    llama(sim, prompt_ids(16), 300)  # ~90 simulated seconds of sustained decode
    rows = sim.traces("device")
    loaded = rows[len(idle) :]
    assert len(idle) >= 15 and len(loaded) >= 40
    sim_dt = [b["sim_time_s"] - a["sim_time_s"] for a, b in itertools.pairwise(rows)]
    real_dt = [(b["mono_ns"] - a["mono_ns"]) / 1e6 for a, b in itertools.pairwise(rows)]
    assert 0.9 < statistics.median(sim_dt) < 1.2, sim_dt[:20]
    assert 8 < statistics.median(real_dt) < 13, real_dt[:20]  # 1 simulated s = 10 ms
    assert all(len(r["chips"]) == 2 for r in rows)
    assert [c["chip"] for c in rows[0]["chips"]] == [0, 1]
    idle_t = [c["temperature_c"] for c in idle[-1]["chips"]]
    hot_t = [c["temperature_c"] for c in loaded[-1]["chips"]]
    assert all(h > i + 10 for h, i in zip(hot_t, idle_t, strict=True)), (idle_t, hot_t)
    assert hot_t[1] > hot_t[0]  # the downstream chip runs hotter
    assert all(c["power_w"] == 18.0 for c in idle[-1]["chips"])  # idle power
    assert max(c["power_w"] for r in loaded for c in r["chips"]) > 40
    assert max(r["finished_jobs"] for r in loaded) >= 250


def test_unreadable_power_is_null_not_zero(start_sim: StartSim) -> None:
    sim = start_sim("--time-scale", "0.01", "--set", 'device.unreadable=["power_w"]')
    llama(sim, "some load", 20)
    rows = sim.wait_for(lambda: sim.traces("device")[2:], what="device rows")
    for r in rows:
        for c in r["chips"]:
            assert c["power_w"] is None
            assert isinstance(c["temperature_c"], float)
            assert c["frequency_mhz"] == 1200.0
    _, _, raw = sim.request("GET", "/metrics")
    fams = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    assert fams["calculet_chip_power_w"].samples == []
    assert len(fams["calculet_chip_temperature_c"].samples) == 2


def test_traces_collected_incrementally_over_http(fast_sim: SimProcess) -> None:
    llama(fast_sim, "first batch", 3, rid="inc-1")
    status, headers, first = fast_sim.request("GET", "/traces/server_events")
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    offset = int(headers["x-next-offset"])
    assert offset == len(first) and first.endswith(b"\n")
    llama(fast_sim, "second batch", 3, rid="inc-2")
    status, headers, second = fast_sim.request("GET", f"/traces/server_events?offset={offset}")
    assert status == 200 and second.endswith(b"\n")
    new_rows = [json.loads(x) for x in second.splitlines()]
    assert {r["request_id"] for r in new_rows if r["request_id"]} == {"inc-2"}
    assert "inc-2" not in first.decode()
    nxt = int(headers["x-next-offset"])
    assert nxt == offset + len(second)
    status, headers, empty = fast_sim.request("GET", f"/traces/server_events?offset={nxt}")
    assert status == 200 and empty == b"" and int(headers["x-next-offset"]) == nxt
    whole = (fast_sim.trace_dir / "server_events.jsonl").read_bytes()
    assert whole.startswith(first + second)


def test_cancelled_stream_is_traced(fast_sim: SimProcess) -> None:
    rid = "cancel-me"
    body = {"prompt": "go on", "n_predict": 5000, "stream": True, "ignore_eos": True}
    data = json.dumps(body).encode()
    sock = socket.create_connection((fast_sim.host, fast_sim.port))
    sock.sendall(
        f"POST {LLAMA} HTTP/1.1\r\nHost: x\r\nX-Request-Id: {rid}\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    got = b""
    while b"data: " not in got:  # tokens are flowing
        got += sock.recv(4096)
    sock.close()

    def cancelled() -> list[dict[str, Any]]:
        rows = by_request(fast_sim.traces("server_events")).get(rid, [])
        return [r for r in rows if r["event"] == "cancelled"]

    rows = fast_sim.wait_for(cancelled, what="cancelled event")
    assert rows[-1]["detail"]["where"] in ("between_steps", "submitted")
    steps = [r for r in fast_sim.traces("steps") if r["request_id"] == rid]
    assert 1 <= len(steps) < 5000


def test_fast_row_serializer_matches_the_schema_module() -> None:
    rows = [
        ServerEventRow(wall_ns=1, mono_ns=2, event=ServerEvent.SAMPLED, request_id="r",
                       job_id=3, seq_id=4, step_index=5, kind="decode", generation=1,
                       detail={"rc": 13, "nested": [1, 2]}),
        StepRow(wall_ns=1, mono_ns=2, request_id="r", job_id=3, seq_id=4, kind="prefill",
                step=0, queue_ms=0.1, prepare_ms=0.2, h2d_ms=0.3, device_wait_ms=0.4,
                d2h_ms=0.5, bf16_ms=0.6, sampling_ms=0.7, engine="sync", kv_before=0,
                kv_after=9, output_status="done"),
        DeviceRow(wall_ns=1, mono_ns=2, chips=[ChipSample(0, 40.5, None, 1200.0, 1.0, 2.0,
                                                          False)],
                  pending_jobs=0, finished_jobs=None, left_jobs=1, reset_count=0),
    ]  # fmt: skip
    for row in rows:
        assert row_dict(row) == row_to_dict(row)
        assert list(row_dict(row)) == list(row_to_dict(row))
