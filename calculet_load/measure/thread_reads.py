"""One response's reads on the thread engine's loop (`ResponseReads`): each read as its
bytes arrive, by the native reader's thread (measure/reader.c) or by the loop itself,
stamped first, then parsed (measure.exchange `respond`) at once or, when the loop is
late, after the reads already waiting (measure.thread_loop `Backlog`); the read timeouts
on one lazily re-armed timer.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
from typing import Any

from calculet_load.clock import SystemClock
from calculet_load.measure.biotls import BioTLS
from calculet_load.measure.exchange import respond
from calculet_load.measure.outcome import CancelAt, Fail, Timeouts
from calculet_load.measure.request_state import Run
from calculet_load.measure.rxstamps import CMSG_SPACE, Reads
from calculet_load.measure.thread_loop import LoopThread, Taken, reads_natively_with
from calculet_load.measure.txstamps import tx_of, tx_on

# A read whose bytes waited this long in the kernel finds the loop late: it is parsed
# after the reads already waiting (`Backlog`), not before them.
LATE_READ_NS = 1_000_000


class ResponseReads(Reads):
    """One response's reads on the loop: each read as its bytes arrive, stamped first,
    then parsed (`respond`) at once or, when the loop is late, after the reads waiting
    (`Backlog`); the read timeouts on one lazily re-armed timer."""

    __slots__ = ("backlog", "cancel", "clock", "ended", "engine", "expiry", "fd", "fut", "gen",
                 "kind", "lazy", "limit_s", "loop", "native", "queued", "since", "sock", "timer",
                 "timer_at", "tls")  # fmt: skip

    def __init__(
        self, engine: LoopThread, sock: socket.socket, conn: Any, run: Run,
        ns: dict[str, int | None], timeouts: Timeouts, deadline: int, cancel: CancelAt,
    ) -> None:  # fmt: skip
        self.tls = isinstance(sock, BioTLS)  # its reads carry stamps too (measure.thread_engine)
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
        stamped as it was made, then queued to be parsed (`Backlog`: in runs of at most
        PARSE_SLICE_NS, so a response's events, read at its end all at once, do not hold
        the loop's timers: the open loop's sends). Once the head is read and the body
        is an event stream's chunks, the reader tells the loop at the stream's end only
        (a cancel mid-stream, and a live listener, want each read as it comes)."""
        for data, t, wall, stamp, err in self.engine.reader.take(self.fd):
            if self.fut.done() or self.ended:
                return
            taken: Taken
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

    def parse(self, taken: Taken) -> None:
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
        taken: Taken
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

    def _parse(self, taken: Taken) -> None:
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
