"""`client/index.json` as a driver writes it: every client process of the run (a Locust
worker, this process, each attempt of a resumed run) with its parts, host and clock
(schema.runfolder.ClientIndex, the one model of the file)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from calculet_load.clock import clock_provenance
from calculet_load.schema.runfolder import ClientIndex, IndexWorker

__all__ = ["parts_of", "this_process", "worker_folders", "write_index"]


def this_process() -> dict[str, Any]:
    """Where this process runs: host, pid and its clock's provenance (NTP, anchor)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), **clock_provenance()}


def parts_of(run_dir: Path, worker: str) -> list[str]:
    """The Parquet parts a worker wrote, by name."""
    return sorted(p.name for p in (run_dir / "client" / worker).glob("part-*.parquet"))


def worker_folders(
    run_dir: Path, here: dict[str, Any], own: str, own_sink: dict[str, Any]
) -> list[IndexWorker]:
    """Every worker folder under `client/`, reported: a Locust worker's from its
    `worker.json`, the others from `here` (this process: host, clock...); this
    process's own (`own`) with its sink's counts."""
    workers = []
    for folder in sorted(p for p in (run_dir / "client").glob("*") if p.is_dir()):
        info = folder / "worker.json"
        entry = json.loads(info.read_text()) if info.exists() else dict(here)
        if folder.name == own:
            entry["sink"] = own_sink
        fields = {**entry, "worker": folder.name, "status": "reported",
                  "parts": parts_of(run_dir, folder.name)}  # fmt: skip
        workers.append(IndexWorker(**fields))
    return workers


def write_index(
    run_dir: Path,
    workers: list[IndexWorker],
    *,
    run_id: str,
    status: str,
    source: str,
    target: str,
    **extra: Any,
) -> None:
    """Write the index; a worker whose sink lost rows makes it `incomplete` (the run
    says so: exit 3)."""
    index = ClientIndex(run_id=run_id, status=status, source=source, target=target,
                        workers=workers, **extra)  # fmt: skip
    index.check_sinks()
    index.write(str(run_dir))
