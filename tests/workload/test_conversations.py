"""The built-in conversation workload against the simulator's prefix cache, end to end:
real `locust` runs of 8 concurrent sessions of 4 turns, then `calculet-load analyze`.

With the cache on, a turn's TTFT falls as its cached share rises (the first sessions'
first turns find nothing cached; every later turn finds the shared system prompt and its
history), and each record's `ext.cached_prompt_tokens` is what the simulator's trace says
it served. With the cache off, every record says 0 and TTFT grows with the context.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.locustproc import LOCUSTFILE, LocustRun
from tests.support.simproc import SimProcess

pytestmark = [pytest.mark.timeout(240), pytest.mark.quiet]

CLI = str(Path(sys.executable).parent / "calculet-load")
MIX = (
    "schema: calculet-mix/v1\nname: sessions\nentries:\n"
    "  - {name: chat, kind: conversation, weight: 1, turns: 4, prompt_tokens: 256,"
    " max_tokens: 8, system_prompt_tokens: 1024}\n"
)


def _conversations(tmp: Path, *sim_args: str) -> tuple[list[dict[str, Any]], Path]:
    """8 sessions at a time for 10 s against a B8 simulator at half time; the records
    that succeeded, and the run folder (analysed)."""
    mix = tmp / "sessions.yaml"
    mix.write_text(MIX)
    sim = SimProcess(tmp, "--profile", "b8", "--time-scale", "0.5",
                     "--trace-dir", str(tmp / "traces"), *sim_args)  # fmt: skip
    try:
        run = LocustRun(
            tmp,
            sim.url,
            ["--protocol", "openai-chat", "--mix", str(mix), "-u", "8", "-r", "8"],
            workers=0,
            run_time_s=10,
            locustfile=LOCUSTFILE,
        ).start()
        assert run.wait() == 0, run.log_text()
    finally:
        sim.stop()
    done = subprocess.run([CLI, "analyze", str(run.run_dir), "--quiet"], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [r for r in run.requests().to_pylist() if r["ext.error_class"] is None]
    return rows, run.run_dir


def _median_ttft(rows: list[dict[str, Any]]) -> float:
    return float(np.median([r["durations_ms.ttft"] for r in rows]))


def test_with_the_cache_ttft_falls_as_the_cached_share_rises(tmp_path: Path) -> None:
    rows, run_dir = _conversations(tmp_path)
    share = {
        r["request_id"]: r["ext.cached_prompt_tokens"] / r["workload.prompt_tokens"] for r in rows
    }
    cold = [r for r in rows if share[r["request_id"]] == 0]
    warm = [r for r in rows if share[r["request_id"]] >= 0.75]
    assert len(cold) >= 4 and len(warm) >= 40, (len(cold), len(warm))
    # the first sessions' first turns (nothing cached) against turns whose system prompt
    # and history were cached: the simulator's prefill costs only what is not cached
    # (about 0.4 on a quiet machine; a busy one adds the simulator's own lag to both)
    assert _median_ttft(warm) < 0.65 * _median_ttft(cold), (_median_ttft(warm), _median_ttft(cold))
    # every record's cached tokens are the simulator's own (its `admitted` row)
    admitted = {}
    for line in (run_dir / "server" / "server_events.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev.get("event") == "admitted":
            admitted[ev["request_id"]] = ev["detail"]["cached_tokens"]
    assert all(admitted[r["request_id"]] == r["ext.cached_prompt_tokens"] for r in rows)
    # the analysis says the same by cached share: its first bin's TTFT above its last's
    with open(run_dir / "conversations.csv", newline="") as f:
        by_share = {g["group"]: g for g in csv.DictReader(f) if g["by"] == "cached_share"}
    assert float(by_share["0"]["p50"]) > 1.5 * float(by_share["(75, 100%]"]["p50"]), by_share


def test_without_the_cache_none_is_reported_and_ttft_grows_with_the_context(
    tmp_path: Path,
) -> None:
    rows, _ = _conversations(tmp_path, "--set", "prefix_cache.enabled=false")
    assert rows and {r["ext.cached_prompt_tokens"] for r in rows} == {0}
    turns: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        turns[r["ext.turn"]].append(r)
    assert set(turns) == {0, 1, 2, 3} and all(len(t) >= 8 for t in turns.values()), turns.keys()
    contexts = [np.median([r["workload.prompt_tokens"] for r in turns[k]]) for k in range(4)]
    assert contexts[3] > 1.5 * contexts[0]  # 1024 + 256, then 256 + 8 more each turn
    # every turn prefills its whole context: the last turn's TTFT above the first's
    assert _median_ttft(turns[3]) > 1.2 * _median_ttft(turns[0]), [
        _median_ttft(turns[k]) for k in range(4)
    ]
