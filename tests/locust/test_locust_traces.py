"""A plain Locust run fetches the target's traces when it stops, so
`analyze` joins client and server, and `export` writes joined §3 records; a target
without traces is `not_available` and the run ends normally. Real simulator, proxy and
Locust processes on loopback; the collector's row selection on its own below."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.judge.rules import DEFAULT_RULES
from calculet_drivers.cli import main
from calculet_load.target.traces import TraceWindow, _NotJsonLines, _select
from tests.support.locustproc import REPO, LocustRun
from tests.support.simproc import SimProcess

LOAD = ["-u", "2", "-r", "2", "--prompt-tokens", "64", "--max-tokens", "8", "--seed", "7"]
SERVER_MS = ("queue", "prefill", "postprocess", "sampling")
RUNTIME_MS = ("h2d_prefill", "infer_prefill", "d2h_prefill")


def _rules(tmp: Path) -> str:
    """The default rules, except that this shared machine's load must not make the run
    infrastructure-invalid (that check has its own tests)."""
    rules = yaml.safe_load(DEFAULT_RULES.read_text())
    rules["infrastructure"]["max_saturated_fraction"] = None
    path = tmp / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    return str(path)


def export_records(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[Any], str]:
    """`calculet-load export RUN` (in process): the §3 objects and its summary line."""
    capsys.readouterr()
    assert main(["export", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    return [json.loads(line) for line in out.splitlines()], err


def assert_joined_records_filled(records: list[dict[str, Any]]) -> int:
    """Every record that joined has its server-side §3 fields; the count of them."""
    joined = [r for r in records if r["quality"]["server_trace_joined"]]
    for r in joined:
        assert all(r["server_ms"][k] is not None for k in SERVER_MS), r["server_ms"]
        assert all(r["runtime_ms"][k] is not None for k in RUNTIME_MS), r["runtime_ms"]
        if (r["workload"]["actual_output_tokens"] or 0) > 1:  # one step has no decode
            assert r["server_ms"]["decode_total"] is not None, r["server_ms"]
            assert r["runtime_ms"]["infer_decode"] is not None, r["runtime_ms"]
    return len(joined)


def test_a_distributed_locust_run_fetches_the_traces_and_analyze_and_export_join_them(
    tmp_path: Path,
    start_sim: Callable[..., SimProcess],
    capsys: pytest.CaptureFixture[str],
) -> None:
    sim = start_sim("--time-scale", "0.05")
    # an earlier run on the same simulator: its rows are not this run's
    before = LocustRun(tmp_path, sim.url, LOAD, workers=0, run_time_s=3).start()
    assert before.wait(60) == 0, before.log_text()
    run = LocustRun(tmp_path, sim.url, [*LOAD, "--run-id", "joined"], workers=2, run_time_s=5)
    assert run.start().wait(90) == 0, run.log_text()

    fetched = run.index()["server_traces"]
    assert fetched["status"] == "fetched", fetched
    assert fetched["window"]["run_id"] == "joined"
    kinds = fetched["kinds"]
    assert {k: v["status"] for k, v in kinds.items()} == dict.fromkeys(kinds, "fetched")
    assert all(kinds[k]["rows"] > 0 for k in ("server_events", "steps", "device")), kinds
    assert kinds["server_events"]["dropped_rows"] > 0  # the earlier run's, left out
    for kind in ("server_events", "steps"):
        lines = (run.run_dir / "server" / f"{kind}.jsonl").read_text().splitlines()
        assert len(lines) == kinds[kind]["rows"]
        ids = {json.loads(x).get("request_id") for x in lines} - {None}
        assert ids and all(i.startswith("joined.") for i in ids), sorted(ids)[:3]

    requests = run.requests().num_rows
    assert requests >= 10, run.log_text()
    code = main(["analyze", str(run.run_dir), "--rules", _rules(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads((run.run_dir / "verdict.json").read_text())
    # every request of the run met its server trace (the figure: records == joined)
    assert doc["run"]["records"] == requests
    assert doc["run"]["joined"] == requests, doc["run"]

    records, summary = export_records(run.run_dir, capsys)
    assert len(records) == requests
    assert assert_joined_records_filled(records) == requests
    assert f"{requests} of {requests} joined to a server trace" in summary
    assert any(r["server_ms"]["decode_total"] is not None for r in records)
    # the device rows joined too: the throttling flag is known (false on the simulator)
    assert all(r["quality"]["throttled"] is False for r in records)


@pytest.fixture
def proxied(tmp_path: Path, start_sim: Callable[..., SimProcess]) -> Iterator[Callable[[str], str]]:
    """`proxy(traces)`: the URL of the simulator behind tests.support.traceless."""
    sim = start_sim("--time-scale", "0.05")
    procs: list[subprocess.Popen[bytes]] = []

    def proxy(traces: str) -> str:
        cmd = [sys.executable, "-m", "tests.support.traceless", sim.url, "--traces", traces]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=REPO)
        procs.append(p)
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 30)
        line = p.stdout.readline().decode() if ready else ""
        assert "listening on http://" in line, line
        return line.strip().rsplit(" ", 1)[1]

    yield proxy
    for p in procs:
        p.terminate()
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


@pytest.mark.parametrize(
    ("traces", "status"), [("404", "not_available"), ("html", "not_available"), ("500", "error")]
)
def test_a_target_without_traces_is_recorded_and_the_run_ends_normally(
    traces: str,
    status: str,
    tmp_path: Path,
    proxied: Callable[[str], str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = LocustRun(tmp_path, proxied(traces), LOAD, workers=0, run_time_s=3).start()
    assert run.wait(60) == 0, run.log_text()
    index = run.index()
    assert index["status"] == "complete"
    fetched = index["server_traces"]
    assert fetched["status"] == status, fetched
    assert {k["status"] for k in fetched["kinds"].values()} == {status}
    assert fetched["reason"], fetched
    assert not list((run.run_dir / "server").glob("server_events.jsonl"))
    log = run.log_text()
    if status == "error":  # loudly: an ERROR line naming what failed
        assert "ERROR/calculet_load: calculet run" in log and "HTTP 500" in log, log
    else:
        assert "no server traces (not_available" in log, log
    # the records stand and export says none joined
    requests = run.requests().num_rows
    assert requests > 0
    records, summary = export_records(run.run_dir, capsys)
    assert len(records) == requests
    assert all(r["server_ms"]["queue"] is None for r in records)
    assert f"0 of {requests} joined" in summary


def test_no_server_traces_turns_the_fetch_off(
    tmp_path: Path, start_sim: Callable[..., SimProcess]
) -> None:
    sim = start_sim("--time-scale", "0.05")
    run = LocustRun(tmp_path, sim.url, [*LOAD, "--no-server-traces"], workers=0, run_time_s=2)
    assert run.start().wait(60) == 0, run.log_text()
    assert run.index()["server_traces"] == {"status": "off", "reason": "--no-server-traces"}
    assert not (run.run_dir / "server" / "server_events.jsonl").exists()


# ------------------------------------------------------------------ the row selection
def _line(**row: Any) -> bytes:
    return (json.dumps(row) + "\n").encode()


def test_the_window_keeps_the_runs_requests_and_its_span() -> None:
    w = TraceWindow("r1", start_wall_ns=100_000, end_wall_ns=200_000, margin_ns=1_000)
    data = b"".join(
        [
            _line(wall_ns=150_000, event="accepted", request_id="r1.w00.00000001"),
            _line(wall_ns=150_000, event="accepted", request_id="r10.w00.00000001"),  # another
            _line(wall_ns=150_000, event="accepted", request_id="r0.w00.00000001"),
            _line(wall_ns=99_500, chips=[]),  # device row inside the margin
            _line(wall_ns=98_000, chips=[]),  # before the window
            _line(wall_ns=201_000, event="state_change"),  # at the margin's end
            _line(wall_ns=250_000, event="accepted", request_id="r1.w00.00000002"),  # later
            b"\n",
        ]
    )
    kept, rows, dropped = _select(data, w)
    assert (rows, dropped) == (3, 4)
    got = [json.loads(x) for x in kept.splitlines()]
    assert [g.get("request_id") for g in got] == ["r1.w00.00000001", None, None]
    assert _select(data, None)[1:] == (7, 0)  # no window: every row as read
    assert _select(b"", w) == (b"", 0, 0)


@pytest.mark.parametrize("body", [b"<html></html>\n", b"[1, 2]\n", b"not json\n"])
def test_an_answer_that_is_not_trace_rows_is_refused(body: bytes) -> None:
    with pytest.raises(_NotJsonLines):
        _select(body, None)
