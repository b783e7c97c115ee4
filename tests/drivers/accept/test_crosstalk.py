"""Spec §14.1 cross-talk under concurrency, end to end: `calculet-load accept` against a
real simulator whose `crosstalk` knob leaks tokens between requests in flight.

The golden set, sent one request at a time, cannot see such a leak; accept's crosstalk
step sends the golden set's greedy cases four at a time after one of each alone, and the
run fails (exit 1) naming the copy, its reference and the concurrency, in the step's
event and in `verdict.json`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from calculet_drivers.cli import main
from tests.support.acceptkit import (
    accept_args,
    accept_sim,
    read_events,
    read_verdict,
    relaxed_rules,
    write_manifest,
    write_matrix,
)
from tests.support.simproc import SimProcess

ONE_CELL = [{"kind": "single", "prompt_tokens": 128, "max_tokens": 16}]
CASES = ("short", "medium", "long-prompt", "one-token")  # configs/golden/sim.yaml, all greedy


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    """The crosstalk step's records: id, cell, arrival, concurrency."""
    parts = sorted((run_dir / "client").glob("*/part-*.requests.parquet"))
    t = pa.concat_tables([pq.read_table(p) for p in parts])
    cols = ("request_id", "ext.cell", "ext.arrival", "workload.concurrency")
    rows = [
        dict(zip(("request_id", "cell", "arrival", "concurrency"), row, strict=True))
        for row in zip(*(t.column(c).to_pylist() for c in cols), strict=True)
    ]
    return [r for r in rows if r["cell"].startswith("crosstalk:")]


@pytest.mark.parametrize("leak", [False, True], ids=["clean", "crosstalk"])
def test_crosstalk_at_concurrency_4_is_caught_naming_both_requests(
    leak: bool,
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    accept_env: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    knob = ("--set", "knobs.crosstalk_probability=1.0") if leak else ()
    sim = accept_sim(start_sim, *knob)
    run_dir = tmp_path / "run"
    args = accept_args(
        write_manifest(tmp_path, sim.url), write_matrix(tmp_path, ONE_CELL), run_dir,
        "--min-repetitions", "3", "--skip-report", "--rules", str(relaxed_rules(tmp_path)),
    )  # fmt: skip
    code = main(args)
    out = capsys.readouterr().out
    assert code == (1 if leak else 0), out

    events = read_events(run_dir)
    golden = [e for e in events if e["step"].startswith("golden") and e["status"] == "end"]
    assert [g["failures"] for g in golden] == [[], []]  # alone, every request is right
    step = next(e for e in events if e["step"] == "crosstalk" and e["status"] == "end")
    assert step["concurrency"] == 4 and step["cases"] == list(CASES)
    # one reference per case, then 4 users x 2 requests and 2 bursts of 4
    assert step["requests"] == 4 + 8 + 8 and step["compared"] == 16
    rows = _rows(run_dir)
    assert Counter((r["arrival"], r["concurrency"]) for r in rows) == {
        ("single", 1): 4,
        ("closed", 4): 8,
        ("burst", 4): 8,
    }
    ids = {r["request_id"]: r for r in rows}
    verdict = read_verdict(run_dir)
    v = next(x for x in verdict["verdicts"] if x["rule"] == "no_crosstalk")
    if not leak:
        assert step["outcome"] == "ok" and step["differences"] == []
        assert v["status"] == "pass" and v["n"] == 16
        return
    assert step["outcome"] == "failed" and step["differences"]
    assert "concurrency 4" in step["reason"] and "sent alone" in step["reason"]
    assert v["status"] == "fail" and verdict["exit_code"] == 1
    first = v["details"][0]
    copy, ref = ids[first["request_id"]], ids[first["reference_id"]]
    assert (copy["arrival"], copy["concurrency"]) != ("single", 1)
    assert first["concurrency"] == copy["concurrency"] == 4
    assert (ref["arrival"], ref["concurrency"], ref["cell"]) == ("single", 1, copy["cell"])
    assert first["request_id"] in v["reason"] and first["reference_id"] in v["reason"]
    assert "concurrency 4" in v["reason"]
    # the step and the analysis found the same differences
    assert {d["request_id"] for d in step["differences"]} == {d["request_id"] for d in v["details"]}
    assert f"crosstalk at concurrency 4: {step['different']} of 16 copies" in out
