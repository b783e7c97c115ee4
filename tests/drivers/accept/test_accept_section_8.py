"""Spec §8 enforced by `calculet-load accept`: an acceptance
refuses a cell below 30 repetitions (100 for a short case) unless the manifest's purpose
says rehearsal; idle sampling waits for the rules file's stability criterion and stops
with exit 3 naming the series that did not settle; `--record-golden` records the golden
set's hashes from the run and checks golden after against them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from calculet_drivers.cli import main
from tests.support.acceptkit import (
    GOLDEN,
    accept_args,
    accept_sim,
    assert_bundle_verifies,
    read_events,
    read_plan,
    read_verdict,
    relaxed_rules,
    write_manifest,
    write_matrix,
)
from tests.support.simproc import SimProcess

ACCEPTANCE = "acceptance of build 1.2.3"  # a purpose that does not say rehearsal


def _refused(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """Run `accept`; assert exit 2 and one line on stderr; that line."""
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------ §8.6 repetitions
def test_an_acceptance_below_30_repetitions_exits_2_naming_the_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 10-repetition matrix is refused before anything runs (no target is contacted:
    the URL is closed) with one line naming the cell and its repetitions."""
    manifest = write_manifest(tmp_path, "http://127.0.0.1:9", run_id="acc", purpose=ACCEPTANCE)
    cells = [{"kind": "single", "prompt_tokens": 1024, "max_tokens": 64}]
    run_dir = tmp_path / "run"
    err = _refused(capsys, accept_args(manifest, write_matrix(tmp_path, cells, reps=10), run_dir))
    assert "cell single-p1024-o64 has 10 repetitions, fewer than the 30" in err, err
    assert "rehearsal" in err and ACCEPTANCE in err
    assert not run_dir.exists()  # refused before the run folder


def test_a_short_case_needs_100_and_a_boundary_cell_is_exempt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """30 repetitions are enough for a long case, not for a short one (prompt <= 512 and
    output <= 32 tokens); a boundary cell (a policy test) needs no minimum; `--min-
    repetitions` counts as what the plan gives."""
    manifest = write_manifest(tmp_path, "http://127.0.0.1:9", run_id="acc", purpose=ACCEPTANCE)
    long_ = {"kind": "single", "prompt_tokens": 1024, "max_tokens": 64}
    short = {"kind": "single", "prompt_tokens": 128, "max_tokens": 32}
    edge = {"kind": "boundary", "prompt_tokens": 40959, "max_tokens": 32, "repetitions": 3}
    run_dir = tmp_path / "run"

    def matrix(*cells: dict[str, object], name: str, reps: int = 30) -> Path:
        return write_matrix(tmp_path, list(cells), name=name, reps=reps)

    err = _refused(capsys, accept_args(manifest, matrix(long_, short, edge, name="a"), run_dir))
    assert "cell single-p128-o32 has 30 repetitions, fewer than the 100" in err, err
    assert "short case (prompt <= 512, output <= 32 tokens)" in err
    capped = accept_args(
        manifest, matrix(long_, edge, name="b"), run_dir, "--min-repetitions", "12"
    )
    err = _refused(capsys, capped)
    assert "cell single-p1024-o64 has 12 repetitions" in err, err
    # the same matrices with rehearsal in the purpose get past the check (to the target,
    # which is closed: exit 3 from the release step, not 2)
    rehearsal = write_manifest(tmp_path, "http://127.0.0.1:9", run_id="reh", purpose="Rehearsal")
    assert main(accept_args(rehearsal, matrix(long_, short, edge, name="d"), run_dir)) == 3


