"""Spec §10 and §17 fields: slot and admission waits apart from the
queue, jobs left on the device, and the vendor's counters (`server/vendor.jsonl`,
`calculet-load schema vendor`) joined to the records by request id as steps are; and
without that file, every section that would need it says "graph/service level only
(§17)". The old CSV (§1) as a trend line, marked non-authoritative."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from analysis.analyze import analyze, write_outputs
from analysis.legacy import import_legacy
from analysis.report import write_report
from analysis.tables.join import load_run
from analysis.tables.vendor import GRAPH_SERVICE_ONLY
from calculet_drivers.cli import main
from tests.analysis.test_report import Page
from tests.support.runs import MS, WALL0, RunBuilder, device_row, request, server_chain, step_row

SENTENCE = "graph/service level only (§17)"


def _event(name: str, rid: str, mono: int) -> dict[str, Any]:
    return {"wall_ns": WALL0 + mono, "mono_ns": mono, "event": name, "request_id": rid,
            "job_id": None, "seq_id": 1, "step_index": None, "kind": None, "generation": 1,
            "detail": None}  # fmt: skip


def _op(rid: str | None, chip: int, op: str, cycles: int, **kw: Any) -> dict[str, Any]:
    return {"wall_ns": WALL0, "mono_ns": 0, "kind": "op", "chip": chip, "request_id": rid,
            "job_id": 1, "step": 0, "op": op, "cycles": cycles, "d2d_bytes": kw.get("d2d"),
            "ddr_bytes": kw.get("ddr"), "pcie_bytes": kw.get("pcie"), "sram_used_kib": None,
            "sram_total_kib": None}  # fmt: skip


def _chip(chip: int, mono: int, sram: float) -> dict[str, Any]:
    return {"wall_ns": WALL0 + mono, "mono_ns": mono, "kind": "chip", "chip": chip,
            "sram_used_kib": sram, "sram_total_kib": 4096.0}  # fmt: skip


VENDOR_ROWS = [
    # r000: 2 ops on chip 0, 1 on chip 1
    _op("r000", 0, "matmul", 1000, d2d=10, ddr=100, pcie=1),
    _op("r000", 0, "softmax", 200, ddr=20),
    _op("r000", 1, "matmul", 3000, d2d=30, ddr=300, pcie=3),
    # r001: one op
    _op("r001", 0, "matmul", 500, ddr=50),
    # a row of no request: counted per op and per chip, joined to nothing
    _op(None, 1, "allreduce", 700, d2d=70),
    _chip(0, 1 * MS, 1024.0),
    _chip(0, 2 * MS, 2048.0),
    _chip(0, 3 * MS, 512.0),
]


def _run(root: Path, *, vendor: bool) -> str:
    """Four requests with server chains whose slot and admission waits are known."""
    b = RunBuilder(root)
    for i in range(4):
        rid = f"r{i:03d}"
        t0 = i * 300 * MS
        b.add(request(rid, t0=t0, cell="p16-o5"))
        a = t0 + 1 * MS
        chain = server_chain(rid, accepted=a, steps=[(a + 9 * MS, a + 30 * MS, a + 31 * MS)])
        # accepted a, slot_assigned a + 2 ms (slot wait 2), admitted a + 7 ms (admission
        # wait 5), job_prepared a + 9 ms (queue 9 = 2 + 5 + 2 waiting for the job)
        chain[1:1] = [_event("slot_assigned", rid, a + 2 * MS),
                      _event("admitted", rid, a + 7 * MS)]  # fmt: skip
        b.trace("server_events", chain)
        b.trace("steps", [step_row(rid, 0, h2d=0.1, wait=20.0, d2h=0.1, sampling=0.2)])
    b.trace("device", [device_row(j * 100 * MS, (40.0, 41.0)) for j in range(15)])
    if vendor:
        b.trace("vendor", VENDOR_ROWS)
    b.complete_index()
    return b.write()


def test_the_vendor_schema_is_declared_and_the_rows_of_this_test_follow_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["schema", "vendor"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "calculet-vendor-trace/v1"
    assert {"request_id", "chip", "op", "cycles", "d2d_bytes", "ddr_bytes", "pcie_bytes",
            "sram_used_kib"} <= set(schema["properties"])  # fmt: skip
    for row in VENDOR_ROWS:
        jsonschema.validate(row, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**VENDOR_ROWS[0], "cycles": "many"}, schema)


def test_a_vendor_trace_joins_by_request_id_like_steps(tmp_path: Path) -> None:
    run = _run(tmp_path, vendor=True)
    t = load_run(run).requests
    by = dict(zip(t.column("request_id").to_pylist(), range(t.num_rows), strict=True))
    cycles = t.column("vendor.cycles").to_pylist()
    ddr = t.column("vendor.ddr_bytes").to_pylist()
    pcie = t.column("vendor.pcie_bytes").to_pylist()
    assert cycles[by["r000"]] == 1000 + 200 + 3000
    assert ddr[by["r000"]] == 100 + 20 + 300
    assert pcie[by["r000"]] == 1 + 3
    assert (cycles[by["r001"]], ddr[by["r001"]], pcie[by["r001"]]) == (500, 50, None)
    assert cycles[by["r002"]] is None  # no vendor row: null, never 0

    result = analyze(run)
    write_outputs(result, run)
    v = result.document["vendor"]
    assert v["present"] and v["joined_records"] == 2 and v["op_rows"] == 5
    assert v["totals"]["cycles"] == 1000 + 200 + 3000 + 500 + 700
    assert [o["op"] for o in v["ops"]] == ["matmul", "allreduce", "softmax"]
    assert v["ops"][0]["cycles"] == 4500
    assert v["ops"][0]["cycles_share"] == pytest.approx(4500 / 5400)
    chips = {c["chip"]: c for c in v["chips"]}
    assert chips[0]["cycles"] == 1700 and chips[1]["cycles"] == 3700
    assert (chips[0]["sram_used_kib_max"], chips[0]["sram_used_kib_last"]) == (2048.0, 512.0)
    assert chips[1]["sram_used_kib_max"] is None  # chip 1 sent no chip sample

    page = Page(Path(write_report(run)).read_text())
    ops = page.tables["vendor_ops"]
    assert ops[0][:3] == ["matmul", "3", "4,500"]
    cells = page.tables["vendor_cells"]
    assert cells[0][1] == "2"  # two requests of the cell have vendor rows
    assert SENTENCE not in page.sections["vendor"]
    assert SENTENCE not in page.sections["slowest"] and SENTENCE not in page.sections["device"]
    slowest = {r[1]: r for r in page.tables["slowest"]}
    assert slowest["r000"][-2] == "4,200"  # vendor cycles of the request


def test_without_a_vendor_trace_every_section_that_needs_it_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert GRAPH_SERVICE_ONLY == SENTENCE
    run = _run(tmp_path, vendor=False)
    assert main(["analyze", run]) == 0
    out = capsys.readouterr().out
    assert f"no vendor trace: {SENTENCE}" in out
    doc = json.loads((Path(run) / "verdict.json").read_text())
    assert doc["vendor"]["present"] is False and SENTENCE in doc["vendor"]["note"]
    assert main(["report", run]) == 0
    page = Page((Path(run) / "report.html").read_text())
    for section in ("vendor", "slowest", "device"):
        assert SENTENCE in page.sections[section], section
    assert "vendor_ops" not in page.tables


def test_slot_and_admission_waits_are_apart_from_the_queue(tmp_path: Path) -> None:
    run = _run(tmp_path, vendor=False)
    t = load_run(run).requests
    assert np.allclose(t.column("join.slot_wait_ms").to_numpy(), 2.0)
    assert np.allclose(t.column("join.admission_wait_ms").to_numpy(), 5.0)
    assert np.allclose(t.column("server_ms.queue").to_numpy(), 9.0)
    result = analyze(run)
    write_outputs(result, run)
    [cell] = [c for c in result.document["cells"] if c["partition"] == "measured"]
    assert cell["p50_ms"]["slot_wait_ms"] == pytest.approx(2.0)
    assert cell["p50_ms"]["admission_wait_ms"] == pytest.approx(5.0)
    assert cell["p50_ms"]["server_queue_ms"] == pytest.approx(9.0)
    page = Page(Path(write_report(run)).read_text())
    row = page.tables["slowest"][0]
    assert row[8:11] == ["9.000", "2.000", "5.000"]  # queue, slot wait, admission wait


def test_jobs_left_on_the_device_are_drawn(tmp_path: Path) -> None:
    run = _run(tmp_path, vendor=False)
    write_outputs(analyze(run), run)
    html = Path(write_report(run)).read_text()
    assert "jobs left on device" in html and "jobs pending" in html


def test_the_legacy_csv_is_a_trend_line_marked_non_authoritative(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "run", vendor=False)
    write_outputs(analyze(run), run)
    csv = tmp_path / "old.csv"
    csv.write_text(
        "model,prompt_n,prompt_ms,predicted_ms,predicted_n\n"
        + "".join(f"deepseek,{p},{p / 10},{100 + i},32\n" for i, p in
                  enumerate((16, 16, 128, 128, 512)))
    )  # fmt: skip
    legacy = str(tmp_path / "legacy")
    import_legacy(csv, legacy)
    assert main(["report", run, "--legacy", legacy, "--out", str(tmp_path / "r.html")]) == 0
    page = Page((tmp_path / "r.html").read_text())
    text = page.sections["legacy"]
    assert "NON-AUTHORITATIVE" in text and "trend reference only (spec §1)" in text
    assert "old.csv" in text
    assert "legacy 'TTFT' p50 (non-authoritative)" in (tmp_path / "r.html").read_text()
    # nothing of it is judged: the verdict is the run's own
    assert "legacy" not in json.loads((Path(run) / "verdict.json").read_text())
    # without --legacy the section is not there
    assert "legacy" not in Page(Path(write_report(run)).read_text()).sections
