"""Network breaks detected, and a server crash that is not one (spec §9/§15), with real
processes.

A network break is what the network does: the client in a network namespace whose veth
is taken down for 3.5 s (no route: `unreachable`, the probe's connects lost) → one
detected `network_break`, the requests inside it excluded, exit 3. A server that is
killed and restarted on the same port does something else on the wire (its port
refuses, its connections are reset): no network break, the run is judged on reliability
(exit 1, the errors counted). The server's host going away (the link down) while the
server restarts is set aside by the server's own trace: its restart explains it.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.analyze import analyze
from calculet_load.schema.netsigns import NETWORK_ERROR_CLASSES
from calculet_load.target.netprobe import measure_round
from tests.locust.test_netns import _ip, _skip_reason, private_net
from tests.support.acceptkit import relaxed_rules
from tests.support.locustproc import LocustRun
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(120)

LOAD = ["-u", "2", "-r", "2", "--prompt-tokens", "32", "--max-tokens", "8", "--seed", "7"]
PROBE = ["--rtt-samples", "3", "--rtt-every", "0.5"]
# Open loop: during a break arrivals keep coming and find no idle connection (those in
# flight wait on TCP's retransmissions), so they connect afresh and find no route. (A
# closed loop's users would spin on instant refusals while the server is down, and the
# client's self-watch would call the run saturated.)
OPEN = ["--arrival", "poisson", "--rate", "20"]
SIM = ("--time-scale", "0.02")
BREAK_S = 2.0
# The link-down test's break: longer than a probe sample's health timeout (2 s,
# netprobe.measure_round) and a round's spacing. A sample connected just before the cut
# hangs to that timeout (a server that does not answer: not a network sign), and the
# round's next samples must still meet the break to name it: with a 2-s break one round
# of a fresh-clone run read 1 health_timeout, 1 unreachable, 1 answered, no sign.
LINK_DOWN_S = 3.5
netns = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


def _serving(sim: SimProcess, timeout_s: float = 30) -> None:
    """Wait until the run's load reaches the simulator: its trace shows requests beyond
    the one the run's start check sends (20 arrivals a second: 5 within a second)."""
    sim.wait_for(
        lambda: sum(r.get("event") == "accepted" for r in sim.traces("server_events")) >= 5,
        timeout_s,
        "the run's load at the simulator",
    )


