"""A distributed `calculet-load accept` against the real simulator.

`--workers N` starts N local Locust worker processes; `--master` waits for workers
started by hand with the documented `locust -f locustfiles/calculet.py --worker …`
command, as on remote client hosts. The runs are judged from their own files: the
Parquet records (which worker sent which request), `client/index.json`, `plan.json`.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from calculet_load.workload.dispatch import Share, split
from calculet_load.workload.matrix import Cell
from calculet_load.workload.mixes import load_mix, single
from tests.support.acceptkit import (
    CLI,
    REPO,
    SMALL_MATRIX,
    accept_args,
    accept_sim,
    child_env,
    read_events,
    read_plan,
    record_rows,
    relaxed_rules,
    write_manifest,
    write_matrix,
)
from tests.support.ports import free_port
from tests.support.simproc import SimProcess


# ------------------------------------------------------------------ the split (pure)
@pytest.mark.parametrize("processes", [1, 2, 3, 5])
def test_split_sends_every_request_once_whatever_the_number_of_processes(processes: int) -> None:
    mix = single(128, 16)
    cases = [
        (Cell(kind="single"), 31),
        (Cell(kind="closed", concurrency=4), 30),
        (Cell(kind="closed", concurrency=1), 7),
        (Cell(kind="burst", size=8, rounds=3), 24),
    ]
    for cell, reps in cases:
        steps = split(cell, mix, reps, 11, processes)
        assert all(len(step) == processes for step in steps)
        keys = [k for step in steps for s in step if s for k in s.indexes()]
        assert sorted(keys) == list(range(reps)), (cell.kind, processes)
        if cell.kind == "closed":
            (step,) = steps
            assert sum(s.users for s in step if s) == cell.concurrency
            for s in step:  # repetitions in proportion to the users: within one round
                if s:
                    assert abs(s.count - reps * s.users / cell.concurrency) <= s.users
        if cell.kind == "burst":
            assert len(steps) == cell.rounds
            for r, step in enumerate(steps):
                got = sorted(k for s in step if s for k in s.indexes())
                assert got == list(range(r * cell.size, (r + 1) * cell.size))
        if cell.kind == "single":
            (step,) = steps
            assert step[0] is not None and step[0].count == reps
            assert all(s is None for s in step[1:])  # one request at a time: one process


def test_an_open_loop_cell_gives_each_process_one_slot_of_one_schedule() -> None:
    cell = Cell(kind="open", rate=4.0)
    (step,) = split(cell, single(128, 16), 20, 3, 3)
    assert [(s.slot, s.slots, s.count) for s in step if s] == [(0, 3, 20), (1, 3, 20), (2, 3, 20)]


def test_a_share_crosses_the_wire_unchanged() -> None:
    cell = Cell(name="mixed", kind="open", rate=2.0, mix="mixed-70-20-10")
    share = split(cell, load_mix("mixed-70-20-10"), 10, 5, 2)[0][1]
    assert share is not None
    again = Share.from_wire(share.to_wire())
    assert again == share
    # the mix travels with the share: a remote host needs no mix file
    assert again.mix.entries == load_mix("mixed-70-20-10").entries


# ------------------------------------------------------------------ end to end
def _by_cell_worker(run_dir: Path) -> dict[str, collections.Counter[str]]:
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in record_rows(run_dir):
        out[r["cell"]][r["worker"]] += 1
    return out


def test_local_workers_share_every_load_shape_and_the_index_lists_them(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    procs: list[subprocess.Popen[Any]],
) -> None:
    sim = accept_sim(start_sim)
    run_dir = tmp_path / "run"
    matrix = write_matrix(tmp_path, SMALL_MATRIX)
    args = accept_args(write_manifest(tmp_path, sim.url), matrix, run_dir, "--min-repetitions", "8")
    args += ["--rules", str(relaxed_rules(tmp_path)), "--workers", "2", "--skip-report"]
    p = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    cells = _by_cell_worker(run_dir)
    # the sequential steps stay in the pipeline's own process (w00)
    assert {w for c, ws in cells.items() if c.startswith(("golden", "warmup")) for w in ws} == {
        "w00"
    }
    single_cell = next(c for c in cells if c.startswith("single"))
    assert cells[single_cell] == {"w01": 8}  # one request at a time: one process
    for prefix in ("c2-", "poisson", "burst"):
        name = next(c for c in cells if c.startswith(prefix))
        assert set(cells[name]) == {"w01", "w02"}, (name, cells[name])
    burst = next(c for c in cells if c.startswith("burst"))
    assert sum(cells[burst].values()) == 4 * 2  # size 4 × 2 rounds, every request once
    closed = next(c for c in cells if c.startswith("c2-"))
    assert cells[closed] == {"w01": 4, "w02": 4}

    index = json.loads((run_dir / "client" / "index.json").read_text())
    workers = {w["worker"]: w for w in index["workers"]}
    assert set(workers) == {"w00", "w01", "w02"}
    assert len({w["pid"] for w in workers.values()}) == 3  # three processes
    for name in ("w01", "w02"):
        assert workers[name]["parts"], name
        assert "clock_anchor" in workers[name]
        assert (run_dir / "client" / name / "worker.json").exists()
        # the master measured the worker's clock (one host: offset about 0)
        sync = workers[name]["master_clock_sync"]
        assert abs(sync["master_offset_ns"]) <= sync["master_rtt_ns"] // 2 + 200_000, sync
    for name in ("w00", "w01", "w02"):  # RTT to the target from every sending process
        assert workers[name]["target_rtt"]["before"]["health"]["n"] == 8, workers[name]
    events = read_events(run_dir)
    order = [e["step"] for e in events]
    assert order.index("workers") < order.index("golden_before") < order.index("matrix")
    cell_events = [e for e in events if e["step"] == "cell"]
    assert len(cell_events) == 2 * len(SMALL_MATRIX)
    for e in cell_events:  # the device as each cell starts and ends (§8, per round)
        assert e["device"]["temperature_c"] > 0 and e["device"]["throttled_chips"] >= 0, e
    port = next(e["port"] for e in events if e["step"] == "workers" and e["status"] == "start")
    assert _workers_on_port(port) == []  # the local workers ended with the run
    assert list((run_dir / "logs" / "spool").iterdir()) == []  # every part was sent


def _workers_on_port(port: int) -> list[int]:
    """Locust workers of the master on `port` still running."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "--worker" in cmd and str(port) in cmd:
            found.append(proc.pid)
    return found


