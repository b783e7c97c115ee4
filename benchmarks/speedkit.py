"""The measuring kit of benchmarks/client_speed.py (and event_parse.py): the exact-timing
server started and stopped (benchmarks/exact_server.py), one point's figures against
its truth, and the client's CPU over the steady middle of a point, by thread.

A module of its own: client_speed.py is the side-by-side benchmark (its clients, its
report, its speed targets); this is what any benchmark of a client against the exact
server measures with.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from calculet_load.measure.threads import ENGINE_THREAD, READER_THREAD, SINK_THREAD

SERVER = Path(__file__).resolve().parent / "exact_server.py"


def taskset(core: int | None) -> list[str]:
    if core is None or not shutil.which("taskset"):
        return []
    return ["taskset", "-c", str(core)]


# ----------------------------------------------------------------- the server
def launch(
    cmd: list[str], what: str, timeout_s: float = 30.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server that prints `listening on http://HOST:PORT` first (the simulator,
    the exact server); returns it and that URL, or exits naming `what` and its line."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().decode() if ready else ""
    if "listening on http://" not in line:
        stop_child(proc)
        raise SystemExit(f"{what} did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[1]


def stop_child(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a server `launch` started (killed after 10 s) and close its pipe."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def start_sim(core: int | None, args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """A calculet-sim process on 127.0.0.1 (pinned to `core`); returns it and its URL."""
    cmd = [sys.executable, "-m", "calculet_sim.cli", "--host", "127.0.0.1", "--port", "0"]
    return launch([*taskset(core), *cmd, *args], "sim")


class ExactServer:
    def __init__(self, core: int | None, ttft_ms: float, itl_ms: float, burst: int = 1) -> None:
        cmd = [*taskset(core), sys.executable, str(SERVER), "--port", "0"]
        cmd += ["--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), "--burst", str(burst)]
        self.proc, self.url = launch(cmd, "exact server", 20)
        self.host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)

    def truth(self) -> list[list[Any]]:
        """The requests completed since the last call: [id, recv ns, [send ns...], n]."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.request("GET", "/truth")
            return list(json.loads(conn.getresponse().read()))
        finally:
            conn.close()

    def stop(self) -> None:
        stop_child(self.proc)


# ---------------------------------------------------------------- one point
@dataclass
class Point:
    client: str
    mode: str  # "poisson" or "closed"
    level: float  # rate or users
    requests: int = 0  # completed requests the server counted
    failed: int = 0  # client-side failures (records with an error, peers' failures)
    rate: float = 0.0  # requests/s the server received in the steady window
    cpu_percent: float = float("nan")
    cpu_us_per_request: float = float("nan")
    err: dict[str, float] = field(default_factory=dict)  # "ttft_p50" -> ms
    cpu_ratio: float = float("nan")  # cpu per request / the reference's
    # calculet-load's CPU µs per request by thread over the same window: "engine" (the
    # I/O engine's loop), "reader" (its native reader), "main" (the greenlets), "sink"
    # (the writer), "other"
    threads: dict[str, float] = field(default_factory=dict)
    verdict: str = ""  # calculet: its own verdict (exit code and what it named)
    note: str = ""
    # the closed loop's turnaround, ms (p50, p99, mean): calculet-load's records'
    # `ext.turnaround_ms`, the client's own time around each request; the reference's
    # from a response's last token to the same user's next send (`user_turnaround`)
    turnaround: tuple[float, float, float] | None = None
    load: float = float("nan")  # the 1-minute load average when the point started

    @property
    def label(self) -> str:
        return f"{self.level:g}/s" if self.mode == "poisson" else f"C={self.level:g}"


def quantiles(values: list[float] | np.ndarray, qs: tuple[int, ...] = (50, 99)) -> list[float]:
    arr = np.asarray(values, dtype=float)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return [float("nan") for _ in qs]
    return [float(np.percentile(arr, q)) for q in qs]


def truth_figures(rows: list[list[Any]]) -> dict[str, list[float]]:
    ttft, itl, tpot = [], [], []
    for _rid, recv, sends, n in rows:
        if len(sends) != n or not sends:
            continue
        ttft.append((sends[0] - recv) / 1e6)
        itl.extend(np.diff(np.asarray(sends, dtype=np.int64)) / 1e6)
        if n > 1:
            tpot.append((sends[-1] - sends[0]) / 1e6 / (n - 1))
    return {"ttft": ttft, "itl": itl, "tpot": tpot}


def errors(reported: dict[str, Any], truth: dict[str, list[float]]) -> dict[str, float]:
    out = {}
    for key in ("ttft", "itl", "tpot"):
        rep = quantiles(reported.get(key, []))
        tru = quantiles(truth[key])
        out[f"{key}_p50"] = rep[0] - tru[0]
        out[f"{key}_p99"] = rep[1] - tru[1]
    return out


