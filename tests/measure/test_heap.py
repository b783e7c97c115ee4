"""The Locust process's heap pacer (calculet_load.measure.heap): collections by time, not
by Python's allocation count; start-up frozen; Python's thresholds back when it stops."""

from __future__ import annotations

import gc
import weakref

import gevent
import pytest

from calculet_load.measure.heap import BACKSTOP_THRESHOLDS, HeapPacer


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def pacer() -> HeapPacer:
    saved, frozen = gc.get_threshold(), gc.get_freeze_count()
    p = HeapPacer(young_every_s=0.005, middle_every=3, full_every_s=0.05)
    yield p
    while p.running:
        p.stop()
    gc.set_threshold(*saved)
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()


def test_the_pacer_collects_each_generation_by_time_and_frees_cycles(pacer: HeapPacer) -> None:
    saved = gc.get_threshold()
    pacer.start()
    assert pacer.running and gc.get_threshold() == BACKSTOP_THRESHOLDS
    assert gc.get_freeze_count() > 0  # what existed at the start is out of reach
    # a cycle made after the start: Python's backstop (50,000 new objects) would not
    # collect it in this test; the pacer's next young collection does
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    assert gone() is not None
    gevent.sleep(0.3)
    assert gone() is None
    young, middle, full = pacer.collections
    assert young >= 10 and middle >= 3 and full >= 1, pacer.collections
    assert young > middle > full
    pacer.stop()
    assert not pacer.running and gc.get_threshold() == saved
    done = list(pacer.collections)
    gevent.sleep(0.05)
    assert pacer.collections == done  # stopped: no more collections


def test_the_last_user_stops_the_pacer(pacer: HeapPacer) -> None:
    saved = gc.get_threshold()
    pacer.start()
    pacer.start()  # a second run's Worker in the same process
    pacer.stop()
    assert pacer.running and gc.get_threshold() == BACKSTOP_THRESHOLDS
    gevent.sleep(0.03)
    assert pacer.collections[0] >= 2
    pacer.stop()
    assert not pacer.running and gc.get_threshold() == saved
    pacer.stop()  # one stop too many changes nothing
    assert not pacer.running and gc.get_threshold() == saved
