"""Free TCP ports for the servers tests start (the suite runs in parallel: no fixed port)."""

from __future__ import annotations

import socket

# ports this process handed out already: never twice, even once their servers ended
_GIVEN: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now, for a child process to bind.

    The kernel picks it at random from the ephemeral range, so parallel pytest workers and
    other test runs on the machine seldom meet; a server that can bind port 0 and say its
    port (as `calculet-sim --port 0` does) needs no helper at all. Bounded: 100 tries."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port on {host} in 100 tries")