def test_the_master_takes_workers_started_with_the_documented_locust_command(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    procs: list[subprocess.Popen[Any]],
    signing_key: Path,
) -> None:
    sim = accept_sim(start_sim)
    run_dir = tmp_path / "run"
    port = free_port()
    matrix = write_matrix(tmp_path, SMALL_MATRIX[1:3])
    args = accept_args(write_manifest(tmp_path, sim.url), matrix, run_dir, "--min-repetitions", "6")
    args += ["--rules", str(relaxed_rules(tmp_path)), "--skip-report", "--master"]
    args += ["--expect-workers", "1", "--master-bind-host", "127.0.0.1"]
    args += ["--master-bind-port", str(port)]
    env = child_env(signing_key)
    master = subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
    )
    procs.append(master)
    # what a client host runs (docs/acceptance.md, "Several client processes and hosts")
    worker_cmd = [sys.executable, "-m", "locust", "-f", "locustfiles/calculet.py", "--worker"]
    worker_cmd += ["--master-host", "127.0.0.1", "--master-port", str(port)]
    worker = subprocess.Popen(
        worker_cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    procs.append(worker)
    out, _ = master.communicate(timeout=300)
    assert master.returncode == 0, out[-3000:]
    assert worker.wait(30) == 0  # the master's quit ends the worker
    cells = _by_cell_worker(run_dir)
    for prefix in ("c2-", "poisson"):
        name = next(c for c in cells if c.startswith(prefix))
        assert cells[name] == {"w01": 6}, cells[name]


def test_no_worker_connecting_is_an_infrastructure_stop(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
) -> None:
    sim = accept_sim(start_sim)
    run_dir = tmp_path / "run"
    args = accept_args(
        write_manifest(tmp_path, sim.url), write_matrix(tmp_path, SMALL_MATRIX[:1]), run_dir
    )
    args += ["--master", "--master-bind-host", "127.0.0.1"]
    args += ["--master-bind-port", str(free_port()), "--workers-timeout-s", "2"]
    p = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stdout[-2000:]
    assert "0 of 1 worker(s) connected within 2 s" in p.stdout


def test_a_lost_worker_stops_the_run_and_a_resume_finishes_without_repeating_cells(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    procs: list[subprocess.Popen[Any]],
    signing_key: Path,
) -> None:
    sim = accept_sim(start_sim)
    run_dir = tmp_path / "run"
    cells = [
        {"kind": "closed", "concurrency": 2, "prompt_tokens": 128, "max_tokens": 16,
         "name": f"c2-{i}"}
        for i in range(4)
    ]  # fmt: skip
    manifest = write_manifest(tmp_path, sim.url)
    matrix = write_matrix(tmp_path, cells)
    base = accept_args(manifest, matrix, run_dir, "--min-repetitions", "12", "--idle-gap-s", "1")
    base += ["--rules", str(relaxed_rules(tmp_path)), "--skip-report", "--workers", "2"]
    env = child_env(signing_key)
    first = subprocess.Popen(
        [*CLI, *base], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
    )
    procs.append(first)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and first.poll() is None:
        plan = read_plan(run_dir) if (run_dir / "plan.json").exists() else {"cells": []}
        if any(c["status"] == "done" for c in plan["cells"]):
            break
        time.sleep(0.2)
    workers = [c for c in psutil.Process(first.pid).children() if "locust" in " ".join(c.cmdline())]
    assert len(workers) == 2
    workers[0].kill()
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 3, out[-3000:]
    assert "local worker process exited" in out
    spools = list((run_dir / "logs" / "spool").iterdir())
    assert len(spools) == 1  # the killed worker's spool stays with the run
    done_before = {c["name"] for c in read_plan(run_dir)["cells"] if c["status"] == "done"}
    assert done_before and len(done_before) < 4

    again = subprocess.run([*CLI, *base, "--resume"], capture_output=True, text=True, env=env,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:]
    plan = read_plan(run_dir)
    assert all(c["status"] == "done" for c in plan["cells"])
    by_cell = _by_cell_worker(run_dir)
    for name in done_before:  # finished cells were not sent again
        assert set(by_cell[name]) <= {"w01", "w02"}, by_cell[name]
    resumed = {c["name"] for c in plan["cells"]} - done_before
    for name in resumed:
        assert {"w01-r1", "w02-r1"} <= set(by_cell[name]), by_cell[name]
    cut = {e["cell"] for e in plan["excluded"]}
    assert cut <= resumed  # the cell cut by the lost worker is excluded, then run again
