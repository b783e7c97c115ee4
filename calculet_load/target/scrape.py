"""Sampling the target while a run goes on: its `/metrics` and its process (§10.2, §10.3).

`ServerSampler` scrapes the server's Prometheus exposition every `interval_s` seconds
into `server/metrics.jsonl`, and, when the server runs on this host, samples its process
(RSS, CPU, threads, open FDs, with and without its children) with psutil into
`server/process.jsonl` (row shapes: `calculet_load.schema.scrape`). The Locust master
(or a single local process) runs one for every run; any other process can run one too.

It runs on a `threading.Thread`: a real thread in a plain process, a greenlet where
gevent has patched threading (Locust), so it never blocks an event loop on a socket.
What would still block a loop (psutil's reads of /proc: finding the server by its port
takes ~80 ms; an object store's writes) goes to gevent's thread pool there, so a
local run's loop, which stamps tokens, keeps running. The parser is a single pass over
the text lines (prometheus_client's parser takes ~4 ms for the simulator's exposition).

The run folder may be a local path (rows are appended and flushed one by one, so a
crash loses nothing written) or an object-store URI, which cannot append: there the
whole file is rewritten at most every `flush_s` seconds and at the end.
"""

from __future__ import annotations

import dataclasses
import http.client
import ipaddress
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import psutil
import pyarrow.fs as pafs

from calculet_load.schema.access import TargetAccess
from calculet_load.schema.fs import resolve_fs
from calculet_load.schema.prometheus import parse_exposition  # the one parser
from calculet_load.schema.scrape import (
    SERVER_METRICS_FILE,
    SERVER_PROCESS_FILE,
    MetricsScrapeRow,
    ProcessRow,
)
from calculet_load.schema.traces import row_to_dict

__all__ = [
    "JsonlAppender",
    "ServerSampler",
    "find_server_pid",
    "parse_exposition",
    "sample_process",
    "sampler_for_run",
]

log = logging.getLogger("calculet_load")

MAX_BODY_BYTES = 16 << 20  # a /metrics body larger than this is refused, not parsed

T = TypeVar("T")


