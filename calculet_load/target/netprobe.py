"""Round trips to the target (spec §5: RTT and jitter, above all with a VPN in the path).

One sample opens a fresh TCP connection (the connect round trip: SYN to SYN-ACK, as
the kernel completes it), sends `GET /health` on it (the target profile's health path
under the target's base path, with the target's headers and key) and waits for the end
of the response headers (the request/response round trip, which also holds the server's
time to answer it; a 404 from a server without that path still times a round trip). A
round is a small bounded number of samples, one after another; each sample is bounded
by its timeout, so a round ends by itself. Figures per round come
from calculet_load.schema.clocks.rtt_summary (jitter = standard deviation, ms).

The round uses the standard library's own socket and sleep, even where gevent has
patched them: a Locust worker runs it in a native thread (`gevent.get_hub().threadpool`),
so a round trip is stamped when the kernel hands over the bytes, not when a busy event
loop gets round to it (a greenlet measured 5 ms more during a worker's start-up). Plain
`http` targets only: for `https` the /health round trip is not taken.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from calculet_load.clock import Clock, SystemClock
from calculet_load.schema.access import TargetAccess, access_of
from calculet_load.schema.clocks import rtt_summary
from calculet_load.schema.netsigns import is_unreachable
from calculet_load.target.api import off_loop

__all__ = ["RttRounds", "health_request", "measure_round", "rounds_record"]

ROUNDS_KEEP = 60  # rounds kept after the first (a 72-hour run keeps the latest)


def _original(module: str, name: str) -> Any:
    """The standard library's `module.name`, as it was before any gevent patching."""
    try:
        from gevent.monkey import get_original
    except ImportError:  # pragma: no cover - gevent is a dependency
        return getattr(__import__(module), name)
    return get_original(module, name)


# the class and functions themselves: socket.create_connection would look up the patched
# socket class at call time
_Socket: type[socket.socket] = _original("socket", "socket")
_getaddrinfo: Callable[..., Any] = _original("socket", "getaddrinfo")
_sleep: Callable[[float], None] = _original("time", "sleep")


def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    family, kind, proto, _, address = _getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]
    sock = _Socket(family, kind, proto)
    try:
        sock.settimeout(timeout_s)
        sock.connect(address)
    except OSError:
        sock.close()
        raise
    return sock


MAX_SAMPLES = 1000
HEADER_LIMIT = 65536


class _SampleFailed(Exception):
    """One sample failed: `kind` (calculet_load.schema.netsigns.PROBE_FAILURE_KINDS)."""

    def __init__(self, kind: str, exc: BaseException) -> None:
        super().__init__(f"{kind}: {type(exc).__name__}: {exc}"[:200])
        self.kind = kind


class _Closed(OSError):
    """The target closed the connection before the /health response headers."""


def _connect_kind(exc: OSError) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return "connect_timeout"
    if is_unreachable(exc):
        return "unreachable"
    return "refused" if isinstance(exc, ConnectionRefusedError) else "connect_error"


def _exchange_kind(exc: OSError) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return "health_timeout"  # connected: the server does not answer, not the network
    return "reset" if isinstance(exc, ConnectionError | _Closed) else "health_error"


def _one(
    host: str, port: int, request: bytes | None, clock: Clock, timeout_s: float
) -> tuple[int, int | None]:
    """(connect ns, /health ns or None) of one fresh connection; _SampleFailed naming how
    it failed (a TCP connect that timed out or had no route is the network's doing; a
    refusal, a reset or a /health that never answers is the target's)."""
    t0 = clock.mono_ns()
    try:
        sock = _connect(host, port, timeout_s)
    except OSError as exc:
        raise _SampleFailed(_connect_kind(exc), exc) from None
    try:
        return _exchange(sock, request, clock, t0)
    except OSError as exc:
        raise _SampleFailed(_exchange_kind(exc), exc) from None
    finally:
        sock.close()


def _exchange(
    sock: socket.socket, request: bytes | None, clock: Clock, t0: int
) -> tuple[int, int | None]:
    t1 = clock.mono_ns()
    if request is None:  # https: the connect round trip only
        return t1 - t0, None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t2 = clock.mono_ns()
    sock.sendall(request)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(4096)
        if not chunk:
            raise _Closed("connection closed before the /health response headers")
        got += chunk
        if len(got) > HEADER_LIMIT:
            raise OSError("no end of headers in the /health response")
    t3 = clock.mono_ns()
    return t1 - t0, t3 - t2


