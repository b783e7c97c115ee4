"""How many token events per second the simulator emits on one core (firehose mode).

Later client benchmarks compare against this figure to show the simulator is not the
bottleneck. The simulator runs in `--profile firehose` (zero delays, 16 tokens per
write), pinned to one core when `taskset` works; a deliberately cheap reader (raw
sockets, counts `data: ` lines with bytes.count) runs on the other core with several
concurrent streams.

Usage: .venv/bin/python benchmarks/sim_firehose.py [--seconds 10] [--streams 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import psutil
from speedkit import start_sim, stop_child  # this folder's


async def one_stream(port: int, body: bytes, deadline: float, counts: list[int]) -> None:
    head = (
        f"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < deadline:
            writer.write(head + body)
            tail = b""
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    return
                counts[0] += data.count(b"data: ")
                tail = (tail + data)[-64:]
                if b'"stop":true' in tail or tail.endswith(b"0\r\n\r\n"):
                    break
    finally:
        writer.close()


async def drive(port: int, streams: int, seconds: float, tokens: int) -> int:
    body = json.dumps(
        {"prompt": [300, 301, 302, 303], "n_predict": tokens, "stream": True}
    ).encode()
    counts = [0]
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(one_stream(port, body, deadline, counts) for _ in range(streams)))
    return counts[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per request")
    args = ap.parse_args()
    ncpu = os.cpu_count() or 1
    sim_core = 1 if ncpu > 1 else None
    proc, url = start_sim(sim_core, ["--profile", "firehose"])
    port = int(url.rsplit(":", 1)[1])
    if sim_core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    sim_ps = psutil.Process(proc.pid)
    me = psutil.Process()
    try:
        sim_cpu0, my_cpu0 = sim_ps.cpu_times(), me.cpu_times()
        t0 = time.monotonic()
        events = asyncio.run(drive(port, args.streams, args.seconds, args.tokens))
        wall = time.monotonic() - t0
        sim_cpu1, my_cpu1 = sim_ps.cpu_times(), me.cpu_times()
    finally:
        stop_child(proc)
    sim_cpu = (sim_cpu1.user + sim_cpu1.system - sim_cpu0.user - sim_cpu0.system) / wall
    my_cpu = (my_cpu1.user + my_cpu1.system - my_cpu0.user - my_cpu0.system) / wall
    rate = events / wall
    print("sim_firehose: token events emitted by calculet-sim (firehose profile, 1 token/event)")
    print(f"  streams={args.streams} tokens/request={args.tokens} wall={wall:.1f}s")
    print(f"  sim pinned to core: {sim_core if sim_core is not None else 'no (1 CPU)'}")
    print(f"  token events/s      : {rate:,.0f}")
    print(f"  sim CPU (cores)     : {sim_cpu:.2f}   <- ~1.0 means the sim's core is the limit")
    print(f"  reader CPU (cores)  : {my_cpu:.2f}   <- must stay well below 1.0")
    print(f"  sim CPU per event   : {sim_cpu / rate * 1e6 if rate else float('nan'):.2f} µs")
    print("  Meaning: a client benchmark whose event rate is well below this figure is")
    print("  measuring the client, not the simulator.")


if __name__ == "__main__":
    main()
