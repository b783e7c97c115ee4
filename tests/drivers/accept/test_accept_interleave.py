"""`calculet-load accept --interleave-with TARGET` against two simulators.

The candidate is the manifest's target; TARGET is the baseline. The tests check the
interleaving from the runs' own event logs (cell start times), the ABBA positions in
`plan.json`, and the comparison in `verdict.json`.
"""

from __future__ import annotations

import collections
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.sign import load_verify_key, verify
from calculet_load.schema.crosstalk import CELL_PREFIX as CROSSTALK_PREFIX
from tests.support.acceptkit import (
    CLI,
    accept_args,
    accept_sim,
    child_env,
    read_events,
    read_plan,
    read_verdict,
    record_rows,
    relaxed_rules,
    write_manifest,
    write_matrix,
)
from tests.support.simproc import SimProcess


def _cell_starts(run_dir: Path) -> dict[str, int]:
    return {
        e["cell"]: e["wall_ns"]
        for e in read_events(run_dir)
        if e["step"] == "cell" and e["status"] == "start"
    }


def test_a_slower_interleaved_baseline_comparison_is_a_regression_exit_4(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    signing_key: Path,
) -> None:
    scale = "0.5"  # decode steps long enough for a 30% slower one to stand out of the noise
    base_sim = accept_sim(start_sim, scale=scale)
    cand_sim = accept_sim(start_sim, "--set", "timing.decode_base_ms=15.6", scale=scale)  # 12 × 1.3
    cells = [
        {"kind": "single", "prompt_tokens": 128, "max_tokens": 16},
        {"kind": "single", "prompt_tokens": 256, "max_tokens": 16},
    ]
    run_dir = tmp_path / "run"
    manifest = write_manifest(tmp_path, cand_sim.url, run_id="ab", warmup_requests=5)
    args = accept_args(manifest, write_matrix(tmp_path, cells, reps=30), run_dir)
    args += ["--rules", str(relaxed_rules(tmp_path)), "--interleave-with", base_sim.url]
    p = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=child_env(signing_key), timeout=400
    )
    assert p.returncode == 4, p.stdout[-3000:] + p.stderr[-2000:]

    baseline = run_dir / "baseline"
    verdict = read_verdict(run_dir)
    assert verdict["baseline"]["run_id"] == "ab-baseline"
    refactor = next(v for v in verdict["verdicts"] if v["rule"] == "refactor")
    assert refactor["status"] == "fail", refactor
    # both targets ran every §8 step; the baseline's folder is a complete run
    for folder in (run_dir, baseline):
        steps = {e["step"] for e in read_events(folder)}
        assert {"release", "idle", "golden_before", "warmup", "golden_after"} <= steps, folder
        assert (folder / "client" / "index.json").exists()
        assert (folder / "server" / "steps.jsonl").exists()
    given = yaml.safe_load((baseline / "manifest.yaml").read_text())
    assert given["target"]["url"] == base_sim.url and given["run_id"] == "ab-baseline"
    # ABBA: the first cell of the plan ran candidate first, the second baseline first
    cand_plan, base_plan = read_plan(run_dir), read_plan(baseline)
    assert [c["name"] for c in cand_plan["cells"]] == [c["name"] for c in base_plan["cells"]]
    first, second = (c["name"] for c in cand_plan["cells"])
    cs, bs = _cell_starts(run_dir), _cell_starts(baseline)
    assert cs[first] < bs[first] < bs[second] < cs[second], (cs, bs)
    assert [c["interleave_position"] for c in cand_plan["cells"]] == [0, 1]
    assert [c["interleave_position"] for c in base_plan["cells"]] == [1, 0]
    assert cand_plan["interleaved_with"]["url"] == base_sim.url
    # the candidate's signed bundle covers the baseline's files too
    key = load_verify_key(f"{signing_key}.pub")
    assert verify(str(run_dir), key).ok
    (baseline / "client" / "index.json").write_text("{}")
    assert [m.name for m in verify(str(run_dir), key).modified] == ["baseline/client/index.json"]


@pytest.mark.slow  # a combination of two tested parts; `scripts/test --slow` runs it
def test_interleaving_with_local_workers_sends_both_targets_from_the_workers(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    signing_key: Path,
) -> None:
    base_sim, cand_sim = accept_sim(start_sim), accept_sim(start_sim)
    cells: list[dict[str, Any]] = [
        {"kind": "closed", "concurrency": 2, "prompt_tokens": 128, "max_tokens": 16},
        {"kind": "burst", "size": 4, "rounds": 2, "prompt_tokens": 128, "max_tokens": 16},
    ]
    run_dir = tmp_path / "run"
    manifest = write_manifest(tmp_path, cand_sim.url, run_id="ab2")
    # the baseline given as a manifest file (as for another build)
    base_manifest = write_manifest(tmp_path, base_sim.url, run_id="ab2-base")
    args = accept_args(manifest, write_matrix(tmp_path, cells), run_dir, "--min-repetitions", "8")
    args += ["--rules", str(relaxed_rules(tmp_path)), "--skip-report", "--workers", "2"]
    args += ["--interleave-with", str(base_manifest)]
    p = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=child_env(signing_key), timeout=400
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert read_verdict(run_dir)["baseline"]["run_id"] == "ab2-base"
    for folder in (run_dir, run_dir / "baseline"):
        senders: dict[str, set[str]] = collections.defaultdict(set)
        for r in record_rows(folder):
            senders[r["cell"]].add(r["worker"])
        # the sequential steps (golden, warm-up, crosstalk) stay in the pipeline's process
        sequential = ("golden", "warmup", CROSSTALK_PREFIX)
        assert {w for c in senders if c.startswith(sequential) for w in senders[c]} <= {"w00"}
        matrix_cells = [c for c in senders if not c.startswith(sequential)]
        assert len(matrix_cells) == 2, senders
        for c in matrix_cells:
            assert senders[c] == {"w01", "w02"}, (folder, c, senders[c])
        index = json.loads((folder / "client" / "index.json").read_text())
        assert {w["worker"] for w in index["workers"]} == {"w00", "w01", "w02"}
