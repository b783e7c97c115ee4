"""One sign for clock offsets (calculet_load.schema.clocks), from the writer to the reader.

The offset is written the way a run writes it (clock_provenance's `ntp_offset_ns` from a
chrony answer, into the worker's entry of client/index.json; the server host's chrony
answer into server/clock.json) and read back through analysis.load_run: a known shift
must be corrected, not doubled.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from analysis.tables.join import load_run
from calculet_load import clock
from calculet_load.schema.clocks import (
    best_sample,
    exchange,
    from_reference_ns,
    rtt_summary,
    to_reference_ns,
)
from tests.support.runs import MS, WALL0, RunBuilder, request


def _chrony(system_time_s: str) -> str:
    """`chronyc -c tracking` saying the local clock is `system_time_s` slow of NTP time."""
    return (
        f"A9FEA97B,169.254.169.123,4,1704967211.4,{system_time_s},0.0,0.0,-3.4,-0.001,"
        "0.012,0.0003,0.0001,64.2,Normal\n"
    )


def _provenance_with(monkeypatch: pytest.MonkeyPatch, chrony_csv: str) -> dict[str, object]:
    """clock_provenance() as a host whose chronyd prints `chrony_csv` writes it."""

    def run(argv: list[str], **_kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, stdout=chrony_csv, stderr="")

    real = clock.query_ntp_offset
    monkeypatch.setattr(clock, "query_ntp_offset", lambda: real(run))
    return clock.clock_provenance()


def test_a_known_shift_is_corrected_not_doubled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client host's wall clock runs 300 ms fast (chrony: 0.3 s "fast", i.e. -0.3),
    # the server host's 100 ms slow (chrony: +0.1). A request starts at true time
    # T = WALL0 + 2000 ms, so its anchor reads T + 300 ms. On the server's clock it began
    # at T − 100 ms. The old reading (anchor − offset + server offset) gave T + 700 ms.
    client = _provenance_with(monkeypatch, _chrony("-0.300000000"))
    assert client["ntp_offset_ns"] == -300 * MS
    server_offset = clock.parse_chrony_tracking_csv(_chrony("0.100000000")).offset_ns
    assert server_offset == 100 * MS

    true_start = WALL0 + 2_000 * MS
    rec = request("a", t0=2_000 * MS)
    assert rec.ext.wall_anchor_ns == true_start
    fast = dataclasses.replace(rec.ext, wall_anchor_ns=true_start + 300 * MS)
    rec = dataclasses.replace(rec, ext=fast)  # what the fast client clock read
    b = RunBuilder(tmp_path).add(rec).complete_index()
    assert b.index is not None
    b.index["workers"][0].update(client)  # the worker entry as the index holds it
    run_dir = b.write()
    (tmp_path / "server").mkdir(exist_ok=True)
    (tmp_path / "server" / "clock.json").write_text(json.dumps({"ntp_offset_ns": server_offset}))

    run = load_run(run_dir)
    assert run.client_offsets_ns == {"w00": -300 * MS}
    assert run.server_offset_ns == 100 * MS
    row = run.requests.to_pylist()[0]
    assert row["join.wall_start_ns"] == true_start - 100 * MS


def test_conversions_are_inverse_and_signed_like_chrony() -> None:
    # local 1000, reference 1250: the local clock is behind, offset +250
    assert to_reference_ns(1000, 250) == 1250
    assert from_reference_ns(1250, 250) == 1000


def test_four_stamp_exchange_known_answer() -> None:
    # The worker's clock is 200 ms ahead of the master's (master − worker = −200 ms);
    # 1 ms each way, 0.5 ms in the worker. t1 = 0 (master), t2 = 1 ms + 200 ms (worker),
    # t3 = 1.5 ms + 200 ms (worker), t4 = 2.5 ms (master).
    s = exchange(0, 201 * MS, 201 * MS + MS // 2, 2 * MS + MS // 2)
    assert s.offset_ns == -200 * MS
    assert s.rtt_ns == 2 * MS
    # an asymmetric sample (3 ms out, 0 back) errs by half its round trip, 1.5 ms; the
    # best keeps the tighter one
    skewed = exchange(0, 203 * MS, 203 * MS, 3 * MS)
    assert (skewed.offset_ns, skewed.rtt_ns) == (-201 * MS - MS // 2, 3 * MS)
    assert best_sample([skewed, s]) == s
    assert best_sample([]) is None


def test_rtt_summary_at_n0_n1_and_known_spread() -> None:
    assert rtt_summary([])["jitter_ms"] is None
    one = rtt_summary([5 * MS])
    assert (one["n"], one["p50_ms"], one["jitter_ms"]) == (1, 5.0, 0.0)
    # 26 ± 4 ms alternating: mean 26, population standard deviation exactly 4
    many = rtt_summary([22 * MS, 30 * MS] * 5)
    assert many["mean_ms"] == 26.0
    assert many["jitter_ms"] == pytest.approx(4.0)
    assert (many["min_ms"], many["max_ms"], many["p50_ms"]) == (22.0, 30.0, 30.0)