def _verdicts(run_dir: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """analyze's exit code and verdicts, with the client's saturation gate off and its
    send-lag limit at 500 ms: this busy machine's own load must not make the run
    infrastructure-invalid, while a stale retry's lag (the 2 s a dead connection held
    it) would still fail the send-lag check if it were counted."""
    path = relaxed_rules(run_dir.parent, "netbreak")
    rules = yaml.safe_load(path.read_text())
    rules["infrastructure"]["max_send_lag_p99_ms"] = 500.0
    path.write_text(yaml.safe_dump(rules))
    result = analyze(str(run_dir), rules_path=path)
    return result.exit_code, {v["rule"]: v for v in result.document["verdicts"]}


def _restart(start_sim: Callable[..., SimProcess], sim: SimProcess, down_s: float) -> SimProcess:
    """Kill the simulator (SIGKILL: a crash) and start it again on the same address and
    trace folder `down_s` later."""
    sim.proc.send_signal(signal.SIGKILL)
    sim.proc.wait(10)
    time.sleep(down_s)
    return start_sim(*SIM, "--host", sim.host, "--port", str(sim.port),
                     "--trace-dir", str(sim.trace_dir))  # fmt: skip


@contextmanager
def _loaded(
    tmp_path: Path, start_sim: Callable[..., SimProcess], *, netns: bool, run_s: float = 9
) -> Iterator[tuple[SimProcess, LocustRun, Callable[[bool], None]]]:
    """A simulator and a `run_s` open-loop Locust run against it, yielded 1 s after the load reached
    the simulator: (the simulator, the run, set_link(up)). With `netns` the client runs
    in a namespace of its own, joined by a veth to a bridge in the root namespace where
    the simulator listens, and set_link takes its end of the veth down or up. The run is
    waited for on the way out."""
    with ExitStack() as stack:
        host, prefix, link = "127.0.0.1", [], None
        if netns:
            net = stack.enter_context(private_net(1))
            host, prefix = net.gateway, ["ip", "netns", "exec", net.namespaces[0]]
            link = ["-n", net.namespaces[0], "link", "set", f"cl{net.tag}p0"]

        def set_link(up: bool) -> None:
            assert link is not None, "no namespace: no link to set"
            _ip(*link, "up" if up else "down")

        sim = start_sim(*SIM, "--host", host)
        run = LocustRun(tmp_path, sim.url, [*LOAD, *OPEN, *PROBE], workers=0, run_time_s=run_s,
                        prefix=prefix).start()  # fmt: skip
        try:
            _serving(sim)
            time.sleep(1.0)
            yield sim, run, set_link
        finally:
            run.wait(90)  # Locust's own exit code counts the failures: not what is judged


@netns
def test_a_link_down_is_a_detected_network_break(
    tmp_path: Path, start_sim: Callable[..., SimProcess]
) -> None:
    with _loaded(tmp_path, start_sim, netns=True, run_s=11) as (_, run, set_link):
        set_link(False)
        cut = time.time_ns()
        time.sleep(LINK_DOWN_S)
        set_link(True)
        back = time.time_ns()
    code, v = _verdicts(run.run_dir)
    brk = v["network_break"]
    assert brk["status"] == "fail" and code == 3, (json.dumps(brk), run.log_text()[-1500:])
    detected = [b for b in brk["details"] if b["source"] == "detected"]
    assert len(detected) == 1 and len(brk["details"]) == 1, brk["details"]
    b = detected[0]
    # both signs, each naming what it saw
    probe = [e for e in b["evidence"] if "RTT probe round" in e]
    assert probe and all("unreachable" in e for e in probe), b["evidence"]
    assert any("requests could not reach the target" in e and "unreachable" in e
               for e in b["evidence"]), b["evidence"]  # fmt: skip
    # the interval lies on the time the link was down (the probe's last round ends a
    # little after it came back)
    assert cut - 0.5e9 <= b["start_wall_ns"] and b["end_wall_ns"] <= back + 2.5e9, (b, cut, back)
    assert b["end_wall_ns"] - b["start_wall_ns"] >= 1.0e9
    assert b["records"] >= 3 and brk["observed"] > 0
    assert "detected, first:" in brk["reason"]
    # every record that failed for lack of a route lies inside the break, and is excluded
    table = run.requests()
    failed = [c for c in table.column("ext.error_class").to_pylist() if c is not None]
    assert failed and set(failed) <= set(NETWORK_ERROR_CLASSES), failed

    # a declared break of the operator still counts beside the detected one
    first = b["start_wall_ns"] - 3_000_000_000
    (run.run_dir / "network_breaks.json").write_text(
        json.dumps(
            {
                "schema": "calculet-network-breaks/v1",
                "breaks": [
                    {"start_wall_ns": first, "end_wall_ns": first + 1, "reason": "VPN re-key"}
                ],
            }
        )
    )
    _, v2 = _verdicts(run.run_dir)
    details = v2["network_break"]["details"]
    assert [d["source"] for d in details] == ["declared", "detected"]
    assert details[0]["reason"] == "VPN re-key"


def test_a_server_killed_and_restarted_is_not_a_network_break(
    tmp_path: Path, start_sim: Callable[..., SimProcess]
) -> None:
    with _loaded(tmp_path, start_sim, netns=False) as (sim, run, _):
        _restart(start_sim, sim, BREAK_S)  # its port refuses for 2 s, its streams reset
    table = run.requests()
    failed = [c for c in table.column("ext.error_class").to_pylist() if c is not None]
    assert "connect_refused" in failed, failed  # what a crashed server looks like
    assert not set(failed) & set(NETWORK_ERROR_CLASSES), failed
    code, v = _verdicts(run.run_dir)
    brk = v["network_break"]
    assert brk["status"] == "pass" and brk["details"] == [], brk
    assert "none detected" in brk["reason"]
    assert "network break" not in json.dumps([brk["details"], v["error_rate"]["reason"]])
    # judged on reliability: the failures are errors, nothing was excluded
    err = v["error_rate"]
    assert err["status"] == "fail" and code == 1, (err, code)
    assert err["observed"] > 0


@netns
def test_the_server_restarting_while_unreachable_is_set_aside(
    tmp_path: Path, start_sim: Callable[..., SimProcess]
) -> None:
    """The server's host drops off the network and its server restarts: the client sees
    the same signs as a network break, the server's trace (a start event inside the
    interval) says what it was."""
    with _loaded(tmp_path, start_sim, netns=True) as (sim, run, set_link):
        set_link(False)
        _restart(start_sim, sim, 0.5)
        time.sleep(BREAK_S - 0.5)
        set_link(True)
    code, v = _verdicts(run.run_dir)
    brk = v["network_break"]
    assert brk["status"] == "pass" and brk["observed"] == 0, (brk, run.log_text())
    assert [d["source"] for d in brk["details"]] == ["server_restart"], brk["details"]
    aside = brk["details"][0]
    assert aside["records"] == 0 and "not a network break" in aside["reason"]
    assert "a server restart, not a network break" in aside["evidence"][-1]
    assert "state_change starting -> ready" in aside["evidence"][-1]
    assert "set aside: the server restarted" in brk["reason"]
    # requests whose kept-alive connection the restart reset went out again: their lag is
    # the dead connection's, not the client's schedule
    assert v["send_lag"]["status"] == "pass", v["send_lag"]
    err = v["error_rate"]
    assert err["status"] == "fail" and code == 1, (err, code)


def test_probe_failures_are_told_apart() -> None:
    """The probe names how each sample failed: a closed port refuses (the target's), a
    listener that never answers /health hangs (the target's), neither is the network."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    r = measure_round(f"http://127.0.0.1:{port}", 2, timeout_s=0.5)
    assert r["errors"] == 2 and r["failures"] == {"refused": 2}, r
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts, no answer
        r = measure_round(f"http://127.0.0.1:{silent.getsockname()[1]}", 2, timeout_s=0.3)
    assert r["failures"] == {"health_timeout": 2}, r
