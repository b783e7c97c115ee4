"""The built-in conversation workload in `calculet-load accept`: a matrix's closed cell runs
its concurrency as concurrent sessions, an open cell's Poisson arrivals start sessions,
and every turn is a record of its session (the manifest's target speaks llama.cpp's
native protocol; the conversations go to its chat endpoint)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.acceptkit import (
    accept_sim,
    relaxed_rules,
    run_pipeline,
    write_manifest,
    write_matrix,
)
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(240)


def test_conversation_cells_run_sessions_of_turns(
    tmp_path: Path, start_sim: Callable[..., SimProcess]
) -> None:
    sim = accept_sim(start_sim)
    mix = tmp_path / "sessions.yaml"
    mix.write_text(
        "schema: calculet-mix/v1\nname: sessions\nentries:\n"
        "  - {name: chat, kind: conversation, weight: 1, turns: 3, prompt_tokens: 32,"
        " max_tokens: 8, system_prompt_tokens: 64, think_time_s: 0.05, think: exponential}\n"
    )
    cells = [
        {"name": "sessions-c2", "kind": "closed", "concurrency": 2, "mix": str(mix)},
        {"name": "sessions-poisson", "kind": "open", "arrival": "poisson", "rate": 4.0,
         "mix": str(mix)},
    ]  # fmt: skip
    run_dir = tmp_path / "run"
    manifest = write_manifest(tmp_path, sim.url, run_id="conv", warmup_requests=1)
    code = run_pipeline(manifest, write_matrix(tmp_path, cells, reps=4), run_dir,
                        relaxed_rules(tmp_path), None)  # fmt: skip
    assert code == 0, (run_dir / "verdict.json").read_text()
    parts = sorted((run_dir / "client").glob("*/part-*.requests.parquet"))
    rows = pa.concat_tables([pq.read_table(p) for p in parts]).to_pylist()
    sessions: dict[str, list[dict[str, object]]] = defaultdict(list)
    for r in rows:
        if r["ext.session_id"] is not None:
            sessions[r["ext.session_id"]].append(r)
    by_cell = defaultdict(list)
    for turns in sessions.values():
        assert [t["ext.turn"] for t in sorted(turns, key=lambda t: t["ext.turn"])] == [0, 1, 2]
        assert {t["ext.protocol"] for t in turns} == {"openai-chat"}
        assert all(t["ext.error_class"] is None for t in turns)
        by_cell[turns[0]["ext.cell"]].append(turns)
    # each cell's 4 arrivals started 4 sessions; the open cell's first turns keep their
    # intended instant, later turns follow the one before
    assert {c: len(s) for c, s in by_cell.items()} == {"sessions-c2": 4, "sessions-poisson": 4}
    for turns in by_cell["sessions-poisson"]:
        first, *later = sorted(turns, key=lambda t: t["ext.turn"])
        assert first["ext.intended_start_ns"] is not None and first["ext.arrival"] == "poisson"
        assert all(t["ext.intended_start_ns"] is None for t in later)
    for turns in by_cell["sessions-c2"]:
        assert {t["workload.concurrency"] for t in turns} == {2}
