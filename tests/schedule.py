"""The order in which the suite's phases hand tests to their workers (scripts/test).

Both orders come from measured durations (a fresh-clone `scripts/test --durations=40`
on this 2-core machine, stop 24) and change which worker runs what, never what runs:

- **parallel phase** (`--dist worksteal`): xdist gives each of its N workers one
  contiguous slice of the collection and lets idle workers steal from the end of the
  others' slices. A long test near the end of a slice could start last and keep one
  worker busy alone; each slice here starts with its share of the longest tests
  (`LONG_S`), dealt round-robin, so they start first, side by side. Only tests on
  function-scoped fixtures move (a moved test of a module-fixture file would set the
  fixture up twice).
- **quiet phase** (`--dist loadfile --no-loadscope-reorder`): whole files, two side by
  side; the longest files (`QUIET_FILE_S`) are handed out first (xdist's own order is
  by number of tests).

An xdist worker runs with its `dist` option reset to "no": the phase's mode is read from
the controller's command line (`dist_mode`).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

LONG_S: dict[str, float] = {
    "tests/test_client_speed_bench.py::test_two_short_points_of_both_clients": 85,
    "tests/load/test_accept_interleave.py::"
    "test_a_slower_interleaved_baseline_comparison_is_a_regression_exit_4": 64,
    "tests/load/test_capacity.py::test_capacity_search_finds_the_saturation_point": 60,
    "tests/load/test_soak.py::test_killed_soak_resumes_to_its_planned_end_and_records_the_gap": 50,
    "tests/load/test_locust_dist.py::test_open_loop_poisson_across_two_workers": 47,
    "tests/load/test_soak.py::test_dev_rehearsal_reports_the_leak": 46,
    "tests/load/test_pipeline.py::test_a_killed_run_resumes_without_repeating_finished_cells": 36,
    "tests/load/test_pipeline.py::test_the_demo_ends_with_a_signed_report[None-0]": 33,
    "tests/load/test_accept_distributed.py::"
    "test_a_lost_worker_stops_the_run_and_a_resume_finishes_without_repeating_cells": 32,
    "tests/load/test_soak_stage_rules.py::"
    "test_a_candidate_rehearsal_is_judged_by_the_stage_rules": 30,
    "tests/load/test_locust_dist.py::"
    "test_a_killed_worker_leaves_readable_parts_and_an_incomplete_run": 25,
    "tests/load/test_accept_distributed.py::"
    "test_local_workers_share_every_load_shape_and_the_index_lists_them": 22,
}

QUIET_FILE_S: dict[str, float] = {
    "tests/analysis/test_e2e_stability.py": 51,
    "tests/analysis/test_report_browser.py": 50,
    "tests/load/test_head_of_line.py": 46,
    "tests/load/test_soak.py": 41,
    "tests/load/test_pipeline.py": 30,
    "tests/analysis/test_e2e.py": 20,
    "tests/load/test_locust_llm.py": 16,
    "tests/load/test_record_safety.py": 8,
}


def worksteal_slices(total: int, workers: int) -> list[int]:
    """The slice sizes xdist's worksteal scheduler deals `total` tests into at the start
    (xdist.scheduler.worksteal.check_schedule: each idle worker in turn gets
    len(pending) // workers_remaining)."""
    sizes, left = [], total
    for i in range(workers):
        n = left // (workers - i)
        sizes.append(n)
        left -= n
    return sizes


def order(items: list[Any], dist: str | None, workers: int) -> list[Any]:
    """`items` (pytest items, each with a `nodeid`) in the order the phase should deal them."""
    if dist == "loadfile":
        weight = {f: -s for f, s in QUIET_FILE_S.items()}
        return sorted(items, key=lambda it: weight.get(it.nodeid.split("::")[0], 0.0))
    if dist != "worksteal" or workers < 2:
        return items
    long = sorted((it for it in items if it.nodeid in LONG_S), key=lambda it: -LONG_S[it.nodeid])
    if not long:
        return items
    moved = {id(it) for it in long}
    rest = iter([it for it in items if id(it) not in moved])
    out: list[Any] = []
    for i, size in enumerate(worksteal_slices(len(items), workers)):
        heads = long[i::workers][:size]
        out += heads
        out += [next(rest) for _ in range(size - len(heads))]
    out += list(rest)
    assert len(out) == len(items)
    return out


def dist_mode(config: pytest.Config) -> str | None:
    """The run's --dist mode, in an xdist worker too (xdist resets a worker's option to
    "no"; the controller's command line travels in workerinput["mainargv"])."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return str(config.getoption("dist", None) or "") or None
    argv = list(workerinput.get("mainargv", []))
    for i, arg in enumerate(argv):
        if arg == "--dist" and i + 1 < len(argv):
            return str(argv[i + 1])
        if arg.startswith("--dist="):
            return arg.split("=", 1)[1]
    return None


def worker_count() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
