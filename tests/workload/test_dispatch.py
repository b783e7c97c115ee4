"""The one open-loop dispatcher (calculet_load.workload.dispatch.OpenLoop): its ends,
its timing, its drops and its re-timing on a rate change, without a target."""

from __future__ import annotations

import itertools
import time

import gevent
import gevent.event
import gevent.pool
import pytest

from calculet_load.measure.prompts import Prompt
from calculet_load.measure.session import RequestSpec
from calculet_load.workload.arrivals import RateClock, Schedule
from calculet_load.workload.dispatch import OpenLoop, Sender

PROMPT = Prompt(sample_id="s", tokens=1, payload="x")


class Recorder:
    """A fake target: notes when each request starts; holds it `hold_s`."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.sent: list[tuple[int, int]] = []  # (intended, actual) monotonic ns
        self.dropped: list[str] = []
        self.hold_s = hold_s

    def send(self, spec: RequestSpec) -> None:
        assert spec.intended_start_ns is not None
        self.sent.append((spec.intended_start_ns, time.monotonic_ns()))
        gevent.sleep(self.hold_s)

    def drop(self, spec: RequestSpec, reason: str) -> None:
        self.dropped.append(reason)


def _loop(rate: float, rec: Recorder, pool_size: int = 100, **kw: object) -> OpenLoop:
    clock = RateClock(rate, 1)
    return OpenLoop(
        schedule=Schedule("constant", 1, clock),
        clock=clock,
        origin_ns=time.monotonic_ns() + 20_000_000,
        sender=Sender(gevent.pool.Pool(pool_size), rec.send, rec.drop),
        spec=lambda k, due: RequestSpec(PROMPT, 1, intended_start_ns=due),
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.serial  # ms send lags: a busy machine delays the recorder's greenlet
def test_bounded_in_count_sends_on_time() -> None:
    rec = Recorder()
    loop = _loop(200.0, rec, count=40)
    res = loop.run()
    loop.sender.pool.join()
    assert res.arrivals == 40 and res.dropped == 0 and len(rec.sent) == 40
    intended = [i for i, _ in rec.sent]
    gaps = {round((b - a) / 1e6, 3) for a, b in itertools.pairwise(intended)}
    assert gaps == {5.0}  # constant at 200/s: one every 5 ms, as scheduled
    lags_ms = sorted((a - i) / 1e6 for i, a in rec.sent)
    assert lags_ms[0] >= 0  # never early
    assert lags_ms[len(lags_ms) // 2] < 2.0, lags_ms  # the median send is on time
    # the loop measures its lag when it hands the arrival over; the send greenlet starts
    # a moment later (a fresh-clone serial run: 3.2 ms once)
    assert res.max_lag_ms >= lags_ms[-1] - 5.0


def test_bounded_in_time_and_stopped_on_request() -> None:
    rec = Recorder()
    start = time.monotonic_ns()
    loop = _loop(100.0, rec, end_ns=start + 220_000_000)
    res = loop.run()
    # arrivals from +20 ms every 10 ms, none due at or after +220 ms
    assert res.arrivals == 20
    assert all(i < start + 220_000_000 for i, _ in rec.sent)

    # One arrival every 2 s: stopped after the first, the loop returns without waiting
    # for the second. (A stop at a fixed +100 ms, with arrivals every 10 ms, saw none
    # sent on a loaded machine: the stop's timer and the first arrival's were due in the
    # same pass of the hub after a descheduling.)
    rec2 = Recorder()
    loop2 = _loop(0.5, rec2, wake=gevent.event.Event())
    stopped: list[float] = []

    def stop_after_the_first() -> None:
        while not rec2.sent:
            gevent.sleep(0.005)
        stopped.append(time.monotonic())
        loop2.stop()

    stopper = gevent.spawn(stop_after_the_first)
    loop2.run()
    stopper.join()
    assert time.monotonic() - stopped[0] < 1.0  # the stop wakes the wait: not 2 s
    assert loop2.result.arrivals == 1 and len(rec2.sent) == 1


def test_a_full_pool_drops_and_says_so() -> None:
    rec = Recorder(hold_s=1.0)
    loop = _loop(200.0, rec, pool_size=3, count=10, why_full=" at the intended time")
    res = loop.run()
    loop.sender.pool.kill()
    assert (res.arrivals, res.dropped, len(rec.sent)) == (10, 7, 3)
    assert rec.dropped == ["in-flight cap 3 full at the intended time"] * 7


def test_a_rate_change_retimes_the_waiting_arrival() -> None:
    rec = Recorder()
    wake = gevent.event.Event()
    loop = _loop(1.0, rec, count=3, wake=wake)  # 2nd arrival due 1 s after the 1st

    def faster() -> None:
        # from now on 100/s: the arrival waiting for +1 s comes ~10 ms from now instead
        loop.clock.change(time.monotonic_ns() - loop.origin_ns, 100.0)
        wake.set()

    gevent.spawn_later(0.1, faster)
    t0 = time.monotonic()
    loop.run()
    loop.sender.pool.join()
    assert len(rec.sent) == 3
    assert time.monotonic() - t0 < 0.5
