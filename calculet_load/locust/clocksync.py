"""Master ↔ worker wall-clock offsets over Locust's message channel.

The master measures each worker with NTP-style exchanges (calculet_load.schema.clocks):

  master → worker   calculet_clock_ping    {seq, t1}          t1: master's wall clock
  worker → master   calculet_clock_pong    {seq, t1, t2, t3}  t2/t3: worker's wall clock
  master → worker   calculet_clock_offset  {offset_ns, rtt_ns, measured_wall_ns}

`ROUNDS` exchanges per measurement, one at a time; the least-round-trip one gives the
offset (master − worker, so master ≈ worker + offset). The master measures a worker when
it connects, before each run starts, and every `--clock-sync-every` s; it tells the
worker its latest offset, and the worker converts every wall instant the master sends
(schedule origin, burst fire-at, an `accept` step's start) onto its own clock with it.

The worker stamps t2 and t3 in its message loop (the handler is not spawned), so the
round trip covers the master's and worker's message loops and the channel; the offset's
error is at most half of that round trip.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gevent
import gevent.event
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from calculet_load.clock import Clock, SystemClock, mono_at_wall
from calculet_load.schema.clocks import (
    OffsetSample,
    best_sample,
    exchange,
    from_reference_ns,
    to_reference_ns,
)

log = logging.getLogger("calculet_load")

ROUNDS = 8
ROUND_TIMEOUT_S = 1.0
HISTORY_KEEP = 64  # measurements kept per worker (a 72-hour run must not grow the index)


# ------------------------------------------------------------------ the worker side
@dataclass
class LocalOffset:
    """What this worker knows of its offset to the master (None: never measured, so the
    master's wall instants are taken as they are)."""

    clock: Clock = field(default_factory=SystemClock)
    offset_ns: int | None = None  # master − this worker
    rtt_ns: int | None = None
    measured_wall_ns: int | None = None  # on the master's clock
    updates: int = 0

    def to_local_ns(self, master_wall_ns: int) -> int:
        """A wall instant of the master's clock on this worker's wall clock."""
        return from_reference_ns(master_wall_ns, self.offset_ns or 0)

    def to_master_ns(self, local_wall_ns: int) -> int:
        """A wall instant of this worker's clock on the master's wall clock."""
        return to_reference_ns(local_wall_ns, self.offset_ns or 0)

    def mono_at(self, master_wall_ns: int) -> int:
        """The monotonic instant at which this worker's wall clock shows the master's
        instant `master_wall_ns` (waits are on the monotonic clock)."""
        return mono_at_wall(self.to_local_ns(master_wall_ns), self.clock)

    def snapshot(self) -> dict[str, Any]:
        return {
            "master_offset_ns": self.offset_ns,
            "master_rtt_ns": self.rtt_ns,
            "measured_wall_ns": self.measured_wall_ns,
            "updates": self.updates,
        }


LOCAL = LocalOffset()  # this process's, when it is a Locust worker


def install_worker(runner: WorkerRunner) -> None:
    """Answer the master's pings and keep the offset it sends."""
    runner.register_message("calculet_clock_ping", _on_ping)
    runner.register_message("calculet_clock_offset", _on_offset)


def _on_ping(environment: Environment, msg: Any, **_kw: Any) -> None:
    t2 = LOCAL.clock.wall_ns()
    runner = environment.runner
    assert isinstance(runner, WorkerRunner)
    data = {"seq": msg.data["seq"], "t1": msg.data["t1"], "t2": t2}
    data["t3"] = LOCAL.clock.wall_ns()
    runner.send_message("calculet_clock_pong", data)


def _on_offset(environment: Environment, msg: Any, **_kw: Any) -> None:
    LOCAL.offset_ns = int(msg.data["offset_ns"])
    LOCAL.rtt_ns = int(msg.data["rtt_ns"])
    LOCAL.measured_wall_ns = int(msg.data["measured_wall_ns"])
    LOCAL.updates += 1


# ------------------------------------------------------------------ the master side
class ClockSync:
    """The master's measurements of its workers, by Locust client id."""

    def __init__(self, runner: MasterRunner, clock: Clock | None = None) -> None:
        self.runner = runner
        self.clock = clock or SystemClock()
        self.latest: dict[str, dict[str, Any]] = {}
        self.history: dict[str, list[dict[str, Any]]] = {}
        self._waiting: dict[tuple[str, int], gevent.event.AsyncResult] = {}
        self._seq = itertools.count(1)
        self._busy: set[str] = set()
        self._loop: gevent.Greenlet[..., Any] | None = None
        runner.register_message("calculet_clock_pong", self._on_pong)

    def measure(self, client_id: str, rounds: int = ROUNDS) -> dict[str, Any] | None:
        """`rounds` exchanges with one worker; the least-round-trip sample is kept, sent to
        the worker and returned (None: no answer within the rounds' timeouts)."""
        samples: list[OffsetSample] = []
        silent = 0
        for _ in range(rounds):
            if silent >= 2:  # not answering (gone, or without our handler): do not stall
                break
            seq = next(self._seq)
            waiter = gevent.event.AsyncResult()
            self._waiting[(client_id, seq)] = waiter
            t1 = self.clock.wall_ns()
            try:
                self.runner.send_message(
                    "calculet_clock_ping", {"seq": seq, "t1": t1}, client_id=client_id
                )
                t2, t3, t4 = waiter.get(timeout=ROUND_TIMEOUT_S)
            except gevent.Timeout:
                silent += 1
                continue
            finally:
                self._waiting.pop((client_id, seq), None)
            silent = 0
            samples.append(exchange(t1, int(t2), int(t3), int(t4)))
        best = best_sample(samples)
        if best is None:
            log.warning("calculet: no clock answer from worker %s", client_id)
            return None
        result = {
            "master_offset_ns": best.offset_ns,
            "master_rtt_ns": best.rtt_ns,
            "measured_wall_ns": best.t1_ns,
            "exchanges": len(samples),
            "exchange_rtts_ns": [s.rtt_ns for s in samples],
        }
        self.latest[client_id] = result
        hist = self.history.setdefault(client_id, [])
        hist.append(
            {k: result[k] for k in ("measured_wall_ns", "master_offset_ns", "master_rtt_ns")}
        )
        del hist[:-HISTORY_KEEP]
        msg = {k: result[k] for k in ("measured_wall_ns", "master_rtt_ns")}
        msg["offset_ns"] = best.offset_ns
        msg["rtt_ns"] = best.rtt_ns
        self.runner.send_message("calculet_clock_offset", msg, client_id=client_id)
        return result

    def ensure(self, client_ids: list[str], max_age_s: float) -> None:
        """Measure each of these workers whose last measurement is older than `max_age_s`."""
        for cid in client_ids:
            # the periodic loop may be measuring this worker right now: wait for it
            give_up = self.clock.mono_ns() + int(ROUNDS * ROUND_TIMEOUT_S * 1e9)
            while cid in self._busy and self.clock.mono_ns() < give_up:
                gevent.sleep(0.01)
            last = self.latest.get(cid)
            age_ns = None if last is None else self.clock.wall_ns() - int(last["measured_wall_ns"])
            if cid not in self._busy and (age_ns is None or age_ns > max_age_s * 1e9):
                self._measure_once(cid)

    def start(self, every_s: Callable[[], float]) -> None:
        """Measure workers as they connect, and each again every `every_s()` s (≤ 0: only
        at connect)."""
        if self._loop is None:
            self._loop = gevent.spawn(self._run, every_s)

    def for_client(self, client_id: str) -> dict[str, Any] | None:
        """The latest measurement and the bounded history of one worker, for the index."""
        last = self.latest.get(client_id)
        if last is None:
            return None
        return {**last, "history": list(self.history.get(client_id, []))}

    def _run(self, every_s: Callable[[], float]) -> None:
        while True:
            gevent.sleep(0.5)
            every = every_s()
            ids = [c.id for c in self.runner.clients.values() if c.state != "missing"]
            try:
                self.ensure(ids, max_age_s=every if every > 0 else float("inf"))
            except Exception:  # a bug here must not stop the run: logged, retried
                log.exception("calculet: clock sync failed")

    def _measure_once(self, cid: str) -> None:
        self._busy.add(cid)
        try:
            self.measure(cid)
        finally:
            self._busy.discard(cid)

    def _on_pong(self, environment: Environment, msg: Any, **_kw: Any) -> None:
        t4 = self.clock.wall_ns()  # first: the reply's arrival, before anything else runs
        waiter = self._waiting.get((msg.node_id, int(msg.data["seq"])))
        if waiter is not None:
            waiter.set((msg.data["t2"], msg.data["t3"], t4))
