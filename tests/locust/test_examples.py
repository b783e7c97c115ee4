"""The example locustfiles of docs/locust.md ("Writing your own users"), each run headless
as a user would run it, against a real simulator on loopback: Locust exits 0 and the run
folder holds the records each example's calls make."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.locustproc import LocustRun
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(120)

EXAMPLES = Path(__file__).resolve().parents[2] / "locustfiles" / "examples"


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    proc = SimProcess(tmp_path_factory.mktemp("examples-sim"), "--time-scale", "0.2")
    yield proc
    proc.stop()


def _cells(tmp: Path, sim: SimProcess, name: str, *args: str, run_s: float = 6) -> Counter[str]:
    """The completed records of the example's run, by cell."""
    run = LocustRun(tmp, sim.url, [*args], workers=0, run_time_s=run_s,
                    locustfile=str(EXAMPLES / name)).start()  # fmt: skip
    assert run.wait() == 0, run.log_text()
    rows = run.requests().select(["ext.cell", "ext.error_class"]).to_pylist()
    return Counter(r["ext.cell"] for r in rows if r["ext.error_class"] is None)


def test_the_chat_user(tmp_path: Path, sim: SimProcess) -> None:
    assert len((EXAMPLES / "chat_user.py").read_text().splitlines()) <= 20
    cells = _cells(tmp_path, sim, "chat_user.py", "-u", "2", "-r", "2")
    assert set(cells) == {"openai-chat"} and cells["openai-chat"] >= 4


def test_the_two_turn_user(tmp_path: Path, sim: SimProcess) -> None:
    cells = _cells(tmp_path, sim, "two_turns.py", "--protocol", "openai-chat", "-u", "2")
    assert set(cells) == {"turn1", "turn2"} and min(cells.values()) >= 2


def test_the_conversation_user(tmp_path: Path, sim: SimProcess) -> None:
    cells = _cells(tmp_path, sim, "conversation_user.py", "-u", "3", "-r", "3")
    assert set(cells) == {"chat"} and cells["chat"] >= 6


def test_the_tools_user(tmp_path: Path, sim: SimProcess) -> None:
    cells = _cells(tmp_path, sim, "tools_user.py", "-u", "2", "-r", "2")
    assert set(cells) == {"tools", "json"} and min(cells.values()) >= 2
