"""A client process's heap during a run: start-up frozen, collections paced by time.

Every process that sends a run's requests holds it: a Locust worker (locust.worker) and
a driver's client (drive.RunClient: accept, the fault matrix, soak).

A garbage collection holds the interpreter lock, so while it runs the I/O engine's
thread can neither send nor read: a send waits (the open loop's send lag), and a read
that waits past the next token stamps the first token with the next one's arrival
(docs/measurement.md, "Pauses that hold the engine").

Python starts a young collection when the tracked objects made since the last one, less
those freed (old ones too), pass a threshold. With a run's churn that count is a poor
clock: at 320 req/s on one core (benchmarks/exact_server.py, 64 tokens 10 ms apart) the
young collections of a threshold of 2,000 came every ~0.5 s and each scanned the 10,000
to 20,000 objects made meanwhile and still alive (the in-flight requests' tasks,
futures, timers and greenlets, and the records waiting for their part): 2-15 ms a young
one, 7-33 ms a middle one. `HeapPacer` runs them by time instead: a young collection
every YOUNG_EVERY_S, so each scans what 20 ms made (0.1-0.3 ms, the longest of 850 in
one run 0.7 ms); a middle one every MIDDLE_EVERY young ones (1.2-1.4 ms, at most 5.5);
a full one every FULL_EVERY_S, for the cycles that live long enough to reach the old
generation. The automatic thresholds stay as a backstop (BACKSTOP_THRESHOLDS): should
the pacer's greenlet not get its turn, Python collects on its own. What the pacer costs:
a little more CPU in collections (0.22-0.27 s over an 18-s run at 320 req/s, against
0.15-0.20 by Python's count: about 10 µs a request) and one timer a YOUNG_EVERY_S on
the process's event loop.
"""

from __future__ import annotations

import gc
import time

import gevent

YOUNG_EVERY_S = 0.02
MIDDLE_EVERY = 10
# A full collection scans every object the run made that is still alive (start-up's are
# frozen): tens of ms at 320 req/s. Once per 10 min; cycles wait that long at most.
FULL_EVERY_S = 600.0
# Python's own collections when the pacer falls behind: young ones every 50,000 new
# objects (20 ms of a 320 req/s run makes a few hundred), middle ones every 10 young
# ones, full ones as rarely as Python's rule allows (every 12,500 middle ones, and only
# when the objects that reached the old generation grew by a quarter since the last).
BACKSTOP_THRESHOLDS = (50_000, 10, 12_500)


class HeapPacer:
    """Start-up's objects frozen out of the collector's reach (`gc.freeze`) and the
    collections paced on the gevent loop, while at least one user (a run's Worker, a
    driver's client) has it started; `stop` by the last user puts Python's thresholds
    back and unfreezes."""

    def __init__(
        self,
        young_every_s: float = YOUNG_EVERY_S,
        middle_every: int = MIDDLE_EVERY,
        full_every_s: float = FULL_EVERY_S,
    ) -> None:
        self.young_every_s = young_every_s
        self.middle_every = middle_every
        self.full_every_s = full_every_s
        self.collections = [0, 0, 0]  # paced collections of each generation
        self._users = 0
        self._greenlet: gevent.Greenlet[[], None] | None = None
        self._saved: tuple[int, int, int] = gc.get_threshold()

    @property
    def running(self) -> bool:
        return self._greenlet is not None

    def start(self) -> None:
        """Freeze what exists now (everything start-up made: Locust, gevent, pyarrow, the
        prompts) and pace the collections from here."""
        self._users += 1
        gc.collect()
        gc.freeze()
        if self._greenlet is not None:
            return
        self._saved = gc.get_threshold()
        gc.set_threshold(*BACKSTOP_THRESHOLDS)
        self._greenlet = gevent.spawn(self._run)

    def stop(self) -> None:
        self._users = max(self._users - 1, 0)
        if self._users or self._greenlet is None:
            return
        self._greenlet.kill()
        self._greenlet = None
        gc.set_threshold(*self._saved)
        # what start froze is the collector's again: a process that runs more than one
        # driver (a test session) frees the cycles it left meanwhile
        gc.unfreeze()

    def _run(self) -> None:
        young = 0
        full_at = time.monotonic() + self.full_every_s
        while True:
            gevent.sleep(self.young_every_s)
            young += 1
            if time.monotonic() >= full_at:
                generation = 2
                full_at = time.monotonic() + self.full_every_s
            elif young % self.middle_every == 0:
                generation = 1
            else:
                generation = 0
            gc.collect(generation)
            self.collections[generation] += 1


# The process's one pacer (Workers of several runs in one process share it).
PACER = HeapPacer()
