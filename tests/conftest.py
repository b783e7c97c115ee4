from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.simproc import SimProcess

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., SimProcess]]:
    """Start real simulator processes on loopback; all are stopped after the test."""
    procs: list[SimProcess] = []

    def start(*args: str, **kw: Any) -> SimProcess:
        sim = SimProcess(tmp_path, *args, **kw)
        procs.append(sim)
        return sim

    yield start
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def fast_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    """One shared simulator at time scale 0.02 (50x faster), faults enabled."""
    sim = SimProcess(tmp_path_factory.mktemp("fast-sim"), "--time-scale", "0.02", faults=True)
    yield sim
    sim.stop()
