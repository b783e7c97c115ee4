"""HTTP front end of the simulator: generation endpoints, tokenize, health, models,
metrics and trace collection. Every error is a JSON body `{"error": {code, type,
message}}`; a bad request never stops the server."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from calculet_load.schema import DeviceRow, ServerEvent
from calculet_sim import admin
from calculet_sim.admin import ENGINE
from calculet_sim.engine import Engine, GenRequest, Reject, Seq
from calculet_sim.faults import FaultInjector
from calculet_sim.metrics import SimMetrics
from calculet_sim.profile import Profile
from calculet_sim.protocols import Formatter, Options, dumps, parse_request, timings
from calculet_sim.tokens import EOS, Tokenizer
from calculet_sim.traces import TRACE_FILES, TraceWriter, now_ns

_RID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# A 40960-token prompt is well under 1 MiB of JSON, even as token ids.
MAX_BODY_BYTES = 8 * 2**20
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, code: str, message: str, rid: str | None = None) -> web.Response:
    headers = {"X-Request-Id": rid} if rid else None
    body = {"error": {"code": status, "type": code, "message": message}}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request.headers.get("X-Request-Id")
    if rid is not None and not _RID.fullmatch(rid):
        rid = None  # never echo a malformed header back
    try:
        resp = await handler(request)
    except Reject as exc:
        return error_response(exc.status, exc.code, exc.message, rid)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = (exc.reason or "error").lower().replace(" ", "_")
        if exc.status == 413:
            message = f"body: larger than {MAX_BODY_BYTES} bytes"
        else:
            message = f"{request.method} {request.path}: {exc.reason}"
        return error_response(exc.status, code, message, rid)
    if rid is not None and not resp.prepared and "X-Request-Id" not in resp.headers:
        resp.headers["X-Request-Id"] = rid
    return resp


class Sim:
    """The simulator's state shared by the handlers."""

    def __init__(self, profile: Profile, trace_dir: Path | None) -> None:
        self.profile = profile
        self.tok = Tokenizer(profile.output.vocab_size, profile.reasoning.enabled)
        tr = profile.traces
        self.traces = TraceWriter(
            trace_dir, {"server_events": tr.server_events, "steps": tr.steps, "device": tr.device}
        )
        self.faults = FaultInjector(profile.seed)
        self.engine = Engine(profile, self.traces, self.faults, self.tok)
        self.metrics = SimMetrics(self.engine)
        self.engine.metrics = self.metrics
        self._rid_counter = 0
        self._bg: list[asyncio.Task[None]] = []

    def request_id(self, request: web.Request) -> str:
        rid = request.headers.get("X-Request-Id")
        if rid and _RID.fullmatch(rid):
            return rid
        self._rid_counter += 1
        return f"sim-{self._rid_counter}"

    async def _read_json(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except UnicodeDecodeError as exc:
            raise Reject(400, "invalid_json", f"body: invalid UTF-8 at byte {exc.start}") from None
        except json.JSONDecodeError as exc:
            raise Reject(400, "invalid_json", f"body: {exc.msg} at byte {exc.pos}") from None
        except RecursionError:
            raise Reject(400, "invalid_json", "body: nested too deeply") from None
        except ValueError as exc:  # e.g. an integer literal of more than 4300 digits
            raise Reject(400, "invalid_json", f"body: {exc}") from None

    def formatter(self, opts: Options, req: GenRequest, cached_tokens: int = 0) -> Formatter:
        p = self.profile
        fingerprint = p.versions.get("server_commit", "calculet-sim")
        reasoning = p.reasoning.enabled
        return Formatter(opts, req, p.output.model_name, fingerprint, cached_tokens, reasoning)

    # ------------------------------------------------------------- generation
    def endpoint(self, protocol: str) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            rid = self.request_id(request)
            body = await self._read_json(request)
            try:
                req, opts = parse_request(
                    protocol, body, rid, self.tok, self.profile.scheduling.max_context
                )
            except Reject as exc:
                raise Reject(exc.status, exc.code, exc.message) from None
            out = self.profile.output
            if out.reject_unknown_models and req.model not in (
                None, out.model_name, out.model_alias
            ):  # fmt: skip
                raise Reject(404, "model_not_found", f"The model `{req.model}` does not exist.")
            if self.profile.firehose:
                return await self._firehose(request, req, opts)
            eng = self.engine
            seq = eng.accept(req)
            try:
                await eng.admit(seq)
            except asyncio.CancelledError:
                eng.cancel(seq)
                raise
            t_admitted = time.monotonic_ns()
            try:
                if opts.stream:
                    return await self._stream(request, seq, req, opts, t_admitted)
                return await self._whole(seq, req, opts, t_admitted)
            except (asyncio.CancelledError, ConnectionResetError):
                eng.cancel(seq)
                raise

        return handle

    def _headers(self, rid: str) -> dict[str, str]:
        return {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Request-Id": rid,
        }

    async def _stream(
        self, request: web.Request, seq: Seq, req: GenRequest, opts: Options, t_admitted: int
    ) -> web.StreamResponse:
        out = self.profile.output
        resp = web.StreamResponse(headers=self._headers(req.request_id))
        await resp.prepare(request)
        _nodelay(request)
        fmt = self.formatter(opts, req, seq.cached_tokens)
        text_out = self.engine.text_out(req)
        k = out.tokens_per_event
        group: list[tuple[int, int]] = []  # (token id, step) not yet sent
        held = 0  # tokens inside `group` merged from a held-back event
        nan_any = False
        t_first = t_last = 0
        for ev in fmt.start():
            await resp.write(b"data: " + ev.encode() + b"\n\n")
        while True:
            item = await seq.out.get()
            kind = item[0]
            if kind == "token":
                group.append((item[1], item[2]))
                nan_any |= item[3]
                t_last = time.monotonic_ns()
                t_first = t_first or t_last
                if len(group) - held < k:
                    continue
            elif kind == "abort":
                # Broken shutdown: the connection is dropped mid-stream.
                if request.transport is not None:
                    request.transport.close()
                return resp
            said, text = text_out.feed([t for t, _ in group[held:]])
            if kind == "finish":
                said_end, text_end = text_out.flush()
                said, text = said + said_end, text + text_end
            # a token without text (one ending inside a character, a reasoning tag given
            # apart) is held back and merged into the next event
            if group and (text or said or kind != "token"):
                # At the end, held tokens flush without a newer one: name the last.
                ids = [t for t, _ in group[held:]] or [group[-1][0]]
                n_sent = seq.n_generated_sent + len(group)
                ev = fmt.tokens(text, ids, n_sent, nan_any, said, text_out.reasoning_tokens)
                data = b"data: " + ev.encode() + b"\n\n"
                t_write = time.monotonic_ns()  # no byte of the event left before this
                await resp.write(data)
                self._flushed(seq, group, t_write)
                seq.n_generated_sent += len(group)
                group, held, nan_any = [], 0, False
            elif group:
                held = len(group)  # llama.cpp: the next event lists only the newer token
                continue
            if kind == "finish":
                prompt_ms = (t_first - t_admitted) / 1e6 if t_first else 0.0
                n = seq.n_generated_sent
                tm = timings(
                    len(req.prompt_ids), prompt_ms, n, (t_last - t_first) / 1e6, seq.cached_tokens
                )
                for ev in fmt.finish(item[1], n, tm, text_out.reasoning_tokens):
                    await resp.write(b"data: " + ev.encode() + b"\n\n")
                break
            if kind == "error":
                for ev in fmt.error(item[1], item[2], item[3]):
                    await resp.write(b"data: " + ev.encode() + b"\n\n")
                break
        await resp.write_eof()
        return resp

    def _flushed(self, seq: Seq, group: list[tuple[int, int]], t_write: int) -> None:
        """One `token_flushed` row per token of the event just written.

        The row's `mono_ns` is stamped after the write returned; `detail.write_start_mono_ns`
        was read before it began. The bytes left between the two, so a client's arrival
        is never before the start, and a stall of this process between the write and the
        stamp (the scheduler, a collection) moves only the row's own stamp.
        """
        if not self.traces.enabled("server_events"):
            return
        for _, step in group:
            self.engine.event(
                ServerEvent.TOKEN_FLUSHED,
                seq,
                step_index=step,
                kind="prefill" if step == 0 else "decode",
                detail={"write_start_mono_ns": t_write},
            )

    async def _whole(
        self, seq: Seq, req: GenRequest, opts: Options, t_admitted: int
    ) -> web.StreamResponse:
        ids: list[int] = []
        steps: list[tuple[int, int]] = []
        nan = False
        t_first = t_last = 0
        while True:
            item = await seq.out.get()
            if item[0] == "token":
                ids.append(item[1])
                steps.append((item[1], item[2]))
                nan |= item[3]
                t_last = time.monotonic_ns()
                t_first = t_first or t_last
                continue
            if item[0] == "error":
                raise Reject(item[1], item[2], item[3])
            if item[0] == "abort":
                raise Reject(503, "shutting_down", "instance shut down mid-request")
            break
        prompt_ms = (t_first - t_admitted) / 1e6 if t_first else 0.0
        cached = seq.cached_tokens
        tm = timings(len(req.prompt_ids), prompt_ms, len(ids), (t_last - t_first) / 1e6, cached)
        body = self._whole_body(opts, req, ids, item[1], tm, nan, cached)
        # a whole response goes out once the handler returns: both stamps precede its bytes
        self._flushed(seq, steps, time.monotonic_ns())
        return web.Response(
            text=dumps(body),
            content_type="application/json",
            headers={"X-Request-Id": req.request_id},
        )

    def _whole_body(
        self, opts: Options, req: GenRequest, ids: list[int], reason: str,
        tm: dict[str, float], nan: bool, cached_tokens: int,
    ) -> dict[str, object]:  # fmt: skip
        text_out = self.engine.text_out(req)
        said, text = text_out.whole(ids)
        fmt = self.formatter(opts, req, cached_tokens)
        reasoning = said if text_out.separate else None
        return fmt.whole(text, ids, reason, len(ids), tm, nan, reasoning, text_out.reasoning_tokens)

    async def _firehose(
        self, request: web.Request, req: GenRequest, opts: Options
    ) -> web.StreamResponse:
        """No delays, many tokens per write: measures the client, not the server.

        Same validation and the same output ids as the timed path (so golden hashes
        agree), but no device model, no scheduling and no traces.
        """
        out = self.profile.output
        limit = self.engine.output_limit(req)
        model = self.engine.output_model(req, limit)
        ids_all: list[int] = []
        for i in range(limit):
            tok = model.token_at(i)
            if tok == EOS:
                break
            ids_all.append(tok)
        n = len(ids_all)
        reason = "length" if n == limit else "stop"
        tm = timings(len(req.prompt_ids), 0, n, 0)
        if not opts.stream:
            body = self._whole_body(opts, req, ids_all, reason, tm, False, 0)
            return web.Response(
                text=dumps(body),
                content_type="application/json",
                headers={"X-Request-Id": req.request_id},
            )
        resp = web.StreamResponse(headers=self._headers(req.request_id))
        await resp.prepare(request)
        _nodelay(request)
        fmt = self.formatter(opts, req)
        text_out = self.engine.text_out(req)
        k = out.tokens_per_event
        per_write = self.profile.firehose_tokens_per_write
        parts = [b"data: " + e.encode() + b"\n\n" for e in fmt.start()]
        in_parts = 0  # tokens in `parts`
        for i in range(0, n, k):
            ids = ids_all[i : i + k]
            said, text = text_out.feed(ids)
            if i + k >= n:
                said_end, text_end = text_out.flush()
                said, text = said + said_end, text + text_end
            ev = fmt.tokens(text, ids, i + len(ids), False, said, text_out.reasoning_tokens)
            parts.append(b"data: " + ev.encode() + b"\n\n")
            in_parts += len(ids)
            if in_parts >= per_write:
                await resp.write(b"".join(parts))
                parts, in_parts = [], 0
                await asyncio.sleep(0)
        for ev in fmt.finish(reason, n, tm, text_out.reasoning_tokens):
            parts.append(b"data: " + ev.encode() + b"\n\n")
        await resp.write(b"".join(parts))
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------------ misc
    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise Reject(400, "invalid_request", "body: expected a JSON object")
        if "messages" in body:
            req, _ = parse_request(
                "chat", {"messages": body["messages"]}, "tokenize", self.tok, 1 << 30
            )
            ids = req.prompt_ids
        else:
            text = body.get("content", body.get("prompt"))
            if not isinstance(text, str):
                raise Reject(400, "invalid_request", "content: expected a string")
            ids = self.tok.encode(text)
        return web.json_response(
            {
                "tokens": ids,
                "count": len(ids),
                "max_model_len": self.profile.scheduling.max_context,
            }
        )

    async def health(self, request: web.Request) -> web.StreamResponse:
        state = self.engine.state
        ok = state not in ("failed", "stopped")
        return web.json_response(
            {"status": "ok" if ok else "unavailable", "state": state}, status=200 if ok else 503
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        out = self.profile.output
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": out.model_name,
                        "object": "model",
                        "owned_by": "calculet-sim",
                        "alias": out.model_alias,
                        "max_model_len": self.profile.scheduling.max_context,
                    }
                ],
            }
        )

    async def metrics_endpoint(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def trace(self, request: web.Request) -> web.StreamResponse:
        kind = request.match_info["kind"]
        if kind == "audit" and admin.AUDIT_READER in request.app:
            reader: admin.AuditReader = request.app[admin.AUDIT_READER]
            return await reader(request)
        if kind not in TRACE_FILES or kind == "audit":
            raise Reject(404, "not_found", f"trace {kind!r}: one of server_events, steps, device")
        if self.traces.trace_dir is None:  # nothing kept: not an empty trace of the run
            raise Reject(404, "not_found", "this simulator keeps no traces (--trace-dir)")
        try:
            offset = int(request.query.get("offset", "0"))
        except ValueError:
            raise Reject(400, "invalid_request", "offset: expected an integer") from None
        if offset < 0:
            raise Reject(400, "invalid_request", "offset: must be >= 0")
        data = self.traces.read(kind, offset)
        return web.Response(
            body=data,
            content_type="application/x-ndjson",
            headers={"X-Next-Offset": str(offset + len(data))},
        )

    # ------------------------------------------------------- background tasks
    async def _device_sampler(self) -> None:
        """A device row every simulated `sample_interval_s`, on a fixed grid (no drift).

        The real period has a 1 ms floor (the loop's timer granularity); at a smaller
        time scale a row covers several simulated seconds, which `sim_time_s` shows.
        """
        eng = self.engine
        cfg = self.profile.device
        scale = eng.scale or 1.0
        period_ns = max(int(cfg.sample_interval_s * scale * 1e9), 1_000_000)
        t_start = time.monotonic_ns()
        last_busy, last_t = eng.busy_ns, t_start
        tick = 0
        while True:
            tick += 1
            now = time.monotonic_ns()
            if t_start + tick * period_ns < now:  # stalled: skip the missed samples
                tick = (now - t_start) // period_ns + 1
            await asyncio.sleep((t_start + tick * period_ns - now) / 1e9)
            now = time.monotonic_ns()
            util = (eng.busy_ns - last_busy) / max(now - last_t, 1)
            eng.device.advance((now - last_t) / 1e9 / scale, util)
            last_busy, last_t = eng.busy_ns, now
            wall, mono = now_ns()
            self.traces.write(
                "device",
                DeviceRow(
                    wall_ns=wall,
                    mono_ns=mono,
                    chips=eng.device.samples(eng.kv_allocated),
                    pending_jobs=eng.pending_jobs,
                    finished_jobs=eng.finished_jobs,
                    left_jobs=eng.left_jobs,
                    reset_count=eng.reset_count,
                    sim_time_s=round((now - t_start) / 1e9 / scale, 3),
                ),
            )

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(self.profile.traces.flush_interval_s)
            self.traces.flush()

    async def on_startup(self, app: web.Application) -> None:
        eng = self.engine
        eng.start(2 if self.profile.scheduling.ping_pong else 1)
        loop = asyncio.get_running_loop()
        self._bg = [loop.create_task(self._device_sampler()), loop.create_task(self._flusher())]
        eng.event(ServerEvent.STATE_CHANGE, None, detail={"from": "starting", "to": "ready"})

    async def on_cleanup(self, app: web.Application) -> None:
        for t in self._bg:
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        await self.engine.stop()
        self.traces.close()


def _nodelay(request: web.Request) -> None:
    # Tokens are small writes: Nagle would hold each one back for an ACK.
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def build_app(
    profile: Profile,
    trace_dir: Path | None,
    *,
    faults_enabled: bool = False,
    admin_token: str | None = None,
) -> web.Application:
    sim = Sim(profile, trace_dir)
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = sim.engine
    app.router.add_post("/v1/chat/completions", sim.endpoint("chat"))
    app.router.add_post("/v1/completions", sim.endpoint("completions"))
    app.router.add_post("/completion", sim.endpoint("llama"))
    app.router.add_post("/completions", sim.endpoint("llama"))
    app.router.add_post("/tokenize", sim.tokenize)
    app.router.add_get("/health", sim.health)
    app.router.add_get("/v1/models", sim.models)
    app.router.add_get("/metrics", sim.metrics_endpoint)
    app.router.add_get("/traces/{kind}", sim.trace)
    admin.add_routes(app, sim.engine, faults_enabled=faults_enabled, token=admin_token)
    app.on_startup.append(sim.on_startup)
    app.on_cleanup.append(sim.on_cleanup)
    return app


__all__ = ["ENGINE", "build_app", "error_response"]