def health_request(access: TargetAccess, path: str = "/health") -> bytes:
    """The probe's request: GET `path` under the target's base path, with the target's
    headers and key (sent, never written), closing the connection after the answer."""
    lines = [f"GET {access.path(path)} HTTP/1.1", f"Host: {access.authority}"]
    lines += [f"{name}: {value}" for name, value in access.request_headers()]
    lines += ["Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1")


def measure_round(
    target: str | TargetAccess,
    samples: int,
    *,
    path: str = "/health",
    clock: Clock | None = None,
    timeout_s: float = 2.0,
    gap_s: float = 0.02,
) -> dict[str, Any]:
    """`samples` connect and health round trips to the target's host, one after another
    (`path`: the profile's health path, from the server's root under the base path).

    Returns {"wall_ns", "end_wall_ns", "samples", "errors", "failures", "last_error",
    "connect": summary, "health": summary}; a failed sample counts in `errors` and, by
    how it failed, in `failures` (kind -> count,
    calculet_load.schema.netsigns.PROBE_FAILURE_KINDS), and adds no round trip.
    analysis.tables.netbreaks reads a round whose connects mostly timed out or had no
    route as a network break; refusals, resets and a silent /health are the target's.
    """
    if not 0 <= samples <= MAX_SAMPLES:
        raise ValueError(f"samples must be in 0..{MAX_SAMPLES}, got {samples}")
    clock = clock or SystemClock()
    access = access_of(target)  # not an http(s) URL: AccessError, a ValueError
    host, port = access.host, access.port
    request = None if access.tls else health_request(access, path)
    connect: list[int] = []
    health: list[int] = []
    errors = 0
    failures: dict[str, int] = {}
    last_error: str | None = None
    wall = clock.wall_ns()
    for i in range(samples):
        if i:
            _sleep(gap_s)
        try:
            c, h = _one(host, port, request, clock, timeout_s)
        except _SampleFailed as exc:
            errors += 1
            failures[exc.kind] = failures.get(exc.kind, 0) + 1
            last_error = str(exc)
            continue
        connect.append(c)
        if h is not None:
            health.append(h)
    return {
        "wall_ns": wall,
        "end_wall_ns": clock.wall_ns(),  # a round of failed samples spans a network break
        "samples": samples,
        "errors": errors,
        "failures": failures,
        "last_error": last_error,
        "connect": rtt_summary(connect),
        "health": rtt_summary(health),
        "connect_us": [c // 1000 for c in connect],  # the samples, bounded by `samples`
        "health_us": [h // 1000 for h in health],
    }


def rounds_record(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """`target_rtt` of a worker's entry in client/index.json: the first round ("before"
    the load), the later rounds' medians pooled ("during"), and the rounds themselves."""
    before = next((r for r in rounds if r.get("phase") == "before"), None)
    during = [r for r in rounds if r.get("phase") == "during"]
    pooled = {
        kind: rtt_summary([int(r[kind]["p50_ms"] * 1e6) for r in during if r[kind]["n"]])
        for kind in ("connect", "health")
    }
    return {
        "before": None if before is None else {k: before[k] for k in ("connect", "health")},
        "during_medians": pooled,
        "rounds": rounds,
    }


class RttRounds:
    """Rounds taken now and then by a process that sends load itself (an `accept` run):
    `take("before")` once, then `take("during")` at most every `every_s`. Under gevent a
    round runs in the hub's native thread pool, so the event loop is not held up."""

    def __init__(
        self,
        target: str | TargetAccess,
        samples: int = 8,
        every_s: float = 60.0,
        path: str = "/health",
    ) -> None:
        self.target = target
        self.path = path
        self.samples = samples
        self.every_s = every_s
        self.clock = SystemClock()
        self.rounds: list[dict[str, Any]] = []
        self._last_mono_ns: int | None = None

    def take(self, phase: str) -> None:
        now = self.clock.mono_ns()
        if self.samples <= 0 or (
            phase == "during"
            and self._last_mono_ns is not None
            and now - self._last_mono_ns < self.every_s * 1e9
        ):
            return
        self._last_mono_ns = now
        try:
            row = off_loop(
                lambda: measure_round(self.target, self.samples, path=self.path, clock=self.clock)
            )
        except ValueError:
            return  # not an http(s) URL: nothing to measure
        self.rounds.append({"phase": phase, **row})
        del self.rounds[1:-ROUNDS_KEEP]

    def record(self) -> dict[str, Any]:
        return rounds_record(self.rounds)
