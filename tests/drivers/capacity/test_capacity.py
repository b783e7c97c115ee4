"""Capacity search (spec §14.3) against a simulator profile with a known saturation
point: B1, one request = one prefill job of fixed size and no jitter, so the device
serves exactly one request per service time T and the stable max QPS is 1/T."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from calculet_drivers.capacity.sla import SLA, GoodputSLA, load_sla
from calculet_drivers.capacity.window import p99
from calculet_load.target.api import TargetAPI, time_scale
from calculet_sim.profile import load_profile
from tests.conftest import REPO
from tests.support.simproc import ADMIN_TOKEN, SimProcess

StartSim = Callable[..., SimProcess]
PROFILE = [
    "timing.prefill_base_ms=400",  # a long device job: the simulator's own overhead is small
    "timing.jitter=0",
    "timing.warmup_requests=0",
]
PROMPT, OUTPUT = 16, 1  # one prefill job per request, no decode step


def service_time_ms() -> float:
    """T of one request from the profile: the host phases and the prefill's device time
    (spec: prefill_base + per_token * P + per_token_sq * P^2), then D2H and sampling."""
    p = load_profile(None, PROFILE)
    t, n = p.timing, PROMPT
    host = t.prepare_ms + t.h2d_base_ms + t.h2d_ms_per_mtoken * n / 1e6 + t.bf16_ms
    device = t.prefill_base_ms + t.prefill_per_token_ms * n + t.prefill_per_token_sq_ms * n * n
    return host + device + t.d2h_ms + t.sampling_ms_per_lane


@pytest.mark.quiet  # a time-scaled simulator's capacity: in the parallel phase of CI runs
# it served 1.67 req/s once (2.49 alone), and the search found 1.94 another time
def test_capacity_search_finds_the_saturation_point(start_sim: StartSim, tmp_path: Path) -> None:
    args = [a for kv in PROFILE for a in ("--set", kv)]
    sim = start_sim("--time-scale", "0.1", *args, faults=True)
    expected = 1000.0 / service_time_ms()  # req per target second (~2.49)
    env = {**os.environ, "CALCULET_ADMIN_TOKEN": ADMIN_TOKEN}
    cmd = [sys.executable, "-m", "calculet_drivers.cli", "capacity",
           "--manifest", str(REPO / "configs" / "manifest.sim.yaml"), "--url", sim.url,
           "--run-dir", str(tmp_path), "--start-rate", "1", "--max-rate", "8",
           "--window-s", "60", "--prompt-tokens", str(PROMPT), "--max-tokens", str(OUTPUT),
           "--arrival", "constant"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "capacity.json").read_text())
    found = doc["stable_max_qps"]
    curve = {w["rate"]: w for w in doc["curve"]}
    # Above saturation the backlog grows and the device serves what it can: the capacity
    # the search must find is that served rate, measured in this run. It is about 1/T:
    # 2.35-2.42 against 2.49 alone (the simulator's own work between device jobs takes a
    # little time, counted 10x at time scale 0.1), lower when the machine is starved (in
    # CI runs' parallel phase: the search found 1.94 once, and the device served 1.67
    # another time; the test now runs in the quiet phase).
    # The highest rate tried is the doubling's first unstable one (4 alone, 2 that time).
    top = curve[max(curve)]
    served = top["metrics"]["served_rate"]
    assert not top["stable"], top
    assert 0.6 * expected < served < 1.05 * expected, (served, expected)
    assert abs(found - served) / served <= 0.10, (found, served, expected, proc.stdout)
    assert doc["first_unstable_qps"] > found and doc["time_scale"] == 0.1 and doc["rehearsal"]
    # well below the capacity every window is stable, well above none is
    assert all(w["stable"] for r, w in curve.items() if r <= 0.8 * served), curve
    assert not any(w["stable"] for r, w in curve.items() if r >= 1.2 * served), curve
    assert "stable max" in proc.stdout and "capacity curve" in proc.stdout
    assert list(tmp_path.glob("client/w00/part-*.requests.parquet"))


def test_sla_file_and_options(tmp_path: Path) -> None:
    path = tmp_path / "sla.yaml"
    path.write_text("sla: {max_reject_rate: 0.05, max_queue_p99_ms: 250}\n")
    sla = load_sla(str(path), {"max_e2e_p99_ms": 900.0, "max_ttft_p99_ms": None})
    assert sla == SLA(max_reject_rate=0.05, max_queue_p99_ms=250, max_e2e_p99_ms=900)
    path.write_text("sla: {max_reject_rate: 2}\n")
    with pytest.raises(ValueError, match="max_reject_rate"):
        load_sla(str(path), {})
    assert p99([float(x) for x in range(1, 101)]) == 100.0
    assert p99([3.0]) == 3.0 and p99([]) is None
    path.write_text("sla: {goodput: {max_ttft_ms: 500, min_share: 0.95}}\n")
    goodput = load_sla(str(path), {}).goodput
    assert goodput == GoodputSLA(max_ttft_ms=500, min_share=0.95)
    path.write_text("sla: {goodput: {min_share: 0.95}}\n")
    with pytest.raises(ValueError, match=r"^sla\.goodput: set max_ttft_ms or max_tpot_ms"):
        load_sla(str(path), {})


def test_goodput_is_a_criterion_of_the_search(start_sim: StartSim, tmp_path: Path) -> None:
    """With the SLA's goodput, a window whose requests all miss their TTFT objective is
    not stable however well the queue holds, and one whose requests all meet it is: the
    search counts a request good by the analysis' definition (through the door)."""
    sim = start_sim("--time-scale", "0.1", faults=True)
    env = {**os.environ, "CALCULET_ADMIN_TOKEN": ADMIN_TOKEN}
    found = {}
    for name, ttft_ms in (("unmet", 0.001), ("met", 600_000.0)):
        sla = tmp_path / f"{name}.yaml"
        sla.write_text(f"sla: {{goodput: {{max_ttft_ms: {ttft_ms}, min_share: 0.5}}}}\n")
        run = tmp_path / name
        cmd = [sys.executable, "-m", "calculet_drivers.cli", "capacity",
               "--manifest", str(REPO / "configs" / "manifest.sim.yaml"), "--url", sim.url,
               "--run-dir", str(run), "--start-rate", "2", "--max-rate", "2", "--window-s", "10",
               "--prompt-tokens", "16", "--max-tokens", "4", "--sla", str(sla)]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        doc = json.loads((run / "capacity.json").read_text())
        found[name] = (proc.returncode, doc)
    code, doc = found["unmet"]
    assert code == 1 and doc["stable_max_qps"] is None  # no rate met it, down to 2/64
    for w in doc["curve"]:
        m = w["metrics"]
        assert m["goodput_good"] == 0 and m["goodput_share"] == 0.0
        assert any(r.startswith("goodput share 0.0% < 50.0%") for r in w["reasons"]), w
    code, doc = found["met"]
    assert code == 0 and doc["stable_max_qps"] == 2.0, doc["curve"]
    (w,) = doc["curve"]
    assert w["metrics"]["goodput_share"] >= 0.5 and w["metrics"]["goodput_good"] > 0
    assert doc["sla"]["goodput"] == {"max_ttft_ms": 600000.0, "max_tpot_ms": None,
                                     "min_share": 0.5}  # fmt: skip


def test_time_scale_of_the_target(start_sim: StartSim) -> None:
    """One function for the soak and the capacity search: the hint wins, else the
    target's /admin/state (needs the token), else 1."""
    import gevent

    sim = start_sim("--time-scale", "0.05", faults=True)
    with_token = TargetAPI(sim.url, ADMIN_TOKEN)
    without = TargetAPI(sim.url)
    unreachable = TargetAPI("http://127.0.0.1:9", ADMIN_TOKEN, timeout_s=2)
    got = gevent.spawn(
        lambda: [time_scale(with_token, None), time_scale(with_token, 0.5),
                 time_scale(without, None), time_scale(unreachable, None)]
    ).get(timeout=30)  # fmt: skip
    assert got == [0.05, 0.5, 1.0, 1.0]


pytestmark = pytest.mark.timeout(500)
