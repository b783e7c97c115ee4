"""Pre-registered exclusions, counted with their reasons (analysis.tables.quality)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pytest

from analysis.errors import ArtifactError
from analysis.tables.join import load_run
from analysis.tables.quality import apply_quality
from calculet_load.schema.records import RequestRecord
from calculet_load.schema.selfwatch import (
    HELD_SHARE_LIMIT,
    SATURATED_CPU_PERCENT,
    SATURATED_LAG_MS,
)
from tests.support.runs import MS, WALL0, RunBuilder, request, selfwatch

S = 1_000 * MS


def _run(tmp_path: Path) -> str:
    b = RunBuilder(tmp_path)
    # self-watch of w00 every second; the 3 s sample (covering (2 s, 3 s]) saw 6 ms lag
    b.watch += [selfwatch("w00", k * S, lag_ms=6.0 if k == 3 else 1.0) for k in (1, 2, 3, 4)]
    # every request lasts 90.1 ms (TTFT 50 ms + 4 × 10 ms + 0.1 ms)
    b.add(request("a", t0=1_200 * MS))  # inside (1 s, 2 s]: clean
    b.add(request("b", t0=1_950 * MS))  # 1.95 → 2.0401 s reaches the lagging sample
    b.add(request("c", t0=3_500 * MS))  # (3 s, 4 s]: clean
    b.add(request("d", t0=2_500 * MS, error="http_5xx"))  # a failure is flagged too
    b.add(request("e", t0=100 * MS, quality={"warmup": True}))
    b.add(request("f", t0=3_600 * MS, error="dropped", ext={"dropped": True}))
    b.add(request("g", t0=3_700 * MS, error="cancelled", ext={"cancelled_at": "run_stop"}))
    b.add(request("h", t0=1_300 * MS, quality={"clock_complete": False}))
    b.add(request("i", t0=5_200 * MS))  # inside the declared break
    b.add(request("j", t0=3_650 * MS, quality={"throttled": True}))
    b.add(request("k", t0=2_400 * MS, worker="w01"))  # w01 has no self-watch: not flagged
    b.add(request("l", t0=3_800 * MS, error="cancelled", ext={"cancelled_at": "first_token"}))
    run_dir = b.write()
    breaks = {
        "schema": "calculet-network-breaks/v1",
        "breaks": [
            {"start_wall_ns": WALL0 + 5_000 * MS, "end_wall_ns": WALL0 + 5_500 * MS, "reason": "x"}
        ],
    }
    (tmp_path / "network_breaks.json").write_text(json.dumps(breaks))
    return run_dir


def test_every_record_gets_one_partition_and_every_reason_is_counted(tmp_path: Path) -> None:
    table, q = apply_quality(load_run(_run(tmp_path)))
    part = dict(
        zip(
            table.column("request_id").to_pylist(),
            table.column("quality.partition").to_pylist(),
            strict=True,
        )
    )
    assert part == {
        "a": "measured",
        "b": "excluded",
        "c": "measured",
        "d": "excluded",
        "e": "warmup",
        "f": "dropped",
        "g": "cut_at_stop",
        "h": "excluded",
        "i": "excluded",
        "j": "throttled",
        "k": "measured",
        "l": "measured",
    }
    assert q.by_reason == {
        "dropped": 1,
        "cut_at_stop": 1,
        "warmup": 1,
        "clock_incomplete": 1,
        "network_break": 1,
        "client_saturated": 2,
        "interrupted_attempt": 0,
    }
    assert q.by_partition == {
        "measured": 4,
        "excluded": 4,
        "warmup": 1,
        "dropped": 1,
        "cut_at_stop": 1,
        "throttled": 1,
    }
    assert (q.records, q.sent, q.successes) == (12, 11, 8)  # successes: a b c e h i j k
    assert q.workers_without_selfwatch == ("w01",)
    assert q.saturated == 2 and q.clock_incomplete_successes == 1
    reasons = dict(
        zip(
            table.column("request_id").to_pylist(),
            table.column("quality.reasons").to_pylist(),
            strict=True,
        )
    )
    assert reasons["b"] == "client_saturated"
    assert reasons["a"] is None


def test_cpu_saturation_uses_the_shared_limit(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    b.watch += [
        selfwatch("w00", 1 * S, cpu=SATURATED_CPU_PERCENT + 1),
        selfwatch("w00", 2 * S, cpu=SATURATED_CPU_PERCENT),  # at the limit: not saturated
        selfwatch("w00", 3 * S, lag_ms=SATURATED_LAG_MS),  # at the limit: not saturated
    ]
    b.add(request("x", t0=500 * MS)).add(request("y", t0=1_500 * MS))
    b.add(request("z", t0=2_500 * MS))
    table, q = apply_quality(load_run(b.write()))
    assert table.column("quality.client_saturated").to_pylist() == [True, False, False]
    assert q.saturated == 1


def _flags(table: pa.Table) -> dict[str, bool]:
    """Each record's `quality.client_saturated`, by its request id."""
    ids = table.column("request_id").to_pylist()
    return dict(zip(ids, table.column("quality.client_saturated").to_pylist(), strict=True))


