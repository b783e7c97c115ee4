"""An OpenAI `/v1/completions` streaming server with exact timings, for benchmarks.

Each streamed request gets its first token `--ttft-ms` after the request was read, then
one token every `--itl-ms` (deadlines from the first one, so lateness never drifts), as
many as the request's `max_tokens`, each token one word (" w") in its own SSE event and
its own HTTP chunk. With `--burst N` each deadline sends the next N tokens in one write
(one chunk each), as vLLM's multi-step scheduling and SGLang's stream interval stream:
the first N arrive together after the TTFT. It records its own truth per request: the
monotonic instant the request was read, and the instant right after each token's write
returned (same clock as a client on the same host). `GET /truth` returns the records of
the requests completed since the last call (and forgets them): that is what a client's
figures are compared to.

HTTP/1.1 keep-alive, chunked responses. Also: `GET /health` ({"status": "ok"}),
`GET /v1/models`, `POST /tokenize` (one id per word), `GET /count` (requests received),
so calculet-load and the peers start against it as against vLLM or calculet-sim. With
`continuous_usage_stats` every chunk carries usage (vLLM's extension), with
`include_usage` a final usage chunk.

Usage: python benchmarks/exact_server.py [--port 0] [--ttft-ms 50] [--itl-ms 10] [--burst 1]
prints `exact-server listening on http://127.0.0.1:PORT` when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import time
import zlib
from typing import Any

MODEL = "exact"


class Stream:
    __slots__ = ("conn", "due", "id", "include_usage", "n", "prompt", "recv", "sends", "usage")

    def __init__(self, conn: Conn, rid: str, recv: int, n: int, prompt: int, body: Any) -> None:
        self.conn, self.id, self.recv, self.n, self.prompt = conn, rid, recv, n, prompt
        opts = body.get("stream_options") or {}
        self.usage = bool(opts.get("continuous_usage_stats"))
        self.include_usage = bool(opts.get("include_usage"))
        self.sends: list[int] = []
        self.due = 0


class Server:
    def __init__(self, ttft_ns: int, itl_ns: int, burst: int = 1) -> None:
        self.ttft_ns, self.itl_ns, self.burst = ttft_ns, itl_ns, burst
        self.heap: list[tuple[int, int, Stream]] = []
        self.seq = itertools.count()
        self.done: list[list[Any]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0
        self.loop = asyncio.get_event_loop()
        self.ids = itertools.count(1)
        self.received = 0

    def start(self, s: Stream) -> None:
        s.due = s.recv + self.ttft_ns
        self._push(s)

    def _push(self, s: Stream) -> None:
        heapq.heappush(self.heap, (s.due, next(self.seq), s))
        if self.timer is None or s.due < self.timer_at:
            self._arm()

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.heap:
            return
        self.timer_at = self.heap[0][0]
        delay = max((self.timer_at - time.monotonic_ns()) / 1e9, 0.0)
        self.timer = self.loop.call_later(delay, self._tick)

    def _tick(self) -> None:
        self.timer = None
        now = time.monotonic_ns()
        heap = self.heap
        while heap and heap[0][0] <= now + 100_000:
            _, _, s = heapq.heappop(heap)
            if s.conn.closed:
                self.finish(s)
                continue
            self._send(s)
            if len(s.sends) < s.n:
                s.due += self.itl_ns
                heapq.heappush(heap, (s.due, next(self.seq), s))
            else:
                self.finish(s)
            now = time.monotonic_ns()
        self._arm()

    def _send(self, s: Stream) -> None:
        """The next `burst` tokens (fewer at the end) in one write."""
        count = min(self.burst, s.n - len(s.sends))
        wire = b"".join(self._token(s, len(s.sends) + 1 + i) for i in range(count))
        s.conn.transport.write(wire)
        s.sends.extend([time.monotonic_ns()] * count)

    def _token(self, s: Stream, k: int) -> bytes:
        """Token k's chunks (the last token's with the stream's end)."""
        last = k == s.n
        # the event's JSON from a template (json.dumps per token would make this server,
        # not the client, the bottleneck at 640 req/s)
        usage = (
            b',"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}'
            % (s.prompt, k, s.prompt + k)
            if s.usage
            else b""
        )
        event = b'data: {"id":"%s","object":"text_completion","created":0,"model":"%s",' % (
            s.id.encode(),
            MODEL.encode(),
        )
        event += (
            b'"choices":[{"index":0,"text":" w","logprobs":null,"finish_reason":%s}]%s}\n\n'
            % (
                b'"length"' if last else b"null",
                usage,
            )
        )
        events = [event]
        if last:
            if s.include_usage:
                tail = {
                    "id": s.id,
                    "object": "text_completion",
                    "created": 0,
                    "model": MODEL,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": s.prompt,
                        "completion_tokens": k,
                        "total_tokens": s.prompt + k,
                    },
                }
                events.append(b"data: " + json.dumps(tail).encode() + b"\n\n")
            events.append(b"data: [DONE]\n\n")
        wire = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
        if last:
            wire += b"0\r\n\r\n"
        return wire

    def finish(self, s: Stream) -> None:
        self.done.append([s.id, s.recv, s.sends, s.n])
        s.conn.busy = False


