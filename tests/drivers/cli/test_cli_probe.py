"""`calculet-load probe`, `check-manifest`, `schema` and `export`, run as a user would."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from calculet_drivers.cli import main
from calculet_load.schema.runfolder import read_records
from tests.conftest import REPO
from tests.support.ports import free_port
from tests.support.simproc import SimProcess

SIM_MANIFEST = REPO / "configs" / "manifest.sim.yaml"


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "calculet_drivers.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


@pytest.mark.parametrize("protocol", ["llama", "openai-chat", "openai-completions"])
def test_probe_prints_the_timeline_and_writes_the_record(
    fast_sim: SimProcess, tmp_path: Path, protocol: str
) -> None:
    run_dir = tmp_path / "run"
    res = cli(
        "probe",
        "--url",
        fast_sim.url,
        "--protocol",
        protocol,
        "--prompt-tokens",
        "64",
        "--max-tokens",
        "8",
        "--run-dir",
        str(run_dir),
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    stamps = re.findall(r"^  (t[0-6]) +([0-9.]+) ms", out, re.M)
    assert [s for s, _ in stamps] == [f"t{i}" for i in range(7)]
    times = [float(v) for _, v in stamps]
    assert times == sorted(times) and times[0] == 0.0
    assert re.search(r"tokens: client 8 in \d+ events .*server 8", out)
    assert "MISMATCH" not in out
    (rec,) = read_records(str(run_dir))
    assert rec.workload.actual_output_tokens == 8
    assert rec.quality.clock_complete
    assert rec.durations_ms.ttft == pytest.approx(times[4], abs=0.002)
    line = (run_dir / "client" / "probe" / "requests.jsonl").read_text().splitlines()
    assert json.loads(line[0])["request_id"] == rec.request_id


def test_probe_of_one_token_has_a_null_tpot(fast_sim: SimProcess, tmp_path: Path) -> None:
    res = cli("probe", "--url", fast_sim.url, "--max-tokens", "1", "--run-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert re.search(r"^  TPOT  null$", res.stdout, re.M)
    assert re.search(r"^  TTFT  [0-9.]+ ms$", res.stdout, re.M)


def test_probe_of_an_unreachable_target_exits_3(tmp_path: Path) -> None:
    res = cli("probe", "--url", f"http://127.0.0.1:{free_port()}", "--run-dir", str(tmp_path))
    assert res.returncode == 3
    assert "cannot reach" in res.stderr


def test_probe_with_the_manifest_takes_its_provenance(fast_sim: SimProcess, tmp_path: Path) -> None:
    data = yaml.safe_load(SIM_MANIFEST.read_text())
    data["target"]["url"] = fast_sim.url
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(data))
    res = cli("probe", "--manifest", str(manifest), "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    (rec,) = read_records(str(tmp_path / "run"))
    assert rec.run_id == data["run_id"]
    assert rec.calbin_sha256 == data["model"]["calbin_sha256"]
    assert rec.software.driver == "sim"
    assert rec.hardware.board_serial_hash and rec.hardware.board_serial_hash != "sim-board-0"


def edit(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node = data
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("model.calbin_sha256", _DELETE, "model.calbin_sha256: REQUIRED field missing"),
        ("software.driver", "REQUIRED", "software.driver: REQUIRED field not filled in"),
        ("model.calbin_sha256", "abc", "model.calbin_sha256: Value error, must be 64"),
        ("hardware.chips", "two", "hardware.chips: Input should be a valid integer"),
        ("environment.ambient_c", _DELETE, "environment.ambient_c: REQUIRED field missing"),
        ("timeout_s", -1, "timeout_s: Input should be greater than 0"),
        ("client.transport", "grpc", "client.transport: Input should be 'http-sse'"),
        ("schema", "calculet-perf-run/v2", "schema: Input should be 'calculet-perf-run/v1'"),
        ("extra_field", 1, "extra_field: Extra inputs are not permitted"),
    ],
)
def test_a_bad_manifest_exits_2_with_one_line_naming_the_field(
    tmp_path: Path, path: str, value: Any, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = edit(yaml.safe_load(SIM_MANIFEST.read_text()), path, value)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    for command in (["check-manifest", str(bad)], ["probe", "--manifest", str(bad)]):
        assert main(command) == 2  # in-process: the same entry point the script calls
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert len(lines) == 1, captured.err
        assert lines[0].startswith(f"{bad}: {message}")


def test_the_template_names_its_first_unfilled_field() -> None:
    res = cli("check-manifest", "configs/manifest.template.yaml")
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "configs/manifest.template.yaml: model.calbin_sha256: REQUIRED field not filled in"
    )


def test_invalid_yaml_and_a_missing_file_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_id: [unclosed\n")
    res = cli("check-manifest", str(bad))
    assert res.returncode == 2 and res.stderr.strip() == f"{bad}: line 2 invalid YAML"
    res = cli("check-manifest", str(tmp_path / "nope.yaml"))
    assert res.returncode == 2 and "No such file" in res.stderr


def test_the_manifest_json_schema_accepts_the_sim_manifest_and_rejects_the_template() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    res = cli("schema", "manifest")
    assert res.returncode == 0
    schema = json.loads(res.stdout)
    jsonschema.validate(yaml.safe_load(SIM_MANIFEST.read_text()), schema)
    template = yaml.safe_load((REPO / "configs" / "manifest.template.yaml").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(template, schema)


def test_export_writes_spec3_lines(fast_sim: SimProcess, tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    assert cli("probe", "--url", fast_sim.url, "--run-dir", run_dir).returncode == 0
    res = cli("export", run_dir)
    assert res.returncode == 0, res.stderr
    (obj,) = [json.loads(line) for line in res.stdout.splitlines()]
    assert obj["schema"] == "calculet-perf-request/v1" and "ext" not in obj
    res = cli("export", run_dir, "--full", "--out", str(tmp_path / "x.jsonl"))
    assert res.returncode == 0
    assert "ext" in json.loads((tmp_path / "x.jsonl").read_text())