def _pooled_if_patched(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` through `target.api.off_loop` (gevent's thread pool) when gevent
    patched this process, else here: the sampler also runs in a native thread of a
    process gevent did not patch, where the call belongs inline (and gevent unimported)."""
    if "gevent" in sys.modules:
        from gevent import monkey

        if monkey.is_module_patched("threading"):
            from calculet_load.target.api import off_loop  # imports gevent

            return off_loop(lambda: fn(*args))
    return fn(*args)


# ------------------------------------------------------------------ the process
def _is_this_host(host: str) -> bool:
    try:
        addrs = {str(ai[4][0]) for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local = {a.address for addrs_ in psutil.net_if_addrs().values() for a in addrs_}
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in local for a in addrs)


def find_server_pid(url: str) -> int | None:
    """The pid listening on the URL's port, when the URL's host is this host (None when
    it is elsewhere, or the listener's owner cannot be seen)."""
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not _is_this_host(parts.hostname):
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


def _own(proc: psutil.Process) -> tuple[int, int, float, int, int]:
    with proc.oneshot():
        mem = proc.memory_info()
        cpu = proc.cpu_times()
        return mem.rss, mem.vms, cpu.user + cpu.system, proc.num_threads(), proc.num_fds()


def _unread(wall: int, mono: int, pid: int, *, alive: bool, error: str) -> ProcessRow:
    known = ("wall_ns", "mono_ns", "pid", "alive", "error")
    unread = {f.name: None for f in dataclasses.fields(ProcessRow) if f.name not in known}
    return ProcessRow(wall, mono, pid, alive, error=error, **unread)


def sample_process(
    proc: psutil.Process, clock: Callable[[], int] = time.monotonic_ns
) -> ProcessRow:
    """One ProcessRow of `proc`; a process that is gone gives alive=False and Nones."""
    wall, mono = time.time_ns(), clock()
    try:
        rss, vms, cpu_s, threads, fds = _own(proc)
        cpu_pct = proc.cpu_percent(None)
        children = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return _unread(wall, mono, proc.pid, alive=False, error="process gone")
    except psutil.AccessDenied as exc:
        return _unread(wall, mono, proc.pid, alive=True, error=f"access denied: {exc}")
    tree = [rss, threads, fds]
    for child in children:
        try:
            c_rss, _, _, c_threads, c_fds = _own(child)
        except psutil.Error:
            continue  # a child that exits (or is not ours) between listing and reading
        tree = [tree[0] + c_rss, tree[1] + c_threads, tree[2] + c_fds]
    return ProcessRow(
        wall_ns=wall,
        mono_ns=mono,
        pid=proc.pid,
        alive=True,
        rss_bytes=rss,
        vms_bytes=vms,
        cpu_seconds=cpu_s,
        cpu_percent=cpu_pct,
        threads=threads,
        fds=fds,
        children=len(children),
        tree_rss_bytes=tree[0],
        tree_threads=tree[1],
        tree_fds=tree[2],
    )


# ------------------------------------------------------------------ the files
class JsonlAppender:
    """Rows appended to one JSONL file of a run folder (local: append + flush per row;
    object store: the whole file rewritten at most every `flush_s` and at close)."""

    def __init__(
        self,
        run_dir: str,
        rel: str,
        *,
        flush_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fs, root = resolve_fs(run_dir)
        self.path = f"{root.rstrip('/')}/{rel}"
        self.fs.create_dir(self.path.rsplit("/", 1)[0], recursive=True)
        self.flush_s = flush_s
        self._clock = clock
        self._local = isinstance(self.fs, pafs.LocalFileSystem)
        self._lines: list[bytes] = []
        self._flushed = clock()
        self._stream: Any = None
        if self._local:
            self._stream = self.fs.open_append_stream(self.path)
        elif self.fs.get_file_info(self.path).type == pafs.FileType.File:
            with self.fs.open_input_stream(self.path) as f:  # a resumed run keeps its rows
                self._lines = [x + b"\n" for x in bytes(f.read()).splitlines() if x]
        self.rows = 0

    def add(self, row: Any) -> None:
        line = (json.dumps(row_to_dict(row), separators=(",", ":")) + "\n").encode()
        self.rows += 1
        if self._local:
            self._stream.write(line)
            self._stream.flush()
            return
        self._lines.append(line)
        if self._clock() - self._flushed >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        if self._local:
            self._stream.flush()
            return
        tmp = self.path + ".tmp"
        with self.fs.open_output_stream(tmp) as f:
            f.write(b"".join(self._lines))
        self.fs.move(tmp, self.path)
        self._flushed = self._clock()

    def close(self) -> None:
        if self._local:
            if self._stream is not None:
                self._stream.close()
                self._stream = None
        else:
            self.flush()


# ------------------------------------------------------------------ the sampler
class ServerSampler:
    """Scrapes `metrics_url` and samples the server's process every `interval_s` seconds.

    The process is `pid`, or the one listening on `find_pid_of`'s port when that URL's
    host is this host (looked up on the sampler's thread, not the caller's)."""

    def __init__(
        self,
        run_dir: str,
        *,
        metrics_url: str | None,
        pid: int | None = None,
        find_pid_of: str | None = None,
        interval_s: float = 5.0,
        bucket_every: int = 12,
        timeout_s: float = 5.0,
        flush_s: float = 30.0,
        access: TargetAccess | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.run_dir = run_dir
        self.metrics_url = metrics_url
        # the target's TLS settings and headers, for a metrics URL on the target's origin
        self.access = access
        self.interval_s = interval_s
        self.bucket_every = max(bucket_every, 1)
        self.timeout_s = timeout_s
        self.flush_s = flush_s
        self.metrics_out = (
            JsonlAppender(run_dir, SERVER_METRICS_FILE, flush_s=flush_s) if metrics_url else None
        )
        self.proc: psutil.Process | None = None
        self.process_out: JsonlAppender | None = None
        self._pid = pid
        self._find_pid_of = find_pid_of
        self._attached = pid is None and find_pid_of is None
        self.scrapes = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> ServerSampler:
        self._thread = threading.Thread(target=self._run, name="calculet-scrape", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling, take a last sample (with buckets) and close the files."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 5.0)
            self._thread = None
        self.sample(final=True)
        for out in (self.metrics_out, self.process_out):
            if out is not None:
                _pooled_if_patched(out.close)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sample()
            except Exception:  # a bug: say so, keep sampling; the run goes on regardless
                log.exception("calculet: server sampling failed")
            self._stop.wait(max(self.interval_s - (time.monotonic() - started), 0.0))

    def sample(self, final: bool = False) -> None:
        """One scrape and one process sample (each when configured)."""
        with self._lock:
            if not self._attached:
                self._attached = True
                _pooled_if_patched(self._attach)
            if self.metrics_out is not None and self.metrics_url:
                buckets = final or self.scrapes % self.bucket_every == 0
                row = self._scrape(self.metrics_url, buckets)
                _pooled_if_patched(self.metrics_out.add, row)
                self.scrapes += 1
            if self.proc is not None and self.process_out is not None:
                _pooled_if_patched(
                    lambda p, out: out.add(sample_process(p)), self.proc, self.process_out
                )

    def _attach(self) -> None:
        """Find and open the server's process, and its file (once, on the first sample)."""
        pid = self._pid
        if pid is None and self._find_pid_of:
            pid = find_server_pid(self._find_pid_of)
        if pid is None:
            return
        try:
            proc = psutil.Process(pid)
            proc.cpu_percent(None)  # prime: the first call has no interval
        except psutil.Error as exc:
            log.warning("calculet: server process %d cannot be sampled: %s", pid, exc)
            return
        self.process_out = JsonlAppender(self.run_dir, SERVER_PROCESS_FILE, flush_s=self.flush_s)
        self.proc = proc
        log.info("calculet: sampling server process %d into %s", pid, SERVER_PROCESS_FILE)

    def _scrape(self, url: str, buckets: bool) -> MetricsScrapeRow:
        wall, mono = time.time_ns(), time.monotonic_ns()
        t = time.perf_counter()
        try:
            body = _get(url, self.timeout_s, self.access)
            samples = parse_exposition(body.decode("utf-8", "replace"), buckets=buckets)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("calculet: cannot scrape %s: %s (retrying every scrape)", url, exc)
            error = f"{type(exc).__name__}: {exc}"[:300]
            return MetricsScrapeRow(wall, mono, url, False, None, error, False, {})
        ms = (time.perf_counter() - t) * 1e3
        return MetricsScrapeRow(wall, mono, url, True, ms, None, buckets, samples)


def _get(url: str, timeout_s: float, access: TargetAccess | None = None) -> bytes:
    parts = urlsplit(url)
    headers: dict[str, str] = {}
    if access is not None and f"{parts.scheme}://{parts.netloc}" == access.origin:
        conn = access.connection(timeout_s)  # the target's TLS settings and headers
        headers = dict(access.request_headers())
    else:
        https = parts.scheme == "https"
        cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
        conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        path = parts.path or "/"
        conn.request("GET", path + (f"?{parts.query}" if parts.query else ""), headers=headers)
        resp = conn.getresponse()
        body = resp.read(MAX_BODY_BYTES + 1)
    finally:
        conn.close()
    if resp.status != 200:
        raise ValueError(f"HTTP {resp.status}")
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"body larger than {MAX_BODY_BYTES} bytes")
    return bytes(body)


def sampler_for_run(
    run_dir: str,
    target: str | None,
    *,
    interval_s: float,
    metrics_url: str = "",
    server_pid: int = 0,
    access: TargetAccess | None = None,
    metrics: bool = True,
) -> ServerSampler | None:
    """The sampler a run's options ask for, started; None when sampling is off.

    `metrics_url` defaults to TARGET/metrics (under the base path of `access`, with its
    TLS settings and headers) where the target has metrics (`metrics`: its profile's);
    `server_pid` 0 looks the server up by the target's port when it runs on this host, a
    negative value turns process sampling off."""
    if interval_s <= 0:
        return None
    if metrics_url:
        url = metrics_url
    elif not metrics:
        url = ""
    elif access is not None:
        url = access.resolve("/metrics")
    else:
        url = f"{target.rstrip('/')}/metrics" if target else ""
    pid = server_pid if server_pid > 0 else None
    find = target if server_pid == 0 and target else None
    if not url and pid is None and find is None:
        return None
    sampler = ServerSampler(
        run_dir,
        metrics_url=url or None,
        pid=pid,
        find_pid_of=find,
        interval_s=interval_s,
        access=access,
    )
    log.info(
        "calculet: sampling %s every %.3g s into server/ (server process: %s)",
        url or "no /metrics",
        interval_s,
        pid if pid is not None else "by the target's port" if find else "off",
    )
    return sampler.start()
