"""When a response's bytes arrived: the stamp each read gives its bytes. With the system
clock, a plain socket's reads carry the kernel's receive time (SO_TIMESTAMPNS, asked for
with `ask_kernel_stamps`), moved onto the monotonic clock through a pair of clock reads
taken together (`clock_pair`, `kernel_ns`); elsewhere a read's stamp is when it returned.
Over TLS the plaintext already decrypted or buffered joins the read it came with
(`tls_drain`). `Reads` keeps the bookkeeping of one response's reads for either engine:
which timeout bounds the next read, each read's stamp, the read waits and the first
token's late bound. (The transmit time of a request's last byte: measure.txstamps.)
"""

from __future__ import annotations

import contextlib
import platform
import socket
import ssl
import struct
import sys

from mypy_extensions import mypyc_attr

from calculet_load.clock import Clock
from calculet_load.measure.biotls import BioTLS
from calculet_load.measure.outcome import Fail, Timeouts
from calculet_load.measure.request_state import Run

_TIMESPEC = struct.Struct("@ll")


# Linux: SO_TIMESTAMPNS asks the kernel for each read's receive time (CLOCK_REALTIME, of
# the last segment the read returned), delivered as an SCM_TIMESTAMPNS control message
# holding a struct timespec (two C longs). Python's socket module does not name it: 35 on
# the architectures of asm-generic/socket.h (others use other numbers: read stamps there).
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", None)
if SO_TIMESTAMPNS is None and sys.platform == "linux" and platform.machine() in (
    "x86_64", "aarch64", "arm64", "i686", "i386", "armv7l", "armv8l", "riscv64",
    "ppc64le", "ppc64", "s390x", "loongarch64",
):  # fmt: skip
    SO_TIMESTAMPNS = 35
CMSG_SPACE = (
    socket.CMSG_SPACE(_TIMESPEC.size)
    if SO_TIMESTAMPNS is not None and hasattr(socket, "CMSG_SPACE")
    else 0
)


def ask_kernel_stamps(sock: socket.socket) -> None:
    """Ask for the kernel's receive time with every read of this plain socket (where the
    kernel cannot, reads carry none and their own time is the stamp)."""
    if SO_TIMESTAMPNS is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)


# A read's time and the wall clock read with it (`clock_pair`): read again until a
# monotonic read after the wall one is within this of the one before it.
PAIR_NS = 20_000
PAIR_TRIES = 4


def clock_pair(clock: Clock) -> tuple[int, int]:
    """The monotonic and the wall clock on one instant: a read's time, and the wall time
    that moves the kernel's stamp of its bytes (CLOCK_REALTIME) onto the monotonic clock
    (`kernel_ns`). A thread preempted between the two reads would move the stamp by the
    preemption, so the pair is read again (at most PAIR_TRIES times) until a third read
    shows none; measure/reader.c reads its pairs the same way."""
    t = wall = 0
    for _ in range(PAIR_TRIES):
        t = clock.mono_ns()
        wall = clock.wall_ns()
        if clock.mono_ns() - t <= PAIR_NS:
            break
    return t, wall


def kernel_ns(
    anc: list[tuple[int, int, bytes]], read_ns: int, wall_ns: int, start: int, prev: int = 0
) -> int | None:
    """The kernel's receive time of a read's bytes on the monotonic clock, or None.

    The kernel stamps CLOCK_REALTIME; `wall_ns` was read right after `read_ns`, so
    `wall_ns - read_ns` moves it onto the monotonic clock (`kernel_wall_ns` says which
    bounds it must keep, and what they may do to it)."""
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            stamp = int(sec) * 1_000_000_000 + int(nsec)
            return kernel_wall_ns(stamp, read_ns, wall_ns, start, prev)
    return None


