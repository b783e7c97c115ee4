"""Stamps from the kernel's receive time: a busy client loop does not make them late.

A plain-socket server in a thread sends one SSE event at a known monotonic instant while
the client's gevent loop is blocked (a greenlet sleeps without yielding, as a loop busy
with other streams would); the client stamps the event when the bytes reached the kernel,
not when its read returned, and records how long they waited (`read_wait_ns`).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import gevent
import pytest

from calculet_load.clock import FakeClock
from calculet_load.measure.connections import Endpoint
from calculet_load.measure.gevent_engine import GeventPool
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.outcome import Outcome, Timeouts
from calculet_load.measure.protocols import adapter_for

FIRST_AT_S = 0.10  # the first event, after the request was read
BLOCK_FROM_S, BLOCK_S = 0.05, 0.15  # the client's loop is blocked over it


def _event(k: int, done: bool = False) -> bytes:
    obj = {
        "choices": [{"index": 0, "text": " w", "finish_reason": "length" if done else None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": k},
    }
    data = b"data: " + json.dumps(obj).encode() + b"\n\n"
    if done:
        data += b"data: [DONE]\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data) + (b"0\r\n\r\n" if done else b"")


class OneShot:
    """Answers one streamed completion: event 1 at FIRST_AT_S, event 2 200 ms later
    (after the client's loop is free again: a read that returns both would carry the
    second's receive time, the kernel's stamp of the read's last bytes)."""

    def __init__(self, second_after_s: float = 0.2) -> None:
        self.second_after_s = second_after_s
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.sent: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with self.srv:
            conn, _ = self.srv.accept()
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            head, _, body = buf.partition(b"\r\n\r\n")
            length = int(
                next(
                    line.split(b":")[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
            )
            while len(body) < length:
                body += conn.recv(65536)
            t = time.monotonic()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            time.sleep(max(t + FIRST_AT_S - time.monotonic(), 0))
            self.sent.append(time.monotonic_ns())  # just before the write of event 1
            conn.sendall(_event(1))
            time.sleep(self.second_after_s)
            self.sent.append(time.monotonic_ns())
            conn.sendall(_event(2, done=True))
            conn.recv(1)  # until the client closes


def _request(port: int, clock: FakeClock | None = None) -> Outcome:
    pool = GeventPool(Endpoint(f"http://127.0.0.1:{port}"), 1)
    adapter = adapter_for("openai-completions")
    body = adapter.body([1, 2, 3], 2, stream=True, model=None, temperature=0.0, seed=None,
                        ignore_eos=True)  # fmt: skip

    def busy() -> None:
        gevent.sleep(BLOCK_FROM_S)
        time.sleep(BLOCK_S)  # blocks the whole loop, as other streams' work would

    def send() -> Outcome:
        blocker = gevent.spawn(busy)
        kw = {"clock": clock} if clock is not None else {}
        out = pool.execute(adapter, body, "ks-1", stream=True, timeouts=Timeouts(), **kw)
        blocker.join()
        pool.close()
        return out

    return run_in_greenlet(send)


@pytest.mark.serial  # ms timings
def test_a_busy_loop_does_not_make_the_stamp_late() -> None:
    server = OneShot()
    out = _request(server.port)
    assert out.ok, out.error_detail
    assert out.stamp_source == "kernel"
    first = out.token_events[0].arrival_ns
    # the bytes reached the kernel when the server sent them (loopback: µs), though the
    # loop could read them only ~100 ms later
    assert 0 <= first - server.sent[0] < 5_000_000, (first - server.sent[0]) / 1e6
    assert out.client_ns.first_token == first
    assert out.read_wait_ns is not None and out.read_wait_ns > 50_000_000
    assert out.late_bound_ns == 0  # the first token came alone in its read: not late
    # the stamps keep their order: t1 <= t2 <= t4 <= t5 <= t6
    ns = out.client_ns
    assert ns.headers_sent <= ns.response_headers <= ns.first_token <= ns.last_token  # type: ignore[operator]
    assert ns.last_token <= ns.response_end  # type: ignore[operator]


def test_a_clock_other_than_the_system_clock_keeps_read_stamps() -> None:
    """A fake clock (tests, replays) has no relation to the kernel's: its reads stamp."""
    server = OneShot()
    out = _request(server.port, FakeClock())
    assert out.ok, out.error_detail
    assert out.stamp_source == "read"
    assert out.read_wait_ns is None


@pytest.mark.serial  # ms timings
def test_events_that_share_a_read_are_bounded_by_the_gap_since_the_read_before() -> None:
    """Events 1 and 2 (10 ms apart) both arrive while the loop is blocked: one read,
    both stamped with event 2's arrival. The first token is then 10 ms late, and the
    outcome's bound says at most how late: from the read before (the head's) to that
    arrival."""
    server = OneShot(second_after_s=0.01)
    out = _request(server.port)
    assert out.ok, out.error_detail
    assert out.max_events_per_read >= 2
    first_late = out.token_events[0].arrival_ns - server.sent[0]
    assert 5_000_000 < first_late < 20_000_000, first_late / 1e6  # event 2's arrival
    assert out.late_bound_ns is not None and out.late_bound_ns >= first_late
    assert out.late_bound_ns < 200_000_000  # since the head's read, not the request


class _PreemptedOnce:
    """A clock whose thread is preempted for `gap_ns` just before its first wall read, as
    a busy core can do to a reading thread; the wall clock is the monotonic one plus
    OFFSET_NS, each monotonic read 1 µs after the one before."""

    OFFSET_NS = 4_000_000_000

    def __init__(self, gap_ns: int) -> None:
        self.mono, self.gap_ns = 1_000_000_000, gap_ns
        self.reads: list[str] = []

    def mono_ns(self) -> int:
        self.reads.append("mono")
        self.mono += 1_000
        return self.mono

    def wall_ns(self) -> int:
        self.reads.append("wall")
        self.mono += self.gap_ns  # the preemption, once
        self.gap_ns = 0
        return self.mono + self.OFFSET_NS


def test_the_clock_pair_is_read_again_when_the_thread_was_preempted_between() -> None:
    """A read's time and the wall time that moves the kernel's stamp onto the monotonic
    clock must be one instant: a pair with a preemption between its reads would move the
    stamp earlier by the preemption. `clock_pair` sees the monotonic clock move past
    PAIR_NS across the wall read and reads the pair again (measure/reader.c does the
    same in C)."""
    from calculet_load.measure.rxstamps import PAIR_NS, clock_pair

    preempted = _PreemptedOnce(gap_ns=5_000_000)
    assert PAIR_NS < 5_000_000
    t, wall = clock_pair(preempted)  # type: ignore[arg-type]
    # the first pair was 5 ms apart: read again, and the pair returned is one instant
    assert preempted.reads == ["mono", "wall", "mono"] * 2
    assert wall - t == _PreemptedOnce.OFFSET_NS
    steady = _PreemptedOnce(gap_ns=0)
    t, wall = clock_pair(steady)  # type: ignore[arg-type]
    assert steady.reads == ["mono", "wall", "mono"]  # one try
    assert wall - t == _PreemptedOnce.OFFSET_NS