def _kernel(
    rid: str, t0: int, held_ms: float = 0.1, arrival: str = "poisson", **ext: object
) -> RequestRecord:
    """An open-loop request (sent 0.2 ms after its schedule unless told) whose stamps are
    the kernel's receive times, on a kept-alive connection unless told, written
    `held_ms` after its start stamp."""
    own = {"stamp_source": "kernel", "stamp_late_bound_ms": 0.0, "connection_reused": True}
    if arrival != "closed":
        own["send_lag_ms"] = 0.2
    rec = request(rid, t0=t0, arrival=arrival, ext={**own, **ext})
    sent = t0 + int(held_ms * MS)
    return dataclasses.replace(rec, client_ns=dataclasses.replace(rec.client_ns, headers_sent=sent))


def test_open_loop_kernel_stamped_records_are_judged_by_their_own_bounds(tmp_path: Path) -> None:
    """Loop lag bounds stamps taken on the loop and the loop's sends, not the kernel's
    stamps nor a send timed against its schedule: an open-loop kernel-stamped record
    under a sample that saw only loop lag is judged by its own bounds (send lag, start
    to sent, and its first token's late bound there); a closed-loop one without a
    turnaround is not (its user's next request waits for the loop); a CPU-saturated
    sample flags every record it covers."""
    b = RunBuilder(tmp_path)
    b.watch += [
        selfwatch("w00", 1 * S, lag_ms=8.0, cpu=30.0),
        selfwatch("w00", 2 * S, cpu=SATURATED_CPU_PERCENT + 5),
        selfwatch("w00", 3 * S),
        selfwatch("w00", 4 * S),
    ]
    b.add(request("read", t0=500 * MS, ext={"send_lag_ms": 0.2}))  # read stamps: flagged
    b.add(_kernel("kernel", t0=600 * MS))  # the kernel's stamps, open loop: not flagged
    b.add(_kernel("closed", t0=650 * MS, arrival="closed"))  # closed loop: flagged
    b.add(_kernel("cpu", t0=1_500 * MS))  # under the CPU sample: flagged
    # a late bound is the most a stamp can be late (a server's burst makes it the
    # prefill): it flags only under a sample that saw loop lag
    b.add(_kernel("late", t0=2_100 * MS, stamp_late_bound_ms=SATURATED_LAG_MS + 1))
    b.add(_kernel("late, lagged", t0=800 * MS, stamp_late_bound_ms=SATURATED_LAG_MS + 1))
    b.add(_kernel("at", t0=850 * MS, stamp_late_bound_ms=SATURATED_LAG_MS))  # the limit
    b.add(_kernel("held", t0=2_300 * MS, held_ms=SATURATED_LAG_MS + 1))
    # a new connection: its connect (5.5 ms) is the network's wait, not the client's
    b.add(_kernel("new", t0=2_400 * MS, held_ms=6.0, connection_reused=False, connect_ms=5.5))
    # ... unless it was not recorded (records from before ext.connect_ms): not judged
    b.add(_kernel("old", t0=2_500 * MS, held_ms=60.0, connection_reused=False))
    # a stale retry's start and send were its retry's: neither is judged
    b.add(_kernel("retry", t0=2_600 * MS, held_ms=60.0, send_lag_ms=60.0, stale_retry=True))
    b.add(_kernel("sent late", t0=2_700 * MS, send_lag_ms=SATURATED_LAG_MS + 1))
    # under the lag sample and past its own bound: judged by the bound, flagged
    b.add(_kernel("lagged", t0=700 * MS, held_ms=SATURATED_LAG_MS + 1))
    b.add(_kernel("clean", t0=3_500 * MS))
    table, q = apply_quality(load_run(b.write()))
    flagged = _flags(table)
    assert flagged == {
        "read": True,
        "kernel": False,
        "closed": True,
        "cpu": True,
        "late": False,
        "late, lagged": True,
        "at": False,
        "held": True,
        "new": False,
        "old": False,
        "retry": False,
        "sent late": True,
        "lagged": True,
        "clean": False,
    }
    assert q.saturated == 7
    assert q.lag_judged_by_own_bounds == 4  # "kernel", "lagged", "late, lagged", "at"
    assert q.saturated_by_own_bounds == 4  # "late, lagged", "held", "sent late", "lagged"


