"""A packet capture as the witness of a client's stamps: tcpdump on loopback, the TCP
streams put back together, each request and response found in them by its
`X-Request-Id`, and each record's stamp set against the packet that carried the byte
completing it.

What is compared with what (Linux, loopback):

- tcpdump's time of a packet on `lo` is the time the packet tap saw it. libpcap keeps
  one copy of each loopback packet, the one `lo` receives: its time is the
  `skb->tstamp` that `netif_rx` gave it inside `loopback_xmit`. The kernel's receive
  time of a read (SO_TIMESTAMPNS) is that same `skb->tstamp` of the last packet the read
  copied: a kernel receive stamp and its packet differ only by the client's conversion
  of the wall clock onto the monotonic one (`clock_pair`, within 20 µs; measured about
  1 µs), unless the read also took a later packet.
- the kernel's transmit time of the request's last byte (SO_TIMESTAMPING, software TX:
  `skb_tx_timestamp` in `loopback_xmit`) is taken a few µs before the same packet's
  `netif_rx`: a kernel t1 comes out slightly before its packet.
- a user-space stamp (t1 taken when the send returned, a read's stamp taken when the
  read returned) can only come after its packet: the capture bounds it from below.

The byte completing a stamp: t1, the request's last byte (its body's last, by its
Content-Length); t2, the last byte of the response's head (CRLF CRLF); an event (t3, t4,
t5, each token event), the last byte of the blank line that ends it; t6, the last byte
of the response (the last chunk's CRLF CRLF). t0 has no packet: it is taken before the
request's first byte is written, so TTFH and TTFT against the packets are measured from
the request's first packet (their error includes t0's lead, by definition).

Over TLS (`tls_keys`: the client's key log, SSLKEYLOGFILE's format, TLS 1.3) each
direction's records are decrypted, and each plaintext byte takes the time of the packet
that carried the last byte of its TLS record: a record is decrypted whole, so that is
the byte that completes what it carries.
"""

from __future__ import annotations

import bisect
import contextlib
import re
import signal
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from cryptography.exceptions import InvalidTag

PCAP_NS = 0xA1B23C4D  # a pcap file whose packet times are in ns (tcpdump's -j nano)
PCAP_US = 0xA1B2C3D4
LINK_ETHERNET, LINK_RAW, LINK_LINUX_SLL = 1, 101, 113


# ------------------------------------------------------------------- tcpdump
class Capture:
    """tcpdump on `lo` for the TCP port `port`, whole packets, nanosecond times, into
    `path`; `stop()` returns how many packets the kernel dropped (the capture is a
    witness only when none was)."""

    def __init__(self, path: Path, port: int, tcpdump: str = "tcpdump") -> None:
        self.path = path
        cmd = [
            tcpdump, "-i", "lo", "-s", "0", "-B", "65536", "-U", "-n",
            "--time-stamp-precision=nano", "-w", str(path), f"tcp port {port}",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline().decode()  # "listening on lo, ..." once ready
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"tcpdump did not start: {line.strip()!r}")
        self.stats = ""

    def stop(self) -> int:
        time.sleep(0.2)  # the last packets through the tap
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=30)
        self.stats = err.decode()
        found = re.search(r"(\d+) packets dropped by kernel", self.stats)
        return int(found[1]) if found else -1


# ---------------------------------------------------------------- pcap, TCP
@dataclass(slots=True)
class Packet:
    ts_ns: int  # the capture's time (CLOCK_REALTIME, ns)
    src: tuple[str, int]
    dst: tuple[str, int]
    seq: int
    flags: int
    payload: bytes