def kernel_wall_ns(stamp: int, read_ns: int, wall_ns: int, start: int, prev: int = 0) -> int | None:
    """`kernel_ns` of a receive time already read from its message (CLOCK_REALTIME ns).

    The bounds, each what a stamp on the monotonic clock must keep:
    - not after `read_ns`, the read that returned the bytes, nor before `start`, the
      request's start t0 (taken before its first byte was written): outside, the wall
      clock stepped between the arrival and the read, and the stamp is not used (None:
      the read's own time is taken). These reject; they never move a stamp;
    - not before `prev`, the kernel stamp of the response's read before: the same
      packet read twice (a read that took the rest of it) through two clock pairs, which
      differ by at most their jitter (`clock_pair`): raised to it.
    Nothing else bounds it: a user-space stamp (t1 when the send returned) is later than
    the bytes it stands for, and a receive stamp before it is the truth."""
    k = stamp - (wall_ns - read_ns)
    if start <= k <= read_ns:
        return max(k, prev)
    return None


def tls_drain(sock: ssl.SSLSocket, data: bytes) -> tuple[bytes, bool]:
    """The rest of what arrived with this read: the plaintext the TLS object holds
    (`pending()`) and the records already in the socket buffer, read now without waiting
    (one plain read takes all the kernel holds; a TLS read returns one record), to be
    stamped with `data`. Returns (the bytes, whether the peer closed after them)."""
    chunks = [data]
    size = len(data)
    closed = False
    timeout = sock.gettimeout()
    sock.settimeout(0.0)
    try:
        while size < 4 * 65536:
            try:
                more = sock.recv(65536)
            except (ssl.SSLWantReadError, BlockingIOError, TimeoutError):
                break  # nothing more yet
            except OSError:
                break  # the next read meets the failure and classifies it
            if not more:
                closed = True
                break
            chunks.append(more)
            size += len(more)
    finally:
        sock.settimeout(timeout)
    return (b"".join(chunks) if len(chunks) > 1 else data), closed


