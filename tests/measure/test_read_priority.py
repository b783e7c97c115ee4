"""The thread engine on a late loop: it reads before it parses (measure.thread_loop
`Backlog`), and a new connection does not wait for the loop.

A read's kernel stamp is the arrival of the last segment it copies, and segments that
arrive while earlier ones wait unread are merged with the newest time. So a stream read
after its next token arrived gets its first token stamped a token interval late. Here N
streams get their first token while the engine's loop is blocked, the next 10 ms later;
parsing each event takes 3 ms (a slow local tokenizer, `count_text`). Read and parsed
one by one, the streams read after the first three lose their first token's own time;
read first and parsed after, every token keeps it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import gevent
import pytest

from calculet_load.measure import thread_loop, thread_reads
from calculet_load.measure.connections import Endpoint
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.outcome import Outcome, Timeouts
from calculet_load.measure.protocols import adapter_for
from calculet_load.measure.thread_engine import ThreadPool
from calculet_load.measure.thread_loop import LoopThread
from tests.measure.test_hostile import PATIENT, SHORT_LLAMA, http
from tests.support.hostile import CLOSE, serve

STREAMS = 8
TOKENS = 4
ITL_S = 0.010
PARSE_S = 0.003  # per text event: eight first tokens are 24 ms of parsing


def _chunk(obj: dict[str, Any] | str) -> bytes:
    data = b"data: " + (obj.encode() if isinstance(obj, str) else json.dumps(obj).encode())
    data += b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


class Fanout:
    """Serves STREAMS streamed completions at once: when all requests are in, it blocks
    the engine's loop for 8 ms, sends every stream's first token 5 ms into the block, then
    one token every ITL_S; it notes each write's time, per request id."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.srv = socket.create_server(("127.0.0.1", 0), backlog=STREAMS)
        self.port = self.srv.getsockname()[1]
        self.sent: dict[str, list[int]] = {}
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _request(self, conn: socket.socket) -> str:
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += conn.recv(65536)
        head, _, body = buf.partition(b"\r\n\r\n")
        fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
        fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
        while len(body) < int(fields[b"content-length"]):
            body += conn.recv(65536)
        return fields[b"x-request-id"].decode()

    def _serve(self) -> None:
        conns = []
        with self.srv:
            for _ in range(STREAMS):
                conn, _ = self.srv.accept()
                conns.append((conn, self._request(conn)))
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for conn, _ in conns:
            conn.sendall(head)
        time.sleep(0.05)  # the heads read and parsed
        self.loop.call_soon_threadsafe(time.sleep, 0.008)  # the loop, busy elsewhere
        time.sleep(0.005)
        start = time.monotonic()
        for k in range(1, TOKENS + 1):
            time.sleep(max(start + (k - 1) * ITL_S - time.monotonic(), 0))
            for conn, rid in conns:
                last = k == TOKENS
                event = {"choices": [{"index": 0, "text": " w",
                                      "finish_reason": "length" if last else None}]}  # fmt: skip
                wire = _chunk(event) + (_chunk("[DONE]") + b"0\r\n\r\n" if last else b"")
                self.sent.setdefault(rid, []).append(time.monotonic_ns())
                conn.sendall(wire)
        for conn, _ in conns:
            conn.recv(1)  # until the client closes
            conn.close()


def _slow_count(text: str) -> int:
    time.sleep(PARSE_S)  # the interpreter lock is let go, as a tokenizer in C would
    return len(text.split())


def _fan_out() -> tuple[list[Outcome], dict[str, list[int]]]:
    server = Fanout(LoopThread.shared().loop)
    pool = ThreadPool(Endpoint(f"http://127.0.0.1:{server.port}"), STREAMS)
    assert pool.engine is LoopThread.shared()
    adapter = adapter_for("openai-completions")
    body = adapter.body([1, 2, 3], TOKENS, stream=True, model=None, temperature=0.0,
                        seed=None, ignore_eos=True)  # fmt: skip

    def one(k: int) -> Outcome:
        return pool.execute(adapter, body, f"rp-{k}", stream=True, timeouts=Timeouts(),
                            count_text=_slow_count)  # fmt: skip

    def all_of_them() -> list[Outcome]:
        jobs = [gevent.spawn(one, k) for k in range(STREAMS)]
        gevent.joinall(jobs, raise_error=True)
        return [j.value for j in jobs]

    try:
        outs = run_in_greenlet(all_of_them)
    finally:
        pool.close()
    server.thread.join(5)
    return outs, server.sent


