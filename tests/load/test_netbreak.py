"""Network breaks detected, not only declared (issue 19 item 7, spec §9/§15), with real
processes: a simulator, a relay in the path that drops it for 2 s (stops listening and
resets what it carries: tests/load/netrelay.py) and a Locust run through the relay whose
worker probes the target every 0.5 s. The analysis finds the break in the failed probe
rounds and the burst of connection failures, excludes the requests inside it, and
judges the run infrastructure-invalid (exit 3) with the evidence; a declared
network_breaks.json still works beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from analysis.analyze import analyze
from tests.load.locustproc import REPO, LocustRun
from tests.simproc import SimProcess

LOAD = ["-u", "2", "-r", "2", "--prompt-tokens", "32", "--max-tokens", "8", "--seed", "7"]
PROBE = ["--rtt-samples", "3", "--rtt-every", "0.5"]


@pytest.fixture
def relay_to() -> Iterator[Callable[[int], str]]:
    procs: list[subprocess.Popen[str]] = []

    def start(port: int) -> str:
        cmd = [sys.executable, "-m", "tests.load.netrelay", "--listen", "127.0.0.1:0",
               "--to", f"127.0.0.1:{port}", "--delay-ms", "0", "--drop-at-s", "4",
               "--drop-for-s", "2", "--max-s", "60"]  # fmt: skip
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)
        procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("PORT "), line
        return f"http://127.0.0.1:{int(line.split()[1])}"

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_dropped_path_is_a_detected_network_break(
    tmp_path: Path, start_sim: Callable[..., SimProcess], relay_to: Callable[[int], str]
) -> None:
    sim = start_sim("--time-scale", "0.02")
    run = LocustRun(tmp_path, relay_to(sim.port), [*LOAD, *PROBE], workers=0, run_time_s=9)
    run.start().wait(90)  # Locust's own exit code counts the failures: not what is judged
    result = analyze(str(run.run_dir))
    v = {x["rule"]: x for x in result.document["verdicts"]}["network_break"]
    assert v["status"] == "fail" and result.exit_code == 3, v
    detected = [b for b in v["details"] if b["source"] == "detected"]
    assert len(detected) == 1, v["details"]
    brk = detected[0]
    # both signs, each naming what it saw
    assert any("RTT probe round" in e and "samples failed" in e for e in brk["evidence"])
    assert any("requests failed to connect" in e for e in brk["evidence"]), brk["evidence"]
    assert 1.0e9 <= brk["end_wall_ns"] - brk["start_wall_ns"] <= 4.0e9  # the 2 s drop
    assert brk["records"] >= 3 and v["observed"] > 0
    assert "detected, first:" in v["reason"]

    # a declared break of the operator still counts beside the detected one
    first = brk["start_wall_ns"] - 3_000_000_000
    (run.run_dir / "network_breaks.json").write_text(
        json.dumps(
            {
                "schema": "calculet-network-breaks/v1",
                "breaks": [
                    {
                        "start_wall_ns": first,
                        "end_wall_ns": first + 1,
                        "reason": "operator: VPN re-key",
                    }
                ],
            }
        )
    )
    again = analyze(str(run.run_dir))
    v2 = {x["rule"]: x for x in again.document["verdicts"]}["network_break"]
    assert [b["source"] for b in v2["details"]] == ["declared", "detected"]
    assert v2["details"][0]["reason"] == "operator: VPN re-key"
