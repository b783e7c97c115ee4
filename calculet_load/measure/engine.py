# size: the thread I/O engine, one concept: its loop thread, pool, reads and request steps
"""The thread I/O engine: a request's socket I/O in one dedicated thread per process.

The thread runs an asyncio loop (uvloop when installed); the caller, a greenlet (a Locust
user, a dispatcher's send), submits a request and waits for its outcome without blocking
the gevent hub: the engine wakes it through the hub's thread-safe async watcher. The
timing-critical work (connect, send at the intended time with `loop.call_at`, each read
and its stamp) is never held up by the greenlets' work (records, sinks, Locust events).

Everything but the waiting is shared with the gevent engine (measure.client: its
docstring names the modules): the same outcome, stamps, counts, errors and retries. Reads are driven
by the socket's readiness (the native reader's thread, or `add_reader`): with the system
clock each read carries the kernel's receive time (SO_TIMESTAMPNS, `stamp_source`
"kernel"), over TLS too (its records come in plain reads: measure.biotls), and where the
native reader reads, t1 is the kernel's transmit time of the request's last byte
(measure.txstamps). When the loop is late, reads come before
parsing (`_Backlog`): a read stamps its bytes, and only reading a socket after its next
token arrived could make a token's stamp late. Token events reach `on_token` as they
arrive, on the caller's greenlet: the engine queues each and wakes the caller's hub
(only a request with a listener pays for it; the stamps are taken on the engine's
thread before, and never move).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import math
import os
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import gevent
import gevent.event
from gevent.monkey import get_original

from calculet_load.clock import Clock, SystemClock
from calculet_load.measure.biotls import BioTLS
from calculet_load.measure.client import ConnectionPool, Endpoint, connect_now, stale
from calculet_load.measure.exchange import prepare, respond, wire
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
from calculet_load.measure.rxstamps import CMSG_SPACE, Reads, ask_kernel_stamps
from calculet_load.measure.threads import ENGINE_THREAD, READER_THREAD, name_this_thread
from calculet_load.measure.txstamps import (
    Counted,
    ask_send_stamps,
    poll_ready,
    settle_t1,
    tx_of,
    tx_on,
)

T = TypeVar("T")
IO_ENGINES = ("gevent", "thread")
# Every run's unless told otherwise (`--io-engine`, `Session(io_engine=...)`): 25-40 %
# less CPU per request than gevent at every point of benchmarks/client_speed.py, and TTFT
# p99 within 1 ms up to twice gevent's rate (docs/measurement.md, "The I/O engines").
DEFAULT_IO_ENGINE = "thread"
# the standard library's, whatever gevent's monkey-patching replaced (Locust patches all):
# a real thread, real locks and sockets the loop waits on itself
_start_thread = get_original("_thread", "start_new_thread")
_allocate_lock = get_original("_thread", "allocate_lock")
_get_ident = get_original("_thread", "get_ident")
_socket = get_original("socket", "socket")


class _Conn(Counted, _socket):  # type: ignore[misc,valid-type]
    """A connection of the thread engine: a standard socket that counts what it sends
    (measure.txstamps)."""

    __slots__ = ("tx",)


_REQUEST = tuple[str, list[tuple[str, str]], bytes]
# Plain sockets are read by the native reader (measure/reader.c) where it is built;
# "0" reads them on the engine's loop, as TLS ones are. On by default since stop 35: 3-17 %
# less CPU a request at 80-320 req/s and 64 streams, and the send lag that kept it
# opt-in was not seen again once the sink's allocator stall was fixed
# (docs/measurement.md, "The native reader")
NATIVE_READS_ENV = "CALCULET_NATIVE_READS"
READ_NATIVELY = os.environ.get(NATIVE_READS_ENV, "1") != "0"
# Opt-in: while reads come densely (a pass would find 3 sockets ready or more), the native
# reader wakes at most once per this many µs and reads every ready socket in one pass. At
# 320 req/s its CPU a request fell 42 % (453 -> 263 µs), but two token events of one
# stream that arrive within the window share a read and its stamp: 0.4-2.4 % of the
# records had one such pair at 320 req/s with a 500-µs window, none without. So "0", each
# socket read as its bytes arrive, is the default (docs/measurement.md, "The native
# reader").
READ_COALESCE_ENV = "CALCULET_READ_COALESCE_US"


def _coalesce_us() -> int:
    text = os.environ.get(READ_COALESCE_ENV, "0")
    if not text.isdigit() or int(text) > 1_000_000:
        raise ValueError(f"{READ_COALESCE_ENV}={text!r}: expected whole µs, 0 to 1000000")
    return int(text)


READ_COALESCE_US = _coalesce_us()


def _reader_module() -> Any:
    """The native reader's module (measure/reader.c), or None when it is not built
    (measure.native)."""
    try:
        from calculet_load.measure import _reader  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _reader


def reads_natively() -> bool:
    """Whether this process's thread engine reads plain sockets with the native reader:
    asked for (READ_NATIVELY, the default) and built."""
    return READ_NATIVELY and _reader_module() is not None


def reads_natively_with(engine: IoEngine, clock: Clock) -> bool:
    """Whether this engine's native reader reads a response timed on `clock`: its reads
    carry the kernel's receive time, which only the system clock can take."""
    native = READ_NATIVELY and engine.reader is not None and CMSG_SPACE > 0
    return native and type(clock) is SystemClock


