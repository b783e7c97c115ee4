"""Locust master + worker processes against the simulator, all on loopback.

Each test runs a real headless master with two worker processes (or one local process)
against a real time-scaled simulator, then reads what the run left: the workers' Parquet
parts, the master's `client/index.json` and Locust's own final stats.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from scipy import stats

from calculet_load.workload.arrivals import intended_times
from tests.support.locustproc import LocustRun
from tests.support.simproc import PATIENT_QUEUE, SimProcess

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def locust_run(tmp_path: Path) -> Iterator[Callable[..., LocustRun]]:
    runs: list[LocustRun] = []

    def start(host: str, *args: str, workers: int = 2, run_time_s: float = 10.0) -> LocustRun:
        run = LocustRun(tmp_path, host, list(args), workers=workers, run_time_s=run_time_s)
        runs.append(run.start())
        return run

    yield start
    for r in runs:
        r.stop()


def _col(table, name):  # type: ignore[no-untyped-def]
    return table.column(name).to_pylist()


def test_open_loop_poisson_across_two_workers(
    start_sim: Callable[..., SimProcess], locust_run: Callable[..., LocustRun]
) -> None:
    rate, run_s, delay = 40.0, 14.0, 2.0
    # fast enough that the mix (with 16K prompts) never fills the sim's admission queue
    # and a queue that waits rather than rejects: on a busy machine the sim may fall
    # behind, which must not turn into failures (this test is about the arrivals)
    sim = start_sim(
        *("--profile", "b16", "--time-scale", "0.005"),
        *PATIENT_QUEUE,
        *("--set", "scheduling.kv_budget_tokens=100000000"),
    )
    run = locust_run(
        sim.url,
        "--arrival", "poisson", "--rate", str(rate), "--seed", "7",
        "--mix", "mixed-70-20-10", "--max-in-flight", "512", "--start-delay", str(delay),
        "-u", "2", "-r", "2",
        run_time_s=run_s,
    )  # fmt: skip
    assert run.wait() == 0, run.log_text()
    t = run.requests()
    index = run.index()

    # both workers wrote parts, the index lists them, and it is complete
    assert index["status"] == "complete", index
    workers = {w["worker"]: w for w in index["workers"]}
    assert set(workers) == {"w00", "w01"}
    per_worker = {w: sum(1 for x in _col(t, "ext.worker") if x == w) for w in workers}
    for name, w in workers.items():
        assert w["status"] == "reported" and w["parts"], w
        assert w["requests"] + w["dropped"] == per_worker[name]
    # the union of the two slots is one schedule: shares about half each
    assert abs(per_worker["w00"] - per_worker["w01"]) < 0.2 * len(t)

    # Locust's own rows (one per mix entry, one event per request) count exactly the
    # requests that were sent and finished
    sent = pc.invert(pc.fill_null(t.column("ext.dropped"), False))
    cut = pc.equal(pc.fill_null(t.column("ext.cancelled_at"), ""), "run_stop")
    counted = int(pc.sum(pc.and_(sent, pc.invert(cut))).as_py() or 0)
    rows = run.locust_stats()
    assert set(rows) <= {"short", "medium", "long"}, rows.keys()
    assert sum(r["num_requests"] for r in rows.values()) == counted

    # intended arrival times: one Poisson process at the target rate (same host: one clock)
    intended = np.sort(np.array(_col(t, "ext.intended_start_ns"), dtype=np.int64))
    gaps_s = np.diff(intended) / 1e9
    assert stats.kstest(gaps_s, "expon", args=(0, 1 / rate)).pvalue > 0.01
    # every intended time is exactly the k-th arrival of the seeded global schedule
    # The schedule's origin on the monotonic clock: each record gives it as its intended
    # instant minus the wall time of that instant after the origin (its wall anchor, read
    # just before its send, less its send lag). An anchor read late (the thread preempted
    # between its wall and monotonic reads: 8.5 ms once on a busy machine) is off by the
    # delay, so the median of all the records' figures, not the first record's.
    plan = index["plan"]
    lag_ns = np.array([x or 0.0 for x in _col(t, "ext.send_lag_ms")]) * 1e6
    origin_mono = int(
        np.median(
            np.array(_col(t, "ext.intended_start_ns"), dtype=np.float64)
            - (np.array(_col(t, "ext.wall_anchor_ns"), dtype=np.float64) - plan["origin_wall_ns"])
            + lag_ns
        )
    )
    rel_s = (intended - origin_mono) / 1e9
    # workers get the stop at slightly different instants: compare up to the first stop
    workers_col = np.array(_col(t, "ext.worker"))[np.argsort(_col(t, "ext.intended_start_ns"))]
    t_end = min(rel_s[workers_col == w].max() for w in ("w00", "w01"))
    rel_s = rel_s[rel_s <= t_end + 1e-6]
    expected = np.array(intended_times("poisson", 7, rate, t_end + 0.5))
    expected = expected[expected <= t_end + 0.001]
    assert len(rel_s) == len(expected)
    assert np.abs(rel_s - expected).max() < 0.005  # wall/monotonic anchor read jitter
    # and the achieved rate is the target's: |n - rate*T| within 4 Poisson SDs (n ~ 450,
    # so within about 19 %; the law itself is checked to 1 % in test_arrivals.py)
    span_s = rel_s[-1]
    assert abs(len(rel_s) - rate * span_s) < 4 * np.sqrt(rate * span_s)
    # and each was sent at its time: open loop, not delayed by responses. On its time: the
    # median send within a few ms. Not held by responses: requests overlap beyond the 2
    # users (a closed loop keeps at most one in flight per user), and the tail stays
    # bounded (a sender held by responses falls behind for good: 2 users serve 2/e2e,
    # 15/s at a quiet 137-ms e2e, and the lag would grow through the run to seconds).
    # The tail's size is the machine's: in the parallel phase, a dozen other processes on
    # 2 cores, both workers' sends stalled together for up to 1.1 s (P99 0.69-0.81 s),
    # their self-watch seeing a 50-ms loop lag at 12 % CPU: starved, not busy. The
    # client's own check flags such a run (send_lag, exit 3; tests/locust/test_accuracy.py).
    lag = np.array([x for x in _col(t, "ext.send_lag_ms") if x is not None])
    late = sorted(
        (round(x, 1), round((i - origin_mono) / 1e9, 3), w)
        for x, i, w in zip(
            _col(t, "ext.send_lag_ms"),
            _col(t, "ext.intended_start_ns"),
            _col(t, "ext.worker"),
            strict=True,
        )
        if x is not None
    )[-8:]
    assert np.percentile(lag, 50) < 20, (np.percentile(lag, [50, 99, 100]), late)
    assert np.percentile(lag, 99) < 2000, (np.percentile(lag, [50, 99, 100]), late)
    sent_at = np.array(_col(t, "client_ns.request_start"), dtype=np.float64)
    ended_at = np.array(_col(t, "client_ns.response_end"), dtype=np.float64)
    overlap = max(int(((sent_at <= s) & (ended_at > s)).sum()) for s in sent_at)
    assert overlap > 3 * 2, overlap
    # the mix: all three entries of §6.3 occur, short most often
    cells = _col(t, "ext.cell")
    assert cells.count("short") > cells.count("medium") > cells.count("long") > 0


def test_overload_drops_are_counted_and_arrivals_stay_independent(
    start_sim: Callable[..., SimProcess], locust_run: Callable[..., LocustRun]
) -> None:
    rate = 20.0
    # B1 at full time scale: one 128/32 request takes ~1.5 s, so 4 in flight per worker
    # (8 in all) serve ~5/s: at 20/s most arrivals find the cap full.
    sim = start_sim("--profile", "default")
    run = locust_run(
        sim.url,
        "--arrival", "poisson", "--rate", str(rate), "--seed", "3",
        "--max-in-flight", "4", "--start-delay", "1", "--late-ms", "20",
        "-u", "2", "-r", "2",
        run_time_s=9.0,
    )  # fmt: skip
    assert run.wait() == 0, run.log_text()
    t = run.requests()
    dropped = pc.fill_null(t.column("ext.dropped"), False)
    n_dropped = int(pc.sum(dropped).as_py() or 0)
    assert n_dropped > len(t) / 3, (n_dropped, len(t))
    assert all(
        c == "dropped"
        for c, d in zip(_col(t, "ext.error_class"), _col(t, "ext.dropped"), strict=True)
        if d
    )
    assert sum(w["dropped"] for w in run.index()["workers"]) == n_dropped
    # the schedule did not slow down: arrivals (sent or dropped) still come at the rate
    intended = np.sort(np.array(_col(t, "ext.intended_start_ns"), dtype=np.int64))
    achieved = (len(intended) - 1) / ((intended[-1] - intended[0]) / 1e9)
    assert achieved == pytest.approx(rate, rel=0.25)
    assert stats.kstest(np.diff(intended) / 1e9, "expon", args=(0, 1 / rate)).pvalue > 0.01


def test_a_killed_worker_leaves_readable_parts_and_an_incomplete_run(
    start_sim: Callable[..., SimProcess], locust_run: Callable[..., LocustRun]
) -> None:
    sim = start_sim("--profile", "b16", "--time-scale", "0.05")
    run = locust_run(
        sim.url, "--arrival", "constant", "--rate", "20", "--start-delay", "1",
        "-u", "2", "-r", "2",
        run_time_s=16.0,
    )  # fmt: skip
    victim = run.procs[2]  # the second worker
    # let it write at least one part (the sink rotates every 10 s), then kill it hard
    deadline = time.monotonic() + 30
    parts_dir = run.run_dir / "client"
    while time.monotonic() < deadline:
        if len(list(parts_dir.glob("*/part-*.requests.parquet"))) >= 2:
            break
        time.sleep(0.3)
    victim.send_signal(signal.SIGKILL)
    run.wait()
    index = run.index()
    assert index["status"] == "incomplete", index
    states = {w["worker"]: w["status"] for w in index["workers"]}
    assert sorted(states.values()) == ["missing", "reported"], states
    t = run.requests()  # every closed part of both workers reads
    assert set(_col(t, "ext.worker")) == {"w00", "w01"}


def test_a_burst_fires_across_workers_within_a_measured_spread(
    start_sim: Callable[..., SimProcess], locust_run: Callable[..., LocustRun]
) -> None:
    sim = start_sim("--profile", "b16", "--time-scale", "0.05")
    run = locust_run(
        sim.url, "--arrival", "burst", "--burst-size", "16", "--burst-every", "3",
        "--start-delay", "1", "--burst-lead", "1", "-u", "2", "-r", "2",
        run_time_s=8.0,
    )  # fmt: skip
    assert run.wait() == 0, run.log_text()
    t = run.requests()
    ids = _col(t, "ext.burst_id")
    assert all(ids)
    bursts = run.index()["bursts"]
    assert len(bursts) >= 2
    for b in bursts:
        members = [i for i, x in enumerate(ids) if x == b["id"]]
        if not members:
            continue  # the last burst may fall after the stop
        assert len(members) == 16
        workers = {_col(t, "ext.worker")[i] for i in members}
        assert workers == {"w00", "w01"}
        # Every worker aims at the master's one instant: on one host the workers' clocks
        # are one clock (their measured offsets about 0), so their intended instants
        # agree to the offset's error. How far the actual sends spread is the machine's
        # scheduling, not the mechanism's (a busy CI phase stretched it to 725 ms): it
        # is measured and recorded, and checked here as a measurement, not bounded
        # (benchmarks/worker_capacity.py has the figures on a quiet machine).
        intended = np.array([_col(t, "ext.intended_start_ns")[i] for i in members], np.int64)
        assert (intended.max() - intended.min()) / 1e6 < 5, intended
        sent = np.array([_col(t, "ext.wall_anchor_ns")[i] for i in members], dtype=np.int64)
        assert (sent.min() - b["fire_at_wall_ns"]) / 1e6 > -5  # never before the instant
        spread_ms = (sent.max() - sent.min()) / 1e6
        assert b["spread_ms"] == pytest.approx(spread_ms, abs=1.0), (b, spread_ms)


def test_closed_loop_records_concurrency_and_token_counts(
    start_sim: Callable[..., SimProcess], locust_run: Callable[..., LocustRun]
) -> None:
    sim = start_sim("--profile", "b4", "--time-scale", "0.05")
    run = locust_run(
        sim.url, "--prompt-tokens", "64", "--max-tokens", "16", "-u", "4", "-r", "4",
        workers=0, run_time_s=6.0,
    )  # fmt: skip
    assert run.wait() == 0, run.log_text()
    t = run.requests()
    ok = [c is None for c in _col(t, "ext.error_class")]
    assert sum(ok) >= 10
    assert set(_col(t, "workload.concurrency")) == {4}
    assert set(_col(t, "ext.arrival")) == {"closed"}
    for i, good in enumerate(ok):
        if good:
            assert _col(t, "workload.actual_output_tokens")[i] == 16
            assert _col(t, "ext.server_output_tokens")[i] == 16
    assert run.index()["status"] == "complete"
