"""Blocking HTTP calls to the target's admin, health, metrics and trace endpoints, run in
gevent's thread pool so that the event loop (and every request it is timing) keeps going.

Used by the fault matrix, the soak and the capacity search. Every path is resolved under
the target's base path, with its TLS settings and headers (calculet_load.schema.access);
the admin token replaces the API key's Authorization on admin calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import gevent

from calculet_load.schema.access import TargetAccess, access_of

T = TypeVar("T")


def off_loop(fn: Callable[[], T]) -> T:
    """Run a blocking call in gevent's thread pool (inside a gevent loop); its exception
    is raised here, in the caller (the pool would also print it as an unhandled error)."""

    def call() -> tuple[bool, Any]:
        try:
            return True, fn()
        except Exception as exc:
            return False, exc

    ok, value = gevent.get_hub().threadpool.apply(call)
    if not ok:
        raise value
    result: T = value
    return result


class HTTPStatusError(OSError):
    """The target answered, with a status other than the one expected (`status`)."""

    def __init__(self, path: str, status: int) -> None:
        super().__init__(f"{path}: HTTP {status}")
        self.status = status


class TargetAPI:
    """The target's non-generation endpoints: `/admin/*` (with the bearer token),
    `/health`, `/metrics`, `/traces/{kind}?offset=N`."""

    def __init__(
        self,
        url: str | TargetAccess,
        admin_token: str | None = None,
        *,
        operator: str = "calculet-load",
        timeout_s: float = 120.0,
    ) -> None:
        self.access = access_of(url)
        self.url = self.access.url
        self.host = self.access.host
        self.port = self.access.port
        self.token = admin_token
        self.operator = operator
        self.timeout_s = timeout_s
        self.offsets: dict[str, int] = {}
        # when a list: every answered admin call (and audit read) is appended to it, so
        # that the target's audit log can be checked against it (spec §12.4)
        self.journal: list[dict[str, Any]] | None = None

    def _call(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        headers = {"X-Operator": self.operator}
        admin = path.startswith("/admin/") or path.startswith("/traces/audit")
        if admin and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        sent: list[int] = []
        status, raw, head = self.access.call(
            method,
            path,
            data,
            headers,
            timeout_s or self.timeout_s,
            on_sent=lambda: sent.append(time.time_ns()),
        )
        if self.journal is not None and admin and self.token:
            self.journal.append(
                {"wall_ns": sent[0], "method": method, "path": path, "status": status}
            )
        return status, raw, head

    def call(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        """(status, body bytes, headers); raises OSError when the target is unreachable."""
        return off_loop(lambda: self._call(method, path, body, timeout_s))

    def json(
        self, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> tuple[int, Any]:
        status, raw, _ = self.call(method, path, body, timeout_s)
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw[:300].decode("utf-8", "replace")

    def state(self) -> dict[str, Any]:
        status, body = self.json("GET", "/admin/state")
        if status != 200 or not isinstance(body, dict):
            raise OSError(f"/admin/state: HTTP {status}: {str(body)[:200]}")
        return body

    def health(self) -> tuple[int, Any]:
        return self.json("GET", "/health")

    def metrics_text(self) -> str:
        status, raw, _ = self.call("GET", "/metrics", timeout_s=30)
        if status != 200:
            raise OSError(f"/metrics: HTTP {status}")
        return raw.decode("utf-8", "replace")

    def metric(self, name: str) -> float | None:
        """One unlabelled sample of the Prometheus text (None when absent)."""
        for line in self.metrics_text().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                try:
                    return float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    return None
        return None

    def trace_bytes(self, kind: str, timeout_s: float = 60.0) -> bytes:
        """The new complete lines of a trace since the last call (offsets kept per kind).
        An answer other than 200 raises `HTTPStatusError` (its `status`)."""
        offset = self.offsets.get(kind, 0)
        path = f"/traces/{kind}?offset={offset}"
        status, raw, _ = self.call("GET", path, timeout_s=timeout_s)
        if status != 200:
            raise HTTPStatusError(f"/traces/{kind}", status)
        end = raw.rfind(b"\n") + 1  # a line still being written is read next time
        self.offsets[kind] = offset + end
        return raw[:end]

    def trace_rows(self, kind: str) -> list[dict[str, Any]]:
        """The new complete rows of a trace since the last call, parsed."""
        rows = []
        for line in self.trace_bytes(kind).splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
        return rows

    def audit_log(self) -> tuple[int, bytes]:
        """(status, the whole audit log): `GET /traces/audit` with the admin token."""
        status, raw, _ = self.call("GET", "/traces/audit?offset=0", timeout_s=60)
        return status, raw

    def skip_to_end(self, kind: str) -> None:
        """Start reading a trace from its current end (the bytes are read once)."""
        self.trace_rows(kind)

    def wait_until(
        self, pred: Callable[[], Any], timeout_s: float, interval_s: float = 0.01
    ) -> Any:
        """Poll pred() (may block, may raise OSError) until truthy; None on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = pred()
            if value:
                return value
            if time.monotonic() >= deadline:
                return None
            gevent.sleep(interval_s)


def time_scale(api: TargetAPI, hint: float | None) -> float:
    """Real seconds per target second: `hint` (`--time-scale-hint`) when given, else the
    `time_scale` of `/admin/state` (the simulator's `--time-scale`; needs the admin
    token), else 1 (a real server, or the state not readable). Used by the soak and the
    capacity search; call it inside the gevent loop (the state is read off the loop)."""
    if hint:  # None or 0: not given
        return float(hint)
    if api.token:
        try:
            return float(api.state().get("time_scale") or 1.0)
        except (OSError, TypeError, ValueError):
            pass
    return 1.0