def _new_reader() -> Any:
    """The native reader, or None when it is not built."""
    module = _reader_module()
    return None if module is None else module.Reader(READER_THREAD, READ_COALESCE_US * 1000)


def _new_loop() -> tuple[asyncio.AbstractEventLoop, str]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop(), "asyncio"
    return uvloop.new_event_loop(), "uvloop"


class IoEngine:
    """One loop thread per process (`IoEngine.shared()`), started when first used."""

    _shared: IoEngine | None = None
    _pid = 0
    _guard = _allocate_lock()

    @classmethod
    def shared(cls) -> IoEngine:
        with cls._guard:
            if cls._shared is None or cls._pid != os.getpid():  # a fork has no thread
                cls._shared, cls._pid = IoEngine(), os.getpid()
            return cls._shared

    def __init__(self) -> None:
        self.loop, self.kind = _new_loop()
        self.backlog = _Backlog(self.loop)  # reads waiting to be parsed (a late loop)
        # plain sockets' reads in a native thread, handed to the loop (`_on_reads`)
        self.reader = _new_reader()
        self.reading: dict[int, _Response] = {}  # the responses it reads, by fd
        # per controller thread (its hub): finished calls, and the watcher that wakes it
        self._hubs: dict[int, tuple[Any, collections.deque[tuple[Any, Any, bool]]]] = {}
        self._out: dict[int, int] = {}  # calls waiting, per watcher
        ready = _allocate_lock()
        ready.acquire()

        def main() -> None:
            name_this_thread(ENGINE_THREAD)
            asyncio.set_event_loop(self.loop)
            if self.reader is not None:
                self.loop.add_reader(self.reader.fileno(), self._on_reads)
            self.loop.call_soon(ready.release)
            self.loop.run_forever()

        _start_thread(main, ())
        # The engine leaves the interpreter's GIL switch interval as the process has it
        # (5 ms by default; the Locust plugin sets 0.5 ms, for the gevent engine's loop:
        # calculet_load/locust/plugin.py). docs/measurement.md has what each did to
        # this engine's tails in a Locust worker (stops 24 and 26).
        ready.acquire()  # a few ms, once per process

    def _on_reads(self) -> None:
        """The native reader has reads a response must see now."""
        for fd in self.reader.ready():
            resp = self.reading.get(fd)
            if resp is not None:
                resp.deliver()

    def _waker(self) -> tuple[Any, collections.deque[tuple[Any, Any, bool]]]:
        key = _get_ident()
        found = self._hubs.get(key)
        if found is None:
            done: collections.deque[tuple[Any, Any, bool]] = collections.deque()
            watcher = gevent.get_hub().loop.async_(ref=False)

            def wake() -> None:
                while done:
                    result, value, ok = done.popleft()
                    if ok:
                        result.set(value)
                    else:
                        result.set_exception(value)

            watcher.start(wake)
            found = self._hubs[key] = (watcher, done)
        return found

    def call(
        self,
        make: Callable[[], Coroutine[Any, Any, T]],
        live: _Live | None = None,
    ) -> T:
        """Run `make()` on the engine's loop; the calling greenlet waits for its value.
        Killed while waiting (the run stopped), the coroutine is cancelled, and the
        GreenletExit carries what it returned as `outcome`. With `live`, the greenlet
        also hands each item the coroutine puts into it (`_Live.put`, on the engine's
        thread) to its listener as it arrives, and all of them before it returns."""
        watcher, done = self._waker()
        # the hub waits for the watcher while a call is out (unreferenced otherwise: an
        # idle engine does not keep a gevent loop from ending)
        watcher.ref = True
        self._out[id(watcher)] = self._out.get(id(watcher), 0) + 1
        result: gevent.event.AsyncResult = gevent.event.AsyncResult()
        tasks: list[asyncio.Task[T]] = []
        if live is not None:

            def wake() -> None:  # on the engine's thread
                done.append((live, None, True))
                watcher.send()

            live.wake = wake

        def finished(task: asyncio.Task[T]) -> None:
            if task.cancelled():
                done.append((result, asyncio.CancelledError(), False))
            elif task.exception() is not None:
                done.append((result, task.exception(), False))
            else:
                done.append((result, task.result(), True))
            if live is not None:
                done.append((live, None, True))  # its listener's greenlet waits on it
            watcher.send()  # thread-safe: wakes the caller's hub

        def start() -> None:
            task = self.loop.create_task(make())
            task.add_done_callback(finished)
            tasks.append(task)

        self.loop.call_soon_threadsafe(start)
        try:
            if live is not None:
                live.serve(result)
            value: T = result.get()
        except gevent.GreenletExit as exc:
            self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in tasks])
            with contextlib.suppress(BaseException):  # cancelled before it sent: nothing
                exc.outcome = result.get(timeout=5.0)
            raise
        finally:
            left = self._out[id(watcher)] = self._out[id(watcher)] - 1
            if not left:
                watcher.ref = False
        return value