def _closed(
    rid: str,
    t0: int,
    turnaround_ms: float | None,
    *,
    ms: float,
    cell: str,
    worker: str = "w00",
    held_ms: float = 0.1,
    late_ms: float = 0.0,
) -> RequestRecord:
    """A closed-loop kernel-stamped request of 2 streams, `ms` from t0 to t6 (5 tokens),
    written `held_ms` after t0, whose user the client held `turnaround_ms` around it."""
    pace = int((ms - 0.1) * MS / 5)
    own = {
        "stamp_source": "kernel",
        "stamp_late_bound_ms": late_ms,
        "connection_reused": True,
        "turnaround_ms": turnaround_ms,
    }
    rec = request(
        rid, t0=t0, ttft=pace, tpot=pace, cell=cell, worker=worker, concurrency=2, ext=own
    )
    sent = t0 + int(held_ms * MS)
    return dataclasses.replace(rec, client_ns=dataclasses.replace(rec.client_ns, headers_sent=sent))


def test_a_closed_loop_cell_is_judged_by_how_long_the_client_held_its_users(
    tmp_path: Path,
) -> None:
    """A closed-loop kernel-stamped cell is judged, per worker, by the client's hold of
    its users (ext.turnaround_ms), not by a loop-lag sample: held when the mean hold per
    request passes SATURATED_LAG_MS and its share of the users' time passes
    HELD_SHARE_LIMIT, and then every request of it is flagged."""
    b = RunBuilder(tmp_path)
    b.watch += [selfwatch("w00", k * S, lag_ms=8.0 if k == 1 else 0.0) for k in range(1, 5)]
    b.watch += [selfwatch("w01", k * S) for k in range(1, 5)]

    def add(rid: str, t0_ms: int, turn: float | None, ms: float, cell: str, **kw: object) -> None:
        b.add(_closed(rid, t0_ms * MS, turn, ms=ms, cell=cell, **kw))

    # the loop stalled once (the 8-ms sample), but the users were held 0.5 ms a request
    add("calm-1", 600, 0.5, 40.0, "calm")
    add("calm-2", 700, 0.5, 40.0, "calm")
    add("calm-slow", 2_100, 0.5, 40.0, "calm", held_ms=SATURATED_LAG_MS + 1)  # its own bound
    # a late bound flags under the loop-lag sample only (a burst makes it the prefill)
    add("calm-late", 2_150, 0.5, 40.0, "calm", late_ms=SATURATED_LAG_MS + 1)
    add("calm-late-lagged", 750, 0.5, 40.0, "calm", late_ms=SATURATED_LAG_MS + 1)
    # stopped 100 ms in every 110: held 96 ms a request, 88 % of the users' time
    add("starved-1", 2_200, 96.0, 13.0, "starved")
    add("starved-2", 2_400, 96.0, 13.0, "starved")
    add("starved-failed", 2_600, None, 13.0, "starved")  # no turnaround: its cell's
    add("starved-other-worker", 2_200, 0.5, 13.0, "starved", worker="w01")  # judged apart
    # waves at 256 streams: 12 ms a request, but 1.7 % of 680-ms requests
    add("waves", 3_000, 12.0, 680.0, "waves")
    # 1-ms requests: a round trip of 0.7 ms is 41 % of the users' time, and no stall
    add("short", 3_200, 0.7, 1.0, "short")
    # a mean at the limit does not pass it
    add("at-limit", 3_300, SATURATED_LAG_MS, 20.0, "at-limit")
    # a closed-loop cell without turnarounds (records from before them): loop lag judges
    add("old", 650, None, 40.0, "old")
    table, q = apply_quality(load_run(b.write()))
    flagged = _flags(table)
    assert flagged == {
        "calm-1": False,
        "calm-2": False,
        "calm-slow": True,
        "calm-late": False,
        "calm-late-lagged": True,
        "starved-1": True,
        "starved-2": True,
        "starved-failed": True,
        "starved-other-worker": False,
        "waves": False,
        "short": False,
        "at-limit": False,
        "old": True,
    }
    holds = {(h["cell"], h["worker"]): h for h in q.closed_loop_holds}
    starved = holds[("starved|c2|closed|stream", "w00")]
    assert starved["held"] and starved["records"] == 2 and starved["mean_hold_ms"] == 96.0
    assert starved["held_share"] == pytest.approx(96 / (96 + 13), abs=1e-4)
    assert q.closed_loop_holds[0] is starved  # most held first
    assert not holds[("waves|c2|closed|stream", "w00")]["held"]
    assert holds[("waves|c2|closed|stream", "w00")]["held_share"] == pytest.approx(
        12 / 692, abs=1e-4
    )
    assert not holds[("starved|c2|closed|stream", "w01")]["held"]
    assert ("old|c2|closed|stream", "w00") not in holds
    assert q.lag_judged_by_own_bounds == 3  # "calm-1", "calm-2", "calm-late-lagged"
    # "calm-slow", "calm-late-lagged" and the starved cell's three
    assert q.saturated_by_own_bounds == 5
    assert q.thresholds["held_share"] == HELD_SHARE_LIMIT


