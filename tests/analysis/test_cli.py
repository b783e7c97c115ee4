"""`calculet-load analyze`: every exit-code path of spec §15 on hand-written runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.judge.rules import DEFAULT_RULES
from calculet_drivers.cli import main
from tests.support.runs import MS, RunBuilder, request, selfwatch

N = 60  # requests per run: enough for P50 intervals, too few for P99 (needs 368)


def _run(
    root: Path,
    *,
    tpot_ms: float = 10.0,
    nan: int = 0,
    lag_ms: float = 1.0,
    index: str | None = "complete",
    cell: str = "p16",
    golden_hash: str | None = None,
    stall_at: int | None = None,
    kernel: bool = False,
    sent_late: int | None = None,
) -> str:
    """N closed-loop requests at concurrency 1, 200 ms apart; TPOT = tpot_ms + i · 1 µs;
    self-watch sample `stall_at` saw the loop held 13.2 ms at 35 % CPU; `kernel`: open
    loop instead, the records' stamps the kernel's receive times, within their own
    bounds but record `sent_late`'s, sent 6 ms after its schedule."""
    stamps = {
        "stamp_source": "kernel",
        "stamp_late_bound_ms": 0.0,
        "connection_reused": True,
        "send_lag_ms": 0.3,
    }
    b = RunBuilder(root)
    tpot = [int((tpot_ms + i * 0.001) * MS) for i in range(N)]
    for i in range(N):
        broken = i < nan
        b.add(
            request(
                f"r{i}",
                t0=i * 200 * MS,
                tpot=tpot[i],
                cell=cell,
                arrival="poisson" if kernel else "closed",
                error="nonfinite_number" if broken else None,
                ext={
                    "nonfinite_field": broken,
                    **(stamps if kernel else {}),
                    **({"send_lag_ms": 6.0} if i == sent_late else {}),
                },
            ),
            tpot=tpot[i],
        )
    if golden_hash is not None:
        b.add(request("g0", t0=N * 200 * MS, cell="golden", token_hash=golden_hash))
    b.watch += [selfwatch("w00", k * 1_000 * MS, lag_ms=lag_ms) for k in range(N // 5 + 3)]
    if stall_at is not None:
        b.watch[stall_at] = selfwatch("w00", stall_at * 1_000 * MS, lag_ms=13.2, cpu=35.0)
    if index is not None:
        b.complete_index(index)
    return b.write()


def _analyze(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["analyze", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _verdicts(run_dir: str) -> dict[str, dict[str, Any]]:
    doc = json.loads((Path(run_dir) / "verdict.json").read_text())
    return {v["rule"]: v for v in doc["verdicts"]}


def test_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _run(tmp_path)
    code, out, _ = _analyze(capsys, run_dir)
    assert code == 0, out
    doc = json.loads((tmp_path / "verdict.json").read_text())
    assert doc["schema"] == "calculet-verdict/v1"
    assert (doc["exit_code"], doc["status"]) == (0, "pass")
    assert (tmp_path / "summary.csv").exists() and (tmp_path / "summary.parquet").exists()
    v = _verdicts(run_dir)
    assert v["error_rate"]["status"] == "pass" and v["error_rate"]["n"] == N
    assert v["refactor"]["status"] == "not_evaluated"  # no baseline: never a pass
    assert "needs a baseline run" in v["refactor"]["reason"]
    assert v["golden"]["status"] == "not_evaluated"
    for field in ("rule", "kind", "class", "status", "observed", "threshold", "n", "reason"):
        assert field in v["no_nonfinite"]
    assert out.splitlines()[-1].startswith("verdict: pass (exit 0)")


def test_correctness_failure_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _run(tmp_path, nan=1)
    code, out, _ = _analyze(capsys, run_dir)
    assert code == 1, out
    v = _verdicts(run_dir)
    assert v["no_nonfinite"]["status"] == "fail"
    assert (v["no_nonfinite"]["observed"], v["no_nonfinite"]["threshold"]) == (1, 0)
    assert "r0" in v["no_nonfinite"]["reason"]
    assert v["error_rate"]["status"] == "fail"
    assert "nonfinite_number 1" in v["error_rate"]["reason"]


def test_corrupt_part_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _run(tmp_path)
    part = tmp_path / "client" / "w00" / "part-00001.requests.parquet"
    part.write_bytes(b"PAR1 not really")
    code, _out, err = _analyze(capsys, run_dir)
    assert code == 2
    assert "part-00001.requests.parquet: unreadable Parquet part" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "verdict.json").exists()


def test_bad_rules_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = yaml.safe_load(DEFAULT_RULES.read_text())
    rules["analysis"]["confidence_level"] = 1.5
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    code, _, err = _analyze(capsys, _run(tmp_path / "run"), "--rules", str(path))
    assert code == 2
    assert "rules.yaml: analysis.confidence_level: Input should be less than 1" in err


def test_saturated_client_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _run(tmp_path, lag_ms=20.0)
    code, out, _ = _analyze(capsys, run_dir)
    assert code == 3, out
    v = _verdicts(run_dir)["client_saturation"]
    assert v["status"] == "fail" and v["class"] == "infrastructure"
    assert v["observed"] == 1.0 and v["threshold"] == 0.05
    assert "add workers or lower the load" in v["reason"]


def test_the_saturation_verdict_names_what_the_self_watch_saw(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One sample's stall flags the requests it covers; the verdict says which samples saw
    the client saturated, and how (a flag is checked against its cause, not taken on
    trust)."""
    run_dir = _run(tmp_path, stall_at=3)
    code, out, _ = _analyze(capsys, run_dir)
    assert code == 3, out
    v = _verdicts(run_dir)["client_saturation"]
    assert v["status"] == "fail"
    samples = N // 5 + 3
    assert (
        f"1 of {samples} self-watch samples saturated: w00 loop lag 13.2 ms at 35 % CPU"
        in (v["reason"])
    )
    kept = json.loads((Path(run_dir) / "verdict.json").read_text())["quality"]
    assert kept["saturated_samples"]["count"] == 1
    (one,) = kept["saturated_samples"]["worst"]
    assert (one["worker"], one["loop_lag_ms"], one["cpu_percent"]) == ("w00", 13.2, 35.0)
    calm = _run(tmp_path / "calm")
    assert _analyze(capsys, calm)[0] == 0
    assert "self-watch samples saturated" not in _verdicts(calm)["client_saturation"]["reason"]


def test_a_loop_stall_does_not_flag_open_loop_records_with_the_kernels_stamps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same stalled sample over open-loop records whose stamps are the kernel's: no
    loop delays those stamps, and each send is timed against its schedule, so they are
    judged by their own bounds, and the verdict says so."""
    run_dir = _run(tmp_path, stall_at=3, kernel=True, sent_late=0)
    code, out, _ = _analyze(capsys, run_dir)
    assert code == 0, out
    v = _verdicts(run_dir)["client_saturation"]
    assert v["status"] == "pass"
    assert "1 of" in v["reason"] and "w00 loop lag 13.2 ms at 35 % CPU" in v["reason"]
    assert (
        "6 records under a sample that saw only loop lag had the kernel's stamps" in (v["reason"])
    )
    kept = json.loads((Path(run_dir) / "verdict.json").read_text())["quality"]
    # one record sent 6 ms after its schedule: flagged by its own bound, named
    assert (
        "; 1 records flagged by their own bounds (send lag, first-token late bound "
        in (v["reason"])
    )
    assert v["observed"] == pytest.approx(1 / 60)
    assert (kept["lag_judged_by_own_bounds"], kept["saturated_by_own_bounds"]) == (6, 1)


def test_incomplete_index_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _run(tmp_path, index="incomplete")
    code, _, _ = _analyze(capsys, run_dir)
    assert code == 3
    assert "status is 'incomplete'" in _verdicts(run_dir)["index_complete"]["reason"]


def test_regression_exits_4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _run(tmp_path / "base", tpot_ms=10.0)
    cand = _run(tmp_path / "cand", tpot_ms=13.0)  # decode 30% slower
    code, out, _ = _analyze(capsys, cand, "--baseline", base)
    assert code == 4, out
    v = _verdicts(cand)["refactor"]
    assert v["status"] == "fail" and v["class"] == "performance"
    rows = {(d["metric"], d["statistic"]): d for d in v["details"]}
    tpot = rows[("tpot_ms", "p50")]
    assert tpot["verdict"] == "regression"
    assert tpot["delta_pct"] == pytest.approx(30.0, abs=0.5)
    assert rows[("ttft_ms", "p50")]["verdict"] != "regression"
    assert rows[("tpot_ms", "p99")]["verdict"] == "inconclusive"  # n = 60 < 368
    assert "p16|c1|closed|stream" in v["reason"]
    assert "FAIL" in out and "refactor" in out


def test_correctness_wins_over_regression(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _run(tmp_path / "base", tpot_ms=10.0)
    cand = _run(tmp_path / "cand", tpot_ms=13.0, nan=1)
    code, _, _ = _analyze(capsys, cand, "--baseline", base)
    assert code == 1
    v = _verdicts(cand)
    assert v["refactor"]["status"] == "fail" and v["no_nonfinite"]["status"] == "fail"


def test_same_build_passes_and_strict_mode_fails_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _run(tmp_path / "base")
    cand = _run(tmp_path / "cand")
    code, _, _ = _analyze(capsys, cand, "--baseline", base)
    assert code == 0
    v = _verdicts(cand)["refactor"]
    assert v["status"] == "inconclusive"  # P99 cannot be judged on 60 requests a side
    assert "none regressed" in v["reason"]
    rules = yaml.safe_load(DEFAULT_RULES.read_text())
    rules["analysis"]["fail_on_inconclusive"] = True
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump(rules))
    code, _, _ = _analyze(capsys, cand, "--baseline", base, "--rules", str(strict))
    assert code == 4


def test_golden_against_the_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _run(tmp_path / "base", golden_hash="abc")
    same = _run(tmp_path / "same", golden_hash="abc")
    code, _, _ = _analyze(capsys, same, "--baseline", base)
    assert code == 0
    assert _verdicts(same)["golden"]["status"] == "pass"
    other = _run(tmp_path / "other", golden_hash="xyz")
    code, _, _ = _analyze(capsys, other, "--baseline", base)
    assert code == 1
    g = _verdicts(other)["golden"]
    assert g["status"] == "fail" and g["observed"] == 0.0
    assert g["details"][0] == {
        "request_id": "g0",
        "prompt": "s0/16/5/greedy/-",
        "problem": "token hash",
    }


def test_out_dir_and_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _run(tmp_path / "run")
    code, out, _ = _analyze(capsys, run_dir, "--out", str(tmp_path / "out"), "--quiet")
    assert code == 0
    assert out.count("\n") == 1
    assert (tmp_path / "out" / "verdict.json").exists()
    assert not (tmp_path / "run" / "verdict.json").exists()


def test_rules_schema_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _analyze(capsys, "--rules-schema")
    assert code == 0
    assert json.loads(out)["title"] == "RulesFile"


def test_analyze_run_is_the_pipeline_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from analysis.cli import analyze_run

    assert analyze_run(_run(tmp_path / "run"), quiet=True) == 0
    assert analyze_run(str(tmp_path / "nowhere")) == 2
    assert "not a run folder" in capsys.readouterr().err