class _Live:
    """Items a call's coroutine hands its caller as they come (a request's token events
    and their text): the engine's thread `put`s each and wakes the caller's hub, the
    caller's greenlet `serve`s them to `listener` until the call's result is in."""

    def __init__(self, listener: Callable[..., None]) -> None:
        self.listener = listener
        self.items: collections.deque[tuple[Any, ...]] = collections.deque()
        self.ready = gevent.event.Event()
        self.wake: Callable[[], object] = lambda: None  # set by `IoEngine.call`

    def put(self, *item: Any) -> None:
        """On the engine's thread."""
        self.items.append(item)
        self.wake()

    def set(self, _value: object) -> None:
        """On the caller's hub (the engine's waker): an item or the result came."""
        self.ready.set()

    def serve(self, result: gevent.event.AsyncResult) -> None:
        """Hand the items over as they come, until `result` is in and none is left."""
        while True:
            self.ready.wait()
            self.ready.clear()
            while self.items:
                self.listener(*self.items.popleft())
            if result.ready():
                while self.items:
                    self.listener(*self.items.popleft())
                return


class EnginePool(ConnectionPool):
    """Keep-alive connections of the thread engine (non-blocking standard sockets), at
    most `max_connections` open; used from the engine's thread only, but for `open`."""

    def __init__(
        self, endpoint: Endpoint, max_connections: int, engine: IoEngine | None = None
    ) -> None:
        super().__init__(endpoint, max_connections)
        self.engine = engine or IoEngine.shared()

    def acquire(self, connect_timeout: float, fresh: bool = False) -> tuple[socket.socket, bool]:
        raise TypeError("the thread engine's pool connects on its loop (take, open_new)")

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
            if READ_NATIVELY and self.engine.reader is not None:
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


