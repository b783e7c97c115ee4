"""Self-watch: a blocked event loop shows up as lag, next to CPU and RSS samples."""

from __future__ import annotations

import time
from pathlib import Path

import gevent

from calculet_load.measure.selfwatch import SelfWatch
from calculet_load.measure.sink import PartSink
from calculet_load.schema.runfolder import read_table


def test_a_blocked_loop_is_measured_as_lag_and_sampled_to_the_sink(tmp_path: Path) -> None:
    sink = PartSink(str(tmp_path), "w1")
    counter = [0]
    watch = SelfWatch(
        sink, "w1", interval_s=0.05, in_flight=lambda: 4, token_events=lambda: counter[0]
    )

    def samples(n: int) -> None:
        """Wait until the watch has taken `n` more samples (a loaded machine stretches a
        fixed sleep's count of them)."""
        want = len(watch.samples) + n
        while len(watch.samples) < want:
            gevent.sleep(0.01)

    stalled = [0.0]  # the longest the process lost, seen by a greenlet of its own (ms)

    def ticker() -> None:
        last = time.monotonic()
        while True:
            gevent.sleep(0.005)
            now = time.monotonic()
            stalled[0] = max(stalled[0], (now - last - 0.005) * 1e3)
            last = now

    def scenario() -> None:
        watch.start()
        tick = gevent.spawn(ticker)
        samples(3)  # an idle loop: small lag
        tick.kill()
        quiet = watch.max_lag_ms
        counter[0] += 500
        time.sleep(0.25)  # a greenlet hogging the loop (not yielding) for 250 ms
        samples(2)
        watch.stop()
        # No more lag than the process itself lost meanwhile (nothing on a quiet machine;
        # a descheduling on a loaded one delays the ticker as much as the watch).
        assert quiet < 50 + stalled[0], (quiet, stalled[0])

    gevent.spawn(scenario).get()
    sink.close()
    assert watch.max_lag_ms >= 150
    table = read_table(str(tmp_path), "selfwatch").to_pylist()
    assert len(table) == len(watch.samples) >= 4
    assert max(r["loop_lag_ms"] for r in table) == watch.max_lag_ms
    assert all(r["worker"] == "w1" and r["in_flight"] == 4 for r in table)
    assert all(r["rss_bytes"] > 10 * 2**20 for r in table)
    assert all(r["cpu_percent"] is not None and r["cpu_percent"] >= 0 for r in table)
    assert sum(r["token_events_per_s"] > 0 for r in table) == 1  # the one interval with +500
