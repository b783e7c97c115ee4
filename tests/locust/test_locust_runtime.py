"""Locust's `--run-time` lasts its whole length with our locustfile (a real run).

libev times a new timer from the loop's cached clock; the locustfile's imports and our
init listeners left that clock about 2 s behind, so a 6 s run stopped after about 4 s
(calculet_load.locust.plugin refreshes it at the end of its init listener).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from calculet_load.measure import native
from tests.support.locustproc import LOCUSTFILE
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(120)

STAMP = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] [^ ]+/INFO/locust\.main: "


def _stamp(log: str, message: str) -> datetime:
    found = re.search(STAMP + re.escape(message), log, re.MULTILINE)
    assert found is not None, f"no {message!r} line in Locust's log:\n{log[-3000:]}"
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")


def test_a_short_run_lasts_its_whole_run_time(
    start_sim: Callable[..., SimProcess], tmp_path: Path
) -> None:
    sim = start_sim("--time-scale", "0.02")
    run_time_s = 3
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "-H", sim.url,
         "-u", "1", "-r", "1", "-t", f"{run_time_s}s", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=90, cwd=tmp_path, check=False,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    # the process says which code reads its responses (what a request costs its CPU)
    assert f"calculet-load's compiled modules: {native.STATE}" in log, log[-3000:]
    armed = _stamp(log, f"Run time limit set to {run_time_s} seconds")
    reached = _stamp(log, "--run-time limit reached")
    # a busy machine only makes the run longer; shorter is the stale clock (ms stamps)
    assert (reached - armed).total_seconds() >= run_time_s - 0.01, log[-3000:]


def test_a_closed_loop_against_a_target_that_went_down_pauses_between_refusals(
    tmp_path: Path,
) -> None:
    """The target answers the start's check, then stops listening: each user pauses after
    a refused connect (50 ms, doubling to 1 s) instead of failing as fast as the client
    can, and the run is judged as one that measured nothing (exit 3), never as a client
    that saturated itself."""
    import pyarrow.parquet as pq

    from tests.measure.test_hostile import SHORT_LLAMA, http
    from tests.support.hostile import RESET, serve
    from tests.support.llamacpp import tokenizer_path

    run_dir = tmp_path / "run"
    with serve([http(SHORT_LLAMA)], [RESET]) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "-H", srv.url,
             "--target-profile", "llama.cpp", "--tokenizer", str(tokenizer_path()),
             "--rtt-samples", "0", "-u", "2", "-r", "2", "-t", "5s", "--run-dir", str(run_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while srv.played < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)  # the start's check was answered: the target goes away
    log, _ = proc.communicate(timeout=90)
    assert proc.returncode == 3, log[-3000:]
    assert "measured nothing" in log, log[-3000:]
    assert "did not keep up" not in log and "saturated" not in log, log[-3000:]
    parts = sorted(run_dir.glob("client/*/part-*.requests.parquet"))
    classes = [c for p in parts for c in pq.read_table(p).column("ext.error_class").to_pylist()]
    # 2 users x 5 s at 50, 100, 200, 400, 800, 1000 ms pauses: about 16 requests, not
    # the thousands a hot loop sends. At least one per user: on a busy machine the
    # start-up (tokenizer, prompts) takes most of the run (hence 5 s).
    assert 2 <= len(classes) <= 40, len(classes)
    # (a request that raced the server's going away was reset, not answered)
    assert "connect_refused" in classes and set(classes) <= {"connect_refused", "connection_reset"}
