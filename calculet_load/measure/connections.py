"""Where requests go and the connections kept to it, whichever I/O engine sends: the
target (`Endpoint`: its address resolved once, its TLS settings in gevent's context and
the standard library's), a connect that waits only when the kernel has not connected at
once (`connect_now`), the keep-alive pool's bookkeeping (`ConnectionPool`: the idle
connections, the cap, the liveness check of a kept-alive one) and the rule for a
kept-alive connection the server had closed (`stale`). Each engine's pool subclasses the
pool with its own connect and request steps (measure.gevent_engine, measure.thread_engine).
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
import sys
from typing import Any

import gevent.ssl as gssl
from gevent.monkey import get_original

from calculet_load.measure.biotls import BioTLS
from calculet_load.measure.outcome import Outcome, PoolExhausted
from calculet_load.schema.access import TargetAccess, access_of

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
    """Keep-alive connections to one endpoint, at most `max_connections` open: what both
    engines' pools share (each opens its connections its own way)."""

    def __init__(self, endpoint: Endpoint, max_connections: int) -> None:
        self.endpoint = endpoint
        self.max_connections = max_connections
        self._idle: list[socket.socket] = []
        self.open = 0

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


def stale(out: Outcome) -> bool:
    """A kept-alive connection that answered not a byte: send once more on a new one."""
    return bool(out.connection_reused and out.unanswered and out.error_class == "connection_reset")
