"""A distributed acceptance run (`--workers N`, `--master`): the run becomes the Locust
master of its client processes (calculet_load.locust.cells), which send the matrix."""

from __future__ import annotations

import socket

from calculet_drivers.accept.acceptrun import AcceptRun
from calculet_load.errors import EXIT_INFRA, RunStop
from calculet_load.workload.dispatch import FleetError

__all__ = ["close_fleet", "start_fleet"]


def start_fleet(run: AcceptRun) -> None:
    o = run.o
    if not (o.workers or o.master):
        return
    from calculet_load.locust.cells import Fleet  # Locust: imported first by the CLI

    expect = o.workers or o.expect_workers
    fleet = run.fleet = Fleet(
        run.run_dir,
        expect=expect,
        local=o.workers,
        bind_host="127.0.0.1" if o.workers else o.master_bind_host,
        bind_port=_free_port() if o.workers else o.master_bind_port,
        suffix=run.suffix(),
        say=run.say,
    )
    run.log.write("workers", "start", expect=expect, local=o.workers, port=fleet.bind_port)
    try:
        fleet.start(o.workers_timeout_s)
    except FleetError as exc:
        raise RunStop(EXIT_INFRA, f"workers: {exc}") from None
    run.clients = fleet
    run.log.write("workers", "end", workers=list(fleet.names.values()))


def close_fleet(run: AcceptRun) -> None:
    """The workers' last parts gathered (a worker that does not report is noted), and
    the workers ended unless the fleet is another run's (an interleaved candidate's)."""
    assert run.fleet is not None
    reports = run.fleet.finish(run.manifest.run_id, run.run_dir)
    if run.owns_fleet:
        run.fleet.close()
    missing = [r["worker"] for r in reports if r.get("status") == "missing"]
    run.log.write("workers", "closed", missing=missing)
    if missing:
        run.notes.append(f"workers {', '.join(missing)} did not report at the end")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
