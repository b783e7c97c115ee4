"""N stand-in Locust workers for benchmarks/master_capacity.py: more workers than this
machine can run, each sending a master what a real worker sends, at a real worker's
pace. Each connects as Locust's worker does (its own identity, `client_ready`), answers
the master's `spawn` and calculet-load's clock pings, sends a heartbeat every second and
every 3 s a report: one recorded from a real worker by benchmarks/master_probe.py (its
Locust statistics and calculet-load's histograms at that worker's request rate), under
its own worker name. It sends no request, so the master's cost is measured at a scale
of workers and request rates this machine could not drive.

Usage (master_capacity.py starts it): replay_workers.py PORT N REPORT SECONDS
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any

import zmq
from locust import __version__
from locust.rpc.protocol import Message

HEARTBEAT_S, REPORT_S = 1.0, 3.0  # locust.runners' HEARTBEAT_INTERVAL, WORKER_REPORT_INTERVAL


def main() -> None:
    port, n, report_path, seconds = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        float(sys.argv[4]),
    )
    report = Message.unserialize(open(report_path, "rb").read()).data  # noqa: SIM115
    ctx = zmq.Context()
    workers: list[tuple[str, Any, bytes]] = []
    for i in range(n):
        cid = f"replay{i:03d}_{uuid.uuid4().hex}"
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, cid.encode())
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(Message("client_ready", __version__, cid).serialize())
        data = dict(report)
        if isinstance(data.get("calculet"), dict):
            data["calculet"] = {**data["calculet"], "worker": f"r{i:03d}"}
        workers.append((cid, sock, Message("stats", data, cid).serialize()))
    poller = zmq.Poller()
    for _, sock, _ in workers:
        poller.register(sock, zmq.POLLIN)
    by_sock = {sock: cid for cid, sock, _ in workers}
    state = "ready"
    end = time.monotonic() + seconds
    next_beat = next_report = time.monotonic()
    tick = 0
    while time.monotonic() < end:
        for sock, _ in poller.poll(timeout=50):
            cid = by_sock[sock]
            msg = Message.unserialize(sock.recv())
            if msg.type == "spawn":
                sock.send(Message("spawning", None, cid).serialize())
                done = {"user_classes_count": {"CalculetUser": 1}, "user_count": 1}
                sock.send(Message("spawning_complete", done, cid).serialize())
                state = "running"
            elif msg.type == "calculet_clock_ping":
                t2 = time.time_ns()
                pong = {"seq": msg.data["seq"], "t1": msg.data["t1"], "t2": t2}
                pong["t3"] = time.time_ns()
                sock.send(Message("calculet_clock_pong", pong, cid).serialize())
            elif msg.type == "quit":
                end = 0.0
        now = time.monotonic()
        if now >= next_beat:
            beat = {"state": state, "current_cpu_usage": 1.0, "current_memory_usage": 1 << 27}
            for cid, sock, _ in workers:
                sock.send(Message("heartbeat", beat, cid).serialize())
            next_beat += HEARTBEAT_S
        if now >= next_report and state == "running":
            # a third of the workers each second: spread as real workers' reports are
            for k, (_, sock, wire) in enumerate(workers):
                if k % 3 == tick % 3:
                    sock.send(wire)
            tick += 1
            next_report += REPORT_S / 3
    for _, sock, _ in workers:
        sock.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
