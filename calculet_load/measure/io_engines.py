"""The I/O engines behind one interface: `IOEngine`, what a session uses of one target's
keep-alive connections on one engine (send a request with its options, open
connections ahead of time, close), implemented by the gevent engine's pool
(measure.gevent_engine `GeventPool`) and the thread engine's (measure.thread_engine
`ThreadPool`), and chosen by name here (`IO_ENGINES`, `open_engine`) once per session.
Both give the same outcome for the same response; they differ only in where the socket
I/O waits (docs/measurement.md, "The I/O engines").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import gevent

from calculet_load.clock import Clock
from calculet_load.measure.connections import Endpoint
from calculet_load.measure.gevent_engine import GeventPool
from calculet_load.measure.outcome import OUTPUT_SLACK_TOKENS, CancelAt, OnToken, Outcome, Timeouts
from calculet_load.measure.protocols import Adapter
from calculet_load.measure.thread_engine import ThreadPool

T = TypeVar("T")


class IOEngine(Protocol):
    """One target's keep-alive connections on one I/O engine, and the requests sent over
    them: at most `max_connections` open (`open` of them now)."""

    endpoint: Endpoint
    max_connections: int
    open: int

    def execute(
        self,
        adapter: Adapter,
        body: dict[str, Any],
        request_id: str,
        *,
        stream: bool,
        timeouts: Timeouts | None = None,
        clock: Clock | None = None,
        cancel: CancelAt = None,
        extra_headers: dict[str, str] | None = None,
        on_token: OnToken | None = None,
        max_tokens: int | None = None,
        output_slack_tokens: int = OUTPUT_SLACK_TOKENS,
        count_text: Callable[[str], int] | None = None,
        keep_text: bool = False,
        send_at_ns: int | None = None,
    ) -> Outcome:
        """Run one request and return its outcome; never raises for a server's behaviour.
        Called on a greenlet (`run_in_greenlet` from outside a gevent loop); `send_at_ns`:
        the monotonic instant to send at."""
        ...

    def prewarm(self, n: int, connect_timeout: float = 10.0) -> int:
        """Open up to `n` idle connections ahead of time; how many were opened."""
        ...

    def close(self) -> None:
        """Close the idle connections."""
        ...


IO_ENGINES: dict[str, Callable[[Endpoint, int], IOEngine]] = {
    "gevent": GeventPool,
    "thread": ThreadPool,
}
# Every run's unless told otherwise (`--io-engine`, `Session(io_engine=...)`): 25-40 %
# less CPU per request than gevent at every point of benchmarks/client_speed.py, and TTFT
# p99 within 1 ms up to twice gevent's rate (figures: docs/performance.md).
DEFAULT_IO_ENGINE = "thread"


def open_engine(name: str, endpoint: Endpoint, max_connections: int) -> IOEngine:
    """The I/O engine called `name` for one target (a ValueError naming the choices)."""
    make = IO_ENGINES.get(name)
    if make is None:
        raise ValueError(f"io_engine {name!r}: one of {', '.join(IO_ENGINES)}")
    return make(endpoint, max_connections)


def run_in_greenlet(fn: Callable[[], T]) -> T:
    """Run a call in its own greenlet (for callers outside a gevent loop)."""
    g = gevent.spawn(fn)
    g.join()
    if g.exception is not None:
        raise g.exception
    value: T = g.value
    return value
