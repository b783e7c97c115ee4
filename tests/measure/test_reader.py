"""The thread engine's native reader (calculet_load/measure/reader.c): each read of a
watched socket made in its own thread, kept with its stamps in order, handed to the
engine's loop when the response must be seen; and the engine reading plain sockets
through it (tests/measure/test_hostile.py runs every hostile response through it too).
"""

from __future__ import annotations

import errno
import itertools
import os
import select
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest

from calculet_load.measure import native, thread_loop
from calculet_load.measure.connections import Endpoint
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.protocols import adapter_for
from calculet_load.measure.rxstamps import ask_kernel_stamps, kernel_wall_ns
from calculet_load.measure.thread_engine import ThreadPool
from calculet_load.measure.thread_loop import LoopThread
from calculet_load.measure.threads import READER_THREAD
from tests.measure.test_hostile import CHUNKED_HEAD, PATIENT, chunk, llama_event
from tests.support.hostile import Sleep, serve

pytestmark = pytest.mark.timeout(30)

try:
    from calculet_load.measure import _reader  # type: ignore[attr-defined]
except ImportError:  # not built: scripts/setup builds it (measure.native)
    _reader = None

needs_reader = pytest.mark.skipif(
    _reader is None, reason=f"the native reader is not built: {native.STATE}"
)


