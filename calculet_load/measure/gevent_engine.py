"""The gevent I/O engine: a request's socket I/O on gevent's sockets, in the greenlet
that sends it (`--io-engine gevent`; the default is measure.thread_engine). It shares
with the thread engine everything but the waiting: the target and the pool's bookkeeping
(measure.connections), the error taxonomy and the outcome (measure.outcome), the
per-request state and the outcome's checks (measure.request_state), the stamps'
bookkeeping (measure.rxstamps) and the response read (measure.exchange: h11 for the
head, measure.chunked, measure.sse). Both are used through one interface
(measure.io_engines `IOEngine`).

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

import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, cast

import gevent
import gevent.socket as gsocket

from calculet_load.clock import Clock, SystemClock
from calculet_load.measure.connections import ConnectionPool, connect_now, stale
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
from calculet_load.measure.selfwatch import sleep_until
from calculet_load.measure.txstamps import (
    Counted,
    TxStamps,
    ask_send_stamps,
    drain_of,
    settle_t1,
)


class _Conn(Counted, gsocket.socket):  # type: ignore[misc]
    """A connection of the gevent engine: gevent's socket, counting what it sends
    (measure.txstamps)."""

    __slots__ = ("tx",)


_TIMEOUTS = Timeouts()


class GeventPool(ConnectionPool):
    """The gevent engine's keep-alive connections to one endpoint (gevent's sockets), at
    most `max_connections` open, and the requests sent over them (`execute`)."""

    def acquire(self, connect_timeout: float, fresh: bool = False) -> tuple[socket.socket, bool]:
        """An idle connection (reused) or a new one; `fresh`: a new one in any case."""
        sock = self.take(fresh)
        return (sock, True) if sock is not None else (self._connect(connect_timeout), False)

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

        `on_token` is called for each event that carries generated tokens, right after it
        is counted (on the reading greenlet: it must be cheap), with its text where
        `keep_text` (which also keeps the whole generated text in the outcome). With
        `max_tokens`, an output (the client's count or the server's total) above it plus
        `output_slack_tokens` is flagged as a count anomaly. `count_text` (a local
        tokenizer's count) counts the tokens of each event that comes with text and no
        count from the server. `send_at_ns`: the monotonic instant to send at, waited for
        here (with the system clock) when the caller hands the request over before it.

        A kept-alive connection the server closed while the request went out (it
        answered not a byte: llama.cpp closes every connection after a streamed
        response, any server may at its keep-alive timeout) is the connection's failure,
        not the server's answer to this request: the request is sent once more on a new
        connection, timed from that send, and the outcome says so (`stale_retry`). A new
        connection that fails the same way is an error like any other."""
        request = prepare(self.endpoint, adapter, body, request_id, stream, extra_headers)
        clock = clock or SystemClock()
        if send_at_ns is not None and type(clock) is SystemClock:
            sleep_until(send_at_ns)  # the open loop's intended time (at once when past)
        kw = dict(
            stream=stream,
            timeouts=timeouts or _TIMEOUTS,
            clock=clock,
            cancel=cancel,
            on_token=on_token,
            max_tokens=max_tokens,
            output_slack_tokens=output_slack_tokens,
            count_text=count_text,
            keep_text=keep_text,
        )
        out = _attempt(self, adapter, request, request_id, fresh=False, **kw)  # type: ignore[arg-type]
        if stale(out):
            out = _attempt(self, adapter, request, request_id, fresh=True, **kw)  # type: ignore[arg-type]
            out.stale_retry = True
        return out


def _attempt(
    pool: GeventPool,
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
