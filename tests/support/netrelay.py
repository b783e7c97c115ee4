"""A userspace TCP relay that delays traffic: the test's stand-in for netem.

    python -m tests.support.netrelay --listen HOST:0 --to HOST:PORT --delay-ms 15 \\
        --jitter-ms 4 --seed 7 --max-s 120

This kernel has no netem (`tc qdisc add … netem` answers "Specified qdisc kind is
unknown"), so tests/locust/test_netns.py puts delay and jitter on the workers' path with
this relay. Every chunk read from either side is written to the other side `delay-ms`
later; chunks towards the client get `± jitter-ms` more. The jitter's sign is drawn once
per connection from a seeded stream per client address in shuffled (+, −) pairs, so the
connections of one client alternate evenly between base + jitter and base − jitter
(standard deviation exactly `jitter-ms` over an even number of them). A connection's
chunks share its delay, so they are released in order.

What it cannot delay: the TCP handshake (the kernel completes it before the relay's
accept), so a client's connect round trip sees only the veth, not `delay-ms`. A /health
round trip on a fresh connection sees 2 × delay-ms ± jitter-ms plus the server's time.

It prints `PORT <n>` once listening, and exits after `--max-s` seconds whatever happens.
Threads, not asyncio: a thread's sleep wakes within tens of µs, asyncio's timers up to a
millisecond late (it rounds the poll timeout), which would add to the delay measured.
"""

from __future__ import annotations

import argparse
import queue
import random
import socket
import sys
import threading
import time
from collections.abc import Iterator


def _signs(seed: int, client: str) -> Iterator[int]:
    rng = random.Random(f"{seed}:{client}")
    while True:
        pair = [1, -1]
        rng.shuffle(pair)
        yield from pair


def _pump(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
    """Copy src to dst, each chunk `delay_s` after it was read, in order."""
    chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()

    def release() -> None:
        try:
            while True:
                due, chunk = chunks.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not chunk:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(chunk)
        except OSError:
            return

    sender = threading.Thread(target=release, daemon=True)
    sender.start()
    try:
        while True:
            chunk = src.recv(65536)
            chunks.put((time.monotonic() + delay_s, chunk))
            if not chunk:
                break
    except OSError:
        chunks.put((0.0, b""))
    sender.join()


class Relay:
    def __init__(self, to: tuple[str, int], delay_s: float, jitter_s: float, seed: int) -> None:
        self.to = to
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.seed = seed
        self.streams: dict[str, Iterator[int]] = {}
        self.lock = threading.Lock()

    def handle(self, client: socket.socket, address: str) -> None:
        with self.lock:
            sign = next(self.streams.setdefault(address, _signs(self.seed, address)))
        try:
            server = socket.create_connection(self.to, timeout=5)
            server.settimeout(None)
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        down = self.delay_s + sign * self.jitter_s
        up = threading.Thread(target=_pump, args=(client, server, self.delay_s), daemon=True)
        up.start()
        _pump(server, client, down)
        up.join()
        client.close()
        server.close()


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--listen", required=True)
    p.add_argument("--to", required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-s", type=float, default=120.0)
    a = p.parse_args(argv)
    sys.setswitchinterval(0.0005)  # a releasing thread waits at most this for the GIL
    lhost, lport = a.listen.rsplit(":", 1)
    thost, tport = a.to.rsplit(":", 1)
    relay = Relay((thost, int(tport)), a.delay_ms / 1e3, a.jitter_ms / 1e3, a.seed)
    listener = socket.create_server((lhost, int(lport)), backlog=256)
    print(f"PORT {listener.getsockname()[1]}", flush=True)
    # bounded: the relay never outlives its test
    threading.Timer(a.max_s, lambda: __import__("os")._exit(0)).start()
    while True:
        client, addr = listener.accept()
        threading.Thread(target=relay.handle, args=(client, str(addr[0])), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1:])
