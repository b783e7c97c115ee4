"""Loaded beside locustfiles/calculet.py by benchmarks/master_capacity.py's master only:
counts what the workers send (messages and bytes by type, as they arrive, before Locust
decodes them) and samples the process's own CPU and memory each second into the JSON
file named by CALCULET_MASTER_PROBE; the largest worker report it received, as it came
over the wire, goes beside it (`.stats`: what the benchmark's replayed workers send).
It adds no users."""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

import gevent
import psutil
from locust import events
from locust.rpc import protocol

_MESSAGES: collections.Counter[str] = collections.Counter()
_BYTES: collections.Counter[str] = collections.Counter()
_LAST_REPORT: list[bytes] = []  # the largest report so far
_unserialize = protocol.Message.unserialize.__func__  # type: ignore[attr-defined]


def _counting(cls: Any, data: bytes) -> Any:
    msg = _unserialize(cls, data)
    _MESSAGES[msg.type] += 1
    _BYTES[msg.type] += len(data)
    if msg.type == "stats" and (not _LAST_REPORT or len(data) >= len(_LAST_REPORT[0])):
        _LAST_REPORT[:] = [data]  # the largest: a report of the running phase
    return msg


protocol.Message.unserialize = classmethod(_counting)  # type: ignore[method-assign, assignment]


def _sampler(path: str, runner: Any) -> None:
    me = psutil.Process()
    samples: list[dict[str, Any]] = []
    while True:
        cpu = me.cpu_times()
        samples.append({
            "mono": time.monotonic(),
            "cpu_s": cpu.user + cpu.system,
            "rss": me.memory_info().rss,
            "workers": len(getattr(runner, "clients", {}) or {}),
            "state": str(getattr(runner, "state", "")),
            "messages": dict(_MESSAGES),
            "bytes": dict(_BYTES),
        })  # fmt: skip
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(samples, f)
        os.replace(tmp, path)
        if _LAST_REPORT:
            with open(f"{path}.stats", "wb") as f:
                f.write(_LAST_REPORT[0])
        gevent.sleep(1.0)


@events.init.add_listener
def _on_init(environment: Any, **_kw: Any) -> None:
    path = os.environ.get("CALCULET_MASTER_PROBE")
    if path and type(environment.runner).__name__ == "MasterRunner":
        gevent.spawn(_sampler, path, environment.runner)
