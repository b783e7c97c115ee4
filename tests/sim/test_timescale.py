"""Time scale (simulated seconds run faster, telemetry included) and the firehose mode."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.simhelpers import LLAMA, llama, prompt_ids, wait_steps
from tests.support.simproc import SimProcess

StartSim = Callable[..., SimProcess]
SLOW_STEPS = ("--set", "timing.decode_base_ms=200", "--set", "timing.jitter=0",
              "--set", "timing.warmup_extra_ms=0")  # fmt: skip


def _run(sim: SimProcess) -> tuple[float, float, float]:
    """(wall s, device ms summed over steps, median real ms between device rows)."""
    t0 = time.monotonic()
    llama(sim, prompt_ids(16), 20, rid="scaled")
    wall = time.monotonic() - t0
    device = sum(r["device_wait_ms"] for r in wait_steps(sim, ["scaled"]))
    rows = sim.traces("device")
    gaps = [(b["mono_ns"] - a["mono_ns"]) / 1e6 for a, b in itertools.pairwise(rows)]
    sim_gaps = [b["sim_time_s"] - a["sim_time_s"] for a, b in itertools.pairwise(rows)]
    assert 0.9 < statistics.median(sim_gaps) < 1.2  # a row per simulated second either way
    return wall, device, statistics.median(gaps)


@pytest.mark.serial  # device-time ratios of 40 vs 400 ms: a busy machine stretches the short one
def test_time_scale_speeds_up_simulated_time(start_sim: StartSim) -> None:
    fast = start_sim("--time-scale", "0.01", *SLOW_STEPS)
    slow = start_sim("--time-scale", "0.1", *SLOW_STEPS)
    fast_wall, fast_dev, fast_gap = _run(fast)
    slow_wall, slow_dev, slow_gap = _run(slow)
    # 20 steps of ~200 simulated ms: 4 s simulated = 40 ms vs 400 ms of device time.
    assert 7 < slow_dev / fast_dev < 13, (fast_dev, slow_dev)
    assert slow_wall / fast_wall > 4, (fast_wall, slow_wall)
    assert 7 < slow_gap / fast_gap < 13, (fast_gap, slow_gap)


def test_firehose_many_events_per_write_no_delays(
    start_sim: StartSim, fast_sim: SimProcess
) -> None:
    sim = start_sim("--profile", "firehose")
    t0 = time.monotonic()
    s = llama(sim, prompt_ids(64), 4000, rid="hose-1")
    elapsed = time.monotonic() - t0
    events = s.json_events()
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 4000
    # The timing model would take 4000 x 12 ms = 48 s at time scale 1.
    assert elapsed < 8, elapsed
    reads = len({t for t, _ in s.events})
    assert len(s.events) / reads >= 4, (len(s.events), reads)
    # Same greedy ids as the timed simulator (golden hashes agree); no traces.
    body: dict[str, Any] = {"prompt": prompt_ids(64), "n_predict": 50, "ignore_eos": True}
    assert (
        sim.json("POST", LLAMA, body)[1]["tokens"]
        == fast_sim.json("POST", LLAMA, body)[1]["tokens"]
    )
    assert sim.traces("steps") == [] and sim.traces("server_events") == []
    # Validation and request ids are those of the timed path.
    status, headers, _ = sim.request("POST", LLAMA, body, headers={"X-Request-Id": "hose-2"})
    assert status == 200 and headers["x-request-id"] == "hose-2"
    assert sim.json("POST", LLAMA, {"prompt": "x", "n_predict": 0})[0] == 400
    assert sim.json("POST", LLAMA, {"prompt": prompt_ids(40_959), "n_predict": 2})[0] == 400


def test_firehose_chunked_openai(start_sim: StartSim) -> None:
    sim = start_sim("--firehose", "--set", "output.tokens_per_event=4")
    body = {
        "prompt": prompt_ids(8),
        "max_tokens": 10,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    s = sim.stream("/v1/completions", body)
    assert s.raw.endswith(b"data: [DONE]\n\n")
    used = [c["usage"]["completion_tokens"] for c in s.json_events()]
    assert used == [4, 8, 10, 10, 10]
