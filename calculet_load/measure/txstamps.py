"""t1 from the kernel: the transmit time of a request's last byte.

t1 taken by the client when its send call returns is late by however long the call took
to return and the thread to get the interpreter back: against a packet capture, up to
1 ms (docs/measurement.md, "How accurate each stamp is"). Linux stamps a TCP send in the
device driver as its last segment leaves for the device (SO_TIMESTAMPING with
SOF_TIMESTAMPING_TX_SOFTWARE) and queues the stamp on the socket's error queue, where a
`recvmsg(MSG_ERRQUEUE)` reads it. With SOF_TIMESTAMPING_OPT_ID each stamp carries the
offset of the byte it stamps among the bytes sent since it was asked for (and
OPT_TSONLY: no copy of the packet with it), so the stamp of a request's last byte is
told from those of earlier requests on the same kept-alive connection, and of a partial
write's (a large prompt that filled the socket's buffer).

A connection that asked for them counts what it sends (`Counted.send`); once the request
is written, `TxStamps.expect` names its last byte, and `TxStamps.drain` reads the error
queue. A stamp queued there makes the socket report an error to poll (EPOLLERR) until
it is read, which wakes a reader or writer waiting on it: every wait on such a socket
reads the queue when it wakes with nothing to read or write (the engine's loop, the
gevent engine's waits, the native reader, measure/reader.c). Where no stamp comes (a
driver that does not stamp, another OS, a fake clock), t1 is the user-space time, as
the record's `ext.sent_stamp_source` says.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import socket
import struct
import termios
import time
from select import POLLIN, POLLOUT
from typing import Any

from gevent.monkey import get_original

from calculet_load.clock import Clock, SystemClock
from calculet_load.measure.biotls import BioTLS
from calculet_load.measure.outcome import Outcome
from calculet_load.measure.rxstamps import SO_TIMESTAMPNS, clock_pair

# linux/net_tstamp.h, linux/errqueue.h, asm-generic/socket.h (where SO_TIMESTAMPNS is 35)
SO_TIMESTAMPING = 37 if SO_TIMESTAMPNS == 35 else None
SOF_TIMESTAMPING_TX_SOFTWARE = 1 << 1
SOF_TIMESTAMPING_SOFTWARE = 1 << 4
SOF_TIMESTAMPING_OPT_ID = 1 << 7
SOF_TIMESTAMPING_OPT_TSONLY = 1 << 11
SOF_TIMESTAMPING_OPT_ID_TCP = 1 << 16  # Linux 6.2: the key counts from the next write
SOF_TIMESTAMPING_OPT_RX_FILTER = 1 << 17  # receive reads carry no SCM_TIMESTAMPING too
SO_EE_ORIGIN_TIMESTAMPING = 4
SCM_TSTAMP_SND = 0
IP_RECVERR, IPV6_RECVERR = 11, 25
_BASE = (
    SOF_TIMESTAMPING_TX_SOFTWARE
    | SOF_TIMESTAMPING_SOFTWARE
    | SOF_TIMESTAMPING_OPT_ID
    | SOF_TIMESTAMPING_OPT_TSONLY
)
# Tried in turn, the first the kernel takes kept for the process: the key and the
# receive filter where the kernel has them (without the filter, each receive read also
# carries an SCM_TIMESTAMPING message, cut off by its control buffer: harmless).
_FLAG_CHOICES = (
    _BASE | SOF_TIMESTAMPING_OPT_ID_TCP | SOF_TIMESTAMPING_OPT_RX_FILTER,
    _BASE | SOF_TIMESTAMPING_OPT_ID_TCP,
    _BASE,
)
_flags: int | None = None
_TIMESPEC = struct.Struct("@ll")
_EXTENDED_ERR = struct.Struct("@IBBBBII")  # struct sock_extended_err
# An error-queue message: SCM_TIMESTAMPNS (with SO_TIMESTAMPNS on), SCM_TIMESTAMPING and
# IP(V6)_RECVERR with the offender's address: 160 bytes on 64-bit Linux.
ERRQUEUE_CMSG_SPACE = 256
_KEY_MASK = 0xFFFFFFFF
_SOURCES = {(socket.IPPROTO_IP, IP_RECVERR), (socket.IPPROTO_IPV6, IPV6_RECVERR)}


class TxStamps:
    """One connection's transmit stamps: the bytes it sent since they were asked for,
    the key of the current request's last byte, and that byte's stamp once read."""

    __slots__ = ("at", "on", "sent", "want")

    def __init__(self) -> None:
        self.on = True  # stamps are made (`tx_on`)
        self.sent = 0
        self.want = -1  # no request's last byte yet: every stamp read is an earlier one's
        self.at: int | None = None  # its stamp (monotonic ns), when read

    def expect(self) -> None:
        """The request's last byte was handed to the socket: its stamp is the one wanted."""
        self.want = (self.sent - 1) & _KEY_MASK
        self.at = None

    def take(self, key: int, stamp: int, mono: int, wall: int) -> None:
        """A transmit stamp read from the queue: `stamp` (CLOCK_REALTIME ns) of the byte
        `key`, the queue read at `mono` with the wall clock `wall` read with it
        (`clock_pair`). Kept when it is the wanted byte's and not after its read (a
        later one: the wall clock stepped between the two)."""
        if key != self.want or self.at is not None:
            return
        k = stamp - (wall - mono)
        if k <= mono:
            self.at = k

    def drain(self, sock: Any, clock: Clock) -> None:
        """Read the error queue of `sock` (a connection's own socket, not waiting: the
        thread engine's are non-blocking, the gevent engine's at a zero timeout) and keep
        the wanted stamp; the other stamps are dropped."""
        while True:
            try:
                _, anc, _, _ = sock.recvmsg(
                    0, ERRQUEUE_CMSG_SPACE, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT
                )
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # the socket failed: its next read or write says how
            found = _stamp_of(anc)
            if found is not None:
                mono, wall = clock_pair(clock)
                self.take(found[0], found[1], mono, wall)


