"""Locust users you program (`calculet_load.locust.LLMUser`), end to end: real `locust`
processes running the users' own locustfiles against a real simulator on loopback.

Each call is one record, one Locust request event and its LLM figures; Locust's own
scheduling runs a closed loop, calculet's dispatcher an open loop or bursts of the same
user code; token events reach listeners as they arrive on the default engine; streams are
read and cancelled as they go; the generated text is never written anywhere.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import stats

from tests.support.locustproc import LocustRun
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parents[1] / "data" / "llmusers"
EXAMPLES = REPO / "locustfiles" / "examples"
CLI = str(Path(sys.executable).parent / "calculet-load")


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    """One real-time simulator (its decode steps ~25 ms: streams last long enough to be
    read while they arrive), its traces kept for the join."""
    tmp = tmp_path_factory.mktemp("llmuser-sim")
    proc = SimProcess(tmp, "--trace-dir", str(tmp / "traces"))
    yield proc
    proc.stop()


def _run(
    tmp: Path, sim: SimProcess, locustfile: Path, args: list[str], run_s: float = 8.0, **env: str
) -> LocustRun:
    os.environ.update(env)
    try:
        run = LocustRun(tmp, sim.url, args, workers=0, run_time_s=run_s, locustfile=str(locustfile))
        run.start()
        code = run.wait()
    finally:
        for key in env:
            os.environ.pop(key, None)
    assert code == 0, run.log_text()
    return run


def _rows(t: pa.Table, *cols: str) -> list[dict[str, Any]]:
    return t.select(list(cols)).to_pylist()


def _completed(t: pa.Table) -> list[dict[str, Any]]:
    """Records of requests that were sent and not cut by the run's stop."""
    rows = _rows(t, "ext.dropped", "ext.cancelled_at", "ext.cell")
    return [r for r in rows if not r["ext.dropped"] and r["ext.cancelled_at"] != "run_stop"]


