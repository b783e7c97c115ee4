"""A smoke of benchmarks/client_speed.py (issue 18): two short points, the reference and
calculet-load on both I/O engines (--io-engine gevent,thread).

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

REPO = Path(__file__).resolve().parents[1]


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
    points = json.loads(out.read_text())
    assert [(p["client"], p["mode"], p["level"]) for p in points] == [
        ("reference", "poisson", 20.0),
        ("calculet:gevent", "poisson", 20.0),
        ("calculet:thread", "poisson", 20.0),
        ("reference", "closed", 4.0),
        ("calculet:gevent", "closed", 4.0),
        ("calculet:thread", "closed", 4.0),
    ]
    for p in points:
        assert p["requests"] >= 10, p  # counted by the server
        assert p["failed"] == 0, p
        for key in ("ttft_p50", "ttft_p99", "itl_p50", "tpot_p50"):
            assert math.isfinite(p["err"][key]), (key, p)
        # the truth is 50 ms to the first token: no client is off by a second at 20/s
        assert -1.0 < p["err"]["ttft_p50"] < 1000.0, p
        assert p["cpu_us_per_request"] > 0, p
    ours = [p for p in points if p["client"].startswith("calculet")]
    assert all(p["cpu_ratio"] > 0 for p in ours), ours
    assert all(p["verdict"].startswith("locust exit ") for p in ours), ours
