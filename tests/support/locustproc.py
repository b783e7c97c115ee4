"""Real Locust master/worker processes on loopback for integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
LOCUSTFILE = str(REPO / "locustfiles" / "calculet.py")


def stop_processes(procs: list[subprocess.Popen[Any]], timeout_s: float = 15) -> None:
    """SIGTERM to each process still running, then wait for each; kill what outlives
    `timeout_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass
class LocustRun:
    """A headless master with N workers (or one local process when workers == 0)."""

    tmp: Path
    host: str
    args: list[str]
    workers: int = 2
    run_time_s: float = 10.0
    locustfile: str = LOCUSTFILE
    # put before every command, e.g. ["ip", "netns", "exec", NS]: the client elsewhere
    prefix: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.run_dir = self.tmp / f"run-{time.monotonic_ns()}"
        self.json_prefix = self.tmp / f"stats-{time.monotonic_ns()}"  # Locust adds .json

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}-{time.monotonic_ns()}.log"
        self.logs.append(log)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.procs.append(proc)
        return proc

    def start(self) -> LocustRun:
        base = [*self.prefix, sys.executable, "-m", "locust", "-f", self.locustfile]
        common = ["--headless", "-H", self.host, "--run-dir", str(self.run_dir)]
        common += ["-t", f"{round(self.run_time_s)}s", "--json-file", str(self.json_prefix)]
        if self.workers == 0:
            self.master = self._spawn("local", [*base, *common, *self.args])
            return self
        port = free_port()
        self.master = self._spawn(
            "master",
            [
                *base,
                "--master",
                "--master-bind-host",
                "127.0.0.1",
                "--master-bind-port",
                str(port),
                "--expect-workers",
                str(self.workers),
                *common,
                *self.args,
            ],
        )
        for i in range(self.workers):
            self._spawn(
                f"worker{i}",
                [*base, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port)],
            )
        return self

    def wait(self, timeout_s: float = 90.0) -> int:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            left = max(deadline - time.monotonic(), 0.1)
            try:
                p.wait(left)
            except subprocess.TimeoutExpired:
                self.stop()
                msg = f"locust did not end in {timeout_s} s:\n{self.log_text()}"
                raise AssertionError(msg) from None
        return int(self.master.returncode)

    def stop(self) -> None:
        stop_processes(self.procs)

    def log_text(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}" for log in self.logs
        )

    # --- what the run left -------------------------------------------------------------
    def index(self) -> dict[str, Any]:
        return dict(json.loads((self.run_dir / "client" / "index.json").read_text()))

    def requests(self) -> pa.Table:
        parts = sorted((self.run_dir / "client").glob("*/part-*.requests.parquet"))
        assert parts, f"no request parts in {self.run_dir}\n{self.log_text()}"
        return pa.concat_tables(pq.read_table(p) for p in parts)

    def token_events(self) -> pa.Table:
        parts = sorted((self.run_dir / "client").glob("*/part-*.tokens.parquet"))
        assert parts, f"no token parts in {self.run_dir}\n{self.log_text()}"
        return pa.concat_tables(pq.read_table(p) for p in parts)

    def locust_stats(self) -> dict[str, dict[str, Any]]:
        rows = json.loads(Path(f"{self.json_prefix}.json").read_text())
        return {r["name"]: r for r in rows}
