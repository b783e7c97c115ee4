"""A reasoning model's requests end to end: the simulator's `qwen3` profile streams its
thinking apart from the answer (chat: `reasoning_content`) or inline (`<think>` in the
text: completions), a real `locust` run records both phases, and the LLM CSV and
`calculet-load analyze` give the time to the first answer token beside TTFT."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.locustproc import LocustRun
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(180)

CLI = str(Path(sys.executable).parent / "calculet-load")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    proc = SimProcess(tmp_path_factory.mktemp("qwen3"), "--profile", "qwen3", "--time-scale", "0.2")
    yield proc
    proc.stop()


@pytest.mark.parametrize("protocol", ["openai-chat", "openai-completions"])
def test_both_phases_are_recorded_and_reported(
    qwen3: SimProcess, tmp_path: Path, protocol: str
) -> None:
    prefix = tmp_path / "stats"
    run = LocustRun(
        tmp_path, qwen3.url,
        ["--protocol", protocol, "--prompt-tokens", "64", "--max-tokens", "32", "-u", "2",
         "-r", "2", "--csv", str(prefix)],
        workers=0, run_time_s=5,
    ).start()  # fmt: skip
    assert run.wait() == 0, run.log_text()
    rows = [r for r in run.requests().to_pylist() if r["ext.error_class"] is None]
    assert len(rows) >= 4
    for r in rows:
        # the profile thinks for half of max_tokens (its tags included), then answers
        assert (r["ext.reasoning_tokens"], r["ext.answer_tokens"]) == (16, 16), r
        assert r["ext.reasoning_tokens"] + r["ext.answer_tokens"] == r["ext.client_output_tokens"]
        assert r["ext.ttft_answer_ms"] > r["durations_ms.ttft"] > 0
        assert r["ext.first_answer_ns"] > r["client_ns.first_token"]
    with open(f"{prefix}_llm_stats.csv", newline="") as f:
        agg = next(row for row in csv.DictReader(f) if row["name"] == "Aggregated")
    assert int(agg["ttft_answer_ms_n"]) >= 4 and float(agg["ttft_answer_ms_p50"]) > float(
        agg["ttft_ms_p50"]
    )
    done = subprocess.run([CLI, "analyze", str(run.run_dir), "--quiet"], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = pq.read_table(run.run_dir / "summary.parquet").to_pylist()
    answer = [s for s in summary if s["metric"] == "ttft_answer_ms"]
    assert answer and all(s["count"] >= 4 and s["reasoning_tokens"] for s in answer), summary