def _stamp_of(anc: list[tuple[int, int, bytes]]) -> tuple[int, int] | None:
    """(key, CLOCK_REALTIME ns) of an error-queue message that is a transmit stamp."""
    stamp = key = None
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and len(data) >= _TIMESPEC.size:
            if kind in (SO_TIMESTAMPNS, SO_TIMESTAMPING) and stamp is None:
                sec, nsec = _TIMESPEC.unpack_from(data)  # SCM_TIMESTAMPING: ts[0] first
                stamp = int(sec) * 1_000_000_000 + int(nsec)
        elif (level, kind) in _SOURCES and len(data) >= _EXTENDED_ERR.size:
            err, origin, _, _, _, info, data_key = _EXTENDED_ERR.unpack_from(data)
            if err == errno.ENOMSG and origin == SO_EE_ORIGIN_TIMESTAMPING:
                key = data_key if info == SCM_TSTAMP_SND else None
    if stamp is None or key is None or stamp <= 0:
        return None
    return key, stamp


def ask_send_stamps(sock: socket.socket) -> TxStamps | None:
    """Ask for the transmit stamps of every byte `sock` (a new connection, before it sent
    a byte) sends; their state, or None where the kernel gives none."""
    global _flags
    if SO_TIMESTAMPING is None:
        return None
    choices = _FLAG_CHOICES if _flags is None else (_flags,)
    for flags in choices:
        try:
            outq = _unsent(sock) if not flags & SOF_TIMESTAMPING_OPT_ID_TCP else 0
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, flags)
        except OSError:
            continue
        _flags = flags
        tx = TxStamps()
        # without OPT_ID_TCP the key counts from the last byte the peer acknowledged,
        # not the last written: the bytes between (a TLS handshake's last flight) count
        tx.sent = outq
        return tx
    return None


def _unsent(sock: Any) -> int:
    """Bytes written to `sock` and not yet acknowledged by the peer (SIOCOUTQ)."""
    buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int(struct.unpack("@i", buf)[0])


