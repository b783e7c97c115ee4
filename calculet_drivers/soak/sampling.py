"""What a soak samples while it runs: the server's traces appended to `server/`, this
client's memory into `client/resources.jsonl`, and `/health` into `soak/health.jsonl`."""

from __future__ import annotations

import time

import gevent
import gevent.pool
import psutil

from calculet_drivers.soak.soakrun import SoakRun
from calculet_drivers.soak.state import TRACE_KINDS, JsonLines

__all__ = ["SoakSampling"]


class SoakSampling(SoakRun):
    """The samplers, each a loop run beside the load."""

    def _traces_loop(self) -> None:
        every = max(self._every(self.stage.sampling.traces_every_s), 1.0)
        while True:
            gevent.sleep(every)
            self._collect_traces()

    def _collect_traces(self, final: bool = False) -> None:
        if final:
            gevent.sleep(0.5)  # the target flushes its trace files periodically
        out = self.run_dir / "server"
        out.mkdir(parents=True, exist_ok=True)
        self.plan["trace_collections"] = self.plan.get("trace_collections", 0) + 1
        for kind in TRACE_KINDS:
            try:
                data = self.api.trace_bytes(kind)
            except OSError as exc:
                if final:
                    self.notes.append(f"traces {kind}: {exc}")
                continue
            if data:
                with (out / f"{kind}.jsonl").open("ab") as f:
                    f.write(data)

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
