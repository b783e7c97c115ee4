"""t1 from the kernel's transmit stamp of the request's last byte (measure.txstamps), on
the gevent engine and the thread engine's native reader; the thread engine's loop reads
keep t1 from the send call (a stamp queued late would close uvloop's watcher).

A server in a thread records, on the client's monotonic clock, when its reads of the
request began and ended: the request's last byte left the client between the two when
the server kept its window shut until then (a small receive buffer, a read after a
pause). A user-space t1 would be the moment the client's send call returned, long
before (the bytes waited in the client's send buffer): only the kernel's stamp falls
between. The same server shows that a stamp queued while the client waits does not make
the wait spin, and that a kernel receive stamp earlier than a late user-space t1 is kept.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from calculet_load.clock import SystemClock
from calculet_load.measure import gevent_engine, thread_engine, thread_loop, txstamps
from calculet_load.measure.connections import Endpoint
from calculet_load.measure.gevent_engine import GeventPool
from calculet_load.measure.io_engines import IOEngine, run_in_greenlet
from calculet_load.measure.outcome import Outcome, Timeouts
from calculet_load.measure.protocols import adapter_for
from calculet_load.measure.session import clock_complete
from calculet_load.measure.thread_engine import ThreadPool
from calculet_load.measure.txstamps import TxStamps, sent_stamp

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(txstamps.SO_TIMESTAMPING is None, reason="no SO_TIMESTAMPING here"),
]
ADAPTER = adapter_for("openai-completions")
BODY_WORDS = 120_000  # a prompt of about 600 KB: more than the server's window holds


def _event(k: int, done: bool = False) -> bytes:
    data = (
        b'data: {"choices":[{"index":0,"text":" w","finish_reason":%s}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n'
        % (b'"length"' if done else b"null", k)
    )
    if done:
        data += b"data: [DONE]\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data) + (b"0\r\n\r\n" if done else b"")


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class SlowReader:
    """Answers streamed completions on one kept-alive connection: waits `read_after_s`
    before reading each request (a receive buffer of 4 KB keeps the client's bytes in
    its own send buffer meanwhile), notes when its reads began and ended, answers the
    head `head_after_s` after the request, then two events."""

    def __init__(self, read_after_s: float, head_after_s: float, requests: int = 1) -> None:
        self.read_after_s, self.head_after_s = read_after_s, head_after_s
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen()
        self.port = self.srv.getsockname()[1]
        self.reads: list[tuple[int, int]] = []  # (first read began, last read ended), ns
        self.heads: list[int] = []  # just before each head's write
        self.requests = requests
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with self.srv:
            conn, _ = self.srv.accept()
        with conn:
            for _ in range(self.requests):
                time.sleep(self.read_after_s)
                began = time.monotonic_ns()
                buf = b""
                while b"\r\n\r\n" not in buf:
                    buf += conn.recv(65536)
                head, _, body = buf.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(body) < length:
                    body += conn.recv(65536)
                self.reads.append((began, time.monotonic_ns()))
                time.sleep(self.head_after_s)
                self.heads.append(time.monotonic_ns())
                conn.sendall(HEAD)
                conn.sendall(_event(1))
                conn.sendall(_event(2, done=True))
            conn.recv(1)  # until the client closes


@pytest.fixture(params=["gevent", "thread", "thread-loop"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(thread_loop, "READ_NATIVELY", request.param == "thread")
    return str(request.param)


def _send(engine: str, port: int, n: int = 1, words: int = BODY_WORDS) -> list[Outcome]:
    """`n` requests in turn on one connection; each outcome."""
    endpoint = Endpoint(f"http://127.0.0.1:{port}")
    body = ADAPTER.body(" w" * words, 2, stream=True, model=None, temperature=0.0, seed=None,
                        ignore_eos=True)  # fmt: skip
    timeouts = Timeouts(connect_s=5.0, first_byte_s=10.0, idle_s=10.0, total_s=20.0)
    pool: IOEngine = (GeventPool if engine == "gevent" else ThreadPool)(endpoint, 1)

    def go() -> list[Outcome]:
        try:
            return [
                pool.execute(ADAPTER, body, f"tx-{i}", stream=True, timeouts=timeouts)
                for i in range(n)
            ]
        finally:
            pool.close()

    return run_in_greenlet(go)


def test_t1_is_the_kernels_time_of_the_last_byte_not_the_send_calls(engine: str) -> None:
    """The send call returns at once (the bytes fit the client's send buffer) and the
    last byte leaves once the server reads: t1 is between the server's first and last
    read, where no user-space time of the send could be (the loop's reads keep that
    time: before the server read a byte). On a kept-alive connection the second
    request's t1 is its own last byte's, not the first's."""
    kernel = engine != "thread-loop"
    server = SlowReader(read_after_s=0.15, head_after_s=0.01, requests=2)
    outs = _send(engine, server.port, n=2)
    for out, (began, ended) in zip(outs, server.reads, strict=True):
        assert out.ok, out.error_detail
        assert out.sent_stamp_source == ("kernel" if kernel else "send")
        t0, t1 = out.client_ns.request_start, out.client_ns.headers_sent
        assert t0 is not None and t1 is not None
        assert began - t0 > 100_000_000  # the server waited before reading
        if kernel:
            # the last byte left after the server began to read, and before its last
            # read ended (the clock pair's conversion: within 20 µs)
            assert began <= t1 <= ended + 20_000, ((t1 - began) / 1e6, (ended - t1) / 1e6)
        else:
            assert t1 < began  # the send call's return, not the last byte's departure
        assert not out.sent_stamp_late
    assert outs[1].client_ns.headers_sent > outs[0].client_ns.response_end  # type: ignore[operator]


def test_a_stamp_queued_while_the_client_waits_does_not_make_it_spin(engine: str) -> None:
    """The last byte's stamp is queued while the client already waits for the response
    (the server reads late): the socket then reports an error to poll until the stamp is
    read. A wait that did not read it would wake again and again for the 300 ms until
    the head: the process's CPU over the request says it did not."""
    server = SlowReader(read_after_s=0.1, head_after_s=0.3)
    cpu = time.process_time()
    (out,) = _send(engine, server.port)
    used = time.process_time() - cpu
    assert out.ok, out.error_detail
    assert out.sent_stamp_source == ("send" if engine == "thread-loop" else "kernel")
    assert used < 0.1, used  # a spinning wait: about 0.3 s of a core


def test_a_receive_stamp_before_a_late_user_space_t1_is_kept(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without transmit stamps t1 is when the send call returned; the thread that sent is
    held 100 ms after its send (as the interpreter lock or the scheduler can hold it),
    while the server answers at once. The head's kernel stamp, before t1, is kept: t2 is
    not raised to t1, the record says t1 was late, and the stamps still count as
    complete."""
    monkeypatch.setattr(thread_engine, "ask_send_stamps", lambda sock: None)
    monkeypatch.setattr(gevent_engine, "ask_send_stamps", lambda sock: None)
    hold = _hold_after_send(engine, monkeypatch)
    server = SlowReader(read_after_s=0.0, head_after_s=0.0)
    (out,) = _send(engine, server.port, words=10)
    assert out.ok, out.error_detail
    ns = out.client_ns
    assert out.sent_stamp_source == "send"
    assert ns.headers_sent is not None and ns.response_headers is not None
    # the head's arrival: after the server began its write (the clock pair's conversion:
    # within 20 µs), well before the held thread took t1
    assert ns.response_headers >= server.heads[0] - 20_000
    assert ns.headers_sent - ns.response_headers > hold * 0.2e9
    assert out.sent_stamp_late
    assert clock_complete(ns, out.output_tokens, out.ok, out.wall_anchor_ns)


def _hold_after_send(engine: str, monkeypatch: pytest.MonkeyPatch) -> float:
    """Hold the sending thread 100 ms right after the request's send returned."""
    hold = 0.1
    if engine == "gevent":
        import gevent.socket as gsocket

        def held_sendall(self: Any, data: bytes, *args: Any) -> None:
            gsocket.socket.sendall(self, data, *args)
            time.sleep(hold)  # blocks the hub as well: no read meanwhile

        monkeypatch.setattr(gevent_engine._Conn, "sendall", held_sendall, raising=False)
    else:
        real_send = thread_engine._send_all

        async def held(*args: Any) -> None:
            await real_send(*args)
            time.sleep(hold)  # blocks the engine's loop: no read meanwhile

        monkeypatch.setattr(thread_engine, "_send_all", held)
    return hold


# --- the pieces --------------------------------------------------------------------------


def test_only_the_wanted_bytes_stamp_is_kept() -> None:
    tx = TxStamps()
    tx.sent = 300  # two requests of 100 and 200 bytes
    tx.take(99, 5_000, 4_000, 4_100)  # the first request's stamp, before `expect`
    tx.expect()
    assert tx.want == 299 and tx.at is None
    tx.take(99, 5_000, 4_000, 4_100)  # an earlier request's, read late: dropped
    assert tx.at is None
    tx.take(299, 9_000, 8_000, 8_100)  # wall - mono = 100: on the monotonic clock 8,900
    assert tx.at is None  # after the read that found it (8,000): the wall clock stepped
    tx.take(299, 8_000, 8_000, 8_100)
    assert tx.at == 7_900
    tx.take(299, 7_000, 8_000, 8_100)  # the first one found stays
    assert tx.at == 7_900
    assert sent_stamp(tx, 7_000, 8_500) == (7_900, "kernel")
    assert sent_stamp(tx, 8_000, 8_500) == (8_500, "send")  # before t0: not believed
    assert sent_stamp(None, 7_000, 8_500) == (8_500, "send")
    tx.sent = 2**32 + 10  # keys are 32 bits wide
    tx.expect()
    assert tx.want == 9


def test_an_error_queue_message_is_read_as_the_kernel_writes_it() -> None:
    ee = struct.pack("@IBBBBII", 42, txstamps.SO_EE_ORIGIN_TIMESTAMPING, 0, 0, 0, 0, 777)
    ts = struct.pack("@ll", 12, 345)
    anc = [(socket.SOL_SOCKET, txstamps.SO_TIMESTAMPNS, ts), (socket.IPPROTO_IP, 11, ee)]
    assert txstamps._stamp_of(anc) == (777, 12_000_000_345)
    # SCM_TIMESTAMPING alone (no SO_TIMESTAMPNS on the socket): its first stamp
    anc = [(socket.SOL_SOCKET, txstamps.SO_TIMESTAMPING, ts * 3), (socket.IPPROTO_IPV6, 25, ee)]
    assert txstamps._stamp_of(anc) == (777, 12_000_000_345)
    sched = struct.pack("@IBBBBII", 42, txstamps.SO_EE_ORIGIN_TIMESTAMPING, 0, 0, 0, 1, 777)
    assert txstamps._stamp_of([(socket.SOL_SOCKET, txstamps.SO_TIMESTAMPNS, ts),
                               (socket.IPPROTO_IP, 11, sched)]) is None  # fmt: skip
    assert txstamps._stamp_of([(socket.IPPROTO_IP, 11, ee)]) is None


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    srv = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    srv.close()
    yield client, peer
    client.close()
    peer.close()


def test_the_native_reader_reads_the_stamps_that_wake_it(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A stamp queued on a socket the native reader watches wakes its thread (an error
    to epoll): it reads the queue and keeps the stamp for the engine (`sent`)."""
    module = thread_loop._reader_module()
    if module is None:
        pytest.skip("the native reader is not built here (measure.native)")
    client, _peer = pair
    assert txstamps.ask_send_stamps(client) is not None
    reader = module.Reader("cl-test", 0)
    try:
        reader.watch(client.fileno(), False)
        before = time.clock_gettime_ns(time.CLOCK_REALTIME)
        client.send(b"x" * 100)
        client.send(b"y" * 50)
        after = time.clock_gettime_ns(time.CLOCK_REALTIME)
        deadline = time.monotonic() + 5
        got: list[tuple[int, int, int, int]] = []
        while len(got) < 2 and time.monotonic() < deadline:
            got += reader.sent(client.fileno())
            time.sleep(0.01)
        assert [key for key, *_ in got] == [99, 149]  # each send's last byte
        for _, stamp, mono, wall in got:
            assert before <= stamp <= after
            assert stamp - (wall - mono) <= mono
        with pytest.raises(BlockingIOError):  # the queue was read
            client.recvmsg(0, 256, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
    finally:
        reader.unwatch(client.fileno())
        reader.close()


def test_a_socket_counts_what_it_sends(pair: tuple[socket.socket, socket.socket]) -> None:
    client, peer = pair
    conn = thread_engine._Conn(fileno=client.detach())
    conn.tx = txstamps.ask_send_stamps(conn)
    assert conn.tx is not None
    conn.send(b"abc")
    conn.sendall(b"defg")  # sendall does not go through `send`: the engines use `send`
    assert peer.recv(16) == b"abcdefg"
    assert conn.tx.sent == 3
    conn.tx.sent = 7
    conn.tx.expect()
    conn.tx.drain(conn, SystemClock())
    assert conn.tx.at is not None  # the stamp of byte 6, the last of `sendall`'s
    conn.close()