def _response(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
        "Connection: keep-alive\r\n\r\n"
    )
    return head.encode() + body


class Conn(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.buf = b""
        self.closed = False
        self.busy = False
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            recv = time.monotonic_ns()
            method, path = head[0].split(" ")[:2]
            self.handle(method, path, headers, body, recv)

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes, t: int) -> None:
        srv = self.server
        path = path.split("?", 1)[0]
        if method == "POST" and path == "/v1/completions":
            req = json.loads(body or b"{}")
            rid = headers.get("x-request-id") or f"exact-{next(srv.ids)}"
            srv.received += 1
            prompt = req.get("prompt")
            n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            n = int(req.get("max_tokens") or 16)
            if not req.get("stream"):
                text = " w" * n
                obj = {
                    "id": rid,
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": n},
                }
                self.transport.write(_response("200 OK", json.dumps(obj).encode()))
                return
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            self.busy = True
            srv.start(Stream(self, rid, t, n, n_prompt, req))
        elif method == "POST" and path == "/tokenize":
            req = json.loads(body or b"{}")
            text = req.get("content") or req.get("prompt") or ""
            if isinstance(req.get("messages"), list):
                text = " ".join(str(m.get("content", "")) for m in req["messages"])
            ids = [zlib.crc32(w.encode()) % 50000 for w in str(text).split()]
            self.transport.write(_response("200 OK", json.dumps({"tokens": ids}).encode()))
        elif method == "GET" and path == "/health":
            self.transport.write(_response("200 OK", b'{"status":"ok"}'))
        elif method == "GET" and path == "/v1/models":
            obj = {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "owned_by": "calculet-exact"}],
            }
            self.transport.write(_response("200 OK", json.dumps(obj).encode()))
        elif method == "GET" and path == "/count":
            body = json.dumps({"received": srv.received}).encode()
            self.transport.write(_response("200 OK", body))
        elif method == "GET" and path == "/truth":
            done, srv.done = srv.done, []
            self.transport.write(_response("200 OK", json.dumps(done).encode()))
        else:
            self.transport.write(_response("404 Not Found", b'{"error":"not found"}'))


async def serve(host: str, port: int, ttft_ms: float, itl_ms: float, burst: int = 1) -> None:
    loop = asyncio.get_running_loop()
    server = Server(int(ttft_ms * 1e6), int(itl_ms * 1e6), burst)
    srv = await loop.create_server(lambda: Conn(server), host, port, backlog=4096)
    bound = srv.sockets[0].getsockname()[1]
    print(f"exact-server listening on http://{host}:{bound}", flush=True)
    async with srv:
        await srv.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--burst", type=int, default=1, help="tokens per write (default 1)")
    ap.add_argument("--no-uvloop", action="store_true")
    args = ap.parse_args()
    if args.burst < 1:
        ap.error(f"--burst {args.burst}: expected 1 or more tokens per write")
    run: Any = asyncio.run
    if not args.no_uvloop:
        try:
            import uvloop

            run = uvloop.run
        except ImportError:
            pass
    run(serve(args.host, args.port, args.ttft_ms, args.itl_ms, args.burst))


if __name__ == "__main__":
    main()