def test_a_burst_cell_counts_its_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A burst cell sends size × rounds requests whatever `repetitions` says: 8 × 4 = 32
    of a long case pass, 8 × 2 = 16 do not."""
    manifest = write_manifest(tmp_path, "http://127.0.0.1:9", run_id="acc", purpose=ACCEPTANCE)
    burst = {"kind": "burst", "size": 8, "rounds": 2, "prompt_tokens": 1024, "max_tokens": 64}
    run_dir = tmp_path / "run"
    err = _refused(capsys, accept_args(manifest, write_matrix(tmp_path, [burst]), run_dir))
    assert "cell burst8-p1024-o64 has 16 repetitions, fewer than the 30" in err, err
    enough = write_matrix(tmp_path, [{**burst, "rounds": 4}], name="enough", reps=1)
    assert main(accept_args(manifest, enough, run_dir)) == 3  # past §8: the target is closed


# ------------------------------------------------------------------ §8.2 idle
def test_an_unstable_idle_exits_3_naming_the_series(
    tmp_path: Path, start_sim: Callable[..., SimProcess], accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """A simulated device whose power swings (±4 W a chip, a 1.2 s period at this time
    scale) never holds the idle criterion: at the time limit the run stops with exit 3,
    naming the series and the limits they broke; nothing after idle ran."""
    sim = accept_sim(start_sim, "--set", "device.power_swing_w=4")
    run_dir = tmp_path / "run"
    matrix = write_matrix(tmp_path, [{"kind": "single", "prompt_tokens": 128, "max_tokens": 8}])
    args = accept_args(write_manifest(tmp_path, sim.url), matrix, run_dir)
    code = main([*args, "--idle-window-s", "1", "--idle-timeout-s", "4"])
    out = capsys.readouterr().out
    assert code == 3, out
    (stop,) = [line for line in out.splitlines() if "STOP (exit 3)" in line]
    assert "idle: the device was not stable within 4 s" in stop, stop
    assert "power_w range" in stop and "1 W" in stop, stop
    events = read_events(run_dir)
    (end,) = [e for e in events if e["step"] == "idle" and e["status"] == "end"]
    assert end["outcome"] == "failed" and end["stable"] is False
    assert end["waited_s"] >= 4 and end["criterion"]["window_s"] == 1
    # power swings by 16 W (two chips), temperature follows (damped): frequency holds
    assert {f.split()[0] for f in end["failing"]} in ({"power_w"}, {"temperature_c", "power_w"})
    assert end["series"]["power_w"]["range"] > 1.0  # the rules file's limit: 1 W
    assert end["series"]["frequency_mhz"]["range"] == 0
    assert not [e for e in events if e["step"] in ("golden_before", "warmup", "matrix")]
    assert not (run_dir / "plan.json").exists()
    assert events[-1] == {**events[-1], "step": "run", "status": "end", "code": 3}


def test_the_idle_criterion_comes_from_the_rules_file(
    tmp_path: Path, start_sim: Callable[..., SimProcess], accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The same swinging device is stable enough under a rules file that leaves power and
    temperature unchecked (its window and limit from the file too); an invalid idle
    section is refused with exit 2 naming the field."""
    sim = accept_sim(start_sim, "--set", "device.power_swing_w=4")
    loose = yaml.safe_load(relaxed_rules(tmp_path).read_text())
    loose["idle"] = {"window_s": 0.5, "timeout_s": 3, "temperature_c": {"max_range": None,
                     "max_slope_per_min": None}, "power_w": {}}  # fmt: skip
    rules = tmp_path / "loose.yaml"
    rules.write_text(yaml.safe_dump(loose))
    run_dir = tmp_path / "run"
    matrix = write_matrix(tmp_path, [{"kind": "single", "prompt_tokens": 128, "max_tokens": 8}])
    args = ["accept", "--manifest", str(write_manifest(tmp_path, sim.url)), "--matrix",
            str(matrix), "--run-dir", str(run_dir), "--min-repetitions", "3", "--skip-report",
            "--idle-gap-s", "0", "--rules"]  # fmt: skip
    assert main([*args, str(rules)]) == 0, capsys.readouterr().out
    (end,) = [e for e in read_events(run_dir) if e["step"] == "idle" and e["status"] == "end"]
    assert end["stable"] is True and end["criterion"]["window_s"] == 0.5
    assert end["criterion"]["timeout_s"] == 3
    assert end["series"]["power_w"]["range"] > 1.0  # swinging, but not checked
    loose["idle"]["power_w"] = {"max_range": -1}
    rules.write_text(yaml.safe_dump(loose))
    capsys.readouterr()
    assert main([*args, str(rules)]) == 2
    err = capsys.readouterr().err
    assert "idle.power_w.max_range: Input should be greater than or equal to 0" in err, err


