"""The client's chunked-body fast path (measure.chunked.ChunkedDecoder) decodes as h11 does.

Event streams are read past h11 once the head is parsed (h11's per-chunk
events cost a sixth of a worker's CPU); these cases, each split at every byte, must give
the same body and the same verdict (complete, waiting for more, or refused) as h11.
"""

from __future__ import annotations

import h11
import pytest

from calculet_load.measure.chunked import ChunkedDecoder

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
CASES = {
    "plain": b"5\r\ndata:\r\n3\r\n 1\n\r\n0\r\n\r\n",
    "upper-hex-and-extension": b"A;name=value\r\n0123456789\r\n0\r\n\r\n",
    "whitespace-after-size": b"2 \t\r\nab\r\n0\r\n\r\n",
    "trailers": b"2\r\nab\r\n0\r\nX-Done: 1\r\nY: 2\r\n\r\n",
    "bad-size": b"zz\r\nab\r\n0\r\n\r\n",
    "bad-footer": b"2\r\nabXY0\r\n\r\n",
    "size-too-long": b"0" * 21 + b"2\r\nab\r\n0\r\n\r\n",
    "bad-trailer": b"2\r\nab\r\n0\r\nnot a header\r\n\r\n",
    "unfinished": b"5\r\ndat",
    "huge-chunk-header": b"1;" + b"x" * 20000,
}


def _h11(body: bytes, cuts: list[int]) -> tuple[bytes, str]:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    got = b""
    pieces = [HEAD] + [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    try:
        for piece in pieces:
            if not piece:
                continue  # b"" would tell h11 the peer closed
            conn.receive_data(piece)
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    break
                if isinstance(ev, h11.Data):
                    got += ev.data
                if isinstance(ev, h11.EndOfMessage):
                    return got, "done"
    except h11.RemoteProtocolError:
        return got, "refused"
    return got, "more"


def _ours(body: bytes, cuts: list[int]) -> tuple[bytes, str]:
    dec = ChunkedDecoder(b"")
    got = b""
    try:
        for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
            got += dec.feed(body[a:b])
            if dec.done:
                return got, "done"
        if dec.error is not None:
            dec.feed(b"")  # the client reads on, and meets the violation
    except ValueError:
        return got, "refused"
    return got, "more"


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_split_decodes_as_h11(name: str) -> None:
    body = CASES[name]
    step = max(1, len(body) // 200)  # every byte of the short cases
    for cut in range(0, len(body) + 1, step):
        for cuts in ([cut], [cut, min(cut + 3, len(body))]):
            assert _ours(body, cuts) == _h11(body, cuts), (name, cuts)


def test_bytes_after_the_last_chunk_are_kept_not_decoded() -> None:
    dec = ChunkedDecoder(b"")
    assert dec.feed(b"2\r\nab\r\n0\r\n\r\nHTTP/1.1") == b"ab"
    assert dec.done and dec.rest == b"HTTP/1.1"  # the connection is then not reused