# Both engines' reads (measure.gevent_engine, measure.thread_reads) subclass it, and
# stay interpreted when this module is compiled (measure.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Reads:
    """The bookkeeping of one response's reads, whichever engine reads: which timeout
    bounds the next read, the stamp each read gives its bytes (the kernel's receive time
    where it gives one), the read waits and the first token's late bound."""

    __slots__ = ("chunked", "deadline", "eof", "first", "last_stamp", "ns", "out", "read_at",
                 "run", "stamps", "t", "timeouts")  # fmt: skip

    def __init__(
        self, run: Run, ns: dict[str, int | None], timeouts: Timeouts, deadline: int,
        stamps: bool,
    ) -> None:  # fmt: skip
        self.ns, self.timeouts, self.deadline = ns, timeouts, deadline
        self.run = run
        self.out = run.out
        self.t = 0  # the stamp of the last read taken (`took`)
        # when the last read with bytes returned, and the last kernel stamp (`stamped_read`:
        # taken by `took` at once, or later when the thread engine's loop is late)
        self.read_at = self.last_stamp = 0
        self.first = b""  # the response's first bytes (up to 5): is it HTTP at all?
        self.eof = False
        self.stamps = stamps  # reads carry the kernel's receive time
        # `respond` reads an event stream's chunked body (`_chunked`): its end is the last
        # chunk's CRLF CRLF (the thread engine's native reads wait for it: measure.thread_reads)
        self.chunked = False

    def limit(self, now: int) -> tuple[float, str]:
        """How long the next read may wait from `now` (s) and the error class if it does."""
        if now >= self.deadline:
            raise Fail("total_timeout", "total timeout reached")
        # Any byte ends the first-byte wait, a partial status line included.
        limit, kind = (
            (self.timeouts.idle_s, "idle_timeout")
            if self.first or self.read_at
            else (self.timeouts.first_byte_s, "first_byte_timeout")
        )
        remaining = (self.deadline - now) / 1e9
        if remaining < limit:
            limit, kind = remaining, "total_timeout"
        return limit, kind

    def receive(self, sock: socket.socket, clock: Clock, tls: bool) -> tuple[bytes, bool, bool]:
        """Read what `sock` holds, stamp it and take it (`stamped_read`, then `took`): (the bytes,
        whether the peer closed after them, whether the stamp is the read's own time)."""
        taken = self.stamped_read(sock, clock, tls)
        return taken[0], taken[1], self.took(*taken)

    def stamped_read(
        self, sock: socket.socket, clock: Clock, tls: bool
    ) -> tuple[bytes, bool, int, int | None, int]:
        """Read what `sock` holds and stamp it (the socket's errors are the caller's to
        classify): (the bytes, whether the peer closed after them, when the read returned,
        the bytes' kernel receive time or None, when the read before returned). What the
        bytes mean is `took`'s and the parser's, now or later (the thread engine parses
        after the reads waiting when its loop is late: measure.thread_reads)."""
        prev, start, before = self._bounds()
        kernel = None
        if self.stamps and not tls:
            data, anc, _, _ = sock.recvmsg(65536, CMSG_SPACE)
            t, wall = clock_pair(clock)  # stamp at the byte, before any parsing
            kernel = kernel_ns(anc, t, wall, start, before)
        else:
            data = sock.recv(65536)
            t = clock.mono_ns()  # stamp at the byte, before any parsing
        closed = False
        if data and tls:
            data, closed = tls_drain(sock, data)  # type: ignore[arg-type]
            if self.stamps and isinstance(sock, BioTLS):
                # the TLS records' own reads carried the kernel's time: that of the last
                # one, which completed what was decrypted (the read's time is after it)
                t, wall = clock_pair(clock)
                kernel = kernel_ns(sock.take_stamp(), t, wall, start, before)
        self._took_at(data, t, kernel)
        return data, closed, t, kernel, prev

    def _bounds(self) -> tuple[int, int, int]:
        """A read's (when the read before it returned, the request's start, the kernel
        stamp of the read before: `kernel_wall_ns`'s bounds)."""
        start = self.ns["t0"] or 0
        return self.read_at or self.ns["t1"] or start, start, self.last_stamp

    def _took_at(self, data: bytes, t: int, kernel: int | None) -> None:
        if data:
            self.read_at = t
            if kernel is not None:
                self.last_stamp = kernel

    def native_read(
        self, data: bytes, t: int, wall: int, stamp: int
    ) -> tuple[bytes, bool, int, int | None, int]:
        """`stamped_read` of a read another thread made (measure.thread_reads' native reads):
        its bytes, when it returned (`t`, monotonic; `wall`, the wall clock read right
        after) and the kernel's receive time of its bytes (`stamp`, CLOCK_REALTIME ns, or
        -1). Reads are given in the order they were made."""
        prev, start, before = self._bounds()
        kernel = (
            kernel_wall_ns(stamp, t, wall, start, before) if stamp >= 0 and self.stamps else None
        )
        self._took_at(data, t, kernel)
        return data, False, t, kernel, prev

    def took(
        self, data: bytes, closed: bool, t: int, kernel: int | None, prev: int | None = None
    ) -> bool:
        """A read returned `data` at `t` (`kernel`: its bytes' receive time, or None; `prev`:
        when the read before it returned): what `stamped_read` gives, now or later. True
        when it was stamped with the read's own time (other streams may want theirs before
        this one parses)."""
        self.run.read_prev = prev
        out = self.out
        by_read = False
        if kernel is not None:
            # The kernel's receive time: what the bytes waited for this read (the loop's
            # lag, other streams' parsing) is not in the figures; it is kept as the
            # request's read wait, the client's self-check.
            wait = t - kernel
            if out.read_wait_ns is None or wait > out.read_wait_ns:
                out.read_wait_ns = wait
            t = kernel
            out.stamp_source = "kernel"
            if out.late_bound_ns is None:
                out.late_bound_ns = 0
        elif data:
            out.stamp_source = "read"
            by_read = True
        self.t = t
        if len(self.first) < 5:
            self.first += data[: 5 - len(self.first)]
        self.eof = not data or closed
        return by_read