def test_the_two_turn_user_runs_unchanged(tmp_path: Path, sim: SimProcess) -> None:
    run = _run(tmp_path, sim, EXAMPLES / "two_turns.py",
               ["--protocol", "openai-chat", "-u", "2", "-r", "2"])  # fmt: skip
    t = run.requests()
    rows = _rows(t, "ext.cell", "ext.error_class", "durations_ms.ttft", "durations_ms.tpot",
                 "workload.prompt_tokens", "ext.protocol", "ext.arrival")  # fmt: skip
    ok = [r for r in rows if r["ext.error_class"] is None]
    assert {r["ext.cell"] for r in rows} == {"turn1", "turn2"}
    for cell in ("turn1", "turn2"):
        mine = [r for r in ok if r["ext.cell"] == cell]
        assert len(mine) >= 3, rows
        assert all(r["durations_ms.ttft"] > 0 and r["durations_ms.tpot"] > 0 for r in mine)
        assert all(
            r["ext.protocol"] == "openai-chat" and r["ext.arrival"] == "closed" for r in mine
        )
    turn1 = {r["workload.prompt_tokens"] for r in ok if r["ext.cell"] == "turn1"}
    turn2 = {r["workload.prompt_tokens"] for r in ok if r["ext.cell"] == "turn2"}
    assert min(turn2) > max(turn1)  # turn 2 carries turn 1 and its answer
    # Locust's Aggregated count is the completed records, each named by its call
    stats_rows = run.locust_stats()
    assert set(stats_rows) == {"turn1", "turn2"}
    assert sum(r["num_requests"] for r in stats_rows.values()) == len(_completed(t))
    # the run folder analyses like any other: cells by the calls' names
    out = subprocess.run([CLI, "analyze", str(run.run_dir)], capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_an_open_loop_runs_the_users_task_on_its_schedule(tmp_path: Path, sim: SimProcess) -> None:
    rate = 4.0
    run = _run(tmp_path, sim, DATA / "open_user.py",
               ["--arrival", "poisson", "--rate", str(rate), "-u", "1", "-r", "1",
                "--start-delay", "1"], run_s=14)  # fmt: skip
    t = run.requests()
    rows = _rows(t, "ext.cell", "ext.arrival", "ext.intended_start_ns", "ext.error_class",
                 "ext.ttft_from_intended_ms", "durations_ms.ttft", "ext.dropped")  # fmt: skip
    assert len(rows) >= 25, rows  # about rate x 12 s
    assert all(r["ext.cell"] == "ask" and r["ext.arrival"] == "poisson" for r in rows)
    assert all(r["ext.intended_start_ns"] is not None for r in rows)
    ok = [r for r in rows if r["ext.error_class"] is None]
    # from the intended arrival: at least the TTFT from the send
    assert ok and all(r["ext.ttft_from_intended_ms"] >= r["durations_ms.ttft"] - 0.01 for r in ok)
    intended = np.sort(np.array([r["ext.intended_start_ns"] for r in rows], dtype=np.int64))
    gaps_s = np.diff(intended) / 1e9
    assert stats.kstest(gaps_s, "expon", args=(0, 1 / rate)).pvalue > 0.01


def test_a_class_attribute_paces_bursts_of_the_users_task(tmp_path: Path, sim: SimProcess) -> None:
    args = ["--protocol", "openai-chat", "--burst-size", "6", "-u", "1", "-r", "1"]
    run = _run(tmp_path, sim, DATA / "burst_user.py", args, run_s=6)
    rows = _rows(run.requests(), "ext.cell", "ext.burst_id", "ext.arrival", "ext.error_class")
    assert len(rows) == 6, rows
    assert {r["ext.arrival"] for r in rows} == {"burst"} and len(
        {r["ext.burst_id"] for r in rows}
    ) == 1
    assert all(r["ext.error_class"] is None and r["ext.cell"] == "burst" for r in rows)


def test_a_first_token_listener_fires_as_the_token_arrives(tmp_path: Path, sim: SimProcess) -> None:
    """On the default engine: each request's first token is seen by its listener after
    its arrival stamp and before the response ended (40 tokens at ~25 ms: about a second
    later), not when the request ends; no stamp moved for it."""
    log = tmp_path / "hooks.jsonl"
    _run(tmp_path, sim, DATA / "hooks.py", ["-u", "2", "-r", "2"], run_s=6, HOOK_LOG=str(log))
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    done = [r for r in rows if r["ok"]]
    assert len(done) >= 4, rows
    for r in done:
        assert r["seen_ns"] is not None and r["arrival_ns"] == r["t4"], r
        assert r["t4"] <= r["seen_ns"] < r["t6"], r


def test_streams_are_read_as_they_arrive_and_cancelled(tmp_path: Path, sim: SimProcess) -> None:
    run = _run(tmp_path, sim, DATA / "streams.py", ["-u", "2", "-r", "2"], run_s=6)
    rows = _rows(run.requests(), "ext.cell", "ext.error_class", "ext.cancelled_at",
                 "ext.client_output_tokens")  # fmt: skip
    by_cell: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["ext.cancelled_at"] != "run_stop":
            by_cell[r["ext.cell"]].append(r)
    assert set(by_cell) == {"streamed", "nested"}, by_cell.keys()  # a TaskSet's task too
    for r in by_cell["streamed"]:  # left after its third event: cancelled, tokens kept
        assert r["ext.error_class"] == "cancelled" and r["ext.cancelled_at"] == "mid_stream"
        assert 3 <= r["ext.client_output_tokens"] < 32, r
    for r in by_cell["nested"]:  # cancel_after_tokens=2
        assert r["ext.error_class"] == "cancelled" and 2 <= r["ext.client_output_tokens"] < 8


def test_a_calculet_user_subclass_runs_its_own_task(tmp_path: Path, sim: SimProcess) -> None:
    run = _run(tmp_path, sim, DATA / "subclass.py", ["-u", "2", "-r", "2"], run_s=5)
    cells = {r["ext.cell"] for r in _completed(run.requests())}
    assert cells == {"mine"}  # the built-in workload's task did not run beside it


def test_a_conversation_mix_sends_each_session_its_history(tmp_path: Path, sim: SimProcess) -> None:
    mix = tmp_path / "conv.yaml"
    mix.write_text(
        "schema: calculet-mix/v1\nname: conv\nentries:\n"
        "  - {name: chat, kind: conversation, weight: 1, turns: 3, prompt_tokens: 32,"
        " max_tokens: 8, system_prompt_tokens: 64}\n"
    )
    args = ["--protocol", "openai-chat", "--mix", str(mix), "-u", "3", "-r", "3"]
    run = _run(tmp_path, sim, REPO / "locustfiles" / "calculet.py", args, run_s=8)
    rows = _rows(run.requests(), "ext.session_id", "ext.turn", "workload.prompt_tokens",
                 "ext.error_class", "ext.cell")  # fmt: skip
    sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        assert r["ext.cell"] == "chat" and r["ext.session_id"], r
        sessions[r["ext.session_id"]].append(r)
    whole = [
        s for s in sessions.values() if len(s) == 3 and all(r["ext.error_class"] is None for r in s)
    ]
    assert len(whole) >= 3, sessions
    for turns in whole:
        turns.sort(key=lambda r: r["ext.turn"])
        assert [r["ext.turn"] for r in turns] == [0, 1, 2]
        sizes = [r["workload.prompt_tokens"] for r in turns]
        # the system prompt and the first message are 64 and 32 tokens as lone messages,
        # chat template included (about 6 each); each later turn adds the answer before
        # it (8 tokens, as the server encodes their text again) and its own message
        assert sizes[0] >= 64 + 32 - 8, sizes
        assert all(b - a >= 30 for a, b in itertools.pairwise(sizes)), sizes


def test_no_text_is_written_anywhere(tmp_path: Path, sim: SimProcess) -> None:
    spy = tmp_path / "spy.jsonl"
    run = _run(tmp_path, sim, DATA / "spy.py", ["--protocol", "openai-chat", "-u", "1", "-r", "1"],
               run_s=5, SPY_LOG=str(spy))  # fmt: skip
    out = subprocess.run([CLI, "analyze", str(run.run_dir)], capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    report = subprocess.run([CLI, "report", str(run.run_dir)], capture_output=True, text=True,
                            timeout=120, check=False)  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    texts = {"Tell me about the sea, in the old words.", "And the sky above the harbour?"}
    for line in spy.read_text().splitlines():
        texts |= {t for t in json.loads(line) if len(t) >= 20}
    assert len(texts) >= 3  # the prompts and at least one answer of 16 tokens
    places: list[str] = [out.stdout, out.stderr, report.stdout, report.stderr, run.log_text()]
    for path in run.run_dir.rglob("*"):
        if path.suffix == ".parquet":  # every string value of every column, decompressed
            table = pq.read_table(path)
            for col in table.columns:
                if pa.types.is_string(col.type) or pa.types.is_dictionary(col.type):
                    places += [str(v) for v in col.to_pylist() if v is not None]
        elif path.is_file():
            places.append(path.read_text(errors="replace"))
    assert (run.run_dir / "report.html").exists()
    leaked = [t for t in texts if any(t in p for p in places)]
    assert not leaked, leaked


def test_a_master_and_two_workers_run_the_users(tmp_path: Path, sim: SimProcess) -> None:
    args = ["--protocol", "openai-chat", "-u", "4", "-r", "4"]
    example = str(EXAMPLES / "two_turns.py")
    run = LocustRun(tmp_path, sim.url, args, workers=2, run_time_s=8, locustfile=example).start()
    assert run.wait() == 0, run.log_text()
    rows = _rows(run.requests(), "ext.cell", "ext.worker", "ext.error_class")
    done = [r for r in rows if r["ext.error_class"] is None]
    assert {r["ext.worker"] for r in done} == {"w00", "w01"}
    assert {r["ext.cell"] for r in done} == {"turn1", "turn2"}
    assert run.index()["status"] == "complete"