def test_a_record_with_several_reasons_is_counted_under_each(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    b.watch += [selfwatch("w00", S, lag_ms=50.0)]
    b.add(request("x", t0=500 * MS, quality={"warmup": True, "clock_complete": False}))
    table, q = apply_quality(load_run(b.write()))
    assert table.column("quality.partition").to_pylist() == ["warmup"]
    assert table.column("quality.reasons").to_pylist() == [
        "warmup;clock_incomplete;client_saturated"
    ]
    assert q.by_reason["warmup"] == q.by_reason["clock_incomplete"] == 1


def test_the_records_of_an_interrupted_cell_attempt_are_excluded(tmp_path: Path) -> None:
    """A resumed pipeline run lists the attempt it cut in plan.json "excluded": the
    records of that cell by that worker leave the measured set; the rerun stays."""
    b = RunBuilder(tmp_path)
    b.add(request("cut1", t0=1_000 * MS, cell="poisson4-p128-o16", worker="w00"))
    b.add(request("cut2", t0=1_100 * MS, cell="poisson4-p128-o16", worker="w00"))
    b.add(request("done", t0=500 * MS, cell="c2-p128-o16", worker="w00"))
    b.add(request("rerun", t0=9_000 * MS, cell="poisson4-p128-o16", worker="w00-r1"))
    b.add(request("other", t0=9_500 * MS, cell="c2-p128-o16", worker="w00-r1"))
    run_dir = b.write()
    plan = {
        "schema": "calculet-plan/v1",
        "attempts": 2,
        "cells": [],
        "excluded": [
            {
                "cell": "poisson4-p128-o16",
                "worker": "w00",
                "reason": "interrupted cell attempt (the cell was run again)",
            }
        ],
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    table, q = apply_quality(load_run(run_dir))
    ids = table.column("request_id").to_pylist()
    part = dict(zip(ids, table.column("quality.partition").to_pylist(), strict=True))
    reasons = dict(zip(ids, table.column("quality.reasons").to_pylist(), strict=True))
    assert part == {
        "cut1": "excluded",
        "cut2": "excluded",
        "done": "measured",
        "rerun": "measured",
        "other": "measured",
    }
    assert reasons["cut1"] == reasons["cut2"] == "interrupted_attempt"
    assert q.by_reason["interrupted_attempt"] == 2
    assert q.by_partition == {"excluded": 2, "measured": 3}


def test_a_malformed_plan_exclusion_is_an_artifact_error(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path)
    b.add(request("x", t0=500 * MS))
    run_dir = b.write()
    (tmp_path / "plan.json").write_text(json.dumps({"excluded": [{"worker": "w00"}]}))
    with pytest.raises(ArtifactError, match=r"plan\.json: excluded\[0\]"):
        apply_quality(load_run(run_dir))


def test_warmup_samples_are_not_judged_and_the_load_still_is(tmp_path: Path) -> None:
    """The worker's start-up (warm-up sample, saturated by building prompts)
    flags nothing; a saturated sample of the load still flags its requests."""
    b = RunBuilder(tmp_path)
    start_up = dataclasses.replace(
        selfwatch("w00", 100 * MS, lag_ms=SATURATED_LAG_MS * 4, cpu=99.0), warmup=True
    )
    b.watch += [
        start_up,  # covers (.., 100 ms]: prompts, tokenization, connections
        selfwatch("w00", 1_100 * MS),  # covers (100, 1100] ms: clean
        selfwatch("w00", 2_100 * MS, lag_ms=SATURATED_LAG_MS * 4),  # (1100, 2100] saturated
    ]
    # x runs in the clean sample only, y in the saturated one
    b.add(request("x", t0=150 * MS)).add(request("y", t0=1_500 * MS))
    table, q = apply_quality(load_run(b.write()))
    assert table.column("quality.client_saturated").to_pylist() == [False, True]
    assert q.saturated == 1
    assert q.selfwatch_samples == 3 and q.selfwatch_warmup_samples == 1
    # the same start-up sample, not marked warm-up, is judged like any other
    b2 = RunBuilder(tmp_path / "unmarked")
    b2.watch += [dataclasses.replace(start_up, warmup=None), *b.watch[1:]]
    b2.add(request("x", t0=50 * MS)).add(request("y", t0=1_500 * MS))
    table2, _ = apply_quality(load_run(b2.write()))
    assert table2.column("quality.client_saturated").to_pylist() == [True, True]
