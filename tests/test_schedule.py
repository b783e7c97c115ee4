"""The phases' test order (tests/schedule.py): the same tests, the longest dealt first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests import schedule


def _items(names: list[str]) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n) for n in names]


def test_the_long_tests_head_the_slices_worksteal_deals() -> None:
    long = sorted(schedule.LONG_S, key=lambda n: -schedule.LONG_S[n])
    names = [f"tests/x.py::t{i}" for i in range(100)] + list(reversed(long))
    items = _items(names)
    out = schedule.order(items, "worksteal", 6)
    assert sorted(id(i) for i in out) == sorted(id(i) for i in items)  # the same tests
    sizes = schedule.worksteal_slices(len(items), 6)
    assert sum(sizes) == len(items) and max(sizes) - min(sizes) <= 1
    starts = [sum(sizes[:k]) for k in range(6)]
    # the six longest start the six slices, the next six come second in them
    assert [out[s].nodeid for s in starts] == long[:6]
    assert [out[s + 1].nodeid for s in starts] == long[6:12]
    # the others keep their order
    rest = [i.nodeid for i in out if i.nodeid not in schedule.LONG_S]
    assert rest == [f"tests/x.py::t{i}" for i in range(100)]


@pytest.mark.parametrize("dist", [None, "load", "no"])
def test_other_modes_keep_the_collection_order(dist: str | None) -> None:
    items = _items([*schedule.LONG_S, "tests/a.py::t"])
    assert schedule.order(items, dist, 6) == items
    assert schedule.order(items, "worksteal", 1) == items


def test_quiet_files_longest_first_each_file_whole() -> None:
    names = ["tests/load/test_record_safety.py::a", "tests/analysis/test_e2e.py::b",
             "tests/analysis/test_e2e_stability.py::c", "tests/analysis/test_e2e_stability.py::d",
             "tests/other.py::e"]  # fmt: skip
    out = [i.nodeid for i in schedule.order(_items(names), "loadfile", 2)]
    assert out == ["tests/analysis/test_e2e_stability.py::c",
                   "tests/analysis/test_e2e_stability.py::d",
                   "tests/analysis/test_e2e.py::b", "tests/load/test_record_safety.py::a",
                   "tests/other.py::e"]  # fmt: skip


def test_a_worker_reads_the_mode_from_the_controllers_command_line() -> None:
    worker = SimpleNamespace(workerinput={"mainargv": ["pytest", "-n", "6", "--dist", "worksteal"]})
    assert schedule.dist_mode(worker) == "worksteal"  # type: ignore[arg-type]
    worker.workerinput["mainargv"] = ["pytest", "--dist=loadfile"]
    assert schedule.dist_mode(worker) == "loadfile"  # type: ignore[arg-type]
