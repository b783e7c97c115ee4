"""measure.biotls against the standard library's own TLS server (a blocking SSLSocket in
a thread, on loopback): what the socket did not take is sent later, a whole response
arrives in order, the peer's close reads as b"", a certificate nobody vouches for fails
the handshake with ssl's own verification error, and a record read late carries the
kernel's receive time of its bytes, not the time of the late read."""

from __future__ import annotations

import functools
import json
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from calculet_load.measure.biotls import BioTLS
from calculet_load.measure.connections import Endpoint
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.outcome import Outcome, Timeouts
from calculet_load.measure.protocols import adapter_for
from calculet_load.measure.rxstamps import CMSG_SPACE, ask_kernel_stamps, kernel_ns
from calculet_load.measure.thread_engine import ThreadPool
from calculet_load.schema.access import TargetAccess
from tests.support.tlsproxy import Pki, make_pki

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("biotls"))


def _server(pki: Pki, handle: Callable[[ssl.SSLSocket], None]) -> Iterator[int]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.cert_file, pki.key_file)
    listener = socket.create_server(("127.0.0.1", 0))
    errors: list[BaseException] = []

    def serve() -> None:
        conn, _ = listener.accept()
        # no Nagle: a small record right after the session tickets would otherwise wait
        # for the client's delayed ACK (40 ms), and the kernel stamps say so
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            with ctx.wrap_socket(conn, server_side=True) as tls:
                handle(tls)
        except (ssl.SSLError, OSError) as exc:
            errors.append(exc)  # the untrusted certificate's handshake fails here
        finally:
            conn.close()  # a failed handshake leaves it open

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    thread.join(20)
    listener.close()


def _connect(port: int, ca_file: Path, sndbuf: int | None = None, stamps: bool = False) -> BioTLS:
    sock = socket.create_connection(("127.0.0.1", port))
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    if stamps:
        ask_kernel_stamps(sock)
    sock.setblocking(False)
    ctx = ssl.create_default_context(cafile=str(ca_file))
    return BioTLS(sock, ctx, "localhost", CMSG_SPACE if stamps else 0)


def _wait(conn: BioTLS, write: bool) -> None:
    r, w = ([], [conn.fileno()]) if write else ([conn.fileno()], [])
    assert select.select(r, w, [], 10) != ([], [], []), "the socket never became ready"


def _handshake(conn: BioTLS) -> None:
    while True:
        try:
            conn.do_handshake()
            return
        except ssl.SSLWantReadError:
            _wait(conn, False)
        except ssl.SSLWantWriteError:
            _wait(conn, True)


def _drain(conn: BioTLS) -> bytes:
    """What can be read now without waiting (up to the end of the stream)."""
    got = bytearray()
    while True:
        try:
            data = conn.recv(65536)
        except ssl.SSLWantReadError:
            return bytes(got)
        if not data:  # the echo server closes once it has echoed everything
            return bytes(got)
        got += data


