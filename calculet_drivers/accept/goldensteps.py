"""Steps 3 and 6 of the acceptance run: the golden set before and after the load (spec
§8.3), and `--record-golden`, which takes this run's hashes as the set's."""

from __future__ import annotations

import functools
import json
from typing import Any

import yaml

from calculet_drivers.accept.acceptrun import GOLDEN_RECORDED, AcceptRun
from calculet_drivers.skeleton.golden import check_golden
from calculet_load.errors import EXIT_FAIL, RunStop
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.outcome import Outcome
from calculet_load.measure.session import RequestSpec

__all__ = ["golden"]


def golden(run: AcceptRun, step: str) -> None:
    """The golden set: any error or hash mismatch stops the run (exit 1). A case
    without a hash is recorded; with `--record-golden`, golden before records every
    case (compares none) and the recorded set is what the rest of the run checks."""
    if run.golden is None:
        run.log.write(step, "skipped", reason="no golden set given")
        return
    record = run.o.record_golden and step == "golden_before"
    run.log.write(step, "start", cases=len(run.golden.cases), record=record)
    _write_golden_json(run)

    def send(spec: RequestSpec) -> Outcome:
        return run_in_greenlet(functools.partial(run.client.session.send, spec))[1]

    got = check_golden(run.golden, send, run.prompt, step, record=record)
    if got.recorded:
        run.log.write(step, "recorded", hashes=got.recorded)
        if record and not got.failures:
            _pin_golden(run, got.recorded)
        elif step == "golden_before":
            run.notes.append(
                f"golden: {len(got.recorded)} case(s) had no expected hash: recorded in "
                "events.jsonl (compared with this run's majority by the analysis)"
            )
    run.log.write(step, "end", failures=got.failures)
    run.say(f"{step}: {got.summary()}")
    if got.failures:
        raise RunStop(EXIT_FAIL, f"{step} failed: {'; '.join(got.failures[:3])}")


def _write_golden_json(run: AcceptRun) -> None:
    """`golden.json`: the expected hash of each golden cell, which the analysis judges
    golden records against (not a majority)."""
    assert run.golden is not None
    expected = [
        {"cell": f"{prefix}:{c.name}", "token_hash": c.token_hash}
        for prefix in ("golden_before", "golden_after")
        for c in run.golden.cases
        if c.token_hash is not None
    ]
    if expected:
        (run.run_dir / "golden.json").write_text(json.dumps({"cases": expected}, indent=1))


def _pin_golden(run: AcceptRun, recorded: list[dict[str, Any]]) -> None:
    """`--record-golden`: the golden set with this run's hashes becomes the run's
    reference (golden after, the fault matrix, the analysis) and is written to
    `golden.recorded.yaml` in the run folder, the file to pin."""
    assert run.golden is not None
    got = {r["name"]: r["token_hash"] for r in recorded}
    given = {c.name: c.token_hash for c in run.golden.cases}
    changed = sorted(n for n, h in got.items() if given.get(n) not in (None, h))
    pinned = run.golden.model_copy(
        update={"cases": [c.model_copy(update={"token_hash": got[c.name]})
                          for c in run.golden.cases]}
    )  # fmt: skip
    path = run.run_dir / GOLDEN_RECORDED
    head = (f"# recorded by calculet-load accept --record-golden, run "
            f"{run.manifest.run_id}, target {run.url}, from {run.o.golden}\n")  # fmt: skip
    doc = pinned.model_dump(by_alias=True, exclude_none=True)
    path.write_text(head + yaml.safe_dump(doc, sort_keys=False, width=200))
    run.golden, run.golden_file = pinned, str(path)
    _write_golden_json(run)
    run.log.write("golden_before", "pinned", file=GOLDEN_RECORDED, cases=len(got),
                  changed=changed)  # fmt: skip
    run.notes.append(
        f"golden: --record-golden: {len(got)} hash(es) recorded, not checked, in "
        f"{path}; golden after was checked against them"
        + (f"; differ from {run.o.golden}: {', '.join(changed)}" if changed else "")
    )