# A read whose bytes waited this long in the kernel finds the loop late: it is parsed
# after the reads already waiting (`_Backlog`), not before them.
LATE_READ_NS = 1_000_000
# The longest a run of parsing goes before the loop polls its sockets again.
PARSE_SLICE_NS = 2_000_000


class _Backlog:
    """Reads taken but not yet parsed, oldest first, on one loop.

    Why: a read's kernel stamp is the arrival of the last segment it copies, and the
    kernel merges segments that arrive while earlier ones wait unread into one buffer
    with the newest time (docs/measurement.md). So what keeps TTFT exact is reading each
    socket before its next token arrives (a token interval, 10 ms in the benchmark),
    not parsing it: when the loop is late (a read's bytes waited `LATE_READ_NS` or more,
    or reads are already waiting here), each ready socket is read and stamped at once and
    its bytes join this queue; the queue is parsed in runs of at most `PARSE_SLICE_NS`,
    each followed by a poll of the sockets (a `call_soon` runs after the next poll). A
    failure in a queued read's bytes is found within a run or two. On time, a read is
    parsed as it is taken, as before."""

    __slots__ = ("loop", "queue", "scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: collections.deque[tuple[_Response, _Taken]] = collections.deque()
        self.scheduled = False

    def add(self, resp: _Response, taken: _Taken) -> None:
        self.queue.append((resp, taken))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.drain)

    def drain(self) -> None:
        queue, end = self.queue, time.monotonic_ns() + PARSE_SLICE_NS
        while queue:
            resp, taken = queue.popleft()
            resp.queued -= 1
            resp.parse(taken)
            if queue and time.monotonic_ns() >= end:
                self.loop.call_soon(self.drain)  # after the loop polls the sockets
                return
        self.scheduled = False


# a read: its bytes, whether the peer closed after them, when it returned, the kernel's
# receive time, when the read before returned; or the socket's error
_Taken = tuple[bytes, bool, int, "int | None", int] | Fail