# ------------------------------------------------------------------ --record-golden
def test_record_golden_records_the_hashes_and_checks_golden_after_against_them(
    tmp_path: Path, start_sim: Callable[..., SimProcess], accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """A non-rehearsal acceptance with §8's repetitions (one long case, 30 requests) and a
    golden set whose hashes are missing or wrong: `--record-golden` records every case
    from golden before (compares none), writes golden.recorded.yaml (the simulator's true
    hashes), and golden after passes against them; the run is an acceptance, so neither
    verdict.json nor the report says rehearsal."""
    truth = yaml.safe_load(GOLDEN.read_text())
    given = yaml.safe_load(GOLDEN.read_text())
    given["cases"][0]["token_hash"] = "0" * 64  # wrong
    del given["cases"][1]["token_hash"]  # not recorded yet
    golden = tmp_path / "golden.yaml"
    golden.write_text(yaml.safe_dump(given, sort_keys=False))
    sim = accept_sim(start_sim)
    run_dir = tmp_path / "run"
    matrix = write_matrix(tmp_path, [{"kind": "single", "prompt_tokens": 1024, "max_tokens": 8}])
    manifest = write_manifest(tmp_path, sim.url, run_id="acc-golden", purpose=ACCEPTANCE)
    args = accept_args(manifest, matrix, run_dir, "--rules", str(relaxed_rules(tmp_path)))
    args[args.index(str(GOLDEN))] = str(golden)
    code = main([*args, "--record-golden"])
    out = capsys.readouterr().out
    assert code == 0, out

    pinned = yaml.safe_load((run_dir / "golden.recorded.yaml").read_text())
    # every case as given, with its true hash (and the fields' defaults written out)
    assert {k: v for k, v in pinned.items() if k != "cases"} == {
        k: v for k, v in truth.items() if k != "cases"
    }
    assert [{k: c[k] for k in t} for c, t in zip(pinned["cases"], truth["cases"], strict=True)] == (
        truth["cases"]
    )
    events = read_events(run_dir)
    (pin,) = [e for e in events if e["status"] == "pinned"]
    assert pin["changed"] == [given["cases"][0]["name"]] and pin["cases"] == 4
    ends = {e["step"]: e for e in events if e["status"] == "end" and "golden" in e["step"]}
    assert ends["golden_before"]["failures"] == ends["golden_after"]["failures"] == []
    assert "--record-golden: 4 hash(es) recorded" in out
    verdict = read_verdict(run_dir)
    assert verdict["exit_code"] == 0
    assert verdict["rehearsal"] is False and verdict["banner"] is None
    status = {v["rule"]: v["status"] for v in verdict["verdicts"]}
    assert status["golden"] == "pass"
    plan = read_plan(run_dir)
    assert plan["rehearsal"] is False and plan["below_minimum_repetitions"] is False
    assert [c["repetitions"] for c in plan["cells"]] == [30]
    if (run_dir / "report.html").exists():
        assert 'class="rehearsal"' not in (run_dir / "report.html").read_text()
    assert_bundle_verifies(run_dir, accept_env)


def test_record_golden_needs_a_golden_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = write_manifest(tmp_path, "http://127.0.0.1:9")
    matrix = write_matrix(tmp_path, [{"kind": "single"}])
    code = main(["accept", "--manifest", str(manifest), "--matrix", str(matrix),
                 "--record-golden"])  # fmt: skip
    assert code == 2
    assert "--record-golden needs --golden" in capsys.readouterr().err
