"""The server's traces copied into a run folder's `server/`: once when a run ends
(`collect`, the library's `target.traces.collect_traces`), or appended as a long run
goes (`TraceAppender`, the soak's: hours of traces are read in pieces, each byte once)."""

from __future__ import annotations

from pathlib import Path

import gevent

from calculet_drivers.skeleton.runtarget import RunTarget
from calculet_drivers.skeleton.steps import StepOutcome, StepResult
from calculet_load.target.api import TargetAPI
from calculet_load.target.traces import TRACE_KINDS, collect_traces

__all__ = ["TraceAppender", "collect"]

_OUTCOME = {"fetched": StepOutcome.OK, "not_available": StepOutcome.NOT_AVAILABLE}


def collect(target: RunTarget, run_dir: Path) -> StepResult:
    """Every row the target holds, whole (the analysis' join picks the run's requests
    out): not_available when the target has no traces, failed when it did not answer."""
    lacking = target.lacks("traces")
    if lacking is not None:
        return StepResult.not_available(lacking)
    got = collect_traces(TargetAPI(target.access), str(run_dir))
    return StepResult(
        _OUTCOME.get(got["status"], StepOutcome.FAILED),
        got["reason"],
        {"fetched": got["status"], "files": got["kinds"]},
    )


class TraceAppender:
    """Appends what the target's traces gained since the last call to
    `server/<kind>.jsonl`. Its offsets start at the local copies' sizes: they hold
    exactly the bytes read so far (a resumed run goes on where the killed one stopped)."""

    def __init__(self, api: TargetAPI, run_dir: Path) -> None:
        self.api = api
        self.out = run_dir / "server"
        for kind in TRACE_KINDS:
            path = self.out / f"{kind}.jsonl"
            api.offsets[kind] = path.stat().st_size if path.exists() else 0

    def append(self, final: bool = False) -> list[str]:
        """One collection; the kinds that could not be read (told on the `final` one
        only: the next collection reads what this one missed)."""
        if final:
            gevent.sleep(0.5)  # the target flushes its trace files periodically
        self.out.mkdir(parents=True, exist_ok=True)
        missed = []
        for kind in TRACE_KINDS:
            try:
                data = self.api.trace_bytes(kind)
            except OSError as exc:
                if final:
                    missed.append(f"traces {kind}: {exc}")
                continue
            if data:
                with (self.out / f"{kind}.jsonl").open("ab") as f:
                    f.write(data)
        return missed
