"""Spec §6.3 head-of-line blocking through `calculet-load accept` against the real,
time-scaled simulator: the shipped `head-of-line` mix and its
`short-only` control run as two open-loop cells; the analysis' head-of-line section
shows the short requests' TTFT penalty beside a long prefill, with its interval, and the
report lays it out in its own section.

The simulator runs a prefill alone and first (docs/simulator.md), so a short request
that arrives while a 32K prefill runs waits for it: at time scale 0.1 the prefill takes
about 270 ms, a short request's TTFT alone a few ms (tens on a loaded machine).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from analysis.report import write_report
from tests.analysis.test_report import Page
from tests.support.acceptkit import (
    accept_sim,
    read_verdict,
    relaxed_rules,
    run_pipeline,
    write_manifest,
    write_matrix,
)
from tests.support.simproc import SimProcess


# The penalty compares TTFT across two cells run one after the other: on a busy machine
# the load on the simulator changes between them (a fresh-clone run's parallel phase saw
# the control 9-49 % slower than the overlapping requests), so two neighbours at most
# (the quiet phase).
@pytest.mark.quiet
def test_a_head_of_line_run_shows_the_short_requests_ttft_penalty_with_an_interval(
    tmp_path: Path, start_sim: Callable[..., SimProcess], accept_env: Path
) -> None:
    sim = accept_sim(start_sim, scale="0.1")  # B4: four decode lanes
    cells = [
        {"kind": "open", "arrival": "poisson", "rate": 10.0, "mix": "head-of-line",
         "repetitions": 200},
        {"kind": "open", "arrival": "poisson", "rate": 10.0, "mix": "short-only",
         "repetitions": 100},
    ]  # fmt: skip
    matrix = write_matrix(tmp_path, cells, name="hol", reps=60)
    run_dir = tmp_path / "hol"
    manifest = write_manifest(tmp_path, sim.url, run_id="hol", warmup_requests=1)
    run_pipeline(manifest, matrix, run_dir, relaxed_rules(tmp_path), None)
    hol = read_verdict(run_dir)["head_of_line"]
    assert hol is not None
    assert hol["cells"] == ["poisson10-head-of-line|-|poisson|stream"]
    assert hol["control_cells"] == ["poisson10-short-only|-|poisson|stream"]
    n = hol["counts"]
    # successes: on a loaded machine some requests time out in admission (503)
    # (a fresh-clone run's parallel phase kept 11 of 50 control requests): the penalty's
    # interval below is what must hold, and too few samples would make it undecided
    assert n["long_prefills"] >= 2 and n["ttft_ms_overlapping"] >= 8 and n["control"] >= 8, n
    rows = {(c["cell"], c["metric"], c["statistic"]): c for c in hol["comparisons"]}
    ttft = rows[("overlapping vs control", "ttft_ms", "p50")]
    lo, hi = ttft["ci_abs"]
    penalty = f"{ttft['delta_abs']:.2f} [{lo:.2f}, {hi:.2f}]"
    print(f"HOL {n}; TTFT P50 {ttft['baseline']:.2f} → {ttft['candidate']:.2f}: {penalty}")
    # the penalty: TTFT P50 beside a long prefill minus the control's, interval above 0
    assert ttft["penalty"] == "shown", ttft["reason"]
    assert 0 < lo <= ttft["delta_abs"] <= hi
    assert ttft["candidate"] > ttft["baseline"]  # ms: waited for part of a prefill
    # the report's own section lays it out
    page = Page(Path(write_report(str(run_dir))).read_text())
    table = page.tables["head-of-line"]
    row = next(r for r in table if r[:3] == ["overlapping vs control", "ttft_ms", "p50"])
    assert row[-1] == "shown" and "[" in row[7]
    assert "Head-of-line blocking" in page.sections["head-of-line"]