def _lateness_ms(outs: list[Outcome], sent: dict[str, list[int]]) -> list[list[float]]:
    late = []
    for out in outs:
        assert out.ok, (out.error_class, out.error_detail)
        assert out.stamp_source == "kernel"
        assert [ev.tokens for ev in out.token_events] == [1] * TOKENS
        writes = sent[out.request_id]
        late.append(
            [(ev.arrival_ns - w) / 1e6 for ev, w in zip(out.token_events, writes, strict=True)]
        )
    return late


@pytest.mark.serial  # ms timings
@pytest.mark.parametrize("reads", ["loop", "native"])
def test_a_late_loop_reads_every_stream_before_it_parses(
    reads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the loop: read first, parsed after (`Backlog`). Natively: the reader's thread
    reads while the loop is blocked (measure/reader.c); the same bound either way."""
    if reads == "native" and LoopThread.shared().reader is None:
        pytest.skip("the native reader is not built (measure.native)")
    monkeypatch.setattr(thread_loop, "READ_NATIVELY", reads == "native")
    outs, sent = _fan_out()
    late = _lateness_ms(outs, sent)
    # every token keeps its own arrival: no read came after the next token's
    worst = max(max(row) for row in late)
    assert worst < 5.0, late
    assert all(x > -1.0 for row in late for x in row), late  # never before the write


@pytest.mark.serial  # ms timings
def test_parsed_as_read_the_last_streams_lose_their_first_tokens_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the contrast that shows what the backlog is for: never late, so parsed at each read
    # (reads on the loop: the native reader reads in a thread of its own)
    monkeypatch.setattr(thread_loop, "READ_NATIVELY", False)
    monkeypatch.setattr(thread_reads, "LATE_READ_NS", 10**12)
    outs, sent = _fan_out()
    late = _lateness_ms(outs, sent)
    firsts = sorted(row[0] for row in late)
    assert firsts[-1] > 7.0, late  # read with its second token: ~10 ms late


@pytest.mark.serial  # ms timings
def test_a_new_connection_on_a_late_loop_is_sent_at_once() -> None:
    """Every pass of the engine's loop takes 5 ms (as when it is late); a request on a
    new connection still goes out within a pass of its start stamp: the connect does
    not wait for the loop (it took four or five passes through asyncio.wait_for)."""
    loop = LoopThread.shared().loop
    hogging = [True]

    def hog() -> None:
        if hogging[0]:
            time.sleep(0.005)
            loop.call_soon(hog)

    with serve([http(SHORT_LLAMA), CLOSE]) as server:  # one answer per connection
        pool = ThreadPool(Endpoint(server.url), 4)
        adapter = adapter_for("llama")
        body = adapter.body([1, 2, 3], 3, stream=True, model=None, temperature=0.0,
                            seed=None, ignore_eos=True)  # fmt: skip
        loop.call_soon_threadsafe(hog)
        try:
            outs = [
                run_in_greenlet(
                    lambda k=k: pool.execute(
                        adapter, body, f"nc-{k}", stream=True, timeouts=PATIENT
                    )
                )
                for k in range(4)
            ]
        finally:
            hogging[0] = False
            pool.close()
    for out in outs:
        assert out.ok, (out.error_class, out.error_detail)
        assert not out.connection_reused  # each its own connection: the server closed
        ns = out.client_ns
        assert ns.headers_sent is not None and ns.request_start is not None
        assert ns.headers_sent - ns.request_start < 4_000_000, out.client_ns
