"""What the `calculet-load accept` tests share: the simulator they start, the manifest,
matrix and rules they write, the command line they run, and readers of the run folder's
files (`events.jsonl`, `plan.json`, the Parquet records, `verdict.json`, the bundle).

The fixtures (`signing_key`, `accept_env`, `procs`) are in tests/support/fixtures.py.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from analysis.judge.rules import DEFAULT_RULES
from analysis.sign import load_verify_key, verify
from calculet_drivers.accept.acceptrun import Options
from calculet_drivers.accept.pipeline import Pipeline
from tests.support.simproc import ADMIN_TOKEN, SimProcess

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "calculet_drivers.cli"]  # the `calculet-load` command
SIM_MANIFEST = yaml.safe_load((REPO / "configs" / "manifest.sim.yaml").read_text())
CALBIN = str(SIM_MANIFEST["model"]["calbin_sha256"])
GOLDEN = REPO / "configs" / "golden" / "sim.yaml"
MATRICES = REPO / "configs" / "matrices"
SINGLE = MATRICES / "single.yaml"  # the §6.1 single-request matrix
SCALE = "0.02"  # 50x faster than the simulated device
FAST = ["--idle-window-s", "1", "--idle-timeout-s", "30", "--idle-gap-s", "0.2"]

# The §8 order as the pipeline logs it (consecutive events of one step merged).
ORDER_HEAD = [
    "run", "release", "idle", "golden_before", "crosstalk", "warmup", "matrix", "cell", "matrix",
]  # fmt: skip
ORDER_TAIL = ["golden_after", "resources", "traces", "analysis"]

SMALL_MATRIX: list[dict[str, Any]] = [
    {"kind": "single", "prompt_tokens": 128, "max_tokens": 16},
    {"kind": "closed", "concurrency": 2, "prompt_tokens": 128, "max_tokens": 16},
    {"kind": "open", "arrival": "poisson", "rate": 4.0, "prompt_tokens": 128, "max_tokens": 16},
    {"kind": "burst", "size": 4, "rounds": 2, "prompt_tokens": 128, "max_tokens": 16},
]


def accept_sim(
    start: Callable[..., SimProcess], *args: str, scale: str = SCALE, profile: str | None = "b4"
) -> SimProcess:
    """A simulator serving the manifest's calbin hash, admin API on (the token is
    tests.support.simproc.ADMIN_TOKEN); `profile=None` keeps the simulator's default profile, and
    later `--set` arguments override earlier ones."""
    pre = ["--time-scale", scale, *(["--profile", profile] if profile else [])]
    return start(*pre, "--set", f"versions.calbin_sha256={CALBIN}", *args, faults=True)


def write_manifest(tmp: Path, url: str, run_id: str = "accept-test", **changes: Any) -> Path:
    """The simulator manifest aimed at `url`, with top-level `changes`, written to `tmp`."""
    m = json.loads(json.dumps(SIM_MANIFEST))
    m.update(run_id=run_id, target={"url": url, "protocol": "llama"}, **changes)
    path = tmp / f"manifest-{run_id}.yaml"
    path.write_text(yaml.safe_dump(m, sort_keys=False))
    return path


def write_matrix(tmp: Path, cells: list[dict[str, Any]], name: str = "t", reps: int = 30) -> Path:
    """A matrix of `cells`, `reps` repetitions each (short cells too), written to `tmp`."""
    doc = {"schema": "calculet-matrix/v1", "name": name, "repetitions": reps}
    doc.update(short_repetitions=reps, cells=cells)
    path = tmp / f"matrix-{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def relaxed_rules(
    tmp: Path, name: str = "relaxed", updates: Mapping[str, Mapping[str, Any]] | None = None
) -> Path:
    """The default rules with the client-load infrastructure gates off, and each rule id in
    `updates` updated with its fields, written to `tmp` as `rules-{name}.yaml`.

    This shared 2-core machine's own load must not make a run infrastructure-invalid where
    the test is about something else (test_pipeline.py checks those gates with the default
    rules)."""
    rules = yaml.safe_load(DEFAULT_RULES.read_text())
    rules["infrastructure"]["max_saturated_fraction"] = None
    rules["infrastructure"]["max_send_lag_p99_ms"] = None
    for rule_id, fields in (updates or {}).items():
        next(r for r in rules["rules"] if r["id"] == rule_id).update(fields)
    path = tmp / f"rules-{name}.yaml"
    path.write_text(yaml.safe_dump(rules))
    return path


def accept_args(manifest: Path, matrix: Path, run_dir: Path, *extra: str) -> list[str]:
    """`calculet-load accept` arguments: the golden set, the short idle window, `extra`."""
    args = ["accept", "--manifest", str(manifest), "--matrix", str(matrix)]
    return [*args, "--golden", str(GOLDEN), "--run-dir", str(run_dir), *FAST, *extra]


def run_pipeline(
    manifest: Path, matrix: Path, run_dir: Path, rules: Path, min_repetitions: int | None
) -> int:
    """Run `accept` in this process (no gap between cells, no progress); its exit code."""
    opts = Options(
        manifest=str(manifest),
        matrix=str(matrix),
        golden=str(GOLDEN),
        run_dir=str(run_dir),
        admin_token=ADMIN_TOKEN,
        rules=str(rules),
        idle_window_s=1.0,
        idle_timeout_s=30.0,
        idle_gap_s=0.0,
        min_repetitions=min_repetitions,
        progress=False,
    )
    return Pipeline(opts).run()


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every event of the run's `events.jsonl`, in order."""
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x]


def step_order(events: list[dict[str, Any]]) -> list[str]:
    """The steps of `events`, consecutive events of one step merged."""
    steps: list[str] = []
    for e in events:
        if not steps or steps[-1] != e["step"]:
            steps.append(e["step"])
    return steps


def read_plan(run_dir: Path) -> dict[str, Any]:
    """The run's `plan.json`."""
    return json.loads((run_dir / "plan.json").read_text())  # type: ignore[no-any-return]


def record_rows(run_dir: Path) -> list[dict[str, Any]]:
    """(cell, worker, warmup, id) of every request record on disk."""
    parts = sorted((run_dir / "client").glob("*/part-*.requests.parquet"))
    if not parts:
        return []
    t = pa.concat_tables([pq.read_table(p) for p in parts])
    cols = ("ext.cell", "ext.worker", "quality.warmup", "request_id")
    return [
        dict(zip(("cell", "worker", "warmup", "id"), row, strict=True))
        for row in zip(*(t.column(c).to_pylist() for c in cols), strict=True)
    ]


def read_verdict(run_dir: Path) -> dict[str, Any]:
    """The run's `verdict.json`."""
    return json.loads((run_dir / "verdict.json").read_text())  # type: ignore[no-any-return]


def assert_bundle_verifies(run_dir: Path, pubkey: Path) -> None:
    """The run folder's signed bundle verifies with `pubkey`: nothing modified or missing."""
    result = verify(str(run_dir), load_verify_key(str(pubkey)))
    assert result.ok, (result.modified, result.missing, result.added, result.signature)


def child_env(signing_key: Path) -> dict[str, str]:
    """The environment of an `accept` child process: admin token and signing key file."""
    env = dict(os.environ, CALCULET_ADMIN_TOKEN=ADMIN_TOKEN, PYTHONUNBUFFERED="1")
    env.pop("CALCULET_SIGNING_KEY", None)
    env["CALCULET_SIGNING_KEY_FILE"] = str(signing_key)
    return env
