"""The thread I/O engine's loop thread: one per process (`LoopThread.shared()`), running
an asyncio loop (uvloop when installed) where the engine's requests do their socket I/O
(measure.thread_engine), and the native reader (measure/reader.c) that reads plain
sockets in a thread of its own. The caller, a greenlet (a Locust user, a dispatcher's
send), submits a coroutine and waits for its value without blocking the gevent hub: the
loop wakes it through the hub's thread-safe async watcher (`LoopThread.call`), and a
request's token events reach the caller's greenlet as they arrive (`Live`). Reads taken
when the loop is late wait here to be parsed in order (`Backlog`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

import gevent
import gevent.event
from gevent.monkey import get_original

from calculet_load.clock import Clock, SystemClock
from calculet_load.measure.outcome import Fail
from calculet_load.measure.rxstamps import CMSG_SPACE
from calculet_load.measure.threads import ENGINE_THREAD, READER_THREAD, name_this_thread

T = TypeVar("T")
# the standard library's, whatever gevent's monkey-patching replaced (Locust patches all):
# a real thread and real locks
_start_thread = get_original("_thread", "start_new_thread")
_allocate_lock = get_original("_thread", "allocate_lock")
_get_ident = get_original("_thread", "get_ident")
# Plain sockets are read by the native reader (measure/reader.c) where it is built;
# "0" reads them on the engine's loop, as TLS ones are. On by default: 3-17 % less CPU a
# request at 80-320 req/s and 64 streams (docs/measurement.md, "The native reader")
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


def reads_natively_with(engine: LoopThread, clock: Clock) -> bool:
    """Whether this engine's native reader reads a response timed on `clock`: its reads
    carry the kernel's receive time, which only the system clock can take."""
    return engine.reads_natively() and CMSG_SPACE > 0 and type(clock) is SystemClock


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


# a read: its bytes, whether the peer closed after them, when it returned, the kernel's
# receive time, when the read before returned; or the socket's error
Taken = tuple[bytes, bool, int, "int | None", int] | Fail


class Reading(Protocol):
    """A response whose reads the loop thread hands over (measure.thread_reads)."""

    queued: int  # its reads in the backlog

    def deliver(self) -> None:
        """Take the reads the native reader made of its socket."""

    def parse(self, taken: Taken) -> None:
        """Take a read's bytes into the response."""


class LoopThread:
    """One loop thread per process (`LoopThread.shared()`), started when first used."""

    _shared: LoopThread | None = None
    _pid = 0
    _guard = _allocate_lock()

    @classmethod
    def shared(cls) -> LoopThread:
        with cls._guard:
            if cls._shared is None or cls._pid != os.getpid():  # a fork has no thread
                cls._shared, cls._pid = LoopThread(), os.getpid()
            return cls._shared

    def __init__(self) -> None:
        self.loop, self.kind = _new_loop()
        self.backlog = Backlog(self.loop)  # reads waiting to be parsed (a late loop)
        # plain sockets' reads in a native thread, handed to the loop (`_on_reads`)
        self.reader = _new_reader()
        self.reading: dict[int, Reading] = {}  # the responses it reads, by fd
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
        # this engine's tails in a Locust worker.
        ready.acquire()  # a few ms, once per process

    def reads_natively(self) -> bool:
        """Whether its native reader reads plain sockets: asked for and built."""
        return READ_NATIVELY and self.reader is not None

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
        live: Live | None = None,
    ) -> T:
        """Run `make()` on the engine's loop; the calling greenlet waits for its value.
        Killed while waiting (the run stopped), the coroutine is cancelled, and the
        GreenletExit carries what it returned as `outcome`. With `live`, the greenlet
        also hands each item the coroutine puts into it (`Live.put`, on the engine's
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


class Live:
    """Items a call's coroutine hands its caller as they come (a request's token events
    and their text): the engine's thread `put`s each and wakes the caller's hub, the
    caller's greenlet `serve`s them to `listener` until the call's result is in."""

    def __init__(self, listener: Callable[..., None]) -> None:
        self.listener = listener
        self.items: collections.deque[tuple[Any, ...]] = collections.deque()
        self.ready = gevent.event.Event()
        self.wake: Callable[[], object] = lambda: None  # set by `LoopThread.call`

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


# The longest a run of parsing goes before the loop polls its sockets again.
PARSE_SLICE_NS = 2_000_000


class Backlog:
    """Reads taken but not yet parsed, oldest first, on one loop.

    Why: a read's kernel stamp is the arrival of the last segment it copies, and the
    kernel merges segments that arrive while earlier ones wait unread into one buffer
    with the newest time (docs/measurement.md). So what keeps TTFT exact is reading each
    socket before its next token arrives (a token interval, 10 ms in the benchmark),
    not parsing it: when the loop is late (a read's bytes waited `LATE_READ_NS` or more:
    measure.thread_reads,
    or reads are already waiting here), each ready socket is read and stamped at once and
    its bytes join this queue; the queue is parsed in runs of at most `PARSE_SLICE_NS`,
    each followed by a poll of the sockets (a `call_soon` runs after the next poll). A
    failure in a queued read's bytes is found within a run or two. On time, a read is
    parsed as it is taken."""

    __slots__ = ("loop", "queue", "scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: collections.deque[tuple[Reading, Taken]] = collections.deque()
        self.scheduled = False

    def add(self, resp: Reading, taken: Taken) -> None:
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
