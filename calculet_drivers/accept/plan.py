"""Steps 4 and 5 of the acceptance run: the warmup, and the matrix as a plan.

`plan.json` holds the cells in a seeded random order, each with its repetitions and
seed, and its progress: a cell is `running` while it is sent and `done` once its records
are on disk. A resumed run (`--resume`) sends the cells not done; the records of a cell
that was cut are kept and excluded with their reason. The cells are split into shares
(calculet_load.workload.dispatch) sent by this process or by the workers of a fleet."""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from typing import Any

import gevent

from calculet_drivers.accept.acceptrun import AcceptRun
from calculet_drivers.accept.targetstate import device_now
from calculet_drivers.skeleton.steps import StepResult
from calculet_load.errors import EXIT_INFRA, EXIT_INVALID, RunStop
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.session import RequestSpec
from calculet_load.workload.dispatch import (
    BURST_GAP_S,
    BURST_LEAD_S,
    OPEN_LEAD_S,
    FleetError,
    split,
)
from calculet_load.workload.matrix import Cell
from calculet_load.workload.mixes import load_mix, single

__all__ = ["PLAN_SCHEMA", "make_plan", "matrix_start", "run_entry", "warmup"]

PLAN_SCHEMA = "calculet-plan/v1"


def warmup(run: AcceptRun) -> StepResult:
    """`warmup_requests` of each request shape the matrix sends, recorded as warmup."""
    n = run.manifest.warmup_requests
    shapes = {(c.prompt_tokens, c.max_tokens) for c in run.cells if not c.mix}
    for c in run.cells:
        if c.mix:
            shapes |= {(e.prompt_tokens, e.max_tokens) for e in load_mix(c.mix).entries}
    ordered = sorted(shapes)
    for p, o in ordered:
        for i in range(n):
            spec = RequestSpec(
                prompt=run.prompt(p, i % 4), max_tokens=o, cell=f"warmup:p{p}-o{o}",
                concurrency=1, arrival="single", warmup=True,
            )  # fmt: skip
            run_in_greenlet(functools.partial(run.client.session.send, spec))
    run.say(f"warmup: {n} request(s) for each of {len(ordered)} shape(s)")
    return StepResult.ok(shapes=ordered, per_shape=n)


def make_plan(run: AcceptRun) -> None:
    order = list(range(len(run.cells)))
    random.Random(f"calculet-plan:{run.o.seed}").shuffle(order)
    cells = [
        {"name": run.cells[i].name, "index": i, "repetitions": run.repetitions(run.cells[i]),
         "status": "pending", "seed": run.o.seed * 1_000_003 + i}
        for i in order
    ]  # fmt: skip
    run.plan = {
        "schema": PLAN_SCHEMA,
        "run_id": run.manifest.run_id,
        "seed": run.o.seed,
        "attempts": 1,
        "options": {k: v for k, v in vars(run.o).items() if k != "admin_token"},
        "below_minimum_repetitions": any(run.below_minimum(c) for c in run.cells),
        "rehearsal": run.manifest.rehearsal,
        "cells": cells,
        "excluded": [],
    }
    run.save_plan()


def matrix_start(run: AcceptRun) -> list[dict[str, Any]]:
    """The resource sampler on; cut cell attempts excluded; the cells still to run."""
    if run.o.admin_token:
        # the target's RSS, FDs, threads, KV and leases through the run (leak analysis)
        from calculet_load.target.resources import ResourceSampler

        run.sampler = ResourceSampler(
            run.url, run.run_dir / "server" / "resources.jsonl",
            admin_token=run.o.admin_token, interval_s=run.o.resource_interval_s,
        ).start()  # fmt: skip
    todo = [c for c in run.plan["cells"] if c["status"] != "done"]
    run.log.write("matrix", "start", cells=len(run.plan["cells"]), todo=len(todo))
    for entry in run.plan["cells"]:
        if entry["status"] == "running":  # cut by a crash: its records are excluded
            run.plan["excluded"].append(
                {"cell": entry["name"], "worker": entry.get("worker"),
                 "reason": "interrupted cell attempt (the cell was run again)"}
            )  # fmt: skip
    return todo


def run_entry(run: AcceptRun, entry: dict[str, Any], progress: str) -> None:
    """One cell of the plan, with its repetitions; then the idle gap."""
    cell = run.cells[entry["index"]]
    entry["status"], entry["worker"] = "running", run.worker
    entry["started_wall_ns"] = time.time_ns()
    run.save_plan()
    run.log.write("cell", "start", cell=cell.name, device=device_now(run))
    run.say(f"cell {progress} {cell.name}: {entry['repetitions']} request(s){run.label}")
    try:
        sent = _run_cell(run, cell, entry["repetitions"], int(entry["seed"]))
    except FleetError as exc:  # the cell stays "running": a resume runs it again
        code = EXIT_INFRA if exc.infra else EXIT_INVALID
        raise RunStop(code, f"{cell.name}: {exc}") from None
    run.client.sink.flush_polling(gevent.sleep)  # the cell's records are on disk: it is done
    entry["status"], entry["requests"] = "done", sent
    entry["ended_wall_ns"] = time.time_ns()
    run.save_plan()
    run.log.write("cell", "end", cell=cell.name, requests=sent, device=device_now(run))
    if run.o.idle_gap_s:
        gevent.sleep(run.o.idle_gap_s)


def _run_cell(run: AcceptRun, cell: Cell, reps: int, seed: int) -> int:
    run.rtt.take("during")  # between cells, at most once a minute
    mix = load_mix(cell.mix) if cell.mix else single(cell.prompt_tokens, cell.max_tokens)
    steps = split(cell, mix, reps, seed, run.clients.processes)
    lead = OPEN_LEAD_S if cell.kind == "open" else BURST_LEAD_S
    sent = 0
    for r, step in enumerate(steps):
        if cell.kind == "burst":
            if r:
                gevent.sleep(BURST_GAP_S)
            burst_id = f"{run.manifest.run_id}.{cell.name}.{r:03d}"
            step = [s and dataclasses.replace(s, burst_id=burst_id) for s in step]
        sent += run.clients.run_step(step, _job(run), lead, run.run_dir)
    return sent


def _job(run: AcceptRun) -> dict[str, Any]:
    """What a worker of a distributed run needs to send on this run's behalf."""
    t = run.manifest.target
    target = {"url": run.url, "protocol": run.target.protocol, "model": run.target.model,
              "timeout_s": run.manifest.timeout_s,
              "profile": t.profile if t else "calculet",
              "tokenizer": t.tokenizer if t else None,
              "prompt_reuse": run.client.prompt_reuse,
              # how it was reached: secrets redacted, the key by its source only
              "access": run.target.access.describe()}  # fmt: skip
    return {"run_id": run.manifest.run_id, "context": dataclasses.asdict(run.client.ctx),
            "target": target}  # fmt: skip
