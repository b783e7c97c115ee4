"""TLS for the thread I/O engine: a client connection over a plain non-blocking socket,
driven through the standard library's `ssl.SSLObject` and two memory BIOs.

Why not `SSLContext.wrap_socket`: in a Locust process gevent has monkey-patched the ssl
module, and the standard library's `SSLSocket._create` names the module's `SSLSocket`
(gevent's class after the patch) in its `super()` call, so wrapping an unpatched socket
fails with "super(type, obj): obj must be an instance or subtype of type". An SSLObject
never touches a socket: this class moves the bytes between the socket and the BIOs
itself, the same in a patched process and an unpatched one.

Its reads of the socket can carry the kernel's receive time (`cmsg_space`: recvmsg with
SO_TIMESTAMPNS asked for on the socket): `take_stamp` gives the control messages of the
last read that brought bytes, so the plaintext those bytes completed is stamped with
their arrival, as a plain connection's reads are (measure.rxstamps `Reads.receive`).
Or another reads the socket (the thread engine's native reader, with the kernel's time
of each read) and hands the bytes to `feed`, which gives the plaintext they completed:
either way a plaintext byte's stamp is the arrival of the last TLS bytes of its record.

It has the part of SSLSocket's non-blocking interface the engine uses: `do_handshake`,
`send`, `recv` and `pending` raise `ssl.SSLWantReadError` / `SSLWantWriteError` (or
BlockingIOError) where a non-blocking SSLSocket would, `recv` returns b"" at the end of
the stream (a close_notify, or the peer's FIN without one, as `suppress_ragged_eofs`),
and the certificate and handshake errors are ssl's own.
"""

from __future__ import annotations

import socket
import ssl

_READ = 65536


class BioTLS:
    """One TLS client connection on `sock` (connected, non-blocking)."""

    __slots__ = ("_anc", "_in", "_obj", "_out", "_unsent", "cmsg_space", "sock")

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        server_hostname: str,
        cmsg_space: int = 0,
    ) -> None:
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._in, self._out, server_hostname=server_hostname)
        self._unsent = b""  # TLS bytes written by the object, not yet taken by the socket
        self.cmsg_space = cmsg_space  # > 0: read with recvmsg, keep the control messages
        self._anc: list[tuple[int, int, bytes]] = []

    def take_stamp(self) -> list[tuple[int, int, bytes]]:
        """The control messages of the last read that brought bytes since the last call."""
        anc, self._anc = self._anc, []
        return anc

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    # tls_drain (measure.rxstamps) sets a zero timeout around its reads: these never wait
    def gettimeout(self) -> float:
        return 0.0

    def settimeout(self, value: float | None) -> None:
        pass

    def pending(self) -> int:
        """Plaintext held by the TLS object, and TLS bytes read but not yet decrypted."""
        return self._obj.pending() + self._in.pending

    def flush(self) -> bool:
        """Send what the TLS object wrote; True when nothing is left to send."""
        if self._out.pending:
            self._unsent += self._out.read()
        while self._unsent:
            try:
                sent = self.sock.send(self._unsent)
            except BlockingIOError:
                return False
            self._unsent = self._unsent[sent:]
        return True

    def _fill(self) -> bool:
        """Read what the socket holds into the TLS object; False at the peer's end."""
        # BlockingIOError: nothing yet
        if self.cmsg_space:
            data, anc, _, _ = self.sock.recvmsg(_READ, self.cmsg_space)
            if data:
                self._anc = anc
        else:
            data = self.sock.recv(_READ)
        if not data:
            self._in.write_eof()
            return False
        self._in.write(data)
        return True

    def do_handshake(self) -> None:
        while True:
            try:
                self._obj.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                done = False
            if not self.flush():
                raise ssl.SSLWantWriteError("the handshake's bytes wait for the socket")
            if done:
                return
            try:
                more = self._fill()
            except BlockingIOError:
                raise ssl.SSLWantReadError("the handshake waits for the peer") from None
            if not more:
                raise ssl.SSLEOFError("EOF occurred in violation of protocol (handshake)")

    def send(self, data: bytes | memoryview) -> int:
        """Encrypt `data` and send it; how many of its bytes were taken. Bytes the socket
        did not take yet are sent first by the next call (or `flush`). A write that needs
        the peer's bytes first (a TLS 1.2 renegotiation) takes what the socket holds and
        tries again, or raises SSLWantReadError until the socket has more."""
        if not self.flush():
            raise ssl.SSLWantWriteError("earlier bytes wait for the socket")
        while True:
            try:
                taken = self._obj.write(data)
                break
            except ssl.SSLWantReadError:
                if not self.flush():
                    raise ssl.SSLWantWriteError("the TLS bytes wait for the socket") from None
                try:
                    more = self._fill()
                except BlockingIOError:
                    raise ssl.SSLWantReadError("the write waits for the peer") from None
                if not more:
                    raise ssl.SSLEOFError("EOF occurred in violation of protocol") from None
        self.flush()
        return taken

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        """TLS bytes another read from the socket (b"": the peer closed) into the TLS
        object: the plaintext they complete (none while a record is still coming), and
        whether the stream ended. A certificate or record error is ssl's own."""
        if data:
            self._in.write(data)
        else:
            self._in.write_eof()
        chunks = []
        closed = False
        while True:
            try:
                chunk = self._obj.read(_READ)
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                closed = True
                break
            if not chunk:
                closed = True
                break
            chunks.append(chunk)
        self.flush()  # what reading wrote (a key update's answer)
        return b"".join(chunks), closed

    def recv(self, size: int) -> bytes:
        """Plaintext, up to `size` bytes; b"" at the end of the stream."""
        while True:
            try:
                data = self._obj.read(size)
            except ssl.SSLWantReadError:
                try:
                    if self._fill():
                        continue
                except BlockingIOError:
                    raise ssl.SSLWantReadError("no whole TLS record yet") from None
                return b""  # the peer's FIN without a close_notify
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            self.flush()  # what reading wrote (a key update's answer)
            return data
