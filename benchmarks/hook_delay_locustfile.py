"""The built-in workload with a `token_event` listener that notes, for every token event,
how long after its arrival stamp the listener was called (benchmarks/hook_delay.py reads
the figures from HOOK_DELAY_OUT when the run quits)."""

import json
import os
import time

from locust import events as locust_events

from calculet_load.events import events
from calculet_load.locust import CalculetUser

__all__ = ["CalculetUser"]
DELAYS_NS: list[int] = []


@events.token_event.add_listener
def _on_token(event, **kw):
    DELAYS_NS.append(time.monotonic_ns() - event.arrival_ns)


@locust_events.quit.add_listener
def _write(**kw):
    with open(os.environ["HOOK_DELAY_OUT"], "w") as f:
        json.dump(DELAYS_NS, f)
