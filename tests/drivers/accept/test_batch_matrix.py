"""Spec §7 batch matrices: B4/B8/B16 each at active lanes 1..B, the vendor's
partial-lane statement required at release, and a time-scaled B4 run end to end.

The release refusals and the run are against a real B4 simulator (tests.support.simproc), with
the helpers of tests/support/acceptkit.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.analyze import analyze
from analysis.report import load_view
from analysis.views.loadcurves import batch_section
from calculet_drivers.cli import main
from calculet_load.measure.heap import PACER
from calculet_load.schema.manifest import ManifestError, load_manifest, parse_manifest
from calculet_load.workload.matrix import MatrixError, load_matrix, parse_matrix
from calculet_sim.admin import PARTIAL_LANES
from tests.analysis.test_batch import B4, _rules, _small
from tests.support.acceptkit import (
    MATRICES,
    REPO,
    accept_args,
    accept_sim,
    read_events,
    read_verdict,
    relaxed_rules,
    write_manifest,
)
from tests.support.simproc import SimProcess

BATCH_B4 = MATRICES / "batch-b4.yaml"


def _statement(b: int) -> dict[str, Any]:
    return {"compiled_batch": b, "partial_lanes": "masked: empty lanes are padding"}


# ------------------------------------------------------------------ the matrices as data
@pytest.mark.parametrize("b", [4, 8, 16])
def test_batch_matrix_measures_active_lanes_1_to_b(b: int) -> None:
    m = load_matrix(MATRICES / f"batch-b{b}.yaml")
    assert m.compiled_batch == b and m.name == f"batch-b{b}"
    cells = m.expanded()
    assert [c.concurrency for c in cells] == list(range(1, b + 1))
    assert {(c.kind, c.prompt_tokens, c.max_tokens) for c in cells} == {("closed", 512, 128)}
    assert cells[0].concurrency == 1  # the single-request TPOT P99 of the workload
    assert all(m.repetitions_for(c) >= 30 for c in cells)  # spec §8


def test_compiled_batch_is_optional_and_positive() -> None:
    doc = {"schema": "calculet-matrix/v1", "name": "x", "cells": [{"kind": "single"}]}
    assert parse_matrix(doc, "m").compiled_batch is None
    with pytest.raises(MatrixError, match="compiled_batch"):
        parse_matrix({**doc, "compiled_batch": 0}, "m")
    schema = json.dumps(load_matrix(BATCH_B4).model_json_schema(by_alias=True))
    assert "compiled_batch" in schema


@pytest.mark.parametrize("b", [4, 8, 16])
def test_shipped_sim_manifests_state_the_simulators_policy(b: int) -> None:
    m = load_manifest(REPO / "configs" / f"manifest.sim-b{b}.yaml")
    assert m.batch is not None and m.batch.compiled_batch == b
    assert m.batch.partial_lanes == PARTIAL_LANES
    assert m.matrix == f"configs/matrices/batch-b{b}.yaml"
    assert load_manifest(REPO / "configs" / "manifest.sim.yaml").batch is None


def test_manifest_batch_section_needs_the_statement() -> None:
    doc = yaml.safe_load((REPO / "configs" / "manifest.sim-b4.yaml").read_text())
    del doc["batch"]["partial_lanes"]
    with pytest.raises(ManifestError, match=r"batch\.partial_lanes"):
        parse_manifest(doc)


# ------------------------------------------------------------------ the analysis's B
def test_analysis_takes_b_from_the_manifest_unless_the_rule_sets_it(tmp_path: Path) -> None:
    run_dir = _small(tmp_path / "run")  # c1 alone, c4 four lanes at a time (tests.analysis)
    doc = yaml.safe_load((REPO / "configs" / "manifest.sim-b8.yaml").read_text())
    (Path(run_dir) / "manifest.yaml").write_text(yaml.safe_dump(doc))
    batch = analyze(run_dir, rules_path=_rules(tmp_path)).document["batch"]
    assert (batch["compiled_batch"], batch["compiled_batch_source"]) == (8, "manifest")
    assert batch["vendor_statement"]["partial_lanes"] == PARTIAL_LANES
    assert batch["notes"] == []
    c4 = next(c for c in batch["cells"] if c["cell"].startswith("c4"))
    assert c4["fill_ratio"] == 0.5  # four lanes of the manifest's eight
    batch = analyze(run_dir, rules_path=_rules(tmp_path, B4)).document["batch"]
    assert (batch["compiled_batch"], batch["compiled_batch_source"]) == (4, "rules")
    assert "differs from the manifest's batch.compiled_batch 8" in batch["notes"][0]


# ------------------------------------------------------------------ release refusals
def _refused(tmp: Path, sim: SimProcess, capsys: pytest.CaptureFixture[str], **m: Any) -> str:
    run_dir = tmp / "run"
    code = main(accept_args(write_manifest(tmp, sim.url, **m), BATCH_B4, run_dir))
    out = capsys.readouterr().out
    assert code == 2, out
    stopped = [e for e in read_events(run_dir) if e["status"] == "stopped"]
    assert [e["step"] for e in stopped] == ["run"] and stopped[0]["code"] == 2
    assert not any(e["step"] == "cell" for e in read_events(run_dir))
    return str(stopped[0]["reason"])


def test_release_refuses_a_batch_matrix_without_the_vendor_statement(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    reason = _refused(tmp_path, accept_sim(start_sim), capsys)
    assert "manifest batch.partial_lanes missing" in reason and "B4" in reason
    assert "\n" not in reason


def test_release_refuses_a_statement_for_another_compiled_batch(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    reason = _refused(tmp_path, accept_sim(start_sim), capsys, batch=_statement(8))
    assert "batch.compiled_batch 8 != matrix batch-b4 compiled_batch 4" in reason


def test_release_refuses_a_target_serving_another_compiled_batch(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sim = accept_sim(start_sim, "--profile", "b8")  # the matrix and manifest say B4
    reason = _refused(tmp_path, sim, capsys, batch=_statement(4))
    assert "serves compiled batch 8" in reason and "batch.compiled_batch 4" in reason


# ------------------------------------------------------------------ B4 end to end
@pytest.mark.serial  # each concurrency's requests must meet in one batch: a busy client splits them
def test_batch_b4_run_end_to_end_takes_b_from_the_manifest(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sim = accept_sim(start_sim)
    shipped = yaml.safe_load((REPO / "configs" / "manifest.sim-b4.yaml").read_text())
    manifest = write_manifest(tmp_path, sim.url, run_id="batch-b4", batch=shipped["batch"])
    run_dir = tmp_path / "run"
    args = accept_args(manifest, BATCH_B4, run_dir, "--min-repetitions", "8", "--skip-report")
    paced = list(PACER.collections)
    code = main([*args, "--rules", str(relaxed_rules(tmp_path))])
    # the driver's client paced the process's collections (measure.heap) and stopped
    # pacing at its close: a full collection of this pytest process's heap (in the serial
    # phase, 100-143 ms) held the loop 51 ms in a fresh-clone run before it did
    assert PACER.collections[0] > paced[0] and not PACER.running, PACER.collections
    out = capsys.readouterr().out
    assert code == 0, out

    release = next(
        e for e in read_events(run_dir) if e["step"] == "release" and e["status"] == "end"
    )
    assert "served compiled batch" in release["checked"]
    assert release["batch"] == {
        **shipped["batch"],
        "matrix_compiled_batch": 4,
        "served_compiled_batch": 4,
        "served_partial_lanes": PARTIAL_LANES,
    }

    verdict = read_verdict(run_dir)
    # a stalled loop excludes the records under its self-watch sample: say so, not "a cell
    # is missing"
    assert verdict["quality"]["by_reason"]["client_saturated"] == 0, verdict["quality"]
    batch = verdict["batch"]
    assert batch["compiled_batch"] == 4 and batch["compiled_batch_source"] == "manifest"
    assert batch["vendor_statement"]["partial_lanes"] == PARTIAL_LANES
    assert not any("inferred" in n for n in batch["notes"])
    cells = [c for c in batch["cells"] if c["cell"].startswith("batch-b4-")]
    fill = {c["concurrency"]: c["fill_ratio"] for c in cells}
    assert sorted(fill) == [1, 2, 3, 4], fill
    assert fill[1] == pytest.approx(0.25)
    assert fill[1] < fill[2] < fill[3] < fill[4] <= 1.0, fill
    assert fill[4] > 0.75, fill  # lanes run short only while a new request prefills
    assert {x["active_lanes"] for x in batch["by_active_lanes"]} == {1, 2, 3, 4}
    c1_p99 = cells[0]["tpot_p99_ms"]
    assert c1_p99 is not None
    assert {c["single_request_tpot_p99_ms"] for c in cells} == {c1_p99}
    workload = next(r for r in batch["recommendations"] if r["workload"] == "p512-o128")
    assert "compiled batch B4 (from the manifest)" in workload["assumptions"]

    # the report's batch section shows the statement and where B came from
    section = batch_section(load_view(str(run_dir)))
    intro = " ".join(section.intro)
    assert "B4 (from the run manifest's batch section)" in intro
    assert PARTIAL_LANES in intro and "docs/simulator.md" in intro
