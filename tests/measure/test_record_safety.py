"""End to end: no record is ever lost to another record's value.

Real processes on loopback: a `calculet-sim`, a rewriting proxy in front of it (this test's
own, standing for a hostile or buggy server: one response's final llama.cpp event says
`"tokens_predicted": 2**70`), and a headless Locust run of calculet-load's locustfile.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pyarrow.compute as pc
import pytest
from aiohttp import web

from calculet_load.measure.preflight import REQUEST_ID as PREFLIGHT_ID
from tests.support.locustproc import LocustRun
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(120)

HUGE = 2**70
POISONED_REQUEST = 100  # the proxy rewrites the final event of this /completion response


class RewritingProxy:
    """Forwards every request to `upstream`; in the `nth` streamed `/completion` response
    the final event's `tokens_predicted` becomes `value`. Counts the responses it passed."""

    def __init__(self, upstream: str, nth: int, value: int) -> None:
        self.upstream, self.nth, self.value = upstream, nth, value
        self.completions = 0
        self.rewritten: str | None = None  # the request id of the rewritten response
        self.url = ""
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> RewritingProxy:
        self._thread.start()
        assert self._ready.wait(10), "proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()

    def _main(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(auto_decompress=False) as self._client:
            self._ready.set()
            await self._stop.wait()
        await runner.cleanup()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with self._client.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as up:
            start_check = request.headers.get("X-Request-Id") == PREFLIGHT_ID  # not a record
            if (
                request.path != "/completion"
                or "text/event-stream" not in up.content_type
                or start_check
            ):
                data = await up.read()
                return web.Response(status=up.status, body=data, content_type=up.content_type)
            self.completions += 1
            poison = self.completions == self.nth
            out = web.StreamResponse(status=up.status)
            out.content_type = "text/event-stream"
            rid = up.headers.get("X-Request-Id")
            if rid:
                out.headers["X-Request-Id"] = rid
            await out.prepare(request)
            buf = b""
            async for chunk in up.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if poison and b'"stop":true' in event:
                        event = re.sub(
                            rb'"tokens_predicted":\d+', b'"tokens_predicted":%d' % self.value, event
                        )
                        self.rewritten = rid or request.headers.get("X-Request-Id")
                    await out.write(event + b"\n\n")
            if buf:
                await out.write(buf)
            await out.write_eof()
            return out


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimProcess]:
    s = SimProcess(tmp_path, "--profile", "firehose")
    try:
        yield s
    finally:
        s.stop()


def _local_run(tmp_path: Path, url: str, *, users: int, seconds: int) -> LocustRun:
    """A one-process headless run of short llama.cpp requests (16-token prompts, 4 out)."""
    args = ["-u", str(users), "-r", str(users), "--protocol", "llama"]
    args += ["--prompt-tokens", "16", "--max-tokens", "4"]
    return LocustRun(tmp_path, url, args, workers=0, run_time_s=seconds)


def _analyze(run_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "calculet_drivers.cli", "analyze", str(run_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.quiet  # hundreds of records in a 6 s run: a busy machine sends fewer
def test_one_out_of_range_counter_among_hundreds_costs_only_its_own_record(
    tmp_path: Path, sim: SimProcess
) -> None:
    with RewritingProxy(sim.url, POISONED_REQUEST, HUGE) as proxy:
        run = _local_run(tmp_path, proxy.url, users=4, seconds=6).start()
        run.wait(90)
        completions = proxy.completions
    assert proxy.rewritten is not None, run.log_text()
    t = run.requests()
    assert completions >= 500, f"only {completions} responses: the case needs >= 500"
    # every response the proxy passed has its record (a request cut by the run's stop
    # may have a record the proxy never finished: hence >=)
    assert t.num_rows >= completions
    ids = t.column("request_id").to_pylist()
    assert proxy.rewritten in ids
    bad = t.filter(pc.equal(t.column("request_id"), proxy.rewritten)).to_pylist()[0]
    assert bad["ext.error_class"] == "value_out_of_range"
    assert bad["ext.invalid_value"] == str(HUGE)
    assert bad["ext.client_output_tokens"] == 4  # what arrived before the bad event stands
    classes = t.column("ext.error_class").to_pylist()
    assert classes.count("value_out_of_range") == 1
    cut = t.column("ext.cancelled_at").to_pylist()
    others = {
        (c, w) for c, w in zip(classes, cut, strict=True) if c not in (None, "value_out_of_range")
    }
    assert others <= {("cancelled", "run_stop")}, others  # only the users cut by the stop
    assert classes.count(None) >= completions - 1 - 4
    index = run.index()
    assert index["status"] == "complete", index
    assert all(w["sink"]["quarantined"] == 0 and not w["sink"]["errors"] for w in index["workers"])
    assert not list(run.run_dir.glob("client/*/quarantine-*"))


def test_a_record_the_sink_cannot_write_makes_the_run_incomplete_and_loud(
    tmp_path: Path, sim: SimProcess
) -> None:
    locustfile = str(Path(__file__).parents[1] / "data" / "poison_locustfile.py")
    run = _local_run(tmp_path, sim.url, users=2, seconds=4)
    run.locustfile = locustfile
    run.start()
    code = run.wait(90)
    log = run.log_text()
    assert code == 3, log
    assert "INCOMPLETE" in log and "1 row(s) quarantined" in log
    t = run.requests()
    ids = t.column("request_id").to_pylist()
    assert len(ids) >= 100 and not any(i.endswith(".00000050") for i in ids)
    index = run.index()
    assert index["status"] == "incomplete"
    (worker,) = index["workers"]
    assert worker["status"] == "incomplete" and worker["sink"]["quarantined"] == 1
    (qfile,) = worker["sink"]["quarantine_files"]
    lines = (run.run_dir / "client" / worker["worker"] / qfile).read_text().splitlines()
    row = json.loads(lines[0])["row"]
    assert row["request_id"].endswith(".00000050") and row["ext"]["server_output_tokens"] == HUGE
    result = _analyze(run.run_dir)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "1 row(s) not in the Parquet parts (1 quarantined" in result.stdout + result.stderr