def read_pcap(path: Path) -> Iterator[Packet]:
    """The TCP packets of a pcap file (IPv4 and IPv6; Ethernet, raw IP or Linux SLL)."""
    data = path.read_bytes()
    magic = struct.unpack_from("<I", data)[0]
    order = "<"
    if magic not in (PCAP_NS, PCAP_US):
        order = ">"
        magic = struct.unpack_from(">I", data)[0]
    if magic not in (PCAP_NS, PCAP_US):
        raise ValueError(f"{path}: not a pcap file")
    scale = 1 if magic == PCAP_NS else 1000
    link = struct.unpack_from(order + "I", data, 20)[0]
    pos = 24
    head = struct.Struct(order + "IIII")
    while pos + 16 <= len(data):
        sec, frac, caplen, _ = head.unpack_from(data, pos)
        pos += 16
        frame = data[pos : pos + caplen]
        pos += caplen
        ts = sec * 1_000_000_000 + frac * scale
        if link == LINK_ETHERNET:
            ether, ip = struct.unpack_from("!H", frame, 12)[0], frame[14:]
        elif link == LINK_LINUX_SLL:
            ether, ip = struct.unpack_from("!H", frame, 14)[0], frame[16:]
        elif link == LINK_RAW:
            ether, ip = (0x0800 if frame[0] >> 4 == 4 else 0x86DD), frame
        else:
            raise ValueError(f"{path}: link type {link} not read")
        packet = _tcp(ether, ip, ts)
        if packet is not None:
            yield packet


def _tcp(ether: int, ip: bytes, ts: int) -> Packet | None:
    if ether == 0x0800:
        if ip[9] != 6:
            return None
        ihl, total = (ip[0] & 15) * 4, struct.unpack_from("!H", ip, 2)[0]
        src, dst = ".".join(map(str, ip[12:16])), ".".join(map(str, ip[16:20]))
        seg = ip[ihl:total]
    elif ether == 0x86DD:
        if ip[6] != 6:  # no extension headers on loopback
            return None
        length = struct.unpack_from("!H", ip, 4)[0]
        src, dst = ip[8:24].hex(), ip[24:40].hex()
        seg = ip[40 : 40 + length]
    else:
        return None
    sport, dport, seq = struct.unpack_from("!HHI", seg)
    off, flags = seg[12] >> 4, seg[13]
    return Packet(ts, (src, sport), (dst, dport), seq, flags, bytes(seg[off * 4 :]))


SYN = 0x02


@dataclass
class Stream:
    """One direction of one TCP connection: its bytes in order and, for each byte, the
    time of the first packet that carried it (a retransmission adds no time)."""

    isn: int | None = None
    syn_ns: int | None = None  # the time of its SYN (a connection's first packet)
    data: bytearray = field(default_factory=bytearray)
    starts: list[int] = field(default_factory=list)  # offset of each packet's first new byte
    times: list[int] = field(default_factory=list)
    gaps: int = 0  # bytes the capture missed (a hole): the stream is not a witness

    def add(self, p: Packet) -> None:
        if p.flags & SYN:
            self.isn, self.syn_ns = p.seq, p.ts_ns
            return
        if not p.payload:
            return
        if self.isn is None:  # the capture began inside the connection
            self.isn = (p.seq - 1) & 0xFFFFFFFF
        off = (p.seq - self.isn - 1) & 0xFFFFFFFF
        end = off + len(p.payload)
        have = len(self.data)
        if end <= have:
            return
        if off > have:
            self.gaps += off - have
            self.data += bytes(off - have)
            have = off
        self.starts.append(have)
        self.times.append(p.ts_ns)
        self.data += p.payload[have - off :]

    def time_at(self, offset: int) -> int:
        """The capture's time of the packet that carried the byte at `offset`."""
        return self.times[bisect.bisect_right(self.starts, offset) - 1]


Ends = tuple[tuple[str, int], tuple[str, int]]


def streams(path: Path) -> dict[Ends, list[Stream]]:
    """Every direction of every connection in the capture, by (source, destination): a
    port used again by a later connection starts a stream of its own at its SYN."""
    out: dict[Ends, list[Stream]] = {}
    for p in read_pcap(path):
        found = out.setdefault((p.src, p.dst), [Stream()])
        if p.flags & SYN and (found[-1].isn is not None or found[-1].data):
            found.append(Stream())
        found[-1].add(p)
    return out


# ------------------------------------------------------------ TLS 1.3 and 1.2
def _hkdf_label(secret: bytes, label: bytes, length: int, hash_name: str) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

    algo = hashes.SHA384() if hash_name == "sha384" else hashes.SHA256()
    full = b"tls13 " + label
    info = struct.pack("!H", length) + bytes([len(full)]) + full + b"\x00"
    return HKDFExpand(algo, length, info).derive(secret)


