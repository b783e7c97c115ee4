"""Sampling the server's resources during a run into `server/resources.jsonl` (spec §13).

`sample_resources(url, admin_token)` reads the target's `/metrics` (Prometheus text:
the figures a real Calculet service is asked to expose) and, given the admin token,
`/admin/state` (the simulator's, which fills what /metrics lacks), and
returns one `calculet_load.schema.ResourceRow` as a dict; a figure neither exposes is
None. `ResourceSampler` takes a sample every `interval_s` on its own thread and appends
it to the run folder's file; `calculet-load analyze` judges the series (analysis.judge.resources).

Blocking I/O on a plain thread: it never runs on (or patches) a gevent loop.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from calculet_load.schema import ResourceRow, row_to_dict
from calculet_load.schema.prometheus import (
    FLOAT_FIELDS,
    METRIC_NAMES,
    parse_metrics,
    resource_fields,
)

__all__ = [
    "METRIC_NAMES",
    "RESOURCES_FILE",
    "ResourceSampler",
    "parse_metrics",
    "resource_fields",
    "sample_resources",
]

RESOURCES_FILE = "server/resources.jsonl"


def _get(url: str, token: str | None, timeout_s: float) -> bytes:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
        req.add_header("X-Operator", "calculet-load-resources")
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return bytes(resp.read())


def _from_state(state: dict[str, Any]) -> dict[str, Any]:
    proc = state.get("process") or {}
    kv = state.get("kv") or {}
    pool = state.get("buffer_pool") or {}
    queue = state.get("queue") or {}
    return {
        "rss_bytes": proc.get("rss_bytes"),
        "fds": proc.get("open_fds"),
        "threads": proc.get("threads"),
        "kv_allocated_tokens": kv.get("allocated_tokens"),
        "kv_quarantined_tokens": kv.get("quarantined_tokens"),
        "leases": pool.get("leased"),
        "leases_free": pool.get("free"),
        "leases_total": pool.get("total"),
        "sequences_active": state.get("sequences_active"),
        "requests_queued": queue.get("waiting"),
        "time_scale": state.get("time_scale"),
        "kv_free_blocks": kv.get("free_blocks"),
        "kv_largest_free_extent_tokens": kv.get("largest_free_extent_tokens"),
    }


def sample_resources(
    url: str, admin_token: str | None = None, *, timeout_s: float = 5.0
) -> dict[str, Any]:
    """One ResourceRow (as a dict) of the server at `url`, stamped when taken.

    /metrics gives the process, KV, lease, queue and device-memory figures; the admin
    state (with a token) fills what /metrics lacks and the simulator's time scale. A
    source that cannot be read leaves its figures None; raises OSError only when
    neither could be read."""
    wall, mono = time.time_ns(), time.monotonic_ns()
    values: dict[str, Any] = {}
    errors = []
    base = url.rstrip("/")
    try:
        metrics = parse_metrics(_get(base + "/metrics", None, timeout_s).decode())
        values.update(resource_fields(metrics))
    except (OSError, urllib.error.URLError, UnicodeDecodeError) as exc:
        errors.append(f"/metrics: {exc}")
    if admin_token:
        try:
            state = json.loads(_get(base + "/admin/state", admin_token, timeout_s))
            for field, value in _from_state(state).items():
                if value is not None and values.get(field) is None:
                    values[field] = float(value) if field in FLOAT_FIELDS else int(value)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            errors.append(f"/admin/state: {exc}")
    if not values and errors:
        raise OSError(f"{base}: no resource figures: {'; '.join(errors)}")
    return row_to_dict(ResourceRow(wall_ns=wall, mono_ns=mono, **values))


class ResourceSampler:
    """Samples every `interval_s` on a daemon thread, appending JSON lines to `path`
    (`<run>/server/resources.jsonl`); a failed sample is skipped and counted."""

    def __init__(
        self,
        url: str,
        path: str | Path,
        *,
        admin_token: str | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.url, self.admin_token, self.interval_s = url, admin_token, interval_s
        self.path = Path(path)
        self.samples = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="resources", daemon=True)

    def start(self) -> ResourceSampler:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def sample_once(self) -> None:
        try:
            row = sample_resources(self.url, self.admin_token)
        except OSError:
            self.failures += 1
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
        self.samples += 1

    def _loop(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            due += self.interval_s
            self._stop.wait(max(0.0, due - time.monotonic()))

    def stop(self) -> None:
        """Stop after a last sample (the quiescent state after the run)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.sample_once()
