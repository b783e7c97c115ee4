"""Self-watch: is the client itself the bottleneck?

A greenlet wakes every `interval_s` and measures how late it woke (event-loop lag: time
every other greenlet made it wait, which is also how late a timestamp taken on the loop
can be; a kernel receive time waits for no loop, and the analysis judges an open-loop
request stamped so by its own bounds: analysis.tables.saturation), and samples this
process's CPU and RSS with psutil. Samples go to the sink beside the records, so the
analysis can exclude windows where the client was saturated.

Start-up is not load. A watch started with `warmup=True` marks its samples `warmup`
until `end_warmup()`, which the owner calls once its prompts, tokenization and
connections are ready and before its first request: it closes the warm-up with one
last warm-up sample and starts the next interval there, so no judged sample covers
start-up work and every request falls under judged samples (analysis.tables.saturation ignores
warm-up samples only).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import gevent
import psutil

from calculet_load.measure.sink import PartSink
from calculet_load.schema.arrow import SelfWatchRow
from calculet_load.schema.selfwatch import SATURATED_CPU_PERCENT as SATURATED_CPU_PERCENT
from calculet_load.schema.selfwatch import SATURATED_LAG_MS as SATURATED_LAG_MS

# gevent timers fire up to ~1.3 ms late (epoll waits in whole ms; measured p99 1.27 ms on
# the development VM): wake this much early and yield until the instant.
TIMER_SLACK_S = 0.002


def sleep_until(due_ns: int) -> None:
    """Sleep until the monotonic instant `due_ns`: a timer to just before it, then
    yield to the loop until it passes (so the wake-up is not ~1 ms late)."""
    remaining = (due_ns - time.monotonic_ns()) / 1e9
    if remaining > TIMER_SLACK_S:
        gevent.sleep(remaining - TIMER_SLACK_S)
    while time.monotonic_ns() < due_ns:
        gevent.sleep(0)


class SelfWatch:
    def __init__(
        self,
        sink: PartSink | None,
        worker: str,
        *,
        interval_s: float = 1.0,
        in_flight: Callable[[], int] | None = None,
        token_events: Callable[[], int] | None = None,
        on_sample: Callable[[SelfWatchRow], None] | None = None,
    ) -> None:
        self.on_sample = on_sample
        self.sink = sink
        self.worker = worker
        self.interval_s = interval_s
        self.in_flight = in_flight
        self.token_events = token_events
        self.samples: list[SelfWatchRow] = []
        self.max_lag_ms = 0.0
        self._proc = psutil.Process()
        self._greenlet: gevent.Greenlet[[], None] | None = None
        self.warmup = False

    def start(self, *, warmup: bool = False) -> None:
        self.warmup = warmup
        self._proc.cpu_percent(None)  # prime: the first call has no interval
        self._greenlet = gevent.spawn(self._run)

    def end_warmup(self) -> None:
        """The load is ready: a last warm-up sample now, then judged intervals from here."""
        if not self.warmup or self._greenlet is None:
            return
        self._greenlet.kill()
        t = time.monotonic_ns()
        gevent.sleep(0)  # the lag of one turn of the loop: what a timer would have seen
        now = time.monotonic_ns()
        self._sample(now, (now - t) / 1e6, None)
        self.warmup = False
        self._greenlet = gevent.spawn(self._run)

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill()
            self._greenlet = None

    def _run(self) -> None:
        last_events = self.token_events() if self.token_events else 0
        last = time.monotonic_ns()
        while True:
            expected = time.monotonic_ns() + int(self.interval_s * 1e9)
            # The lag is then what other greenlets made this one wait (what a token's
            # stamp would wait), not the ~1 ms granularity of the loop's timers.
            sleep_until(expected)
            now = time.monotonic_ns()
            lag_ms = max(now - expected, 0) / 1e6
            if not self.warmup:
                self.max_lag_ms = max(self.max_lag_ms, lag_ms)
            rate = None
            if self.token_events is not None:
                events = self.token_events()
                rate = (events - last_events) / ((now - last) / 1e9)
                last_events = events
            last = now
            self._sample(now, lag_ms, rate)

    def _sample(self, now: int, lag_ms: float, rate: float | None) -> None:
        row = SelfWatchRow(
            worker=self.worker,
            mono_ns=now,
            wall_ns=time.time_ns(),
            loop_lag_ms=lag_ms,
            cpu_percent=self._proc.cpu_percent(None),
            rss_bytes=self._proc.memory_info().rss,
            in_flight=self.in_flight() if self.in_flight else None,
            token_events_per_s=rate,
            warmup=True if self.warmup else None,
        )
        self.samples.append(row)
        if len(self.samples) > 3600:  # keep an hour in memory; the sink has it all
            del self.samples[:600]
        if self.sink is not None:
            self.sink.add_selfwatch(row)
        if self.on_sample is not None:
            self.on_sample(row)