def test_the_reader_is_built_where_the_compiled_modules_are() -> None:
    """scripts/setup builds it with them (one stamp): on with them, or off with them."""
    assert (_reader is not None) == native.STATE.startswith("on"), native.STATE


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A loopback TCP connection: (the client's non-blocking end, asking for the
    kernel's receive times; the server's end)."""
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    srv.close()
    cli.setblocking(False)
    ask_kernel_stamps(cli)
    try:
        yield cli, conn
    finally:
        cli.close()
        conn.close()


@pytest.fixture
def reader() -> Iterator[Any]:
    if _reader is None:
        pytest.skip(f"the native reader is not built: {native.STATE}")
    r = _reader.Reader()
    try:
        yield r
    finally:
        r.close()


def _told(reader: Any, within_s: float) -> list[int]:
    """The fds `ready` names once the reader's eventfd is readable within `within_s`, else
    []."""
    readable, _, _ = select.select([reader.fileno()], [], [], within_s)
    return reader.ready() if readable else []


def test_each_read_comes_in_order_with_its_kernel_receive_time(reader: Any, pair: Any) -> None:
    cli, srv = pair
    reader.watch(cli.fileno(), False)
    reads = []
    for part in (b"HTTP/1.1 200 OK\r\n", b"one", b"two"):
        before = time.monotonic_ns()
        srv.sendall(part)
        assert _told(reader, 5.0) == [cli.fileno()]  # eager: every read is told
        (read,) = reader.take(cli.fileno())
        after = time.monotonic_ns()
        data, mono, wall, stamp, err = read
        assert (data, err) == (part, 0)
        assert before <= mono <= after
        assert abs(wall - time.time_ns()) < 5e9
        # the kernel's receive time, moved onto the monotonic clock as the engine does:
        # after the send began, not after the read returned
        k = kernel_wall_ns(stamp, mono, wall, before)
        assert k is not None and before <= k <= mono, (before, stamp, mono)
        reads.append(mono)
    assert reads == sorted(reads)
    assert reader.take(cli.fileno()) == []  # taken once


def test_lazy_reads_are_told_at_the_response_end_and_keep_their_own_times(
    reader: Any, pair: Any
) -> None:
    cli, srv = pair
    reader.watch(cli.fileno(), True)
    events = [chunk(llama_event(n)) for n in range(1, 4)]
    for ev in events:
        srv.sendall(ev)
        time.sleep(0.03)  # one read each
    assert _told(reader, 0.05) == []  # no end yet: nothing told
    srv.sendall(b"0\r\n\r\n")  # the last chunk
    assert _told(reader, 5.0) == [cli.fileno()]
    reads = reader.take(cli.fileno())
    assert b"".join(r[0] for r in reads) == b"".join(events) + b"0\r\n\r\n"
    assert len(reads) == 4  # each kept as it was read, 30 ms apart
    monos = [r[1] for r in reads]
    assert all(b - a >= 20_000_000 for a, b in itertools.pairwise(monos)), monos


def test_more_than_the_cap_waiting_is_told_without_an_end(reader: Any, pair: Any) -> None:
    cli, srv = pair
    reader.watch(cli.fileno(), True)
    sent = 0
    while sent <= _reader.LAZY_MAX_BYTES:
        srv.sendall(b"x" * 65536)
        sent += 65536
    got = b""
    while len(got) < sent:
        assert _told(reader, 5.0) == [cli.fileno()]
        got += b"".join(r[0] for r in reader.take(cli.fileno()))
        if len(got) < sent:
            srv.sendall(b"\r\n\r\n")  # what is left ends as a response would
            sent += 4
    assert len(got) == sent


def test_the_end_of_the_stream_and_a_reset_are_told_and_end_the_reads(
    reader: Any, pair: Any
) -> None:
    cli, srv = pair
    reader.watch(cli.fileno(), True)
    srv.sendall(b"data")
    srv.shutdown(socket.SHUT_WR)
    assert _told(reader, 5.0) == [cli.fileno()]  # lazy, but the stream ended
    reads = reader.take(cli.fileno())
    assert [(r[0], r[4]) for r in reads] == [(b"data", 0), (b"", 0)]
    reader.unwatch(cli.fileno())

    other = socket.create_server(("127.0.0.1", 0))
    c2 = socket.create_connection(other.getsockname())
    s2, _ = other.accept()
    other.close()
    try:
        c2.setblocking(False)
        c2.sendall(b"unread by the peer")  # its close then resets the connection
        time.sleep(0.05)
        reader.watch(c2.fileno(), True)
        s2.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s2.close()
        assert _told(reader, 5.0) == [c2.fileno()]
        ((data, _, _, _, err),) = reader.take(c2.fileno())
        assert (data, err) == (b"", errno.ECONNRESET)
        reader.unwatch(c2.fileno())
    finally:
        c2.close()


def test_a_socket_is_watched_once_and_its_reads_end_with_unwatch(reader: Any, pair: Any) -> None:
    cli, srv = pair
    reader.watch(cli.fileno(), False)
    with pytest.raises(ValueError, match="watched already"):
        reader.watch(cli.fileno(), False)
    srv.sendall(b"first")
    assert _told(reader, 5.0) == [cli.fileno()]
    reader.unwatch(cli.fileno())  # its reads not taken are dropped
    assert reader.take(cli.fileno()) == []
    srv.sendall(b"second")
    assert _told(reader, 0.1) == []  # not read: the socket keeps it
    assert cli.recv(100) == b"second"
    reader.watch(cli.fileno(), False)  # a kept-alive connection's next response
    srv.sendall(b"third")
    assert _told(reader, 5.0) == [cli.fileno()]
    assert [r[0] for r in reader.take(cli.fileno())] == [b"third"]


def test_the_reader_names_its_thread(reader: Any) -> None:
    names = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f.read().strip())
        except OSError:
            continue
    assert READER_THREAD in names


@needs_reader
def test_dense_reads_are_made_in_passes_each_with_its_own_kernel_receive_time() -> None:
    """Coalescing: 48 sockets each sent a line every 40 ms (1.2 sends a ms in all) are read
    in passes 4 ms apart, several sockets a pass, rather than one wake-up per
    read; each send is still a read of its own (its socket's next send comes later than
    a pass), and each read's kernel stamp is its bytes' arrival: after it was sent, not
    when the pass read it."""
    coalesce_ns, sockets, gap_s, rounds = 4_000_000, 48, 0.04, 10
    reader = _reader.Reader(coalesce_ns=coalesce_ns)
    srv = socket.create_server(("127.0.0.1", 0), backlog=sockets)
    pairs = []
    try:
        for _ in range(sockets):
            cli = socket.create_connection(srv.getsockname())
            conn, _ = srv.accept()
            cli.setblocking(False)
            ask_kernel_stamps(cli)
            pairs.append((cli, conn))
            reader.watch(cli.fileno(), True)  # lazy: nothing told, all kept
        sent: dict[int, list[int]] = {cli.fileno(): [] for cli, _ in pairs}
        start = time.monotonic()
        for r in range(rounds):
            for i, (cli, conn) in enumerate(pairs):
                at = start + (r + i / sockets) * gap_s
                while (left := at - time.monotonic()) > 0:
                    time.sleep(left)
                sent[cli.fileno()].append(time.monotonic_ns())
                conn.sendall(b"r%d\n" % r)
        time.sleep(0.05)
        reads = {fd: reader.take(fd) for fd in sent}
    finally:
        reader.close()
        srv.close()
        for cli, conn in pairs:
            cli.close()
            conn.close()
    monos = []
    for fd, taken in reads.items():
        # one read a send, in order, each stamped between its send and its read
        assert [r[0] for r in taken] == [b"r%d\n" % r for r in range(rounds)], fd
        for (_data, mono, wall, stamp, err), before in zip(taken, sent[fd], strict=True):
            k = kernel_wall_ns(stamp, mono, wall, before)
            assert err == 0 and k is not None and before <= k <= mono, (before, k, mono)
        monos += [r[1] for r in taken]
    # a pass's reads are made one after another; passes are a sleep apart
    monos.sort()
    passes = 1 + sum(b - a > 300_000 for a, b in itertools.pairwise(monos))
    assert passes * 2 <= len(monos), (passes, len(monos))


def _stream(events: int, gap_s: float) -> list[Any]:
    script: list[Any] = [CHUNKED_HEAD]
    for n in range(1, events + 1):
        script += [chunk(llama_event(n, f" w{n}")), Sleep(gap_s)]
    return [*script, chunk(llama_event(events, stop=True)), b"0\r\n\r\n"]


def _request(pool: ThreadPool, request_id: str) -> Any:
    adapter = adapter_for("llama")
    body = adapter.body("Once", 32, stream=True, model=None, temperature=0.0, seed=None,
                        ignore_eos=False)  # fmt: skip
    return run_in_greenlet(
        lambda: pool.execute(adapter, body, request_id, stream=True, timeouts=PATIENT)
    )


@needs_reader
def test_the_engine_reads_a_stream_natively_with_the_same_outcome_as_on_its_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same stream, read by the native reader and on the engine's loop: the same
    tokens, text, counts and reuse; each token stamped at its own arrival either way (the
    server's 20 ms gaps)."""
    engine = LoopThread()
    calls: list[str] = []
    real = engine.reader

    class Spy:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(real, name)

    engine.reader = Spy()
    outs = {}
    with serve(_stream(5, 0.02), _stream(5, 0.02)) as server:
        for native_reads in (True, False):
            monkeypatch.setattr(thread_loop, "READ_NATIVELY", native_reads)
            pool = ThreadPool(Endpoint(server.url), 2, engine=engine)
            try:
                outs[native_reads] = _request(pool, f"req-{native_reads}")
            finally:
                pool.close()
            if native_reads:
                assert {"watch", "lazy", "take", "unwatch"} <= set(calls), calls
                seen = len(calls)
            else:
                assert len(calls) == seen  # on the loop: the reader is not asked
    a, b = outs[True], outs[False]
    assert a.ok and b.ok, (a.error_detail, b.error_detail)
    for field in ("output_tokens", "server_total", "token_hash", "finish_reason", "events",
                  "stamp_source", "http_status"):  # fmt: skip
        assert getattr(a, field) == getattr(b, field), field
    assert a.stamp_source == "kernel"
    for out in (a, b):
        arrivals = [e.arrival_ns for e in out.token_events]
        gaps = [y - x for x, y in itertools.pairwise(arrivals)]
        assert len(gaps) == 4 and min(gaps) >= 15_000_000, gaps


