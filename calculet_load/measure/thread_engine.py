"""The thread I/O engine, the default (`--io-engine thread`): a request's socket I/O on the
process's loop thread (measure.thread_loop), not on the greenlet that sends it. The
timing-critical work (connect, send at the intended time with `loop.call_at`, each read
and its stamp) is never held up by the greenlets' work (records, sinks, Locust events).

Everything but the waiting is shared with the gevent engine (measure.gevent_engine: its
docstring names the modules): the same outcome, stamps, counts, errors and retries.
Reads are driven by the socket's readiness (the native reader's thread, or
`add_reader`: measure.thread_reads): with the system clock each read carries the
kernel's receive time (SO_TIMESTAMPNS, `stamp_source` "kernel"), over TLS too (its
records come in plain reads: measure.biotls), and where the native reader reads, t1 is
the kernel's transmit time of the request's last byte (measure.txstamps). Token events
reach `on_token` as they arrive, on the caller's greenlet: the engine queues each and
wakes the caller's hub (only a request with a listener pays for it; the stamps are taken
on the engine's thread before, and never move).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from gevent.monkey import get_original

from calculet_load.clock import Clock, SystemClock
from calculet_load.measure.biotls import BioTLS
from calculet_load.measure.connections import ConnectionPool, Endpoint, connect_now, stale
from calculet_load.measure.exchange import prepare, wire
from calculet_load.measure.outcome import (
    OUTPUT_SLACK_TOKENS,
    CancelAt,
    Fail,
    OnToken,
    Outcome,
    PoolExhausted,
    Timeouts,
    connect_fail,
    fail_into,
    run_stopped,
)
from calculet_load.measure.protocols import Adapter
from calculet_load.measure.request_state import Run, conclude
from calculet_load.measure.rxstamps import CMSG_SPACE, ask_kernel_stamps
from calculet_load.measure.thread_loop import Live, LoopThread, reads_natively_with
from calculet_load.measure.thread_reads import ResponseReads
from calculet_load.measure.txstamps import (
    Counted,
    ask_send_stamps,
    poll_ready,
    settle_t1,
    tx_of,
    tx_on,
)

# the standard library's, whatever gevent's monkey-patching replaced (Locust patches all):
# sockets the loop waits on itself
_socket = get_original("socket", "socket")


class _Conn(Counted, _socket):  # type: ignore[misc,valid-type]
    """A connection of the thread engine: a standard socket that counts what it sends
    (measure.txstamps)."""

    __slots__ = ("tx",)


_REQUEST = tuple[str, list[tuple[str, str]], bytes]


class ThreadPool(ConnectionPool):
    """Keep-alive connections of the thread engine (non-blocking standard sockets), at
    most `max_connections` open, and the requests sent over them (`execute`); used from
    the loop thread only, but for `open`."""

    def __init__(
        self, endpoint: Endpoint, max_connections: int, engine: LoopThread | None = None
    ) -> None:
        super().__init__(endpoint, max_connections)
        self.engine = engine or LoopThread.shared()

    async def open_new(self, connect_timeout: float) -> socket.socket:
        """A new connection (counted against the cap `take` checked)."""
        return await self._open(connect_timeout)

    async def _open(self, connect_timeout: float) -> socket.socket:
        self.open += 1
        sock: socket.socket | None = None
        loop = asyncio.get_running_loop()
        try:
            family, sockaddr = self.endpoint.address()
            sock = conn = _Conn(family, socket.SOCK_STREAM)
            conn.tx = None
            sock.setblocking(False)
            deadline = time.monotonic() + connect_timeout
            await _connect(loop, sock, sockaddr, connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # over TLS too: its records come in plain reads of this socket (measure.biotls)
            ask_kernel_stamps(sock)
            tls = self.endpoint.plain_tls()
            if tls is not None:
                # the handshake (and verification) within the connect timeout
                bio = BioTLS(sock, tls, self.endpoint.host, CMSG_SPACE)
                await asyncio.wait_for(_handshake(loop, bio), deadline - time.monotonic())
                # the pool and the reads take it for a socket (the part they use)
                sock = bio  # type: ignore[assignment]
            if self.engine.reads_natively():
                # the transmit times of what it sends, TLS records included, where the
                # native reader reads it: a stamp queued on a socket uvloop watches would
                # close its watcher (`_wait_io`); the reader reads them (measure.txstamps)
                conn.tx = ask_send_stamps(conn)
        except BaseException:
            self.open -= 1
            if sock is not None:
                sock.close()
            raise
        return sock

    def prewarm(self, n: int, connect_timeout: float = 10.0) -> int:
        async def warm() -> int:
            todo = max(0, min(n - len(self._idle), self.max_connections - self.open))
            socks = await asyncio.gather(*(self._open(connect_timeout) for _ in range(todo)))
            self._idle.extend(socks)
            return len(socks)

        self.endpoint.address()  # resolved here: a lookup may be gevent's (a greenlet)
        return self.engine.call(warm)

    def close(self) -> None:
        async def close() -> None:
            ConnectionPool.close(self)

        self.engine.call(close)

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
        """The gevent engine's `execute` on the loop thread: the same outcome.
        `send_at_ns`: the monotonic instant to send at (the engine waits for it on its
        loop's timers); the request is built here, on the caller's greenlet, before it is
        handed over. `on_token` is called on the caller's greenlet as each token event
        arrives."""
        self.endpoint.address()  # resolved on the caller's side (gevent's resolver)
        job = _Job(
            pool=self,
            adapter=adapter,
            request=prepare(self.endpoint, adapter, body, request_id, stream, extra_headers),
            request_id=request_id,
            stream=stream,
            timeouts=timeouts or Timeouts(),
            clock=clock or SystemClock(),
            cancel=cancel,
            max_tokens=max_tokens,
            slack=output_slack_tokens,
            count_text=count_text,
            send_at=send_at_ns,
            keep_text=keep_text,
        )
        live = None
        if on_token is not None:
            live = Live(on_token)
            job.on_token = live.put
        return self.engine.call(lambda: _execute(job), live)


async def _ready(
    loop: asyncio.AbstractEventLoop, fd: int, write: bool, timeout_s: float | None
) -> None:
    """Wait until `fd` is writable (or readable)."""
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, ready)

    def late() -> None:
        if not fut.done():
            fut.set_exception(TimeoutError("timed out"))

    timer = loop.call_later(timeout_s, late) if timeout_s is not None else None
    try:
        await fut
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)
        if timer is not None:
            timer.cancel()


async def _connect(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, sockaddr: Any, timeout_s: float
) -> None:
    """Connect the non-blocking `sock`, waiting on the loop only when the kernel has not
    connected it by the time `connect` returns (`connect_now`). Not
    `asyncio.wait_for(loop.sock_connect(...))`: its task and callbacks take four or five
    passes of the loop, each a few ms late when the loop is busy."""
    if not connect_now(sock, sockaddr):
        await _ready(loop, sock.fileno(), True, timeout_s)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))  # ConnectionRefusedError and the like


async def _handshake(loop: asyncio.AbstractEventLoop, sock: BioTLS) -> None:
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            await _ready(loop, sock.fileno(), False, None)
        except ssl.SSLWantWriteError:
            await _ready(loop, sock.fileno(), True, None)


async def _send_all(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes, timeout_s: float
) -> None:
    """Write all of `data`; a wait for room lasts at most `timeout_s` (TimeoutError)."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except (BlockingIOError, ssl.SSLWantWriteError):
            await _wait_io(loop, sock, True, timeout_s)
        except ssl.SSLWantReadError:
            await _wait_io(loop, sock, False, timeout_s)
    if isinstance(sock, BioTLS):  # the last TLS bytes the socket did not take yet
        while not sock.flush():
            await _wait_io(loop, sock, True, timeout_s)


async def _wait_io(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, write: bool, timeout_s: float
) -> None:
    """Wait until `sock` is writable (or readable), at most `timeout_s`: on the loop, or
    polled where its transmit stamps are on (`txstamps.poll_ready` says why)."""
    if tx_of(sock) is None:
        await _ready(loop, sock.fileno(), write, timeout_s)
    else:
        await poll_ready(sock, write, timeout_s)


async def _until(loop: asyncio.AbstractEventLoop, at_ns: int) -> None:
    """Sleep until the monotonic instant `at_ns` on the loop's timers (whole ms: never
    early; a timer that fires early for the loop's cached time waits once more)."""
    while (left := at_ns - time.monotonic_ns()) > 0:
        fut: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(math.ceil(left / 1e6) / 1e3, fut.set_result, None)
        try:
            await fut
        finally:
            timer.cancel()


@dataclasses.dataclass(slots=True)
class _Job:
    pool: ThreadPool
    adapter: Adapter
    request: _REQUEST
    request_id: str
    stream: bool
    timeouts: Timeouts
    clock: Clock
    cancel: CancelAt
    max_tokens: int | None
    slack: int
    count_text: Callable[[str], int] | None
    send_at: int | None
    keep_text: bool = False
    on_token: OnToken | None = None  # on the engine's thread: `Live.put`


async def _execute(job: _Job) -> Outcome:
    loop = asyncio.get_running_loop()
    if job.send_at is not None and type(job.clock) is SystemClock:
        await _until(loop, job.send_at)  # the open loop's intended time
    out = await _attempt(loop, job, fresh=False)
    if stale(out):  # as the gevent engine's: once more on a new connection
        out = await _attempt(loop, job, fresh=True)
        out.stale_retry = True
    return out


async def _attempt(loop: asyncio.AbstractEventLoop, job: _Job, fresh: bool) -> Outcome:
    clock, timeouts, pool = job.clock, job.timeouts, job.pool
    out = Outcome(job.request_id)
    run = Run(
        job.adapter, out, clock, job.stream, job.on_token, job.count_text, None, job.keep_text
    )
    conn, data = wire(job.request)
    sock: socket.socket | None = None
    taken: BaseException | None = None
    try:
        # An idle connection is taken before t0: its liveness check is a system call,
        # and after one this thread may wait for the interpreter lock (the greenlets
        # hold it) between t0 and the send, a delay in every duration from t0 (the
        # self-check's start-to-sent figure would flag it). A new connection
        # is opened after t0, as on gevent: its connect is the request's.
        sock = pool.take(fresh)
    except PoolExhausted as exc:
        taken = exc
    out.wall_anchor_ns = clock.wall_ns()
    t0 = clock.mono_ns()
    ns: dict[str, int | None] = {"t0": t0, "t1": None, "t2": None, "t6": None}
    reusable = False
    deadline = t0 + int(timeouts.total_s * 1e9)
    try:
        try:
            if taken is not None:
                raise taken
            out.connection_reused = sock is not None
            if sock is None:
                began = clock.mono_ns()
                sock = await pool.open_new(timeouts.connect_s)
                out.connect_ns = clock.mono_ns() - began
        except (PoolExhausted, OSError) as exc:  # ssl.SSLError and timeouts are OSErrors
            raise connect_fail(exc, pool.max_connections) from None
        limit = max(min(timeouts.idle_s, (deadline - clock.mono_ns()) / 1e9), 0.001)
        # transmit stamps only where the native reader reads the response: a stamp that
        # came late would close uvloop's watcher on the loop's reads (`_wait_io`)
        tx_on(sock, reads_natively_with(pool.engine, clock))
        try:
            await _send_all(loop, sock, data, limit)
        except OSError as exc:
            out.unanswered = True
            raise Fail("connection_reset", f"while sending: {exc}") from None
        ns["t1"] = clock.mono_ns()
        settle_t1(sock, clock, out, ns, expect=True)
        if job.cancel == "before_headers":
            out.cancelled_at = "before_headers"
            raise Fail("cancelled", "cancelled after the request was sent, before headers")
        resp = ResponseReads(pool.engine, sock, conn, run, ns, timeouts, deadline, job.cancel)
        reusable = await resp.wait()
    except Fail as f:
        fail_into(out, f, job.cancel)
    except asyncio.CancelledError:
        run_stopped(out)  # the caller was killed (the run stopped): keep what it measured
    finally:
        if sock is not None:
            settle_t1(sock, clock, out, ns, expect=False)  # a stamp the driver queued late
            pool.release(sock, reusable and out.error_class is None)
    return conclude(run, ns, job.max_tokens, job.slack)
