"""A target that is not Calculet: the simulator behind a small streaming proxy whose
`/traces/*` answers as a plain OpenAI server or a gateway would.

    python -m tests.support.traceless UPSTREAM_URL --traces 404|500|html

prints `listening on http://127.0.0.1:PORT` once it serves (port 0: a free one). Every
other path is passed through to UPSTREAM_URL, the response streamed back as it arrives
(SSE included), so requests are measured as against the simulator itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

import aiohttp
from aiohttp import web

_KEEP = ("content-type", "x-request-id")


def app(upstream: str, traces: str) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/traces/"):
            if traces == "html":  # a catch-all page, as some gateways answer
                return web.Response(
                    text="<html><body>hello</body></html>\n", content_type="text/html"
                )
            status = int(traces)
            return web.Response(status=status, text=f"HTTP {status}")
        session: aiohttp.ClientSession = request.app["session"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with session.request(
            request.method, upstream + request.path_qs, headers=headers, data=await request.read()
        ) as up:
            resp = web.StreamResponse(
                status=up.status,
                headers={k: v for k, v in up.headers.items() if k.lower() in _KEEP},
            )
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def on_startup(a: web.Application) -> None:
        a["session"] = aiohttp.ClientSession(auto_decompress=False)

    async def on_cleanup(a: web.Application) -> None:
        await a["session"].close()

    a = web.Application()
    a.router.add_route("*", "/{tail:.*}", handle)
    a.on_startup.append(on_startup)
    a.on_cleanup.append(on_cleanup)
    return a


async def _serve(upstream: str, traces: str) -> None:
    runner = web.AppRunner(app(upstream.rstrip("/"), traces))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="traceless")
    p.add_argument("upstream")
    p.add_argument("--traces", default="404", help="404, 500 or html")
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.upstream, args.traces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
