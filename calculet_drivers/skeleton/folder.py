"""A driver's run folder: where it is, the manifest it ran under, its JSON documents, and
what a run that is resumed does with the attempt that was cut.

Each attempt at a run is a client process of its own, named `w00`, then `w00-r1`,
`w00-r2`... (`attempt_worker`): its records go to `client/<worker>/`, so a resumed run
never writes into the parts of the process that was killed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from calculet_drivers.skeleton.jsonl import repair_tail
from calculet_load.schema.manifest import RunManifest

__all__ = [
    "FIRST_WORKER",
    "attempt_worker",
    "copy_manifest",
    "repair_tails",
    "run_dir_for",
    "save_json",
    "set_aside",
]

FIRST_WORKER = "w00"


def run_dir_for(given: str | Path | None, manifest: RunManifest, suffix: str = "") -> Path:
    """`given`, else `runs/<run_id><suffix>`."""
    return Path(given) if given else Path("runs") / f"{manifest.run_id}{suffix}"


def attempt_worker(attempt: int) -> str:
    """The client's name in attempt `attempt` (1 for the first) at a run."""
    return FIRST_WORKER if attempt <= 1 else f"{FIRST_WORKER}-r{attempt - 1}"


def copy_manifest(run_dir: Path, manifest_path: str) -> None:
    """The manifest the run was given, as given: `manifest.yaml`."""
    (run_dir / "manifest.yaml").write_text(Path(manifest_path).read_text())


def save_json(path: Path, doc: Any) -> None:
    """Write a JSON document whole or not at all: a temporary file beside it, synced, then
    a rename, so a kill or a host reboot leaves the previous version or this one (a
    resumed run reads it back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=1, default=str))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def set_aside(run_dir: Path, keep: Collection[str]) -> Path:
    """An attempt cut before the run could resume from it: its files (all but `keep`)
    move to `aborted/attempt-N/`, kept and signed with the run but outside what the
    analysis reads, and the run starts over. Returns where they went."""
    aborted = run_dir / "aborted"
    n = len(list(aborted.glob("attempt-*"))) + 1 if aborted.exists() else 1
    dest = aborted / f"attempt-{n}"
    dest.mkdir(parents=True)
    for path in list(run_dir.iterdir()):
        if path.name not in {"aborted", *keep}:
            path.rename(dest / path.name)
    return dest


def repair_tails(run_dir: Path, names: Iterable[str]) -> dict[str, int]:
    """Cut the lines a killed process left half-written in the JSONL files `names` (under
    `run_dir`); the bytes cut, by file."""
    cut = {}
    for name in names:
        n = repair_tail(run_dir / name)
        if n:
            cut[name] = n
    return cut