@needs_reader
def test_a_forked_child_lets_go_of_its_parents_reader() -> None:
    """A fork's child has no reader thread: dropping the copy neither waits for that thread
    nor takes a lock its parent's thread may have held (LoopThread.shared makes the child
    its own engine)."""
    r = _reader.Reader()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when its copy let go and a new reader works
        code = 1
        try:
            r.close()  # what dropping it does: a hang here fails the test (its timeout)
            fresh = _reader.Reader()
            fresh.close()
            code = 0
        finally:
            os._exit(code)
    r.close()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@needs_reader
def test_a_socket_the_reader_cannot_take_is_read_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = LoopThread()
    real = engine.reader

    class Refuses:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def watch(self, fd: int, lazy: bool) -> None:
            raise OSError(errno.ENOMEM, "no room")

    engine.reader = Refuses()
    monkeypatch.setattr(thread_loop, "READ_NATIVELY", True)
    with serve(_stream(3, 0.01)) as server:
        pool = ThreadPool(Endpoint(server.url), 1, engine=engine)
        try:
            out = _request(pool, "req-loop")
        finally:
            pool.close()
    assert out.ok, out.error_detail
    assert (out.output_tokens, out.stamp_source) == (3, "kernel")


def test_the_coalescing_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(thread_loop.READ_COALESCE_ENV, "250")
    assert thread_loop._coalesce_us() == 250
    for bad in ("-1", "0.5", "2000000", "soon"):
        monkeypatch.setenv(thread_loop.READ_COALESCE_ENV, bad)
        with pytest.raises(ValueError, match=thread_loop.READ_COALESCE_ENV):
            thread_loop._coalesce_us()
    if _reader is not None:
        with pytest.raises(ValueError, match="coalesce_ns"):
            _reader.Reader(coalesce_ns=-1)