_SUITES = {  # TLS 1.3: (AEAD, key length, hash)
    0x1301: ("aesgcm", 16, "sha256"),
    0x1302: ("aesgcm", 32, "sha384"),
    0x1303: ("chacha", 32, "sha256"),
}
_SUITES12 = {  # TLS 1.2's AEAD suites (ECDHE and RSA key exchange alike): the same
    0xC02B: ("aesgcm", 16, "sha256"),
    0xC02F: ("aesgcm", 16, "sha256"),
    0x009C: ("aesgcm", 16, "sha256"),
    0xC02C: ("aesgcm", 32, "sha384"),
    0xC030: ("aesgcm", 32, "sha384"),
    0x009D: ("aesgcm", 32, "sha384"),
    0xCCA8: ("chacha", 32, "sha256"),
    0xCCA9: ("chacha", 32, "sha256"),
}


def _prf12(secret: bytes, label: bytes, seed: bytes, length: int, hash_name: str) -> bytes:
    """TLS 1.2's PRF (RFC 5246 §5): P_hash(secret, label + seed)."""
    import hashlib
    import hmac

    def mac(data: bytes) -> bytes:
        return hmac.new(secret, data, getattr(hashlib, hash_name)).digest()

    out, a = b"", label + seed
    while len(out) < length:
        a = mac(a)
        out += mac(a + label + seed)
    return out[:length]


class _Keys12:
    """One direction's TLS 1.2 AEAD keys: every record after its ChangeCipherSpec."""

    def __init__(self, suite: int, master: bytes, randoms: bytes, client: bool) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

        kind, size, hash_name = _SUITES12[suite]
        iv_size = 4 if kind == "aesgcm" else 12
        block = _prf12(master, b"key expansion", randoms, 2 * (size + iv_size), hash_name)
        at = 0 if client else size
        key = block[at : at + size]
        at = 2 * size + (0 if client else iv_size)
        self.iv = block[at : at + iv_size]
        self.aead: Any = (AESGCM if kind == "aesgcm" else ChaCha20Poly1305)(key)
        self.gcm = kind == "aesgcm"
        self.seq = 0

    def open(self, header: bytes, body: bytes) -> bytes | None:
        seq = self.seq.to_bytes(8, "big")
        self.seq += 1
        if self.gcm:
            nonce, body = self.iv + body[:8], body[8:]
        else:
            nonce = bytes(a ^ b for a, b in zip(self.iv, bytes(4) + seq, strict=True))
        aad = seq + header[:3] + struct.pack("!H", len(body) - 16)
        try:
            plain: bytes = self.aead.decrypt(nonce, body, aad)
        except InvalidTag:
            return None
        return plain


class _Keys:
    """One direction's traffic keys: the handshake's, then the application's."""

    def __init__(self, suite: int, hs_secret: bytes | None, app_secret: bytes | None) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

        kind, size, hash_name = _SUITES[suite]
        aead = AESGCM if kind == "aesgcm" else ChaCha20Poly1305
        self.phases: list[list[Any]] = []  # [aead, iv, next sequence number]
        for secret in (hs_secret, app_secret):
            if secret is not None:
                key = _hkdf_label(secret, b"key", size, hash_name)
                iv = _hkdf_label(secret, b"iv", 12, hash_name)
                self.phases.append([aead(key), iv, 0])

    def open(self, header: bytes, body: bytes) -> bytes | None:
        """The inner plaintext of an application_data record, or None."""
        for phase in reversed(self.phases):  # the application's keys, once in use
            aead, iv, seq = phase
            nonce = bytes(a ^ b for a, b in zip(iv, seq.to_bytes(12, "big"), strict=True))
            try:
                plain: bytes = aead.decrypt(nonce, body, header)
            except InvalidTag:  # not this phase's
                continue
            phase[2] = seq + 1
            if phase is self.phases[-1] and len(self.phases) > 1:
                del self.phases[:-1]  # the handshake's keys are done with
            return plain
        return None


def read_keylog(path: Path) -> dict[bytes, dict[str, bytes]]:
    """An SSLKEYLOGFILE: per client random, its secrets by label."""
    out: dict[bytes, dict[str, bytes]] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and not line.startswith("#"):
            out.setdefault(bytes.fromhex(parts[1]), {})[parts[0]] = bytes.fromhex(parts[2])
    return out


def _records(s: Stream) -> Iterator[tuple[int, int, int]]:
    """(content type, offset of the record's first byte, its length) of each TLS record."""
    pos, data = 0, s.data
    while pos + 5 <= len(data):
        kind, length = data[pos], struct.unpack_from("!H", data, pos + 3)[0]
        if pos + 5 + length > len(data):
            return
        yield kind, pos, length
        pos += 5 + length


