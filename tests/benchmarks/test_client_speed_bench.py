"""A smoke of benchmarks/client_speed.py: two short points, the reference, the
Python read floor (`ref_client.py --python-reads`) and calculet-load on both I/O engines
(--io-engine gevent,thread).

Checks the machinery, not the figures (those need a quiet machine and their own run):
the exact server answers, both clients' figures are read and compared with the server's
truth, CPU is measured, the reference ratio and calculet-load's own verdict are there.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from calculet_load.measure.thread_loop import READ_COALESCE_US, reads_natively

REPO = Path(__file__).resolve().parents[2]


def test_two_short_points_of_both_clients(tmp_path: Path) -> None:
    out = tmp_path / "points.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "client_speed.py"),
            "--rates",
            "20",
            "--concurrency",
            "4",
            "--seconds",
            "5",  # a CPU window of 2.5 s: at 3 s (0.5 s) the reference's CPU was 0 ticks
            "--no-pin",
            "--io-engine",
            "gevent,thread",
            "--clients",
            "reference,floor,calculet",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "load average" in done.stdout
    for name in ("calculet:gevent", "calculet:thread"):  # the speed targets, judged
        assert f"{name} against the speed targets, in this run:" in done.stdout
    assert "TTFT p50 error <= 0.3 ms at 20 req/s: " in done.stdout
    points = json.loads(out.read_text())
    assert [(p["client"], p["mode"], p["level"]) for p in points] == [
        ("reference", "poisson", 20.0),
        ("floor", "poisson", 20.0),
        ("calculet:gevent", "poisson", 20.0),
        ("calculet:thread", "poisson", 20.0),
        ("reference", "closed", 4.0),
        ("floor", "closed", 4.0),
        ("calculet:gevent", "closed", 4.0),
        ("calculet:thread", "closed", 4.0),
    ]
    assert "floor: a Python read loop with kernel stamps, parsing nothing, took " in done.stdout
    # the native reader is the thread engine's default where it is built: the Locust
    # process's reader thread did the reads (its CPU), and the header says so
    on = reads_natively()
    reads = "the native reader" if on else "its loop"
    assert f"the thread engine reads plain sockets with {reads} (" in done.stdout
    if on:  # and its coalescing window, opt-in: off unless the environment sets it
        window = f"{READ_COALESCE_US} µs" if READ_COALESCE_US else "off"
        assert f"the reader's coalescing window: {window} (" in done.stdout
    for p in points:
        if on and p["client"] == "calculet:thread":
            assert p["threads"].get("reader", 0) > 0, p["threads"]
        assert p["requests"] >= 10, p  # counted by the server
        assert p["failed"] == 0, p
        for key in ("ttft_p50", "ttft_p99", "itl_p50", "tpot_p50"):
            assert math.isfinite(p["err"][key]), (key, p)
        # the truth is 50 ms to the first token: no client is off by a second at 20/s
        assert -1.0 < p["err"]["ttft_p50"] < 1000.0, p
        assert p["cpu_us_per_request"] > 0, p
    ours = [p for p in points if p["client"].startswith("calculet")]
    floor = [p for p in points if p["client"] == "floor"]
    assert all(p["cpu_ratio"] > 0 for p in ours + floor), ours + floor
    assert all(p["verdict"].startswith("locust exit ") for p in ours), ours
    # calculet-load's CPU split by thread (measure.threads names them): the thread
    # engine's loop, the greenlets' main thread and the sink's writer, adding up to the
    # process's figure (less threads that started or ended inside the window)
    assert "threads (µs/req): engine " in done.stdout
    # the closed loop's turnaround (ext.turnaround_ms): p50, p99, mean, in order
    assert "; turnaround (ms): p50 " in done.stdout
    for p in ours:
        if p["mode"] == "closed":
            p50, p99, mean = p["turnaround"]
            assert 0 < p50 <= p99 and 0 < mean <= p99, p
    # ... and the reference's, from its users' rows
    (ref,) = [p for p in points if p["client"] == "reference" and p["mode"] == "closed"]
    p50, p99, mean = ref["turnaround"]
    assert 0 < p50 <= p99 and 0 < mean <= p99, ref
    # printed for each closed-loop point: the reference, the floor, both engines
    assert done.stdout.count("turnaround (ms): p50 ") == 4, done.stdout
    for p in ours:
        t = p["threads"]
        assert set(t) >= (
            {"engine", "main", "sink"} if p["client"].endswith("thread") else {"main", "sink"}
        ), p
        assert ("engine" in t) == p["client"].endswith("thread"), p
        assert t["main"] > 0 and all(v >= 0 for v in t.values()), p
        # The threads' CPU and the process's are read one after the other at each end of
        # the window: a busy machine can deschedule the reader between them, with the
        # client on the CPU meanwhile. Allowed: 50 ms of CPU at each end, spread over
        # the point's requests (more than the window's: the stricter share).
        skew_us = 2 * 50_000 / p["requests"]
        assert (
            0.7 * p["cpu_us_per_request"] <= sum(t.values()) <= p["cpu_us_per_request"] + skew_us
        ), p


def test_the_targets_are_judged_from_the_points() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import client_speed as cs
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def point(mode: str, level: float, p50: float, p99: float, ratio: float, verdict: str = ""):
        return cs.Point("calculet:thread", mode, level, err={"ttft_p50": p50, "ttft_p99": p99},
                        cpu_ratio=ratio, verdict=verdict)  # fmt: skip

    lines = cs.target_lines(
        [
            point("poisson", 20, 0.2, 0.5, 1.4),
            point("poisson", 80, 0.1, 1.5, 1.2),  # over 1 ms at 80 req/s
            point("poisson", 320, 0.1, 40.0, 1.1, "locust exit 3 FLAGGED"),
            point("closed", 256, 0.1, 12.0, 1.6),  # beyond 10 ms, and its verdict missed it
        ]
    )
    assert lines[0].startswith("TTFT p99 error <= 1 ms, Poisson up to 80 req/s: NOT met (")
    assert "80/s +1.50" in lines[0]
    assert lines[1].startswith("TTFT p99 error <= 10 ms, Poisson up to 320 req/s: NOT met")
    assert lines[2].startswith("TTFT p99 error <= 10 ms, closed loop up to 256 streams: NOT met")
    assert lines[3] == "TTFT p50 error <= 0.3 ms at 20 req/s: met (20/s +0.20)"
    assert lines[4] == "CPU per request <= 1.5x the reference's: NOT met (1.10x to 1.60x)"
    assert lines[5] == "every point beyond 10 ms flagged by its own verdict: NOT met (C=256)"
    # a run of fewer points says what it did not cover
    (first, *_) = cs.target_lines([point("poisson", 40, 0.1, 0.4, 1.0)])
    assert first == (
        "TTFT p99 error <= 1 ms, Poisson up to 80 req/s: met (run only up to 40) (40/s +0.40)"
    )
    p50_line = cs.target_lines([point("poisson", 40, 0.1, 0.4, 1.0)])[3]
    assert p50_line.endswith("not run (no such point in this run)"), p50_line


def test_a_flagged_point_names_the_rules_analyze_failed(tmp_path: Path) -> None:
    """An `analyze` exit 3 names what failed (not only the verdict's last line)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import client_speed as cs
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    verdicts = [
        {"rule": "client_saturation", "status": "fail", "observed": 0.1109, "threshold": 0.05},
        {"rule": "send_lag", "status": "fail", "observed": 15.458274, "threshold": 10.0},
        {"rule": "error_rate", "status": "pass", "observed": 0.0, "threshold": 0.0},
        {"rule": "golden", "status": "not_evaluated", "observed": None, "threshold": None},
    ]
    seen = {"worker": "w00", "mono_ns": 7, "loop_lag_ms": 13.2, "cpu_percent": 35.0}
    quality = {"saturated_samples": {"count": 1, "worst": [seen]}}
    (tmp_path / "verdict.json").write_text(json.dumps({"verdicts": verdicts, "quality": quality}))
    assert cs.failed_rules(cs.verdict_doc(tmp_path)) == [
        "client_saturation 0.1109 > 0.05 (1 saturated self-watch samples: w00 13.2 ms at 35 % CPU)",
        "send_lag 15.46 > 10",
    ]
    (tmp_path / "verdict.json").write_text("{not json")
    assert cs.failed_rules(cs.verdict_doc(tmp_path)) == []
    assert cs.failed_rules(cs.verdict_doc(tmp_path / "missing")) == []


def test_a_passed_point_says_what_the_self_watch_saw(tmp_path: Path) -> None:
    """A pass with loop-lag samples says the kernel-stamped records under them were
    judged by their own bounds (not an exit 3)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import client_speed as cs
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    seen = {"worker": "w00", "mono_ns": 7, "loop_lag_ms": 8.1, "cpu_percent": 41.0}
    quality = {
        "saturated_samples": {"count": 1, "worst": [seen]},
        "lag_judged_by_own_bounds": 412,
        "saturated_by_own_bounds": 0,
    }
    (tmp_path / "verdict.json").write_text(json.dumps({"verdicts": [], "quality": quality}))
    assert cs.self_watch_note(cs.verdict_doc(tmp_path)) == (
        "self-watch (1 saturated self-watch samples: w00 8.1 ms at 41 % CPU); 412 "
        "kernel-stamped records under loop lag judged by their own bounds"
    )
    hold = {"cell": "x|c256|closed|stream", "worker": "w00", "records": 5000}
    hold |= {"mean_hold_ms": 11.42, "held_share": 0.0168, "held": False}
    quality["closed_loop_holds"] = {"count": 1, "held": [], "most_held": [hold]}
    (tmp_path / "verdict.json").write_text(json.dumps({"verdicts": [], "quality": quality}))
    assert cs.self_watch_note(cs.verdict_doc(tmp_path)).endswith(
        "judged by their own bounds; closed loop: users held 11.4 ms a request, 1.7% of "
        "their time (within limits)"
    )
    quality = {"saturated_samples": {"count": 0, "worst": []}, "lag_judged_by_own_bounds": 0}
    (tmp_path / "verdict.json").write_text(json.dumps({"verdicts": [], "quality": quality}))
    assert cs.self_watch_note(cs.verdict_doc(tmp_path)) == ""
    assert cs.self_watch_note(cs.verdict_doc(tmp_path / "missing")) == ""


def test_the_references_turnaround_runs_from_a_last_token_to_the_same_users_next_send() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import client_speed as cs
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    ms = 1_000_000
    rows = [  # [id, t0, token stamps, ok, user], in the order requests ended
        ["a", 0, [10 * ms, 20 * ms], True, 0],
        ["b", 5 * ms, [30 * ms], True, 1],
        ["c", 21 * ms, [40 * ms], True, 0],  # user 0: 1 ms after its last token
        ["d", 33 * ms, [], False, 1],  # user 1: 3 ms; a failure ends no turn
        ["e", 50 * ms, [60 * ms], True, 1],
        ["f", 44 * ms, [70 * ms], True, 0],  # user 0: 4 ms
        ["g", 1 * ms, [2 * ms], True, None],  # open loop: no user
    ]
    p50, p99, mean = cs.user_turnaround(rows)
    assert mean == pytest.approx((1 + 3 + 4) / 3)
    assert p50 == pytest.approx(3.0) and 3.0 < p99 <= 4.0
    assert cs.user_turnaround([["g", 1, [2], True, None]]) is None
