"""A hostile HTTP server for client tests: it reads a request, then plays a script.

Each accepted connection plays one script: the n-th connection plays the n-th script and
every later one the last script. A script is a list of steps:

- `bytes`: sent as they are (`sendall`);
- `Sleep(s)`: wait s seconds (cut short when the server stops);
- `Until(event, s)`: wait until the test sets `event` (a `threading.Event`), at most s
  seconds (then go on): a hold the test ends once it has seen what it waits for;
- `CLOSE`: shut the connection down cleanly (FIN);
- `RESET`: SO_LINGER 0, then close (the kernel sends RST);
- `READ`: read one more request on the same connection (keep-alive).

Every connection first reads one request (head up to the blank line, then a
Content-Length body); the raw bytes are kept in `requests`. A script that ends without
CLOSE or RESET leaves the connection open until the client closes it or the server stops.
`played` counts the connections whose script has been played to its end (its CLOSE or
RESET done): a test waits on it rather than sleeping for the server's thread.

Plain `socket` and `threading` on real OS sockets, daemon threads, and every wait is a
short poll on the stop flag, so `stop()` (the end of the `serve` block) is prompt and
leaves no socket open. Send and receive errors (the client went away) end the connection
quietly: the server is the hostile side, the client's outcome is what the tests check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence

__all__ = [
    "CLOSE",
    "READ",
    "RESET",
    "HostileServer",
    "Sleep",
    "Step",
    "Until",
    "drip",
    "serve",
]

_POLL_S = 0.02
_READ_LIMIT_S = 5.0  # a request that takes longer than this to arrive is given up on


@dataclasses.dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class Until:
    event: threading.Event
    max_seconds: float


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


CLOSE = _Marker("CLOSE")
RESET = _Marker("RESET")
READ = _Marker("READ")

Step = bytes | Sleep | Until | _Marker


def drip(data: bytes, gap_s: float, size: int = 1) -> list[Step]:
    """`data` sent `size` bytes at a time with `gap_s` seconds before each piece."""
    steps: list[Step] = []
    for i in range(0, len(data), size):
        steps += [Sleep(gap_s), data[i : i + size]]
    return steps


class _Gone(Exception):
    """The client closed the connection or the server is stopping."""


class HostileServer:
    def __init__(self, *scripts: Sequence[Step]) -> None:
        if not scripts:
            raise ValueError("at least one script")
        self.scripts = [list(s) for s in scripts]
        self.requests: list[bytes] = []
        self.connections = 0
        self.played = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self._listener.settimeout(_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True)

    def start(self) -> HostileServer:
        self._acceptor.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._acceptor.join(timeout=2.0)
        self._listener.close()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=2.0)
        with self._lock:  # only if a handler did not finish in time
            for conn in self._conns:
                conn.close()
            self._conns.clear()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                index = self.connections
                self.connections += 1
                self._conns.add(conn)
                script = self.scripts[min(index, len(self.scripts) - 1)]
                t = threading.Thread(target=self._handle, args=(conn, script), daemon=True)
                self._threads.append(t)
            t.start()

    def _handle(self, conn: socket.socket, script: list[Step]) -> None:
        conn.settimeout(_POLL_S)
        open_ = True
        try:
            self._read_request(conn)
            for step in script:
                if isinstance(step, bytes):
                    conn.sendall(step)
                elif isinstance(step, Sleep):
                    if self._stop.wait(step.seconds):
                        raise _Gone
                elif isinstance(step, Until):
                    deadline = time.monotonic() + step.max_seconds
                    while not step.event.wait(_POLL_S) and time.monotonic() < deadline:
                        if self._stop.is_set():
                            raise _Gone
                elif step is READ:
                    self._read_request(conn)
                elif step is CLOSE:
                    conn.shutdown(socket.SHUT_WR)
                    open_ = False
                    break
                elif step is RESET:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    open_ = False
                    break
            if open_:
                self._note_played()
            while open_ and self._recv(conn, None):
                pass  # keep the connection until the client closes it
        except (_Gone, OSError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if not open_:  # its CLOSE or RESET is done: the peer has the FIN or the RST
                self._note_played()

    def _note_played(self) -> None:
        with self._lock:
            self.played += 1

    def _recv(self, conn: socket.socket, deadline: float | None) -> bytes:
        """Bytes from the client (b"" at its EOF); _Gone when stopping or past `deadline`."""
        while not self._stop.is_set():
            if deadline is not None and time.monotonic() > deadline:
                raise _Gone
            try:
                return conn.recv(65536)
            except TimeoutError:
                continue
        raise _Gone

    def _read_request(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + _READ_LIMIT_S
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = self._recv(conn, deadline)
            if not data:
                raise _Gone
            buf += data
        head, _, body = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            data = self._recv(conn, deadline)
            if not data:
                raise _Gone
            body += data
        with self._lock:
            self.requests.append(head + b"\r\n\r\n" + body)


@contextlib.contextmanager
def serve(*scripts: Sequence[Step]) -> Iterator[HostileServer]:
    """A started HostileServer (use `.url`), stopped when the block ends."""
    server = HostileServer(*scripts).start()
    try:
        yield server
    finally:
        server.stop()
