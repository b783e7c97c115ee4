"""A real `calculet-sim` process on loopback, and a small HTTP/SSE client for tests."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from calculet_load.measure.sse import SSEEvent, SSEParser

ADMIN_TOKEN = "test-admin-token-0123456789abcdef"
# simulator options: a queue that waits rather than rejects (a busy test machine makes a
# time-scaled simulator fall behind; a test about something else must not see 503s)
PATIENT_QUEUE = (
    "--set",
    "scheduling.queue_max=100000",
    "--set",
    "scheduling.admission_timeout_s=1e9",
)


@dataclass
class Stream:
    status: int
    headers: dict[str, str]
    events: list[tuple[int, SSEEvent]] = field(default_factory=list)
    raw: bytes = b""

    def json_events(self) -> list[dict[str, Any]]:
        return [json.loads(e.data) for _, e in self.events if e.data != "[DONE]"]


class _Forked:
    """A simulator forked by tests.support.simzygote, with the part of Popen's interface the tests
    use (pid, poll, wait, send_signal, kill, returncode, stdout)."""

    def __init__(self, pid: int, status: socket.socket, stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None
        self._status = status

    def _read(self, timeout: float | None) -> None:
        if self.returncode is None and select.select([self._status], [], [], timeout)[0]:
            said = self._status.recv(64).strip()
            # no word at all: the fork server itself is gone (and sent its children SIGTERM)
            self.returncode = int(said) if said else -signal.SIGTERM
            self._status.close()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired("calculet-sim", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """This test process's fork server (tests.support.simzygote), started at its first use."""

    lock = threading.Lock()
    proc: subprocess.Popen[bytes] | None = None
    control: socket.socket | None = None

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str], stderr: int) -> _Forked:
        with cls.lock:
            if cls.proc is None or cls.proc.poll() is not None:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                cls.proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.support.simzygote", str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], cwd=REPO, stdin=subprocess.DEVNULL,
                )  # fmt: skip
                theirs.close()
                cls.control = ours
            assert cls.control is not None
            status_ours, status_theirs = socket.socketpair()
            out_r, out_w = os.pipe()
            try:
                req = {"argv": argv, "env": env, "cwd": os.getcwd()}
                socket.send_fds(
                    cls.control, [json.dumps(req).encode()], [status_theirs.fileno(), out_w, stderr]
                )
                said = cls.control.recv(64)
            finally:
                status_theirs.close()
                os.close(out_w)
            if not said:
                os.close(out_r)
                status_ours.close()
                raise RuntimeError("the simulators' fork server (tests.support.simzygote) is gone")
            return _Forked(int(said), status_ours, open(out_r, "rb"))


REPO = Path(__file__).resolve().parents[2]
# CALCULET_TEST_SIM_FORK=0: every simulator its own `python -m calculet_sim.cli` process
FORK = os.environ.get("CALCULET_TEST_SIM_FORK", "1") != "0"


class SimProcess:
    def __init__(
        self, tmp: Path, *args: str, faults: bool = False, env: dict[str, str] | None = None
    ) -> None:
        self.trace_dir = tmp / f"traces-{time.monotonic_ns()}"
        argv = ["--port", "0", "--trace-dir", str(self.trace_dir), *args]
        full_env = dict(os.environ)
        if faults:
            argv.append("--enable-faults")
            full_env["CALCULET_SIM_ADMIN_TOKEN"] = ADMIN_TOKEN
        full_env.update(env or {})
        self.stderr_path = tmp / f"sim-stderr-{time.monotonic_ns()}.txt"
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115
        # a variable read when a process starts (a preload, the interpreter's own) needs exec
        exec_env = any(k.startswith(("LD_", "PYTHON", "FAKETIME")) for k in env or {})
        self.proc: subprocess.Popen[bytes] | _Forked
        if FORK and not exec_env:
            self.proc = _Zygote.start(argv, full_env, self._stderr.fileno())
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "calculet_sim.cli", *argv],
                stdout=subprocess.PIPE, stderr=self._stderr, env=full_env,
            )  # fmt: skip
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline().decode() if ready else ""
        if "listening on http://" not in line:
            self.stop()
            raise RuntimeError(f"sim did not start: {line!r} {self.stderr_path.read_text()}")
        self.url = line.strip().rsplit(" ", 1)[1]
        hostport = self.url.removeprefix("http://")
        self.host, port = hostport.rsplit(":", 1)
        self.port = int(port)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._stderr.close()

    def conn(self, timeout: float = 30) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
        timeout: float = 30,
    ) -> tuple[int, dict[str, str], bytes]:
        c = self.conn(timeout)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        c.request(method, path, body=data, headers=hdrs)
        r = c.getresponse()
        out = r.read()
        c.close()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, out

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, _, out = self.request(method, path, body, **kw)
        return status, json.loads(out)

    def admin(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "X-Operator": "pytest"}
        return self.json(method, path, body, headers=headers)

    def state(self) -> dict[str, Any]:
        status, body = self.admin("GET", "/admin/state")
        assert status == 200, body
        return body  # type: ignore[no-any-return]

    def stream(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
        timeout: float = 60,
        stop_after_events: int | None = None,
    ) -> Stream:
        """POST and read the SSE stream, stamping each read when it returns."""
        c = self.conn(timeout)
        c.request("POST", path, body=json.dumps(body).encode(), headers=headers or {})
        r = c.getresponse()
        result = Stream(r.status, {k.lower(): v for k, v in r.getheaders()})
        parser = SSEParser()
        chunks = []
        while True:
            data = r.read1(65536)
            t = time.monotonic_ns()
            if not data:
                break
            chunks.append(data)
            result.events += [(t, e) for e in parser.feed(data)]
            if stop_after_events is not None and len(result.events) >= stop_after_events:
                c.close()  # the client goes away mid-stream
                break
        result.raw = b"".join(chunks)
        c.close()
        return result

    def traces(self, kind: str) -> list[dict[str, Any]]:
        status, _, body = self.request("GET", f"/traces/{kind}")
        assert status == 200
        return [json.loads(line) for line in body.splitlines() if line]

    def audit(self) -> list[dict[str, Any]]:
        path = self.trace_dir / "audit.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x]

    def wait_for(self, cond: Any, timeout: float = 20, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")