def decrypt(
    client: Stream, server: Stream, keylog: dict[bytes, dict[str, bytes]]
) -> tuple[Stream, Stream] | None:
    """The plaintext of both directions of a TLS 1.3 connection, each byte timed by the
    packet that carried the last byte of its record; None when it is not one whose keys
    are in `keylog`."""
    hello = next((r for r in _records(client) if r[0] == 22), None)
    shello = next((r for r in _records(server) if r[0] == 22), None)
    if hello is None or shello is None:
        return None
    random = bytes(client.data[hello[1] + 11 : hello[1] + 43])
    secrets = keylog.get(random)
    if secrets is None:
        return None
    pos = shello[1] + 5 + 4 + 2 + 32  # header, handshake header, version, random
    pos += 1 + server.data[pos]  # the legacy session id
    suite = struct.unpack_from("!H", server.data, pos)[0]
    if suite in _SUITES12 and "CLIENT_RANDOM" in secrets:
        randoms = bytes(server.data[shello[1] + 11 : shello[1] + 43]) + random
        return (
            _plain12(client, _Keys12(suite, secrets["CLIENT_RANDOM"], randoms, True)),
            _plain12(server, _Keys12(suite, secrets["CLIENT_RANDOM"], randoms, False)),
        )
    if suite not in _SUITES:
        return None
    out = []
    for s, side in ((client, "CLIENT"), (server, "SERVER")):
        keys = _Keys(
            suite,
            secrets.get(f"{side}_HANDSHAKE_TRAFFIC_SECRET"),
            secrets.get(f"{side}_TRAFFIC_SECRET_0"),
        )
        plain = Stream(isn=0)
        for kind, start, length in _records(s):
            if kind != 23:
                continue
            header = bytes(s.data[start : start + 5])
            inner = keys.open(header, bytes(s.data[start + 5 : start + 5 + length]))
            if inner is None:
                return None
            inner = inner.rstrip(b"\x00")
            if inner and inner[-1] == 23 and len(inner) > 1:  # application data
                plain.starts.append(len(plain.data))
                plain.times.append(s.time_at(start + 4 + length))  # its last byte
                plain.data += inner[:-1]
        out.append(plain)
    return out[0], out[1]


def _plain12(s: Stream, keys: _Keys12) -> Stream:
    """A TLS 1.2 direction's application data, timed as `decrypt` times it."""
    plain = Stream(isn=0)
    encrypted = False
    for kind, start, length in _records(s):
        if kind == 20:
            encrypted = True
            continue
        if not encrypted:
            continue
        header = bytes(s.data[start : start + 5])
        inner = keys.open(header, bytes(s.data[start + 5 : start + 5 + length]))
        if kind == 23 and inner:
            plain.starts.append(len(plain.data))
            plain.times.append(s.time_at(start + 4 + length))
            plain.data += inner
    return plain


# -------------------------------------------------------------------- HTTP, SSE
@dataclass
class Exchange:
    """One request and its response as the packets carried them (capture ns)."""

    request_id: str
    request_first_ns: int
    request_last_ns: int  # the request's last byte: t1's packet
    connection_ns: int | None  # the connection's SYN, when it was opened for this request
    head_ns: int | None = None  # the response head's last byte: t2's
    events_ns: list[int] = field(default_factory=list)  # each SSE event's last byte
    end_ns: int | None = None  # the response's last byte: t6's
    # every packet of the server's side of the connection, in order: the arrivals a
    # read of it can be stamped with
    arrivals_ns: list[int] = field(default_factory=list)


_ID = re.compile(rb"\r\nx-request-id:[ \t]*([^\r\n]*)", re.IGNORECASE)
_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[ \t]*chunked", re.IGNORECASE)
_LINE_END = re.compile(rb"\r\n|\n|\r")


def _requests(s: Stream) -> list[tuple[str | None, int, int]]:
    """(request id, first byte, last byte) of each request in a client's stream."""
    out: list[tuple[str | None, int, int]] = []
    pos, data = 0, s.data
    while pos < len(data):
        head_end = data.find(b"\r\n\r\n", pos)
        if head_end < 0:
            break
        head = bytes(data[pos : head_end + 2])
        found, length = _ID.search(head), _LENGTH.search(head)
        end = head_end + 4 + (int(length[1]) if length else 0)
        if end > len(data):
            break
        out.append((found[1].decode() if found else None, pos, end - 1))
        pos = end
    return out