def tx_on(sock: Any, on: bool) -> None:
    """Have a connection's sends stamped, or not (from its next send): the thread engine
    keeps them to the requests its native reader reads (measure.thread_engine `_wait_io` says
    why). The bytes are counted either way."""
    raw = raw_of(sock)
    tx: TxStamps | None = getattr(raw, "tx", None)
    if tx is None or tx.on == on or _flags is None:
        return
    flags = _flags if on else _flags & ~SOF_TIMESTAMPING_TX_SOFTWARE
    try:
        raw.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, flags)
    except OSError:
        return
    tx.on = on


def settle_t1(
    sock: Any, clock: Clock, out: Outcome, ns: dict[str, int | None], expect: bool
) -> None:
    """t1 from the kernel's transmit stamp of the request's last byte where one was read,
    else the time the send returned; the record's `sent_stamp_source` says which.
    `expect`: right after the request's send, which names that byte; else at the
    request's end, for a stamp the driver queued late (the queue is left empty)."""
    tx = tx_of(sock)
    t0, t1 = ns["t0"], ns["t1"]
    if expect or out.sent_stamp_source is None:
        out.sent_stamp_source = None if t1 is None else "send"
    if tx is None or t0 is None or t1 is None:
        return
    if expect:
        tx.expect()
    drain_of(sock, clock)
    if type(clock) is SystemClock and out.sent_stamp_source == "send":
        ns["t1"], out.sent_stamp_source = sent_stamp(tx, t0, t1)


# How often a write that waits for room polls a socket whose transmit stamps are on
POLL_S = 0.0005
_poll = get_original("select", "poll")  # the standard library's: gevent patches select


async def poll_ready(sock: Any, write: bool, timeout_s: float) -> None:
    """Wait until `sock` (with transmit stamps on) is writable (or readable), at most
    `timeout_s` (TimeoutError), polling it every POLL_S on the running asyncio loop and
    reading its stamps each time. Not through the loop's own watcher: a stamp queued (a
    partial write's) makes the socket report POLLERR, and uvloop closes a watcher that
    sees one, silently (libuv's uv_poll stops at POLLERR), so it would never wake again."""
    end = time.monotonic() + timeout_s
    poller = _poll()
    poller.register(sock.fileno(), POLLOUT if write else POLLIN)
    while not any(ev & (POLLOUT | POLLIN) for _, ev in poller.poll(0)):
        drain_of(sock)
        if time.monotonic() >= end:
            raise TimeoutError("timed out")
        await asyncio.sleep(POLL_S)


def sent_stamp(tx: TxStamps | None, t0: int, t1: int) -> tuple[int, str]:
    """t1 and where it came from: "kernel", the transmit time of the request's last byte
    where it was read and is not before the request's start t0 (the wall clock stepped),
    else "send", the client's time when its last send call returned."""
    if tx is not None and tx.at is not None and tx.at >= t0:
        return tx.at, "kernel"
    return t1, "send"


class Counted:
    """A socket that counts the bytes it sends (the keys of their transmit stamps): the
    engines' connection classes derive from it and a socket class, with a `tx` slot
    (None: no stamps asked for). Over TLS the record layer sends through it, so the
    count is of the bytes on the wire."""

    __slots__ = ()
    tx: TxStamps | None

    def send(self, data: Any, *args: Any, **kw: Any) -> int:
        n: int = super().send(data, *args, **kw)  # type: ignore[misc]
        tx = self.tx
        if tx is not None:
            tx.sent += n
        return n


_SYSTEM = SystemClock()


def raw_of(sock: Any) -> Any:
    """The socket a connection sends on (under a TLS one, measure.biotls's)."""
    return sock.sock if isinstance(sock, BioTLS) else sock


def tx_of(sock: Any) -> TxStamps | None:
    """The transmit stamps of a connection (or of the socket under a TLS one), or None."""
    tx: TxStamps | None = getattr(raw_of(sock), "tx", None)
    return tx


def drain_of(sock: Any, clock: Clock = _SYSTEM) -> None:
    """`TxStamps.drain` of a connection, if it asked for stamps: what a wait on it does
    when it woke with nothing to read or write (a stamp queued makes it report an
    error until read)."""
    raw = raw_of(sock)
    tx = getattr(raw, "tx", None)
    if tx is not None:
        tx.drain(raw, clock)
