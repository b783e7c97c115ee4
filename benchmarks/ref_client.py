"""A small reference streaming client: asyncio (+ uvloop when installed), raw protocol.

It is the yardstick of benchmarks/client_speed.py: as little work per byte as a useful
client can do. Each read is stamped (`time.monotonic_ns()`) first thing in
`data_received`, before any parsing; an SSE event is a token when it carries `"text"`.
Keep-alive connections, a fixed 128-id prompt (unique by its first id), the request id in
`X-Request-Id`. Open loop (Poisson at `--rate`) or closed loop (`--concurrency` users).

Writes one JSON line per request to `--out`: [request id, t0, [token arrival ns...], ok,
user] (user: the closed-loop user's index, null in open loop).

`--python-reads`: the floor of a Python read loop that stamps the way calculet-load
does. Each socket's reads are a Python callback on the loop (`add_reader`), each a
`recvmsg` carrying the kernel's receive time (SO_TIMESTAMPNS), which stamps the read's
tokens; the rest is as above. What this costs over uvloop's C transport is what any
Python client with kernel stamps pays before it parses a byte (docs/performance.md:
benchmarks/client_speed.py runs it as client `floor`).

Usage: python benchmarks/ref_client.py --url http://127.0.0.1:PORT --seconds 10
       (--rate 80 | --concurrency 16) --out FILE [--python-reads]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import time
from typing import Any

# Linux: the kernel's receive time of each read (CLOCK_REALTIME), as calculet-load asks
# for it (calculet_load.measure.rxstamps), not imported: this client stands alone.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
TIMESPEC = struct.Struct("@ll")
CMSG_SPACE = socket.CMSG_SPACE(TIMESPEC.size)


class Conn(asyncio.Protocol):
    __slots__ = ("buf", "done", "lost", "stamps", "transport")

    def __init__(self) -> None:
        self.transport: Any = None
        self.stamps: list[int] = []
        self.buf = b""
        self.done: asyncio.Future[bool] | None = None
        self.lost = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        if self.done is not None and not self.done.done():
            self.done.set_result(False)

    def data_received(self, data: bytes) -> None:
        self.data_received_at(data, time.monotonic_ns())

    def data_received_at(self, data: bytes, t: int) -> None:
        buf = self.buf + data
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self.buf = buf
            return
        self.buf = buf[cut + 2 :]
        whole = buf[:cut]
        n = whole.count(b'"text"')
        if n:
            self.stamps.extend([t] * n)
        if b"[DONE]" in whole and self.done is not None and not self.done.done():
            self.done.set_result(True)


class PyConn(Conn):
    """`--python-reads`: the same bookkeeping, read by a Python callback on the loop with
    the kernel's stamp of each read (moved onto the monotonic clock)."""

    __slots__ = ("loop", "sock")

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        super().__init__()
        self.loop, self.sock = loop, sock
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        loop.add_reader(sock.fileno(), self.readable)

    def readable(self) -> None:
        try:
            data, anc, _, _ = self.sock.recvmsg(65536, CMSG_SPACE)
        except BlockingIOError:
            return
        except OSError:
            data, anc = b"", []
        t = time.monotonic_ns()
        if not data:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.connection_lost(None)
            return
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, nsec = TIMESPEC.unpack_from(raw)
                t = sec * 1_000_000_000 + nsec - (time.time_ns() - t)
        self.data_received_at(data, t)

    def write(self, data: bytes) -> None:
        sent = self.sock.send(data)  # a request's few hundred bytes fit an empty buffer
        if sent != len(data):
            raise RuntimeError(f"sent {sent} of the request's {len(data)} bytes")


class Client:
    def __init__(
        self, host: str, port: int, max_tokens: int, prompt_tokens: int, python_reads: bool
    ) -> None:
        self.python_reads = python_reads
        self.host, self.port = host, port
        self.idle: list[Conn] = []
        self.results: list[list[Any]] = []
        self.seq = 0
        self.max_tokens = max_tokens
        self.prompt = list(range(1000, 1000 + prompt_tokens))

    async def request(self, user: int | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.seq += 1
        rid = f"ref.{self.seq:08d}"
        self.prompt[0] = self.seq
        body = json.dumps(
            {
                "model": "exact",
                "prompt": self.prompt,
                "max_tokens": self.max_tokens,
                "stream": True,
                "ignore_eos": True,
            },
            separators=(",", ":"),
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"X-Request-Id: {rid}\r\n\r\n"
        ).encode()
        conn = None
        while self.idle:
            c = self.idle.pop()
            if not c.lost:
                conn = c
                break
        if conn is None and self.python_reads:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            await loop.sock_connect(sock, (self.host, self.port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = PyConn(loop, sock)
        elif conn is None:
            _, conn = await loop.create_connection(Conn, self.host, self.port)
        assert conn is not None
        conn.stamps = []
        conn.buf = b""
        conn.done = loop.create_future()
        t0 = time.monotonic_ns()
        conn.write(head + body)
        ok = await conn.done
        self.results.append([rid, t0, conn.stamps, ok, user])
        if ok:
            self.idle.append(conn)


async def run(args: argparse.Namespace) -> None:
    hostport = args.url.removeprefix("http://").rstrip("/")
    host, port = hostport.rsplit(":", 1)
    client = Client(host, int(port), args.max_tokens, args.prompt_tokens, args.python_reads)
    loop = asyncio.get_running_loop()
    end = time.monotonic() + args.seconds
    tasks: set[asyncio.Task[None]] = set()
    if args.rate:
        rng = random.Random(args.seed)
        due = time.monotonic()
        while due < end:
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(client.request())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            due += rng.expovariate(args.rate)
    else:

        async def user(index: int) -> None:
            while time.monotonic() < end:
                await client.request(index)

        tasks = {loop.create_task(user(i)) for i in range(args.concurrency)}
    if tasks:
        await asyncio.wait(tasks, timeout=args.seconds + 30)
    with open(args.out, "w") as f:
        for row in client.results:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals/s (open loop)")
    ap.add_argument("--concurrency", type=int, default=1, help="closed-loop users")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-uvloop", action="store_true")
    ap.add_argument(
        "--python-reads", action="store_true", help="read in Python with kernel stamps (floor)"
    )
    args = ap.parse_args()
    if not args.no_uvloop:
        try:
            import uvloop

            uvloop.run(run(args))
            return
        except ImportError:
            pass
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