class _Response(Reads):
    """One response's reads on the loop: each read as its bytes arrive, stamped first,
    then parsed (`respond`) at once or, when the loop is late, after the reads waiting
    (`_Backlog`); the read timeouts on one lazily re-armed timer."""

    __slots__ = ("backlog", "cancel", "clock", "ended", "engine", "expiry", "fd", "fut", "gen",
                 "kind", "lazy", "limit_s", "loop", "native", "queued", "since", "sock", "timer",
                 "timer_at", "tls")  # fmt: skip

    def __init__(
        self, engine: IoEngine, sock: socket.socket, conn: Any, run: Run,
        ns: dict[str, int | None], timeouts: Timeouts, deadline: int, cancel: CancelAt,
    ) -> None:  # fmt: skip
        self.tls = isinstance(sock, BioTLS)  # its reads carry stamps too (EnginePool._open)
        stamps = CMSG_SPACE > 0 and type(run.clock) is SystemClock
        super().__init__(run, ns, timeouts, deadline, stamps)
        self.engine, self.backlog = engine, engine.backlog
        self.loop = engine.loop
        # the native reader reads a socket whose reads carry the kernel's stamps (a TLS
        # one's records too: decrypted here, `deliver`)
        self.native = reads_natively_with(engine, run.clock)
        self.lazy = False  # ... and tells the loop at the response's end only
        self.cancel = cancel
        self.sock, self.clock, self.fd = sock, run.clock, sock.fileno()
        self.fut: asyncio.Future[bool] = self.loop.create_future()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = self.expiry = 0  # time.monotonic_ns of the timer, of the limit
        self.since = 0  # time.monotonic_ns of the last read (or of the request's send)
        self.kind, self.limit_s = "", 0.0
        self.queued = 0  # this response's reads in the backlog
        self.ended = False  # a read saw the end of the stream or failed: no more reads
        self.gen = respond(conn, self, cancel)
        next(self.gen)  # to its first read

    async def wait(self) -> bool:
        if self.native:
            try:
                self.engine.reader.watch(self.fd, False)
            except OSError:  # the reader cannot take it (out of memory): the loop reads
                self.native = False
                tx_on(self.sock, False)  # and no more stamps for its watcher (`_wait_io`)
            else:
                return await self._wait_native()
        try:
            self._arm()
            self.loop.add_reader(self.fd, self._on_readable)
            return await self.fut
        finally:
            self.loop.remove_reader(self.fd)
            if self.timer is not None:
                self.timer.cancel()

    async def _wait_native(self) -> bool:
        """Wait for the response, its socket watched by the reader (`wait` began it)."""
        reader, reading = self.engine.reader, self.engine.reading
        try:
            reading[self.fd] = self
            self._arm()
            return await self.fut
        finally:
            tx = tx_of(self.sock)
            if tx is not None:  # transmit stamps the reader read from the error queue
                for key, stamp, mono, wall in reader.sent(self.fd):
                    tx.take(key, stamp, mono, wall)
            reader.unwatch(self.fd)
            reading.pop(self.fd, None)
            if self.timer is not None:
                self.timer.cancel()

    def deliver(self) -> None:
        """The reads the native reader made of this response's socket, in order: each
        stamped as it was made, then queued to be parsed (`_Backlog`: in runs of at most
        PARSE_SLICE_NS, so a response's events, read at its end all at once, do not hold
        the loop's timers: the open loop's sends). Once the head is read and the body
        is an event stream's chunks, the reader tells the loop at the stream's end only
        (a cancel mid-stream, and a live listener, want each read as it comes)."""
        for data, t, wall, stamp, err in self.engine.reader.take(self.fd):
            if self.fut.done() or self.ended:
                return
            taken: _Taken
            if err:  # as a failed read on the loop says it (`_on_readable`)
                taken = Fail("connection_reset", str(OSError(err, os.strerror(err))))
                self.ended = True
            else:
                self.since = t  # the idle limit runs from the read
                taken = self.native_read(data, t, wall, stamp)
                self.ended = not data
                if self.tls:
                    # the TLS records' bytes: the plaintext they complete, stamped with
                    # this read's arrival (a record still coming waits for the next)
                    try:
                        plain, closed = self.sock.feed(data)  # type: ignore[attr-defined]
                    except OSError as exc:  # ssl.SSLError: as the loop's reads say it
                        taken, self.ended = Fail("connection_reset", str(exc)), True
                    else:
                        if not plain and not closed and data:
                            continue
                        self.ended = self.ended or closed
                        taken = (plain, closed, *taken[2:])
            self.queued += 1
            self.backlog.add(self, taken)

    def parse(self, taken: _Taken) -> None:
        """Take a read's bytes into the response (its stamps, then `respond`)."""
        self._parse(taken)
        if (
            self.native
            and not self.lazy
            and not self.tls  # its reads end where its records do, never at CRLF CRLF
            and self.chunked
            and self.cancel is None
            and self.run.on_token is None  # a live listener wants each read as it comes
            and not self.fut.done()
        ):
            self.lazy = True
            self.engine.reader.lazy(self.fd, True)

    def _arm(self) -> None:
        """The next read's limit from now (Fail when the total deadline passed); the
        timer moves only when the limit comes sooner than it."""
        self.since = time.monotonic_ns()
        self.limit_s, self.kind = self.limit(self.clock.mono_ns())
        self.expiry = self.since + int(self.limit_s * 1e9)
        if self.timer is None or self.timer_at > self.expiry:
            if self.timer is not None:
                self.timer.cancel()
            self.timer_at = self.expiry
            self.timer = self.loop.call_later(max(self.limit_s, 0.001), self._on_timer)

    def _on_timer(self) -> None:
        """A read waited its limit, or the timer is early: the limit runs from the last
        read (`since`), worked out here rather than at every read."""
        self.timer = None
        if self.native and not self.fut.done():
            self.deliver()  # the reads the reader holds: the limit runs from the last
        if self.fut.done():
            return
        try:
            self.limit_s, self.kind = self.limit(self.read_at or self.clock.mono_ns())
        except Fail as f:
            self.fut.set_exception(f)
            return
        self.expiry = self.since + int(self.limit_s * 1e9)
        left = self.expiry - time.monotonic_ns()
        if left > 0 or self.queued:  # bytes read and not yet parsed: not a wait
            self.timer_at = self.expiry
            self.timer = self.loop.call_later(max(left / 1e9, 0.001), self._on_timer)
            return
        self.fut.set_exception(Fail(self.kind, f"no bytes for {self.limit_s:.3f} s"))

    def _on_readable(self) -> None:
        if self.fut.done() or self.ended:
            return
        taken: _Taken
        late = False
        try:
            taken = self.stamped_read(self.sock, self.clock, self.tls)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return  # nothing for the application yet (a TLS record still coming)
        except OSError as exc:
            taken = Fail("connection_reset", str(exc))
        else:
            self.since = time.monotonic_ns()  # the idle limit runs from here
            data, closed, t, kernel, _ = taken
            late = kernel is not None and t - kernel >= LATE_READ_NS
            if data and not closed and self.tls and self.sock.pending():  # type: ignore[attr-defined]
                # decrypted or undecrypted bytes the socket's readiness will not announce
                self.loop.call_soon(self._on_readable)
        if isinstance(taken, Fail) or not taken[0] or taken[1]:
            # the peer closed or the socket failed: no more reads (an end of stream
            # stays readable: the loop would call again at every poll until parsed)
            self.ended = True
            self.loop.remove_reader(self.fd)
        if late or self.backlog.queue:
            self.queued += 1
            self.backlog.add(self, taken)
        else:
            self._parse(taken)  # read on the loop: no reader to make lazy (`parse`)

    def _parse(self, taken: _Taken) -> None:
        if self.fut.done():
            return  # failed or cancelled meanwhile: nothing to add
        fresh = not self.first  # no byte yet: this read ends the first-byte wait
        try:
            if isinstance(taken, Fail):
                self.out.unanswered = not self.first
                raise taken
            self.took(*taken)
            self.gen.send((taken[0], taken[1]))
            if fresh or self.read_at >= self.deadline:
                self._arm()  # the first bytes end the first-byte wait; past the deadline
        except StopIteration as end:
            self.fut.set_result(end.value)
        except Exception as exc:  # Fail, or a bug: the caller's to raise
            self.fut.set_exception(exc)


