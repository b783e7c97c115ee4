from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.simproc import SimProcess

# The suite's other fixtures (the receive stamps held on, accept's keys, environment and
# child processes) live with the helpers in tests/support/.
pytest_plugins = ["tests.support.fixtures"]

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# Locust's self-check (--accuracy-ms, 10 ms by default) judges whether the client kept
# up. The suite runs side by side on a busy machine where it often does not (stamps late
# by up to 4.6 s in the parallel phase of a fresh-clone run), and no test but the
# self-check's own (tests/locust/test_accuracy.py, the benchmark's smoke) is about that:
# every Locust process a test starts inherits this budget, 60 s (off in effect); a test
# of the check passes --accuracy-ms itself (the command line wins over the environment).
os.environ.setdefault("LOCUST_ACCURACY_MS", "60000")

# The quiet phase's three lanes (scripts/test: `-n 3 --dist loadfile`): the files of a
# lane run one after the other in one worker, the lanes side by side, balanced by the
# files' seconds alone on this machine (in brackets). A file without an entry is a lane of
# its own; give a new quiet file the lane with the fewest seconds.
QUIET_LANES = {
    "tests/drivers/accept/test_head_of_line.py": 1,  # [50]
    "tests/analysis/test_e2e.py": 1,  # [27]
    "tests/drivers/soak/test_soak_stage_rules.py": 1,  # [25]
    "tests/analysis/test_report_browser.py": 2,  # [48]
    "tests/drivers/accept/test_pipeline.py": 2,  # [32]
    "tests/drivers/capacity/test_capacity.py": 2,  # [60]: its capacity search only
    "tests/drivers/soak/test_soak.py": 3,  # [40]
    "tests/analysis/test_e2e_stability.py": 3,  # [32]
    "tests/measure/test_record_safety.py": 3,  # [9]
    "tests/sim/test_prefix_cache_timing.py": 3,  # [10]
    "tests/workload/test_conversations.py": 1,  # [17]
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` with the lanes above as its units (xdist's own `xdist_group`
    marks do not take under pytest 9.2: xdist 3.8 renames `item._nodeid`, which pytest no
    longer reads). Other modes: xdist's own scheduler."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class QuietLanes(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            lane = QUIET_LANES.get(path)
            return path if lane is None else f"quiet-lane-{lane}"

    return QuietLanes(config, log)


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
