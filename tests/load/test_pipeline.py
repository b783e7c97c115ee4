"""`calculet-load accept` end to end against real simulator processes on loopback (issue 7).

Every run here is time-scaled and small (a few cells, `--min-repetitions`-style counts, a
1 s idle window) and is judged from its own files: `events.jsonl` (the §8 order),
`plan.json` (order, progress, exclusions), the Parquet records, `verdict.json` and the
signed bundle. Exit codes are those of spec §15: 0 pass, 1 correctness, 2 artifact or
config invalid, 3 infrastructure invalid, 4 performance regression.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from analysis.load import load_run
from analysis.quality import apply_quality
from analysis.rules import DEFAULT_RULES
from analysis.sign import generate_keypair, load_verify_key, verify
from calculet_load.cli import main
from calculet_load.matrix import load_matrix
from calculet_load.pipeline import Options, Pipeline
from tests.simproc import ADMIN_TOKEN, SimProcess

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "calculet_load.cli"]  # the `calculet-load` command
SIM_MANIFEST = yaml.safe_load((REPO / "configs" / "manifest.sim.yaml").read_text())
CALBIN = str(SIM_MANIFEST["model"]["calbin_sha256"])
GOLDEN = REPO / "configs" / "golden" / "sim.yaml"
SCALE = "0.02"  # 50x faster than the simulated device
FAST = ["--idle-window-s", "1", "--idle-timeout-s", "30", "--idle-gap-s", "0.2"]

# The §8 order as the pipeline logs it (consecutive events of one step merged).
ORDER_HEAD = ["run", "release", "idle", "golden_before", "warmup", "matrix", "cell", "matrix"]
ORDER_TAIL = ["golden_after", "resources", "traces", "analysis"]

SMALL_MATRIX: list[dict[str, Any]] = [
    {"kind": "single", "prompt_tokens": 128, "max_tokens": 16},
    {"kind": "closed", "concurrency": 2, "prompt_tokens": 128, "max_tokens": 16},
    {"kind": "open", "arrival": "poisson", "rate": 4.0, "prompt_tokens": 128, "max_tokens": 16},
    {"kind": "burst", "size": 4, "rounds": 2, "prompt_tokens": 128, "max_tokens": 16},
]


# ------------------------------------------------------------------ helpers
def _sim(start: Callable[..., SimProcess], *args: str, scale: str = SCALE) -> SimProcess:
    """A B4 simulator serving the manifest's calbin hash, admin API on (the token is
    tests.simproc.ADMIN_TOKEN); later `--set` arguments override earlier ones."""
    pre = ["--time-scale", scale, "--profile", "b4", "--set", f"versions.calbin_sha256={CALBIN}"]
    return start(*pre, *args, faults=True)


def _manifest(tmp: Path, url: str, run_id: str = "accept-test", **changes: Any) -> Path:
    m = json.loads(json.dumps(SIM_MANIFEST))
    m.update(run_id=run_id, target={"url": url, "protocol": "llama"}, **changes)
    path = tmp / f"manifest-{run_id}.yaml"
    path.write_text(yaml.safe_dump(m, sort_keys=False))
    return path


def _matrix(tmp: Path, cells: list[dict[str, Any]], name: str = "t", reps: int = 30) -> Path:
    doc = {"schema": "calculet-matrix/v1", "name": name, "repetitions": reps}
    doc.update(short_repetitions=reps, cells=cells)
    path = tmp / f"matrix-{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _relaxed_rules(tmp: Path) -> Path:
    """The default rules, except that this shared 2-core machine's own load must not make
    a run infrastructure-invalid where the test is about something else (the
    infrastructure checks have their own test below, with the default rules)."""
    rules = yaml.safe_load(DEFAULT_RULES.read_text())
    rules["infrastructure"]["max_saturated_fraction"] = None
    rules["infrastructure"]["max_send_lag_p99_ms"] = None
    path = tmp / "rules-relaxed.yaml"
    path.write_text(yaml.safe_dump(rules))
    return path


def _accept(manifest: Path, matrix: Path, run_dir: Path, *extra: str) -> list[str]:
    args = ["accept", "--manifest", str(manifest), "--matrix", str(matrix)]
    return [*args, "--golden", str(GOLDEN), "--run-dir", str(run_dir), *FAST, *extra]


def _events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x]


def _order(events: list[dict[str, Any]]) -> list[str]:
    steps: list[str] = []
    for e in events:
        if not steps or steps[-1] != e["step"]:
            steps.append(e["step"])
    return steps


def _plan(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "plan.json").read_text())  # type: ignore[no-any-return]


def _records(run_dir: Path) -> list[dict[str, Any]]:
    """(cell, worker, warmup) of every request record on disk."""
    parts = sorted((run_dir / "client").glob("*/part-*.requests.parquet"))
    if not parts:
        return []
    t = pa.concat_tables([pq.read_table(p) for p in parts])
    cols = ("ext.cell", "ext.worker", "quality.warmup", "request_id")
    return [
        dict(zip(("cell", "worker", "warmup", "id"), row, strict=True))
        for row in zip(*(t.column(c).to_pylist() for c in cols), strict=True)
    ]


def _verdict(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "verdict.json").read_text())  # type: ignore[no-any-return]


def _assert_bundle_verifies(run_dir: Path, pubkey: Path) -> None:
    result = verify(str(run_dir), load_verify_key(str(pubkey)))
    assert result.ok, (result.modified, result.missing, result.added, result.signature)


@pytest.fixture(scope="module")
def signing_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    key = tmp_path_factory.mktemp("key") / "signing.pem"
    generate_keypair(str(key))
    return key


@pytest.fixture
def accept_env(monkeypatch: pytest.MonkeyPatch, signing_key: Path) -> Path:
    """The environment `calculet-load accept` reads: the admin token and the signing key."""
    monkeypatch.setenv("CALCULET_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("CALCULET_SIGNING_KEY_FILE", str(signing_key))
    monkeypatch.delenv("CALCULET_SIGNING_KEY", raising=False)
    return Path(f"{signing_key}.pub")


def _child_env(signing_key: Path) -> dict[str, str]:
    env = dict(os.environ, CALCULET_ADMIN_TOKEN=ADMIN_TOKEN, PYTHONUNBUFFERED="1")
    env.pop("CALCULET_SIGNING_KEY", None)
    env["CALCULET_SIGNING_KEY_FILE"] = str(signing_key)
    return env


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[Any]]]:
    """Child processes (pipelines, CPU hogs) killed and reaped whatever the test did."""
    started: list[subprocess.Popen[Any]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(10)
        for stream in (p.stdout, p.stderr):
            if stream is not None:
                stream.close()


# ------------------------------------------------------------------ 1 clean run
def test_a_clean_run_follows_the_section_8_order_and_exits_0(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sim = _sim(start_sim)
    run_dir = tmp_path / "run"
    matrix = _matrix(tmp_path, SMALL_MATRIX)
    args = _accept(_manifest(tmp_path, sim.url), matrix, run_dir, "--min-repetitions", "10")
    code = main([*args, "--rules", str(_relaxed_rules(tmp_path))])
    out = capsys.readouterr().out
    assert code == 0, out

    events = _events(run_dir)
    order = _order(events)
    tail = ["run"] if order[-2] == "analysis" else ["report", "run"]
    assert order == ORDER_HEAD + ORDER_TAIL + tail, order
    by_step: dict[str, list[str]] = {}
    for e in events:
        by_step.setdefault(e["step"], []).append(e["status"])
    for step in ("release", "idle", "golden_before", "warmup", "golden_after", "resources"):
        assert by_step[step] == ["start", "end"], (step, by_step[step])
    assert by_step["run"] == ["start", "end"]
    release = next(e for e in events if e["step"] == "release" and e["status"] == "end")
    assert release["checked"] == ["served calbin and generation"]
    idle = next(e for e in events if e["step"] == "idle" and e["status"] == "end")
    assert idle["stable"] is True and idle["samples"] >= 2
    golden = [e for e in events if e["step"].startswith("golden") and e["status"] == "end"]
    assert [g["failures"] for g in golden] == [[], []]
    resources = next(e for e in events if e["step"] == "resources" and e["status"] == "end")
    assert resources["back_to_baseline"] is True
    assert events[-1] == {**events[-1], "step": "run", "status": "end", "code": 0}
    assert next(e for e in events if e["step"] == "analysis" and e["status"] == "end")["code"] == 0

    # the cells ran in plan.json's (seeded, shuffled) order, each once, each complete
    plan = _plan(run_dir)
    names = [c.name for c in load_matrix(matrix).expanded()]
    starts = [e["cell"] for e in events if e["step"] == "cell" and e["status"] == "start"]
    ends = [e["cell"] for e in events if e["step"] == "cell" and e["status"] == "end"]
    assert starts == ends == [c["name"] for c in plan["cells"]]
    assert sorted(starts) == sorted(names)
    assert plan["attempts"] == 1 and plan["excluded"] == []
    assert plan["below_minimum_repetitions"] is True
    assert all(c["status"] == "done" for c in plan["cells"])
    records = _records(run_dir)
    per_cell = Counter(r["cell"] for r in records if not r["warmup"])
    for c in plan["cells"]:
        expected = 4 * 2 if c["name"].startswith("burst") else 10  # burst: size × rounds
        assert c["requests"] == per_cell[c["name"]] == expected, c
    warmup = [r for r in records if r["warmup"]]
    assert len(warmup) == SIM_MANIFEST["warmup_requests"]  # one shape (128 in, 16 out)
    assert per_cell["golden_before:short"] == per_cell["golden_after:short"] == 1

    # the server's traces were copied and joined; the bundle covers the folder as it is
    assert {p.name for p in (run_dir / "server").iterdir()} >= {
        "server_events.jsonl",
        "steps.jsonl",
        "device.jsonl",
    }
    verdict = _verdict(run_dir)
    assert verdict["exit_code"] == 0 and verdict["status"] == "pass"
    assert verdict["run"]["joined"] == verdict["run"]["records"]
    status = {v["rule"]: v["status"] for v in verdict["verdicts"]}
    for rule in ("index_complete", "clock_complete", "golden", "error_rate", "token_counts"):
        assert status[rule] == "pass", (rule, status)
    _assert_bundle_verifies(run_dir, accept_env)
    assert "(signed)" in out


# ------------------------------------------------------------------ 2 failed golden
@pytest.mark.parametrize("broken", ["wrong-expected-hash", "crosstalk"])
def test_a_failed_golden_stops_the_run_with_exit_1(
    broken: str,
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    golden = GOLDEN
    if broken == "crosstalk":  # every token leaks from another request's logits
        sim = _sim(start_sim, "--set", "knobs.crosstalk_probability=1.0")
    else:  # a correct server, but one case's expected hash is not what it produces
        sim = _sim(start_sim)
        doc = yaml.safe_load(GOLDEN.read_text())
        doc["cases"][1]["token_hash"] = "0" * 64
        golden = tmp_path / "golden-wrong.yaml"
        golden.write_text(yaml.safe_dump(doc, sort_keys=False))
    run_dir = tmp_path / "run"
    args = _accept(_manifest(tmp_path, sim.url), _matrix(tmp_path, SMALL_MATRIX), run_dir)
    args[args.index("--golden") + 1] = str(golden)
    code = main([*args, "--min-repetitions", "5", "--skip-report"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "STOP (exit 1): golden_before failed" in out

    events = _events(run_dir)
    order = _order(events)
    assert order[:5] == ["run", "release", "idle", "golden_before", "run"], order
    assert not {"warmup", "matrix", "cell", "golden_after", "resources"} & set(order)
    failed = next(e for e in events if e["step"] == "golden_before" and e["status"] == "end")
    if broken == "crosstalk":
        assert len(failed["failures"]) == 4  # every case
    else:
        assert len(failed["failures"]) == 1 and failed["failures"][0].startswith("medium:")
    stopped = next(e for e in events if e["step"] == "run" and e["status"] == "stopped")
    assert stopped["code"] == 1 and "golden_before" in stopped["reason"]
    assert events[-1]["step"] == "run" and events[-1]["status"] == "end"
    assert events[-1]["code"] == 1
    # no matrix cell ran: no plan, and the only records are the golden set's
    assert not (run_dir / "plan.json").exists()
    cells = {r["cell"] for r in _records(run_dir)}
    assert cells == {f"golden_before:{c}" for c in ("short", "medium", "long-prompt", "one-token")}
    # the analysis and the signed bundle still ran: the evidence of the stop is kept, and
    # the signed verdict itself says the golden set failed (judged against golden.json)
    verdict = json.loads((run_dir / "verdict.json").read_text())
    golden = [v for v in verdict["verdicts"] if v["rule"] == "golden"]
    assert golden and golden[0]["status"] == "fail", golden
    assert verdict["exit_code"] == 1
    _assert_bundle_verifies(run_dir, accept_env)


# ------------------------------------------------------------------ 3 invalid (exit 2)
def test_a_bad_manifest_exits_2_with_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _manifest(tmp_path, "http://127.0.0.1:9")
    doc = yaml.safe_load(good.read_text())
    del doc["model"]["calbin_sha256"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"

    # the manifest names the matrix: it is read before anything else
    assert main(["accept", "--manifest", str(bad), "--run-dir", str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "model.calbin_sha256" in captured.err
    assert "REQUIRED" in captured.err

    doc["model"]["calbin_sha256"] = "not-a-hash"
    bad.write_text(yaml.safe_dump(doc))
    matrix = _matrix(tmp_path, SMALL_MATRIX)
    code = main(
        ["accept", "--manifest", str(bad), "--matrix", str(matrix), "--run-dir", str(run_dir)]
    )
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "model.calbin_sha256" in captured.err
    assert not run_dir.exists()  # nothing started

    # the same through the installed command, as a user types it
    proc = subprocess.run(
        [*CLI, "accept", "--manifest", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "model.calbin_sha256" in proc.stderr


def test_a_calbin_hash_mismatch_exits_2(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    other = "ab" * 32
    sim = _sim(start_sim, "--set", f"versions.calbin_sha256={other}")  # another release
    matrix = _matrix(tmp_path, SMALL_MATRIX)
    run_dir = tmp_path / "served"
    assert main(_accept(_manifest(tmp_path, sim.url), matrix, run_dir)) == 2
    out = capsys.readouterr().out
    assert "STOP (exit 2): release: the target serves calbin abababababab" in out
    events = _events(run_dir)
    assert _order(events) == ["run", "release", "run"]
    assert [e["status"] for e in events if e["step"] == "run"] == ["start", "stopped", "end"]
    assert events[-1]["code"] == 2
    assert _records(run_dir) == []  # not one request was sent

    # a calbin file whose sha256 is not the manifest's (checked before the target)
    calbin = tmp_path / "model.calbin"
    calbin.write_bytes(b"not the released artifact")
    run_dir = tmp_path / "file"
    args = _accept(_manifest(tmp_path, "http://127.0.0.1:9"), matrix, run_dir)
    assert main([*args, "--calbin", str(calbin)]) == 2
    out = capsys.readouterr().out
    assert f"release: calbin {calbin} sha256" in out and "!= manifest model.calbin_sha256" in out
    assert _order(_events(run_dir)) == ["run", "release", "run"]
    assert _events(run_dir)[-1]["code"] == 2


# ------------------------------------------------------------------ 4 starved client
@pytest.mark.skipif(
    not (shutil.which("taskset") and shutil.which("nice")), reason="needs taskset and nice"
)
def test_a_client_starved_of_cpu_is_infrastructure_invalid_exit_3(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    signing_key: Path,
    procs: list[subprocess.Popen[Any]],
) -> None:
    """The pipeline runs pinned to core 0 at nice 10; once its matrix starts, three CPU
    hogs pinned to the same core take nearly all of it until the matrix ends. Its
    self-watch then sees loop lag far above SATURATED_LAG_MS, and the default rules
    judge the run infrastructure-invalid."""
    sim = _sim(start_sim)
    run_dir = tmp_path / "run"
    cells = [
        {"kind": "closed", "concurrency": 2, "prompt_tokens": 128, "max_tokens": 16},
        {"kind": "single", "prompt_tokens": 128, "max_tokens": 16},
    ]
    args = _accept(_manifest(tmp_path, sim.url), _matrix(tmp_path, cells), run_dir)
    cmd = ["nice", "-n", "10", "taskset", "-c", "0", *CLI, *args, "--skip-report"]
    cmd += ["--min-repetitions", "15"]
    log = tmp_path / "accept.log"
    with log.open("wb") as log_file:
        pipeline = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=_child_env(signing_key)
        )
    procs.append(pipeline)
    deadline = time.monotonic() + 60
    while pipeline.poll() is None and not (run_dir / "plan.json").exists():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    hogs = [
        subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
        for _ in range(3)
    ]
    procs.extend(hogs)
    try:
        while pipeline.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                if all(c["status"] == "done" for c in _plan(run_dir)["cells"]):
                    break
            assert time.monotonic() < deadline + 60, log.read_text()
            time.sleep(0.1)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert pipeline.wait(120) == 3, log.read_text()

    verdict = _verdict(run_dir)
    assert verdict["status"] == "infrastructure_invalid" and verdict["exit_code"] == 3
    sat = next(v for v in verdict["verdicts"] if v["rule"] == "client_saturation")
    assert sat["status"] == "fail", sat
    assert verdict["quality"]["by_reason"]["client_saturated"] > 0
    events = _events(run_dir)
    assert next(e for e in events if e["step"] == "analysis" and e["status"] == "end")["code"] == 3
    assert events[-1]["step"] == "run" and events[-1]["code"] == 3
    assert all(c["status"] == "done" for c in _plan(run_dir)["cells"])
    _assert_bundle_verifies(run_dir, Path(f"{signing_key}.pub"))


# ------------------------------------------------------------------ 5 regression
def test_a_slower_candidate_against_a_baseline_run_is_a_regression_exit_4(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    scale = "0.5"  # decode steps long enough for a 30% slower one to stand out of the noise
    cells = [{"kind": "single", "prompt_tokens": 128, "max_tokens": 16}]
    matrix = _matrix(tmp_path, cells, reps=30)
    rules = str(_relaxed_rules(tmp_path))
    base_sim = _sim(start_sim, scale=scale)
    cand_sim = _sim(start_sim, "--set", "timing.decode_base_ms=15.6", scale=scale)  # 12 × 1.3
    baseline, candidate = tmp_path / "baseline", tmp_path / "candidate"
    m = _manifest(tmp_path, base_sim.url, run_id="baseline", warmup_requests=5)
    args = [*_accept(m, matrix, baseline), "--rules", rules, "--skip-report"]
    assert main(args) == 0, capsys.readouterr().out
    capsys.readouterr()
    m = _manifest(tmp_path, cand_sim.url, run_id="candidate", warmup_requests=5)
    args = [*_accept(m, matrix, candidate), "--rules", rules, "--skip-report"]
    args += ["--baseline-run", str(baseline)]
    code = main(args)
    out = capsys.readouterr().out
    verdict = _verdict(candidate)
    refactor = next(v for v in verdict["verdicts"] if v["rule"] == "refactor")
    assert code == 4, (refactor, out)
    assert verdict["status"] == "performance_regression" and verdict["exit_code"] == 4
    assert verdict["baseline"]["run_id"] == "baseline"
    assert refactor["status"] == "fail", refactor
    tpot = next(
        d
        for d in refactor["details"]
        if (d["metric"], d["statistic"]) == ("tpot_ms", "p50") and d["cell"].startswith("single")
    )
    assert tpot["verdict"] == "regression" and 15 < tpot["delta_pct"] < 45, tpot
    # correctness held: same golden hashes as the baseline, no errors
    status = {v["rule"]: v["status"] for v in verdict["verdicts"]}
    assert status["golden"] == status["error_rate"] == "pass"
    events = _events(candidate)
    assert next(e for e in events if e["step"] == "analysis" and e["status"] == "end")["code"] == 4
    assert events[-1]["code"] == 4
    _assert_bundle_verifies(candidate, accept_env)


# ------------------------------------------------------------------ 6 kill and resume
def _seed_with_first(cells: int, first: int) -> int:
    """A `--seed` whose plan order starts with cell `first` (pipeline._make_plan)."""
    for seed in range(100):
        order = list(range(cells))
        random.Random(f"calculet-plan:{seed}").shuffle(order)
        if order[0] == first:
            return seed
    raise AssertionError("no seed found")


def test_a_killed_run_resumes_without_repeating_finished_cells(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    signing_key: Path,
    procs: list[subprocess.Popen[Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Cell A (10 quick requests) runs first, then cell B (52 arrivals at a constant 4/s,
    13 s). The pipeline is SIGKILLed inside B once B's first records are on disk (the
    sink closes a part every 10 s), then resumed in the same folder."""
    sim = _sim(start_sim)
    cells = [
        {"name": "A", "kind": "single", "prompt_tokens": 128, "max_tokens": 16},
        {"name": "B", "kind": "open", "arrival": "constant", "rate": 4.0, "repetitions": 52,
         "prompt_tokens": 128, "max_tokens": 16},
    ]  # fmt: skip
    matrix = _matrix(tmp_path, cells, reps=10)
    run_dir = tmp_path / "run"
    rules = str(_relaxed_rules(tmp_path))
    args = [*_accept(_manifest(tmp_path, sim.url), matrix, run_dir), "--rules", rules]
    args += ["--seed", str(_seed_with_first(2, 0)), "--skip-report"]
    log = tmp_path / "attempt1.log"
    with log.open("wb") as log_file:
        first = subprocess.Popen(
            [*CLI, *args], stdout=log_file, stderr=subprocess.STDOUT, env=_child_env(signing_key)
        )
    procs.append(first)

    deadline = time.monotonic() + 90
    killed_plan: dict[str, Any] | None = None
    while killed_plan is None:
        assert first.poll() is None, f"the run ended before the kill: {log.read_text()}"
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
        try:
            plan = _plan(run_dir)
        except (OSError, ValueError):
            continue
        status = {c["name"]: c for c in plan["cells"]}
        assert [c["name"] for c in plan["cells"]] == ["A", "B"]
        b = status["B"]
        if status["A"]["status"] != "done" or b["status"] != "running":
            continue
        parts = (run_dir / "client" / "w00").glob("part-*.requests.parquet")
        if any(p.stat().st_mtime_ns > b["started_wall_ns"] for p in parts):
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            killed_plan = plan
    assert first.returncode == -signal.SIGKILL
    cut = [r for r in _records(run_dir) if r["cell"] == "B"]
    assert 0 < len(cut) < 52  # the cut attempt left some records behind
    events_before = len(_events(run_dir))

    # resume: the same command with --resume, in the same folder
    monkeypatch.setenv("CALCULET_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("CALCULET_SIGNING_KEY_FILE", str(signing_key))
    code = main([*args, "--resume"])
    out = capsys.readouterr().out
    assert code == 0, out  # the analysis decides: this run passes

    plan = _plan(run_dir)
    assert plan["attempts"] == 2
    assert plan["excluded"] == [
        {
            "cell": "B",
            "worker": "w00",
            "reason": "interrupted cell attempt (the cell was run again)",
        }
    ]
    cells_after = {c["name"]: c for c in plan["cells"]}
    a, b = cells_after["A"], cells_after["B"]
    assert a == {c["name"]: c for c in killed_plan["cells"]}["A"]  # untouched
    assert a["worker"] == "w00" and b["worker"] == "w00-r1"
    assert a["status"] == b["status"] == "done"

    counts = Counter((r["cell"], r["worker"]) for r in _records(run_dir) if not r["warmup"])
    assert counts[("A", "w00")] == 10  # ran once, before the kill
    assert counts[("A", "w00-r1")] == 0  # not repeated
    assert counts[("B", "w00")] == len(cut)  # the cut attempt, kept
    assert counts[("B", "w00-r1")] == 52  # the full rerun
    assert counts[("golden_before:short", "w00")] == counts[("golden_after:short", "w00-r1")] == 1

    # the resumed attempt's steps: release again, the rest of the matrix, then the end
    resumed = _events(run_dir)[events_before:]
    assert _order(resumed) == ["run", "release", "matrix", "cell", "matrix", *ORDER_TAIL, "run"]
    assert resumed[0]["status"] == "resume" and resumed[0]["attempt"] == 2
    assert [e["cell"] for e in resumed if e["step"] == "cell"] == ["B"] * 2

    # the analysis excludes the cut attempt's records (pre-registered reason)
    verdict = _verdict(run_dir)
    assert verdict["exit_code"] == 0
    assert verdict["quality"]["by_reason"]["interrupted_attempt"] == len(cut)
    table, _ = apply_quality(load_run(str(run_dir)))
    columns = ["ext.cell", "ext.worker", "quality.partition", "quality.reasons"]
    b_rows = [r for r in table.select(columns).to_pylist() if r["ext.cell"] == "B"]
    cut_rows = [r for r in b_rows if r["ext.worker"] == "w00"]
    rerun = [r for r in b_rows if r["ext.worker"] == "w00-r1"]
    assert len(cut_rows) == len(cut) and len(rerun) == 52
    assert all(r["quality.partition"] == "excluded" for r in cut_rows)
    assert all("interrupted_attempt" in r["quality.reasons"] for r in cut_rows)
    assert not any("interrupted_attempt" in (r["quality.reasons"] or "") for r in rerun)
    # the verdict's rows of B are the rerun's (all measured on a quiet host)
    shown = {c["partition"]: c["records"] for c in verdict["cells"] if c["cell"].startswith("B|")}
    assert shown == {
        p: n for p, n in Counter(r["quality.partition"] for r in rerun).items() if p != "excluded"
    }
    _assert_bundle_verifies(run_dir, Path(f"{signing_key}.pub"))


# ------------------------------------------------------------------ 7 the demo
def _failed(run_dir: Path) -> dict[str, str]:
    verdicts = _verdict(run_dir)["verdicts"]
    return {v["rule"]: v["class"] for v in verdicts if v["status"] == "fail"}


@pytest.mark.parametrize(("broken", "expected"), [(None, 0), ("nan", 1)])
def test_the_demo_ends_with_a_signed_report(
    broken: str | None, expected: int, tmp_path: Path, procs: list[subprocess.Popen[Any]]
) -> None:
    """The README's first command (time-scaled further and with fewer repetitions, to
    fit the test suite), run as a user runs it, from another directory."""
    runs = tmp_path / "runs"
    cmd = [*CLI, "demo", "--runs-dir", str(runs), "--time-scale", SCALE, "--repetitions", "5"]
    cmd += ["--broken", broken] if broken else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALCULET_")}
    # a key the environment names is not the demo's: the demo signs with the one it prints
    env["CALCULET_SIGNING_KEY_FILE"] = str(tmp_path / "some-other-key.pem")
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    procs.append(proc)
    out, _ = proc.communicate(timeout=240)
    run_dirs = sorted(p for p in runs.glob("demo-*") if p.is_dir())
    if proc.returncode == 3 and run_dirs and (run_dirs[0] / "verdict.json").exists():
        # The demo judges with the default rules: on this shared 2-core machine, other
        # processes can starve its client, which it then rightly calls invalid (exit 3
        # comes before 1 and 4). What else the verdict says must still hold.
        failed = _failed(run_dirs[0])
        assert "infrastructure" in failed.values(), (failed, out)
        if expected == 0:
            assert set(failed.values()) == {"infrastructure"}, failed
        else:
            assert "no_nonfinite" in failed, failed
        _assert_bundle_verifies(run_dirs[0], runs / "demo-signing-key.pem.pub")
        pytest.skip(f"the machine's load saturated the demo's client: {failed}")
    assert proc.returncode == expected, out
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert f"run folder: {run_dir}" in out
    assert f"exit {expected}: " in out
    if (run_dir / "report.html").exists():  # analysis/report.py may not be in this build
        assert f"report:     {(run_dir / 'report.html').resolve()}" in out
    assert _verdict(run_dir)["exit_code"] == expected
    assert _events(run_dir)[-1] == {**_events(run_dir)[-1], "step": "run", "code": expected}
    _assert_bundle_verifies(run_dir, runs / "demo-signing-key.pem.pub")
    assert not list(runs.glob(".*"))  # the simulator's traces and manifest were cleaned up
    if broken == "nan":  # the counter-example: NaN in a response
        assert "no_nonfinite" in _failed(run_dir)


# ------------------------------------------------------------------ §6.1 matrix
SINGLE = REPO / "configs" / "matrices" / "single.yaml"
PROMPTS = [1, 16, 17, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 40959]


def test_the_section_6_1_matrix_expands_to_every_cell() -> None:
    """12 prompt sizes × outputs 1/32/256 × greedy/seeded × stream true/false, except
    that prompt 40959 with output > 1 does not fit the 40960 context: its two cases are
    boundary cells (judged by the rejection/truncation policy), not performance cells."""
    m = load_matrix(SINGLE)
    cells = m.expanded()
    perf = [c for c in cells if c.kind == "single"]
    boundary = [c for c in cells if c.kind == "boundary"]
    assert len(perf) == 11 * 3 * 2 * 2 + 1 * 1 * 2 * 2 == 136
    assert len(boundary) == 2 and len(cells) == 138
    combos = {(c.prompt_tokens, c.max_tokens, c.temperature, c.stream) for c in perf}
    expected = {
        (p, o, t, s)
        for p in PROMPTS
        for o in (1, 32, 256)
        for t in (0.0, 0.7)
        for s in (True, False)
        if p + o <= 40960
    }
    assert combos == expected
    assert {(c.prompt_tokens, c.max_tokens) for c in boundary} == {(40959, 32), (40959, 256)}
    assert len({c.name for c in cells}) == 138
    assert all(c.concurrency == 1 for c in cells)
    reps = {c.name: m.repetitions_for(c) for c in cells}
    for c in perf:  # spec §8: 100 repetitions for short cells, 30 otherwise
        assert reps[c.name] == (100 if c.prompt_tokens <= 512 and c.max_tokens <= 32 else 30)
    assert all(reps[c.name] == 3 for c in boundary)
    assert reps["single-p128-o32-seeded-nostream"] == 100


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:constrained_layout not applied:UserWarning")
def test_the_full_section_6_1_matrix_runs_at_time_scale(
    tmp_path: Path, start_sim: Callable[..., SimProcess], accept_env: Path
) -> None:
    """Every §6.1 cell once (min_repetitions=1) against a simulator at 1/100 time; the
    verdict lists every cell with its repetitions. The two boundary cells (prompt 40959,
    output > 1) are judged here by the simulator's overflow policy (`reject`: HTTP 400),
    and kept out of the error-rate rule: the analysis has no boundary rule (yet)."""
    sim = _sim(start_sim, scale="0.01")
    manifest = _manifest(tmp_path, sim.url, run_id="single-6-1", warmup_requests=1)
    rules = yaml.safe_load(_relaxed_rules(tmp_path).read_text())
    error_rate = next(r for r in rules["rules"] if r["id"] == "error_rate")
    error_rate["select"] = {"exclude": ["boundary-*", "warmup:*"]}
    rules_path = tmp_path / "rules-6-1.yaml"
    rules_path.write_text(yaml.safe_dump(rules))
    run_dir = tmp_path / "run"
    opts = Options(
        manifest=str(manifest),
        matrix=str(SINGLE),
        golden=str(GOLDEN),
        run_dir=str(run_dir),
        admin_token=ADMIN_TOKEN,
        rules=str(rules_path),
        idle_window_s=1.0,
        idle_timeout_s=30.0,
        idle_gap_s=0.0,
        min_repetitions=1,
        progress=False,
    )
    code = Pipeline(opts).run()
    plan = _plan(run_dir)
    assert len(plan["cells"]) == 138
    assert all(c["status"] == "done" and c["requests"] == 1 for c in plan["cells"])
    per_cell = Counter(r["cell"] for r in _records(run_dir) if not r["warmup"])
    assert all(per_cell[c["name"]] == 1 for c in plan["cells"])
    verdict = _verdict(run_dir)
    assert code == verdict["exit_code"] == 0, [
        v for v in verdict["verdicts"] if v["status"] == "fail"
    ]
    rows: dict[str, list[dict[str, Any]]] = {}
    for row in verdict["cells"]:
        rows.setdefault(row["cell"].split("|")[0], []).append(row)
    # On this shared machine some records may be excluded (client_saturated): the
    # verdict summarizes the measured, throttled and warmup partitions only.
    table, _ = apply_quality(load_run(str(run_dir)))
    cells, parts = table.column("ext.cell"), table.column("quality.partition")
    partition = dict(zip(cells.to_pylist(), parts.to_pylist(), strict=True))
    shown = []
    for c in plan["cells"]:  # every cell, with its repetitions
        if partition[c["name"]] == "excluded":
            continue
        (row,) = rows[c["name"]]
        assert row["records"] == 1 and row["partition"] == partition[c["name"]], row
        if c["name"].startswith("boundary-"):
            assert row["errors_by_class"] == {"http_4xx": 1}, row
        else:
            assert row["ok"] == 1, row
        shown.append(c["name"])
    assert len(shown) >= 138 // 2, "most cells were excluded: the machine was too loaded"
    assert _events(run_dir)[-1]["code"] == 0
    report = run_dir / "report.html"
    if report.exists():  # analysis/report.py may not be in this build
        html = report.read_text()
        missing = [name for name in shown if name not in html]
        assert not missing, missing
    _assert_bundle_verifies(run_dir, accept_env)
