"""HTTP/1.1 chunked transfer decoding for the client's event streams (measure.exchange
reads a chunked body with this instead of h11 past the response head: one pass over the
bytes, no per-chunk event objects). Pure: no I/O, no clock."""

from __future__ import annotations

import re

__all__ = ["ChunkedDecoder"]

_CHUNK_HEADER = re.compile(rb"(?P<size>[0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")
_TRAILER_LINE = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+:.*")
_MAX_INCOMPLETE = 16 * 1024  # h11's limit on a head, chunk header or trailer


class ChunkedDecoder:
    """HTTP/1.1 chunked transfer decoding (RFC 9112 §7.1) as h11 0.14-0.16 decodes it:
    chunk-size in 1-20 hex digits, extensions ignored, each chunk's data followed by
    CRLF, trailer lines after the last chunk up to a blank line, at most 16 KiB of an
    unfinished header or trailer. A violation raises ValueError with h11's message."""

    __slots__ = ("discard", "done", "error", "left", "rest", "trailer")

    def __init__(self, rest: bytes) -> None:
        self.rest = rest  # bytes received and not decoded yet
        self.left = 0  # data bytes left in the current chunk
        self.discard = b""  # the CRLF after a chunk's data, still to come
        self.trailer = False
        self.done = False
        self.error: ValueError | None = None  # raised by the next feed (see below)

    def feed(self, data: bytes) -> bytes:
        """The body bytes `data` completes (after what was held back). A violation after
        some body bytes returns those first and raises at the next call, as h11 hands
        over each chunk's data before it reads what follows."""
        if self.error is not None:
            raise self.error
        out: list[bytes] = []
        try:
            self._decode(self.rest + data if self.rest else data, out)
        except ValueError as exc:
            if not out:
                raise
            self.error = exc
        return out[0] if len(out) == 1 else b"".join(out)

    @property
    def between(self) -> bool:
        """Between chunks with nothing held: the next bytes start a chunk's size line, and
        a caller may read whole chunks from them itself (then `feed` the rest)."""
        return not (
            self.rest or self.left or self.discard or self.trailer or self.done or self.error
        )

    def _decode(self, buf: bytes, out: list[bytes]) -> None:
        pos, n = 0, len(buf)
        while pos < n and not self.done:
            if self.discard:
                take = buf[pos : pos + len(self.discard)]
                if take != self.discard[: len(take)]:
                    raise ValueError(
                        f"malformed chunk footer: {take!r} (expected {self.discard!r})"
                    )
                self.discard = self.discard[len(take) :]
                pos += len(take)
                continue
            if self.trailer:
                if buf.startswith(b"\r\n", pos) or buf.startswith(b"\n", pos):
                    pos += 2 if buf[pos] == 0x0D else 1
                    self.done = True
                    break
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                for line in buf[pos:end].split(b"\r\n"):
                    if not _TRAILER_LINE.fullmatch(line):
                        raise ValueError(f"illegal header line: {line!r}")
                pos = end + 4
                self.done = True
                break
            if self.left == 0:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                line = buf[pos : eol + 2]
                m = _CHUNK_HEADER.fullmatch(line)
                if m is None:
                    raise ValueError(f"illegal chunk header: {line!r}")
                pos = eol + 2
                self.left = int(m["size"], 16)
                if self.left == 0:
                    self.trailer = True
                continue
            size = min(self.left, n - pos)
            out.append(buf[pos : pos + size])
            pos += size
            self.left -= size
            if self.left == 0:
                self.discard = b"\r\n"
        self.rest = buf[pos:]
        if not self.done and (self.left == 0 or self.trailer) and len(self.rest) > _MAX_INCOMPLETE:
            raise ValueError("Receive buffer too long")
