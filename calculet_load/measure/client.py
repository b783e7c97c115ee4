# size: the gevent engine: endpoint, pool, reads and the request's steps
"""The timed streaming client on gevent sockets (the default I/O engine; measure.engine
is the other, a dedicated thread). Both share the error taxonomy and the outcome
(measure.outcome), the per-request state and the outcome's checks
(measure.request_state), the stamps' bookkeeping (measure.rxstamps) and the response
read (measure.exchange: h11 for the head, measure.chunked, measure.sse); this module
does the waiting.

Stamps are taken when bytes leave or arrive: t1 the kernel's transmit time of the
request's last byte on a plain connection (measure.txstamps; else when it is fully
written), t2/t3/t4/t5 from the read that completed the headers or the event, t6 at the
end of the message.
Parsing happens after the stamp. Over TLS (gevent's cooperative ssl) a read's stamp is
taken when the decrypted bytes return from it, and the plaintext the TLS layer already
holds (`pending()`, and records already in the socket buffer) is read into the same read
and stamp, as one plain read would take all the kernel holds. Connections are kept
alive in a pool sized to the in-flight cap; a request that would have to wait for a
connection is refused at once (`PoolExhausted`) instead of silently queueing. Every
failure becomes an error class in the outcome (see ERROR_CLASSES); nothing a server
sends can crash the caller.
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import gevent
import gevent.socket as gsocket
import gevent.ssl as gssl
from gevent.monkey import get_original

from calculet_load.clock import Clock, SystemClock
from calculet_load.measure.biotls import BioTLS
from calculet_load.measure.exchange import prepare, respond, wire
from calculet_load.measure.outcome import (
    ERROR_CLASSES,
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
from calculet_load.measure.txstamps import (
    Counted,
    TxStamps,
    ask_send_stamps,
    drain_of,
    settle_t1,
)
from calculet_load.schema.access import TargetAccess, access_of

__all__ = [
    "ERROR_CLASSES",
    "OUTPUT_SLACK_TOKENS",
    "CancelAt",
    "ConnectionPool",
    "Endpoint",
    "OnToken",
    "Outcome",
    "PoolExhausted",
    "Timeouts",
    "execute",
    "run_in_greenlet",
]

T = TypeVar("T")
# the standard library's, whatever gevent's monkey-patching replaced: the thread engine's
# sockets are not gevent's, and a pool's liveness check must not wait
_select = get_original("select", "select")
_SSLContext = get_original("ssl", "SSLContext")


def _plain_tls_context(cafile: str | None = None) -> ssl.SSLContext:
    """ssl.create_default_context's client context, of the standard library's class
    (with its SSLKEYLOGFILE: the TLS keys for a capture's reader, where it is set)."""
    ctx: ssl.SSLContext = _SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cafile:
        ctx.load_verify_locations(cafile)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    keylog = os.environ.get("SSLKEYLOGFILE")
    if keylog and not sys.flags.ignore_environment:
        ctx.keylog_filename = keylog
    return ctx


class _Conn(Counted, gsocket.socket):  # type: ignore[misc]
    """A connection of the gevent engine: gevent's socket, counting what it sends
    (measure.txstamps)."""

    __slots__ = ("tx",)


_TIMEOUTS = Timeouts()


class Endpoint:
    """Where requests go: a URL (http or https, with a base path) or a TargetAccess
    (TLS settings, headers, API key); a ValueError when unusable."""

    def __init__(self, target: str | TargetAccess) -> None:
        self.access = access_of(target)
        self.host = self.access.host
        self.port = self.access.port
        self.authority = self.access.authority
        self.url = self.access.url
        # gevent's context: its sockets wait cooperatively in the handshake and reads
        self.tls = self.access.ssl_context(gssl.create_default_context)
        self.headers = self.access.request_headers()
        self._addr: tuple[int, Any] | None = None
        self._plain_tls: ssl.SSLContext | None = None

    def plain_tls(self) -> ssl.SSLContext | None:
        """The same TLS settings in the standard library's context (the thread engine's
        non-blocking sockets; gevent's monkey-patching does not reach it)."""
        if self.access.tls and self._plain_tls is None:
            self._plain_tls = self.access.ssl_context(_plain_tls_context)
        return self._plain_tls

    def path(self, path: str) -> str:
        """A server path under the URL's base path (schema.access)."""
        return self.access.path(path)

    def address(self) -> tuple[int, Any]:
        """(family, sockaddr), resolved once: a name lookup per connection would add
        milliseconds (gevent's resolver runs in a thread pool) to the first request."""
        if self._addr is None:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            self._addr = (family, sockaddr)
        return self._addr


_IN_PROGRESS = (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY)


def connect_now(sock: socket.socket, sockaddr: Any) -> bool:
    """Start connecting the non-blocking `sock`: True when the kernel has connected it by
    the time `connect` returns (on loopback and on the same host it usually has: the
    handshake runs inside the call), False when the handshake goes on (the caller waits
    for the socket to be writable). A refused or failed connect raises OSError.

    Why not wait in any case: a wait hands the thread to its loop (the engine's, or
    gevent's hub, whose own `connect` always waits after EINPROGRESS), and the loop's
    other work would count as the connect's (`ext.connect_ms`, which the self-check
    leaves out of a new connection's start-to-sent time) and delay the request: with
    `asyncio.wait_for(loop.sock_connect(...))` 13-100 ms between the start stamp and the
    send at 320 req/s on one core (`benchmarks/client_speed.py`)."""
    err = sock.connect_ex(sockaddr)
    if err in _IN_PROGRESS:
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if not err:
            try:
                sock.getpeername()  # connected already (ENOTCONN: the handshake goes on)
            except OSError:
                return False
            return True
    if err:
        raise OSError(err, os.strerror(err))  # ConnectionRefusedError and the like
    return True


class ConnectionPool:
    """Keep-alive connections to one endpoint, at most `max_connections` open."""

    def __init__(self, endpoint: Endpoint, max_connections: int) -> None:
        self.endpoint = endpoint
        self.max_connections = max_connections
        self._idle: list[socket.socket] = []
        self.open = 0

    def acquire(self, connect_timeout: float, fresh: bool = False) -> tuple[socket.socket, bool]:
        """An idle connection (reused) or a new one; `fresh`: a new one in any case."""
        sock = self.take(fresh)
        return (sock, True) if sock is not None else (self._connect(connect_timeout), False)

    def take(self, fresh: bool) -> socket.socket | None:
        """An idle connection still open, or None when a new one may be opened
        (PoolExhausted when the cap is reached)."""
        while self._idle and not fresh:
            sock = self._idle.pop()
            if _alive(sock):
                return sock
            self._discard(sock)
        if self.open >= self.max_connections:
            raise PoolExhausted
        return None

    def _connect(self, connect_timeout: float) -> socket.socket:
        self.open += 1
        sock = None
        try:
            family, sockaddr = self.endpoint.address()
            # gevent's socket has the stdlib socket's interface (not its class).
            conn = _Conn(family, socket.SOCK_STREAM)
            conn.tx = None
            sock = cast(socket.socket, conn)
            sock.settimeout(0.0)  # gevent's connect_ex is then the kernel's, no wait
            connected = connect_now(sock, sockaddr)
            sock.settimeout(connect_timeout)
            if not connected:
                sock.connect(sockaddr)  # gevent waits on the hub for the handshake
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.endpoint.tls is None:
                ask_kernel_stamps(sock)
                # and the transmit times of what it sends (measure.txstamps); not over
                # TLS, whose records gevent's ssl writes out of this count
                conn.tx = ask_send_stamps(sock)
            if self.endpoint.tls is not None:
                # the handshake (and verification) within the connect timeout
                sock = self.endpoint.tls.wrap_socket(sock, server_hostname=self.endpoint.host)
        except BaseException:
            self.open -= 1
            if sock is not None:
                sock.close()
            raise
        return sock

    def prewarm(self, n: int, connect_timeout: float = 10.0) -> int:
        """Open up to `n` idle connections ahead of time (bursts, first requests)."""
        opened = 0
        while len(self._idle) < n and self.open < self.max_connections:
            self._idle.append(self._connect(connect_timeout))
            opened += 1
        return opened

    def release(self, sock: socket.socket, reusable: bool) -> None:
        if reusable:
            self._idle.append(sock)
        else:
            self._discard(sock)

    def _discard(self, sock: socket.socket) -> None:
        self.open -= 1
        sock.close()

    def close(self) -> None:
        while self._idle:
            self._discard(self._idle.pop())


def _alive(sock: socket.socket) -> bool:
    """An idle keep-alive connection is reusable if it has nothing to read (no EOF)."""
    if isinstance(sock, (ssl.SSLSocket, BioTLS)):
        # no MSG_PEEK through TLS: anything readable (a close_notify, EOF, stray bytes)
        # means the connection is not reusable
        if sock.pending():
            return False
        try:
            readable, _, _ = _select([sock.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable
    # Timeout 0: gevent must not wait for readability here, it must answer at once. Set
    # only when it is not already (the thread engine's sockets are non-blocking): setting
    # it is two fcntl calls with the interpreter lock released, after which the engine's
    # thread waited for the lock (5 % of its samples at 320 req/s, py-spy)
    if sock.gettimeout() != 0.0:
        sock.settimeout(0.0)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except (BlockingIOError, TimeoutError):
        return True
    except OSError:
        return False
    return False  # b"" = the server closed it; bytes = stray data, not reusable


def execute(
    pool: ConnectionPool,
    adapter: Adapter,
    body: dict[str, Any],
    request_id: str,
    *,
    stream: bool,
    timeouts: Timeouts = _TIMEOUTS,
    clock: Clock | None = None,
    cancel: CancelAt = None,
    extra_headers: dict[str, str] | None = None,
    on_token: OnToken | None = None,
    max_tokens: int | None = None,
    output_slack_tokens: int = OUTPUT_SLACK_TOKENS,
    count_text: Callable[[str], int] | None = None,
    keep_text: bool = False,
) -> Outcome:
    """Run one request and return its outcome; never raises for a server's behaviour.

    `on_token` is called for each event that carries generated tokens, right after it is
    counted (on the reading greenlet: it must be cheap), with its text where `keep_text`
    (which also keeps the whole generated text in the outcome). With `max_tokens`, an output
    (the client's count or the server's total) above it plus `output_slack_tokens` is
    flagged as a count anomaly. `count_text` (a local tokenizer's count) counts the
    tokens of each event that comes with text and no count from the server.

    A kept-alive connection the server closed while the request went out (it answered
    not a byte: llama.cpp closes every connection after a streamed response, any server
    may at its keep-alive timeout) is the connection's failure, not the server's answer
    to this request: the request is sent once more on a new connection, timed from that
    send, and the outcome says so (`stale_retry`). A new connection that fails the same
    way is an error like any other."""
    request = prepare(pool.endpoint, adapter, body, request_id, stream, extra_headers)
    kw = dict(
        stream=stream,
        timeouts=timeouts,
        clock=clock or SystemClock(),
        cancel=cancel,
        on_token=on_token,
        max_tokens=max_tokens,
        output_slack_tokens=output_slack_tokens,
        count_text=count_text,
        keep_text=keep_text,
    )
    out = _attempt(pool, adapter, request, request_id, fresh=False, **kw)  # type: ignore[arg-type]
    if stale(out):
        out = _attempt(pool, adapter, request, request_id, fresh=True, **kw)  # type: ignore[arg-type]
        out.stale_retry = True
    return out


def stale(out: Outcome) -> bool:
    """A kept-alive connection that answered not a byte: send once more on a new one."""
    return bool(out.connection_reused and out.unanswered and out.error_class == "connection_reset")


def _attempt(
    pool: ConnectionPool,
    adapter: Adapter,
    request: tuple[str, list[tuple[str, str]], bytes],
    request_id: str,
    *,
    fresh: bool,
    stream: bool,
    timeouts: Timeouts,
    clock: Clock,
    cancel: CancelAt,
    on_token: OnToken | None,
    max_tokens: int | None,
    output_slack_tokens: int,
    count_text: Callable[[str], int] | None,
    keep_text: bool,
) -> Outcome:
    out = Outcome(request_id)
    run = Run(adapter, out, clock, stream, on_token, count_text, gevent.sleep, keep_text)
    conn, data = wire(request)
    anchor_wall = clock.wall_ns()
    t0 = clock.mono_ns()
    out.wall_anchor_ns = anchor_wall
    ns: dict[str, int | None] = {"t0": t0, "t1": None, "t2": None, "t6": None}
    sock: socket.socket | None = None
    reusable = False
    killed: gevent.GreenletExit | None = None
    deadline = t0 + int(timeouts.total_s * 1e9)
    try:
        try:
            began = clock.mono_ns()
            sock, out.connection_reused = pool.acquire(timeouts.connect_s, fresh=fresh)
            if not out.connection_reused:
                out.connect_ns = clock.mono_ns() - began
        except (PoolExhausted, OSError) as exc:  # ssl.SSLError and timeouts are OSErrors
            raise connect_fail(exc, pool.max_connections) from None
        limit = max(min(timeouts.idle_s, (deadline - clock.mono_ns()) / 1e9), 0.001)
        tx: TxStamps | None = getattr(sock, "tx", None)
        try:
            if tx is None:
                sock.settimeout(limit)
                sock.sendall(data)
            else:
                sock.settimeout(0.0)  # its waits are `_send`'s and `_Reader.read`'s own
                _send(sock, data, limit)
        except OSError as exc:
            out.unanswered = True
            raise Fail("connection_reset", f"while sending: {exc}") from None
        ns["t1"] = clock.mono_ns()
        settle_t1(sock, clock, out, ns, expect=True)
        if cancel == "before_headers":
            out.cancelled_at = "before_headers"
            raise Fail("cancelled", "cancelled after the request was sent, before headers")
        reusable = _read(sock, conn, run, ns, timeouts, deadline, cancel)
    except Fail as f:
        fail_into(out, f, cancel)
    except gevent.GreenletExit as exc:
        run_stopped(out)  # the run stopped and killed this request's greenlet
        killed = exc
    finally:
        if sock is not None:
            settle_t1(sock, clock, out, ns, expect=False)  # a stamp the driver queued late
            pool.release(sock, reusable and out.error_class is None)
    conclude(run, ns, max_tokens, output_slack_tokens)
    if killed is not None:
        killed.outcome = out  # Session.send records it
        raise killed
    return out


def _send(sock: socket.socket, data: bytes, timeout_s: float) -> None:
    """`sendall` on a socket with transmit stamps (at a zero timeout): a wait drains
    them first, as a partial write's stamp queued would wake it again and again."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            drain_of(sock)
            gsocket.wait_write(sock.fileno(), timeout_s)


class _Reader(Reads):
    """The reads of one response on a gevent socket: each bounded by the right timeout,
    stamped at the byte, TLS drained into one read."""

    __slots__ = ("clock", "io", "sock")

    def __init__(
        self, sock: socket.socket, run: Run, ns: dict[str, int | None], timeouts: Timeouts,
        deadline: int,
    ) -> None:  # fmt: skip
        # the kernel's receive times, on a plain socket read against the system clock
        stamps = (
            CMSG_SPACE > 0
            and type(run.clock) is SystemClock
            and not isinstance(sock, ssl.SSLSocket)
        )
        super().__init__(run, ns, timeouts, deadline, stamps)
        self.sock = sock
        self.clock = run.clock
        # a socket with transmit stamps waits here, not in gevent's recv: a stamp queued
        # wakes a wait until read (measure.txstamps), and gevent's would wake again and
        # again, reading nothing
        self.io = (
            gevent.get_hub().loop.io(sock.fileno(), 1)
            if getattr(sock, "tx", None) is not None
            else None
        )

    def read(self) -> tuple[bytes, bool]:
        """The next bytes (b"": the peer closed) and whether the peer closed after them."""
        clock, sock = self.clock, self.sock
        limit, kind = self.limit(clock.mono_ns())
        try:
            if self.io is None:
                sock.settimeout(max(limit, 0.001))
                data, closed, by_read = self.receive(sock, clock, isinstance(sock, ssl.SSLSocket))
            else:
                data, closed, by_read = self._receive(max(limit, 0.001))
        except (TimeoutError, gsocket.timeout):
            raise Fail(kind, f"no bytes for {limit:.3f} s") from None
        except OSError as exc:
            self.out.unanswered = not self.first
            raise Fail("connection_reset", str(exc)) from None
        if by_read:
            # Let every other stream whose bytes are already here take its stamp before
            # this one spends time parsing: without this, when N streams' tokens land
            # together the last one is stamped after N-1 parses (measured in
            # benchmarks/timing_accuracy.py, the '@b16' level).
            gevent.sleep(0)
        return data, closed

    def _receive(self, limit_s: float) -> tuple[bytes, bool, bool]:
        """`receive` at a zero timeout, waiting on the socket itself for at most
        `limit_s`; a wake with nothing to read reads the transmit stamps."""
        end = time.monotonic() + limit_s
        while True:
            try:
                return self.receive(self.sock, self.clock, False)
            except BlockingIOError:
                drain_of(self.sock, self.clock)
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            gsocket.wait(self.io, left)


def _read(
    sock: socket.socket,
    conn: Any,
    run: Run,
    ns: dict[str, int | None],
    timeouts: Timeouts,
    deadline: int,
    cancel: CancelAt,
) -> bool:
    """Read the response; returns whether the connection may be reused."""
    rd = _Reader(sock, run, ns, timeouts, deadline)
    gen = respond(conn, rd, cancel)
    try:
        next(gen)
        while True:
            gen.send(rd.read())
    except StopIteration as done:
        reusable: bool = done.value
        return reusable
    finally:
        if rd.io is not None:
            rd.io.close()  # the response's own watcher (`_Reader._receive`)


def run_in_greenlet(fn: Callable[[], T]) -> T:
    """Run a call in its own greenlet (for callers outside a gevent loop)."""
    g = gevent.spawn(fn)
    g.join()
    if g.exception is not None:
        raise g.exception
    value: T = g.value
    return value