def _recv_all(conn: BioTLS, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        try:
            data = conn.recv(65536)
        except ssl.SSLWantReadError:
            _wait(conn, False)
            continue
        assert data, f"EOF after {len(got)} of {n} bytes"
        got += data
    return bytes(got)


def test_a_large_write_is_sent_whole_and_its_echo_read_back(pki: Pki) -> None:
    size = 4 * 1024 * 1024
    payload = bytes(range(256)) * (size // 256)

    def echo(tls: ssl.SSLSocket) -> None:
        left = size
        while left:
            data = tls.recv(65536)
            if not data:
                return
            tls.sendall(data)
            left -= len(data)

    for port in _server(pki, echo):
        conn = _connect(port, pki.ca_file, sndbuf=4096)  # the socket takes little at a time
        _handshake(conn)
        view = memoryview(payload)
        deferred = 0
        got = bytearray()
        while view or not conn.flush():
            if view:
                try:
                    view = view[conn.send(view[:65536]) :]
                    continue
                except (ssl.SSLWantWriteError, BlockingIOError):
                    pass
            deferred += 1
            got += _drain(conn)  # the echo comes back meanwhile: take it, or both stall
            fd = conn.fileno()
            select.select([fd], [fd], [], 10)
        got += _recv_all(conn, size - len(got))
        conn.close()
        assert deferred > 0  # the path where the socket did not take everything ran
        assert bytes(got) == payload


def test_the_peers_close_reads_as_the_end(pki: Pki) -> None:
    def answer(tls: ssl.SSLSocket) -> None:
        assert tls.recv(100) == b"ping"
        tls.sendall(b"pong")
        tls.unwrap()  # a close_notify, then the TCP close

    for port in _server(pki, answer):
        conn = _connect(port, pki.ca_file)
        _handshake(conn)
        assert conn.send(b"ping") == 4 and conn.flush()
        assert _recv_all(conn, 4) == b"pong"
        for _ in range(100):  # the close_notify reads as b"" (not an error)
            try:
                assert conn.recv(100) == b""
                break
            except ssl.SSLWantReadError:
                _wait(conn, False)
        else:
            raise AssertionError("no end of stream")
        assert conn.pending() == 0
        conn.close()


def test_an_untrusted_certificate_fails_verification(pki: Pki) -> None:
    for port in _server(pki, lambda tls: None):
        conn = _connect(port, pki.other_ca_file)
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(conn)
        conn.close()


@pytest.mark.skipif(CMSG_SPACE == 0, reason="no SO_TIMESTAMPNS on this platform")
def test_a_record_read_late_carries_its_arrival_time(pki: Pki) -> None:
    sent: list[int] = []

    def answer(tls: ssl.SSLSocket) -> None:
        assert tls.recv(100) == b"ping"
        tls.sendall(b"pong")
        sent.append(time.monotonic_ns())  # the record is in the client's kernel by now
        tls.recv(100)  # until the client closes

    for port in _server(pki, answer):
        conn = _connect(port, pki.ca_file, stamps=True)
        _handshake(conn)
        assert conn.send(b"ping") == 4 and conn.flush()
        _wait(conn, False)
        time.sleep(0.1)  # a busy client: the record waits in the kernel for 100 ms
        assert _recv_all(conn, 4) == b"pong"
        read_ns, wall_ns = time.monotonic_ns(), time.time_ns()
        kernel = kernel_ns(conn.take_stamp(), read_ns, wall_ns, 0)
        conn.close()
        assert kernel is not None
        # within a few ms of the server's write, though it was read 100 ms later
        assert -1_000_000 < sent[0] - kernel < 5_000_000, (sent[0] - kernel) / 1e6
        assert read_ns - kernel > 90_000_000, (read_ns - kernel) / 1e6


def test_the_engine_reads_a_large_body_left_in_the_tls_buffers(pki: Pki) -> None:
    """A read takes at most 256 KiB of plaintext (measure.rxstamps `tls_drain`); what the
    TLS object already holds then is announced by no readiness of the socket when the
    whole response has arrived. The engine reads it at once (it looks at `pending()`
    after each read), rather than waiting for the idle timeout: bodies around that size
    over one kept-alive connection all complete, each in well under a second."""
    sizes = [250_000 + 9_000 * i for i in range(12)]  # 250-349 KB: the cap's edges

    def serve(tls: ssl.SSLSocket) -> None:
        for n in sizes:
            head = b""
            while b"\r\n\r\n" not in head:
                head += tls.recv(65536)
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += tls.recv(65536)
            text = "w" * n
            answer = json.dumps(
                {"id": "b", "object": "text_completion", "model": "m",
                 "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12}}
            ).encode()  # fmt: skip
            tls.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer)
            )
        tls.recv(100)  # the connection stays open until the client closes it

    for port in _server(pki, serve):
        took = _ask_one_by_one(port, pki.ca_file, len(sizes))
        assert max(took) < 2.0, took


def _ask_one_by_one(port: int, ca_file: Path, n: int) -> list[float]:
    """`n` non-streamed requests in turn on the engine, over one TLS connection to
    `port`: how long each took (s); each must succeed."""
    access = TargetAccess(f"https://localhost:{port}", ca_file=str(ca_file))
    pool = ThreadPool(Endpoint(access), 4)
    adapter = adapter_for("openai-completions")
    body = adapter.body([1, 2, 3, 4], 8, stream=False, model="m", temperature=0.0,
                        seed=None, ignore_eos=True)  # fmt: skip
    timeouts = Timeouts(idle_s=20.0)

    def one(i: int) -> Outcome:
        return pool.execute(adapter, body, f"big-{i}", stream=False, timeouts=timeouts)

    took = []
    try:
        for i in range(n):
            start = time.monotonic()
            out = run_in_greenlet(functools.partial(one, i))
            took.append(time.monotonic() - start)
            assert out.ok, (i, out.error_class, out.error_detail)
            assert out.connection_reused == (i > 0)
    finally:
        pool.close()
    return took


class _NeedsPeerFirst:
    """An SSLObject stand-in whose write needs the peer's bytes first (as in a TLS 1.2
    renegotiation): SSLWantReadError until its incoming buffer holds something."""

    def __init__(self, incoming: ssl.MemoryBIO) -> None:
        self.incoming = incoming
        self.written = b""

    def write(self, data: bytes) -> int:
        if not self.incoming.pending:
            raise ssl.SSLWantReadError("needs the peer")
        self.written += bytes(data)
        return len(data)


def test_a_write_that_needs_the_peer_reads_the_socket_first(pki: Pki) -> None:
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    ctx = ssl.create_default_context(cafile=str(pki.ca_file))
    conn = BioTLS(ours, ctx, "localhost")
    stub = _NeedsPeerFirst(conn._in)
    conn._obj = stub  # type: ignore[assignment]
    with pytest.raises(ssl.SSLWantReadError):  # nothing from the peer yet: wait for it
        conn.send(b"request")
    peer.sendall(b"\x16\x03\x03")  # the peer's bytes arrive
    assert conn.send(b"request") == 7  # taken into the TLS buffer, then the write went on
    assert stub.written == b"request"
    peer.close()
    conn.close()
