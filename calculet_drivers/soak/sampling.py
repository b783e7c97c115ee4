"""What a soak samples while it runs: the server's traces appended to `server/`, this
client's memory into `client/resources.jsonl`, and `/health` into `soak/health.jsonl`."""

from __future__ import annotations

import time

import gevent
import gevent.pool
import psutil

from calculet_drivers.skeleton.jsonl import JsonLines
from calculet_drivers.soak.soakrun import SoakRun

__all__ = ["SoakSampling"]


class SoakSampling(SoakRun):
    """The samplers, each a loop run beside the load."""

    def _traces_loop(self) -> None:
        every = max(self._every(self.stage.sampling.traces_every_s), 1.0)
        while True:
            gevent.sleep(every)
            self._collect_traces()

    def _collect_traces(self, final: bool = False) -> None:
        self.plan["trace_collections"] = self.plan.get("trace_collections", 0) + 1
        self.notes.extend(self.traces.append(final))

    def _client_loop(self) -> None:
        every = self._every(self.stage.sampling.client_every_s)
        while True:
            self._client_sample()
            gevent.sleep(every)

    def _client_sample(self) -> None:
        if not hasattr(self, "_client_rows"):
            self._client_rows = JsonLines(self.run_dir / "client" / "resources.jsonl")
            self._proc = psutil.Process()
        mem = self._proc.memory_info()
        self._client_rows.write(
            {
                "wall_ns": time.time_ns(),
                "mono_ns": time.monotonic_ns(),
                "worker": self.worker,
                "rss_bytes": mem.rss,
                "in_flight": self.session.in_flight,
                "sent": self.counts["sent"],
            }
        )

    def _health_loop(self) -> None:
        every = self._every(self.stage.sampling.resources_every_s)
        rows = JsonLines(self.run_dir / "soak" / "health.jsonl")
        while True:
            wall = time.time_ns()
            try:
                status, body = self.api.health()
            except OSError as exc:
                status, body = None, str(exc)
            rows.write({"wall_ns": wall, "worker": self.worker, "status": status, "body": body})
            gevent.sleep(every)