class CpuWindow:
    """The client's CPU and the server's request count over the steady middle of a point:
    from 1 s after the server saw its first request to 1 s before the load ends."""

    def __init__(self, server: ExactServer) -> None:
        self.server = server
        self.samples: list[tuple[float, float, int]] = []
        self.threads: list[dict[int, tuple[str, float]]] = []  # per sample: by thread
        self.last = 0

    def count(self) -> int:
        """Requests the server has received (the last answer when it is too busy to say)."""
        conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=10)
        try:
            conn.request("GET", "/count")
            self.last = int(json.loads(conn.getresponse().read())["received"])
        except OSError:
            pass  # a server saturated by the load: the window keeps its last count
        finally:
            conn.close()
        return self.last

    def watch(self, proc: subprocess.Popen[bytes], seconds: float) -> None:
        ps = psutil.Process(proc.pid)
        start = self.count()
        first = None
        while proc.poll() is None:
            n = self.count()
            now = time.monotonic()
            if first is None and n > start:
                first = now
            elif first is not None and (now - first >= 1.0) and not self.samples:
                self.samples.append((now, _cpu(ps), n))
                self.threads.append(_threads_cpu(proc.pid))
            elif self.samples and now - first >= seconds - 1.5:
                self.samples.append((now, _cpu(ps), n))
                self.threads.append(_threads_cpu(proc.pid))
                return
            time.sleep(0.1)

    def figures(self) -> tuple[float, float, float]:
        """(requests/s, CPU % of a core, CPU µs per request) over the window."""
        if len(self.samples) < 2:
            return float("nan"), float("nan"), float("nan")
        (t1, c1, n1), (t2, c2, n2) = self.samples[0], self.samples[-1]
        rate = (n2 - n1) / (t2 - t1)
        per = (c2 - c1) / (n2 - n1) * 1e6 if n2 > n1 else float("nan")
        return rate, 100 * (c2 - c1) / (t2 - t1), per

    def thread_figures(self) -> dict[str, float]:
        """CPU µs per request by thread kind over the window, from the threads alive at
        both ends (one that started or ended meanwhile is left out)."""
        if len(self.samples) < 2 or len(self.threads) < 2:
            return {}
        n = self.samples[-1][2] - self.samples[0][2]
        a, b = self.threads[0], self.threads[-1]
        out: dict[str, float] = {}
        for tid, (kind, s) in b.items():
            if tid in a and a[tid][0] == kind and n > 0:
                out[kind] = out.get(kind, 0.0) + (s - a[tid][1]) / n * 1e6
        return out


def _threads_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Process `pid`'s threads: each one's kind (its main thread, the threads
    calculet-load names in measure.threads: the I/O engine's loop, its native reader, the
    sink's writer; "other") and CPU seconds, from its scheduler statistics (ns on the CPU; a kernel
    without them: its user and system ticks)."""
    kinds = {ENGINE_THREAD: "engine", READER_THREAD: "reader", SINK_THREAD: "sink"}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):  # it ended meanwhile
                task, tid = f"/proc/{pid}/task/{name}", int(name)
                with open(f"{task}/comm") as f:
                    comm = f.read().strip()
                try:
                    with open(f"{task}/schedstat") as f:
                        cpu_s = int(f.read().split()[0]) / 1e9
                except FileNotFoundError:
                    with open(f"{task}/stat") as f:  # fields 14, 15 after the (comm)
                        fields = f.read().rsplit(")", 1)[1].split()
                    cpu_s = (int(fields[11]) + int(fields[12])) / tick
                out[tid] = ("main" if tid == pid else kinds.get(comm, "other"), cpu_s)
    return out


def _cpu_of(ps: psutil.Process) -> float:
    """CPU seconds of one process, all its threads: Linux's process CPU clock (ns; the
    clock id of `clock_getcpuclockid`), else psutil's ticks (10 ms: a short window of a
    light client read 0 ticks)."""
    try:
        return time.clock_gettime_ns(((~ps.pid) << 3) | 2) / 1e9
    except OSError:
        t = ps.cpu_times()
        return float(t.user + t.system)


def _cpu(ps: psutil.Process) -> float:
    """CPU seconds of the process and its children (a peer may fork workers)."""
    try:
        total = _cpu_of(ps)
        for child in ps.children(recursive=True):
            with contextlib.suppress(psutil.Error, OSError):  # it ended meanwhile
                total += _cpu_of(child)
        return total
    except psutil.Error:
        return float("nan")
