"""A soak run's resumable record: `soak/state.json`, its attempts and the gaps between them.

`soak/state.json` holds the stage's plan, its planned end on the wall clock and each
client process (attempt) that ran it. A process killed mid-stage (SIGKILL, OOM, host
reboot) leaves its closed Parquet parts and samples; `--resume` (calculet_drivers/soak/run.py)
checks the state here, cuts the lines the dead process left half-written, and records
the gap: from the last record or sample of the dead process to the resume, with its
reason. `client/index.json` lists every attempt as a worker.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from calculet_drivers.skeleton.clientindex import parts_of, write_index
from calculet_drivers.skeleton.folder import repair_tails, save_json
from calculet_drivers.skeleton.jsonl import last_row
from calculet_drivers.soak.stage import StageError
from calculet_load.clock import wall_iso
from calculet_load.schema.runfolder import IndexWorker
from calculet_load.target.traces import TRACE_KINDS

STATE_SCHEMA = "calculet-soak-state/v1"
STATE_FILE = "soak/state.json"


def _boot_id() -> str | None:
    """This boot of the host (a monotonic clock is only comparable within one boot)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Is `pid` a running calculet-load soak (not a reused pid)?"""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and "soak" in proc.cmdline()
    except (psutil.Error, OSError):
        return False


def new_state(stage: str, run_id: str, options: dict[str, Any], scale: float) -> dict[str, Any]:
    return {"schema": STATE_SCHEMA, "stage": stage, "run_id": run_id, "options": options,
            "time_scale": scale, "status": "starting", "attempts": [], "gaps": []}  # fmt: skip


def new_attempt(worker: str) -> dict[str, Any]:
    """This process' entry in the state's `attempts` (where it runs: `load_state` refuses
    to resume a run whose last attempt is still alive)."""
    from calculet_load.clock import clock_provenance

    return {
        "worker": worker,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "started_wall_ns": time.time_ns(),
        "status": "running",
        **clock_provenance(),
    }


def load_state(run_dir: Path, stage: str, run_id: str) -> dict[str, Any]:
    """The state of an unfinished soak of `stage` in `run_dir` that no process runs now;
    StageError when the folder cannot be resumed."""
    path = run_dir / STATE_FILE
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise StageError(f"--resume {run_dir}: no {STATE_FILE}: not a soak run") from None
    except ValueError:
        raise StageError(f"--resume: {path}: invalid JSON") from None
    if state.get("schema") != STATE_SCHEMA:
        raise StageError(f"--resume: {path}: schema {state.get('schema')!r}, not {STATE_SCHEMA}")
    if state.get("stage") != stage:
        raise StageError(f"--resume: {run_dir} runs stage {state.get('stage')!r}, not {stage!r}")
    if state.get("run_id") != run_id:
        raise StageError(
            f"--resume: {run_dir} is run {state.get('run_id')!r}; the manifest says {run_id!r}"
        )
    if state.get("status") == "done":
        raise StageError(f"--resume: {run_dir} has finished already (soak.json)")
    prev = (state.get("attempts") or [None])[-1]
    if (
        prev is not None
        and prev.get("boot_id") == _boot_id()
        and prev.get("host") == socket.gethostname()
        and prev.get("pid") != os.getpid()
        and _alive(int(prev["pid"]))
    ):
        raise StageError(f"--resume: the soak of {run_dir} is still running (pid {prev['pid']})")
    return state


def save_state(run_dir: Path, state: dict[str, Any]) -> None:
    """Write `soak/state.json` whole or not at all (a kill mid-write keeps the old one)."""
    save_json(run_dir / STATE_FILE, state)


def repair_files(run_dir: Path) -> dict[str, int]:
    """Cut lines half-written at the kill, in every file a soak run appends to."""
    names = ["events.jsonl", "soak/health.jsonl", "client/resources.jsonl",
             "server/resources.jsonl"] + [f"server/{k}.jsonl" for k in TRACE_KINDS]  # fmt: skip
    return repair_tails(run_dir, names)


def _last_row(path: Path, worker: str | None = None) -> dict[str, Any] | None:
    """The last JSON row of a JSONL file (of `worker`, when rows name one)."""
    row: dict[str, Any] | None = last_row(
        path, lambda r: worker is None or r.get("worker", "w00") == worker
    )
    return row


def no_gap(state: dict[str, Any], prev: dict[str, Any]) -> str | None:
    """Close the previous attempt (`running` on disk: it died); why it left no gap in the
    stage (a note), or None when it left one."""
    if prev.get("status") == "running":  # it never wrote its end: it died
        prev["status"] = "killed"
    if "planned_end_wall_ns" not in state:
        return f"attempt {prev['worker']} stopped before the load started: the stage started over"
    if state.get("status") == "judging":
        return f"attempt {prev['worker']} stopped after the load: judged again"
    return None


def gap(
    state: dict[str, Any],
    prev: dict[str, Any],
    run_dir: Path,
    *,
    worker: str,
    scale: float,
    on_disk: Callable[[str], dict[str, Any]],
) -> dict[str, Any]:
    """The gap the previous attempt `prev` left: from its last record or sample to now,
    when `worker` resumes. `on_disk(w)` counts worker w's records on disk (`records`,
    `sent`)."""
    w = prev["worker"]
    evidence: dict[str, int] = {"attempt start": int(prev["started_wall_ns"])}
    for label, path, of in (
        ("client sample", run_dir / "client" / "resources.jsonl", w),
        ("health sample", run_dir / "soak" / "health.jsonl", None),
        ("server resource sample", run_dir / "server" / "resources.jsonl", None),
    ):
        row = _last_row(path, of)
        if row is not None and isinstance(row.get("wall_ns"), int):
            evidence[label] = row["wall_ns"]
    if prev.get("ended_wall_ns"):
        evidence["clean stop"] = int(prev["ended_wall_ns"])
    start_by, start = max(evidence.items(), key=lambda kv: kv[1])
    resumed = time.time_ns()
    planned_end = int(state["planned_end_wall_ns"])
    end = max(start, min(resumed, planned_end))
    counts = on_disk(w)
    last = _last_row(run_dir / "client" / "resources.jsonl", w) or {}
    if prev.get("status") == "terminated":
        reason = f"client stopped by {prev.get('signal', 'a signal')} (flushed, resumable)"
        lost: dict[str, Any] = {"open_part_lost": False, "requests_on_disk": counts["records"]}
    else:
        if prev.get("boot_id") not in (None, _boot_id()):
            reason = "host rebooted: the client process died with it (no clean stop)"
        else:
            reason = "client process died without a clean stop (SIGKILL, OOM kill or crash)"
        sent_last = int(last.get("sent", 0))
        lost = {
            "open_part_lost": True,
            "lost_requests": "unknown",
            "requests_on_disk": counts["records"],
            "sent_at_last_sample": sent_last,
            "lost_requests_at_least": max(0, sent_last - counts["sent"]),
            "in_flight_at_last_sample": int(last.get("in_flight", 0)),
        }
    prev.setdefault("ended_wall_ns", start)
    found = {
        "index": len(state["gaps"]) + 1,
        "start_wall_ns": start,
        "end_wall_ns": end,
        "resumed_wall_ns": resumed,
        "start": wall_iso(start),
        "end": wall_iso(end),
        "duration_s": round((end - start) / 1e9, 3),
        "duration_target_s": round((end - start) / 1e9 / scale, 3),
        "start_evidence": start_by,
        "reason": reason,
        "before_worker": w,
        "after_worker": worker,
        **lost,
    }
    if resumed > planned_end:
        found["note"] = "resumed after the stage's planned end: the rest of the stage is lost"
    return found


def write_client_index(
    run_dir: Path, state: dict[str, Any], *, status: str, run_id: str, source: str, target: str
) -> None:
    """`client/index.json`: every attempt is a worker. A killed one's part open at the
    kill is lost (`open_part_lost`); the gap is in soak.json."""
    workers = []
    keys = ("ntp_offset_ns", "ntp_source", "ntp_synchronized", "ntp_detail", "clock_anchor")
    for a in state["attempts"]:
        w = a["worker"]
        entry = IndexWorker(
            worker=w,
            host=a.get("host"),
            pid=a.get("pid"),
            status="reported" if a.get("status") == "finished" else "interrupted",
            attempt_status=a.get("status"),
            parts=parts_of(run_dir, w),
            **{k: a[k] for k in keys if k in a},
            # a killed attempt's open part is lost
            **({"open_part_lost": True} if a.get("status") == "killed" else {}),
        )
        if a.get("sink") is not None:
            entry.sink = a["sink"]
        workers.append(entry)
    # rows not in the parts make the index incomplete: the run says so (exit 3)
    write_index(run_dir, workers, run_id=run_id, status=status, source=source, target=target,
                gaps=state["gaps"])  # fmt: skip