def _responses(s: Stream) -> list[tuple[int, list[int], int | None]]:
    """(the head's last byte, each event's last byte, the response's last byte or None)
    of each response in a server's stream, in order."""
    out: list[tuple[int, list[int], int | None]] = []
    pos, data = 0, s.data
    while pos < len(data):
        head_end = data.find(b"\r\n\r\n", pos)
        if head_end < 0:
            break
        head = bytes(data[pos : head_end + 2])
        body_at = head_end + 4
        if not _CHUNKED.search(head):
            length = _LENGTH.search(head)
            end = body_at + (int(length[1]) if length else 0)
            out.append((head_end + 3, [], end - 1 if end <= len(data) else None))
            pos = end
            continue
        body, where, end = _dechunk(data, body_at)
        events = [where(i) for i in _event_ends(body)]
        out.append((head_end + 3, events, end))
        if end is None:
            break
        pos = end + 1
    return out


def _dechunk(data: bytearray, pos: int) -> tuple[bytes, Any, int | None]:
    """A chunked body from `pos`: (its bytes, body offset -> stream offset, the offset of
    the body's last byte in the stream or None when it is cut short)."""
    body = bytearray()
    body_starts: list[int] = []
    stream_starts: list[int] = []
    end: int | None = None
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            break
        size = int(bytes(data[pos:line_end]).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            close = data.find(b"\r\n\r\n", line_end)  # trailers, if any, then CRLF
            end = close + 3 if close >= 0 else None
            break
        body_starts.append(len(body))
        stream_starts.append(line_end + 2)
        body += data[line_end + 2 : line_end + 2 + size]
        pos = line_end + 2 + size + 2

    def where(i: int) -> int:
        k = bisect.bisect_right(body_starts, i) - 1
        return stream_starts[k] + i - body_starts[k]

    return bytes(body), where, end


def _event_ends(body: bytes) -> list[int]:
    """The offset of the last byte of each dispatched SSE event (a blank line after at
    least one data line; WHATWG line ends)."""
    ends, has_data, start = [], False, 0
    for m in _LINE_END.finditer(body):
        line = body[start : m.start()]
        if not line:
            if has_data:
                ends.append(m.end() - 1)
            has_data = False
        elif line.startswith(b"data"):
            has_data = True
        start = m.end()
    return ends


def exchanges(
    path: Path, server_port: int, keylog: dict[bytes, dict[str, bytes]] | None = None
) -> tuple[dict[str, Exchange], int]:
    """Every request with an `X-Request-Id` to `server_port` in the capture, with its
    response; and the bytes the capture missed in those connections."""
    found: dict[str, Exchange] = {}
    gaps = 0
    all_streams = streams(path)
    pairs = [
        (client, server)
        for (src, dst), clients in all_streams.items()
        if dst[1] == server_port
        for client, server in zip(
            clients, all_streams.get((dst, src), []) + [Stream()] * len(clients), strict=False
        )
    ]
    for client, server in pairs:
        gaps += client.gaps + server.gaps
        syn, arrivals = client.syn_ns, server.times  # over TLS too: the packets themselves
        if keylog is not None:
            plain = decrypt(client, server, keylog)
            if plain is None:
                continue
            client, server = plain
        responses = _responses(server)
        for i, (rid, first, last) in enumerate(_requests(client)):
            if rid is None:
                continue
            ex = Exchange(rid, client.time_at(first), client.time_at(last), syn if i == 0 else None)
            if i < len(responses):
                head, events, end = responses[i]
                ex.head_ns = server.time_at(head)
                ex.events_ns = [server.time_at(e) for e in events]
                ex.end_ns = None if end is None else server.time_at(end)
                ex.arrivals_ns = arrivals
            found[rid] = ex
    return found, gaps


# ------------------------------------------------------------------ the records
@dataclass
class Record:
    """What a compared record holds: t0..t6, its token events, the stamps' sources."""

    request_id: str
    ns: dict[str, int | None]
    tokens: list[tuple[int, int]]  # (event index, arrival ns) of each token event
    stamp_source: str | None  # the receive side's (ext.stamp_source)
    sent_source: str | None  # t1's (ext.sent_stamp_source; absent before it existed)
    ok: bool
    new_connection: bool  # opened for this request: t0 came before its SYN


STAMPS = ("t0", "t1", "t2", "t3", "t4", "t5", "t6")
_NS_COLUMNS = dict(
    zip(
        STAMPS,
        ("request_start", "headers_sent", "response_headers", "first_event", "first_token",
         "last_token", "response_end"),
        strict=True,
    )
)  # fmt: skip


def read_records(run_dir: Path) -> list[Record]:
    """The request records and token events of a run folder (every worker's parts)."""
    tokens: dict[str, list[tuple[int, int]]] = {}
    for part in sorted(run_dir.glob("client/*/part-*.tokens.parquet")):
        t = pq.read_table(part, columns=["request_id", "event_index", "arrival_ns", "tokens"])
        for rid, idx, at, n in zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True):
            if n:
                tokens.setdefault(rid, []).append((idx, at))
    out = []
    for part in sorted(run_dir.glob("client/*/part-*.requests.parquet")):
        t = pq.read_table(part)
        names = set(t.column_names)
        cols = {c: t.column(c).to_pylist() for c in names}
        for i, rid in enumerate(cols["request_id"]):
            ns = {s: cols[f"client_ns.{c}"][i] for s, c in _NS_COLUMNS.items()}
            sent = cols["ext.sent_stamp_source"][i] if "ext.sent_stamp_source" in names else None
            out.append(
                Record(
                    rid,
                    ns,
                    sorted(tokens.get(rid, [])),
                    cols["ext.stamp_source"][i],
                    sent,
                    cols["ext.error_class"][i] is None,
                    cols["ext.connection_reused"][i] is False,
                )
            )
    return out


