"""The fault matrix of §12 as a step of `calculet-load accept` (`--faults DIR`)."""

from __future__ import annotations

import os

from calculet_drivers.accept.acceptrun import AcceptRun
from calculet_drivers.faults.matrix import FaultMatrix
from calculet_drivers.faults.scenariorun import ERROR, FAIL, NOT_RUN, FaultOptions
from calculet_drivers.skeleton.jsonl import read_rows
from calculet_load.errors import EXIT_FAIL, EXIT_INFRA, RunStop

__all__ = ["fault_step"]


def fault_step(run: AcceptRun) -> None:
    """The fault matrix as a step of `calculet-load accept` (after the matrix, before
    golden after; `--faults DIR`). Every scenario runs on the target under test, except
    one that stops it. A failed scenario, or one not run because the manifest does not
    authorize its maintenance actions (§12.4), makes the run a correctness failure (exit 1)
    and the run goes on to golden after (the recovery check); an invalid scenario file
    stops the run with exit 2, a target without a fault API with exit 3."""
    o, log, scenarios = run.o, run.log, run.o.faults
    if not scenarios:
        return
    log.write("faults", "start", scenarios=scenarios,
              broken_rehearsal=os.environ.get("CALCULET_FAULTS_BROKEN"))  # fmt: skip
    # rehearsals against the simulator only: arm these scenarios' faults broken
    broken = [x for x in os.environ.get("CALCULET_FAULTS_BROKEN", "").split(",") if x] or None
    opts = FaultOptions(
        manifest=o.manifest, scenarios=scenarios, url=run.url,
        run_dir=str(run.run_dir), golden=run.golden_file, admin_token=o.admin_token,
        progress=o.progress, broken=broken, run_started_wall_ns=_run_start(run),
    )  # fmt: skip
    try:
        fm = FaultMatrix(opts)
    except RunStop as stop:
        log.write("faults", "end", code=stop.code, reason=str(stop))
        raise RunStop(stop.code, f"faults: invalid scenarios in {scenarios}: {stop}") from None
    code = fm.run()
    doc = fm.document()
    failed = [r["name"] for r in fm.results if r["verdict"] in (FAIL, ERROR)]
    not_run = [r["name"] for r in fm.results if r["verdict"] == NOT_RUN]
    log.write("faults", "end", code=code, summary=doc["summary"], failed=failed,
              not_run=not_run, file="faults.json")  # fmt: skip
    if code == EXIT_INFRA:
        raise RunStop(EXIT_INFRA, f"faults: {doc['infrastructure_error']}")
    if code == EXIT_FAIL:
        run.code = EXIT_FAIL
        if failed:
            run.notes.append(f"faults: {len(failed)} scenario(s) failed: {', '.join(failed)}")
        if not_run:
            run.notes.append(
                f"faults: {len(not_run)} scenario(s) NOT RUN (not authorized by the manifest, "
                f"spec §12.4): {', '.join(not_run)}"
            )


def _run_start(run: AcceptRun) -> int | None:
    """When the acceptance run began: its first `run start` event."""
    for row in read_rows(run.log.path):
        if row.get("step") == "run" and row.get("status") == "start":
            wall = row.get("wall_ns")
            return wall if isinstance(wall, int) else None
    return None