@dataclasses.dataclass(slots=True)
class _Job:
    pool: EnginePool
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
    on_token: OnToken | None = None  # on the engine's thread: `_Live.put`


async def _execute(job: _Job) -> Outcome:
    loop = asyncio.get_running_loop()
    if job.send_at is not None and type(job.clock) is SystemClock:
        await _until(loop, job.send_at)  # the open loop's intended time
    out = await _attempt(loop, job, fresh=False)
    if stale(out):  # as measure.client.execute: once more on a new connection
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
        resp = _Response(pool.engine, sock, conn, run, ns, timeouts, deadline, job.cancel)
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


def execute_threaded(
    pool: EnginePool,
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
    send_at_ns: int | None = None,
    keep_text: bool = False,
) -> Outcome:
    """measure.client.execute on the engine's thread: the same outcome. `send_at_ns`: the
    monotonic instant to send at (the engine waits for it on its loop's timers); the
    request is built here, on the caller's greenlet, before it is handed over.
    `on_token` is called on the caller's greenlet as each token event arrives."""
    pool.endpoint.address()  # resolved on the caller's side (gevent's resolver)
    job = _Job(
        pool=pool,
        adapter=adapter,
        request=prepare(pool.endpoint, adapter, body, request_id, stream, extra_headers),
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
        live = _Live(on_token)
        job.on_token = live.put
    return pool.engine.call(lambda: _execute(job), live)