# ------------------------------------------------------------------ comparison
ROWS = ("t1", "t2", "t3", "t4", "t5", "t6", "token events", "t0 lead", "TTFH", "TTFT")


@dataclass
class Errors:
    """Record − packet per stamp, ms, split by the stamp's source ("kernel" or "user");
    "t0 lead" is the other way round, the request's first packet − t0 (t0 has no
    packet: it is stamped before the request is written), and "TTFH" and "TTFT" are the
    record's durations − the packets' from the request's first packet (their error
    includes t0's lead, by definition)."""

    values: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    matched: int = 0  # records found in the capture
    unmatched: int = 0  # successful records not found whole in it
    t2_is_t1: int = 0  # records whose t2 equals their t1
    t2_is_t1_by_packets: int = 0  # ... where the packets say so too (within 1 µs)
    # kernel receive stamps (t2..t6, token events) that are the arrival of their own
    # packet; of a later packet of the connection (the read took it too: a read made
    # after it arrived); of no packet at or after their own (none should be); each
    # within 0.1 ms (`classify`)
    own: int = 0
    later: int = 0
    no_packet: int = 0

    def add(self, row: str, source: str, value_ns: int) -> None:
        self.values.setdefault((row, source), []).append(value_ns / 1e6)

    def classify(self, stamp: int, packet: int, arrivals: list[int], within: int = 100_000) -> None:
        """Count a kernel receive stamp as its own packet's arrival, a later one's, or
        none's, `within` ns: the conversions of the wall clock onto the monotonic one
        (each within 20 µs), and a read that came with no kernel time (seen about once
        in 5,000), whose own time is then its stamp, a wake-up of the reader after its
        packet."""
        if abs(stamp - packet) <= within:
            self.own += 1
            return
        at = bisect.bisect_left(arrivals, stamp - within)
        if stamp > packet and at < len(arrivals) and abs(arrivals[at] - stamp) <= within:
            self.later += 1
        else:
            self.no_packet += 1

    def of(self, row: str, source: str | None = None) -> np.ndarray:
        keys = [k for k in self.values if k[0] == row and source in (None, k[1])]
        return np.concatenate([self.values[k] for k in keys]) if keys else np.empty(0)

    def table(self) -> str:
        """The figures, one line per stamp and source: n, p50, p99, max (ms)."""
        lines = [f"{'stamp':<14} {'source':<7} {'n':>6} {'p50':>9} {'p99':>9} {'max':>9}"]
        for row in ROWS:
            for source in ("kernel", "user"):
                v = self.of(row, source)
                if v.size:
                    p50, p99 = np.percentile(v, [50, 99], method="higher")
                    lines.append(
                        f"{row:<14} {source:<7} {v.size:>6} {p50:>+9.3f} {p99:>+9.3f} "
                        f"{v.max():>+9.3f}"
                    )
        lines.append(
            f"records matched {self.matched}, not found {self.unmatched}; t2 = t1 in "
            f"{self.t2_is_t1} (the packets say so in {self.t2_is_t1_by_packets})"
        )
        lines.append(
            f"kernel receive stamps: {self.own} their own packet's arrival, {self.later} a "
            f"later packet's (a read that took it too), {self.no_packet} no packet's"
        )
        return "\n".join(lines)


