"""`calculet-load import-legacy` (spec §1): the old 163-row CSV becomes a trend-only,
non-authoritative folder that `analyze` refuses as a run and as a baseline (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.csv as pacsv
import pytest

from analysis.legacy import load_legacy_trend
from calculet_drivers.cli import main
from tests.support.runs import RunBuilder, request

CSV = Path(__file__).parents[1] / "data" / "legacy-163.csv"


def test_the_163_rows_import_as_a_flagged_trend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "legacy"
    assert main(["import-legacy", str(CSV), "--out", str(out)]) == 0
    assert "imported 163 legacy rows" in capsys.readouterr().out
    index = json.loads((out / "client" / "index.json").read_text())
    assert index["legacy"] is True and index["authoritative"] is False
    assert index["source"]["rows"] == 163 and index["workers"] == []
    assert any("deepseek" in n for n in index["notes"])
    trend = load_legacy_trend(str(out))
    assert trend.num_rows == 163
    assert trend.schema.metadata[b"authoritative"] == b"false"
    src = pacsv.read_csv(CSV)
    # row 1: prompt_ms 8.082 + predicted_ms 387.409 = 395.491: the old "TTFT" is the
    # server's whole response time; 387.409 / 32 tokens = 12.1065 ms per output token
    row = trend.slice(0, 1).to_pylist()[0]
    assert row["row"] == 1 and row["legacy_ttft_ms"] == pytest.approx(395.491)
    assert row["server_prompt_ms"] == pytest.approx(8.082)
    assert row["server_ms_per_output_token"] == pytest.approx(387.409 / 32)
    assert row["model_as_written"] == "deepseek"
    assert trend.column("prompt_ms").to_pylist() == src.column("prompt_ms").to_pylist()
    assert not list(out.glob("client/*/part-*"))  # no request record: nothing to mix


def test_analyze_refuses_a_legacy_folder_as_baseline_and_as_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy = tmp_path / "legacy"
    assert main(["import-legacy", str(CSV), "--out", str(legacy)]) == 0
    b = RunBuilder(tmp_path / "run")
    b.add(request("r0", t0=0))
    run_dir = b.write()
    capsys.readouterr()
    assert main(["analyze", run_dir, "--baseline", str(legacy)]) == 2
    err = capsys.readouterr().err
    assert "cannot be a baseline" in err and "trend reference only" in err
    assert len(err.strip().splitlines()) == 1
    assert not (Path(run_dir) / "verdict.json").exists()
    assert main(["analyze", str(legacy)]) == 2
    assert "trend reference only" in capsys.readouterr().err


def test_a_csv_that_is_not_the_old_benchmark_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["import-legacy", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert "'prompt_ms' and 'predicted_ms'" in capsys.readouterr().err
    out = tmp_path / "taken"
    out.mkdir()
    (out / "something").write_text("x")
    assert main(["import-legacy", str(CSV), "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