def compare(records: list[Record], found: dict[str, Exchange], offset_ns: int) -> Errors:
    """Each successful record's stamps against its packets; `offset_ns` is the wall clock
    minus the monotonic one (the capture's times are the wall clock's)."""
    e = Errors()
    for r in records:
        ex = found.get(r.request_id)
        if not r.ok:
            continue
        if ex is None or ex.head_ns is None or ex.end_ns is None or not ex.events_ns:
            e.unmatched += 1
            continue
        e.matched += 1

        def mono(wall: int) -> int:
            return wall - offset_ns

        ns = r.ns
        recv = "kernel" if r.stamp_source == "kernel" else "user"
        sent = "kernel" if r.sent_source == "kernel" else "user"
        # the request's first packet: its connection's SYN when it was opened for it
        opened = ex.connection_ns if r.new_connection else None
        first = mono(ex.request_first_ns if opened is None else opened)
        head = mono(ex.head_ns)
        if ns["t0"] is not None:
            e.add("t0 lead", "user", first - ns["t0"])
        pairs: list[tuple[str, str, int | None, int | None]] = [
            ("t1", sent, ns["t1"], mono(ex.request_last_ns)),
            ("t2", recv, ns["t2"], head),
            ("t3", recv, ns["t3"], mono(ex.events_ns[0])),
            ("t6", recv, ns["t6"], mono(ex.end_ns)),
        ]
        if r.tokens and r.tokens[-1][0] < len(ex.events_ns):
            t4 = mono(ex.events_ns[r.tokens[0][0]])
            pairs += [
                ("t4", recv, ns["t4"], t4),
                ("t5", recv, ns["t5"], mono(ex.events_ns[r.tokens[-1][0]])),
            ]
            for idx, at in r.tokens:
                e.add("token events", recv, at - mono(ex.events_ns[idx]))
            if ns["t0"] is not None and ns["t4"] is not None:
                e.add("TTFT", recv, (ns["t4"] - ns["t0"]) - (t4 - first))
        if ns["t0"] is not None and ns["t2"] is not None:
            e.add("TTFH", recv, (ns["t2"] - ns["t0"]) - (head - first))
        for row, source, stamp, packet in pairs:
            if stamp is not None and packet is not None:
                e.add(row, source, stamp - packet)
        if recv == "kernel":  # on the capture's clock
            stamps = [(st, p) for row, _, st, p in pairs if row != "t1"]
            stamps += [(at, mono(ex.events_ns[idx])) for idx, at in r.tokens]
            for stamp, packet in stamps:
                if stamp is not None and packet is not None:
                    e.classify(stamp + offset_ns, packet + offset_ns, ex.arrivals_ns)
        if ns["t1"] is not None and ns["t1"] == ns["t2"]:
            e.t2_is_t1 += 1
            if abs(head - mono(ex.request_last_ns)) <= 1000:
                e.t2_is_t1_by_packets += 1
    return e


def wall_minus_mono() -> int:
    """CLOCK_REALTIME − CLOCK_MONOTONIC now, read as a pair on one instant (within
    20 µs, as the client reads its pairs)."""
    best = None
    for _ in range(16):
        a = time.monotonic_ns()
        w = time.time_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
    assert best is not None
    return best[1]


@contextlib.contextmanager
def captured(path: Path, port: int) -> Iterator[Capture]:
    """A capture for the block; raises when the kernel dropped a packet."""
    cap = Capture(path, port)
    try:
        yield cap
    finally:
        dropped = cap.stop()
    if dropped != 0:
        raise RuntimeError(f"tcpdump: {dropped} packets dropped, not a witness: {cap.stats}")
