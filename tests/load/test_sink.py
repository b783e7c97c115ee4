"""The Parquet sink: rotation, closed parts, off-loop writes, SIGTERM flush, crash loss bound,
and reading a run folder with parts from several workers."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from calculet_load import runfolder, sink
from calculet_load.runfolder import export_jsonl, part_files, read_records, read_table
from calculet_load.schema.arrow import SelfWatchRow, records_table
from calculet_load.schema.records import (
    SPEC3_ORDER,
    ClientNs,
    Ext,
    RequestRecord,
    SchemaVersionError,
    TokenEvent,
)
from calculet_load.sink import PartSink
from tests.conftest import REPO


def rec(i: int, worker: str = "w1") -> RequestRecord:
    return RequestRecord(
        "run",
        f"{worker}-{i:04d}",
        client_ns=ClientNs(request_start=i, response_end=i + 10),
        ext=Ext(worker=worker),
    )


def tokens(i: int, n: int = 3) -> list[TokenEvent]:
    return [TokenEvent(f"w1-{i:04d}", k, 1000 * i + k, 1, k + 1) for k in range(n)]


def test_parts_rotate_by_rows_and_read_back_in_order(tmp_path: Path) -> None:
    s = PartSink(str(tmp_path), "w1", rotate_rows=3, rotate_s=1e9)
    for i in range(7):
        s.add(rec(i), tokens(i))
    stats = s.close()
    files = part_files(str(tmp_path), "requests")
    assert [Path(f).name for f in files] == [
        "part-00001.requests.parquet",
        "part-00002.requests.parquet",
        "part-00003.requests.parquet",
    ]
    assert [pq.read_metadata(f).num_rows for f in files] == [3, 3, 1]
    assert [r.request_id for r in read_records(str(tmp_path))] == [f"w1-{i:04d}" for i in range(7)]
    assert read_table(str(tmp_path), "tokens").num_rows == 21
    assert stats.records == 7 and stats.token_events == 21 and stats.parts == 3
    on_disk = sum(
        Path(f).stat().st_size for t in ("requests", "tokens") for f in part_files(str(tmp_path), t)
    )
    assert stats.bytes == on_disk and stats.errors == []


def test_parts_rotate_by_time(tmp_path: Path) -> None:
    now = [0.0]
    s = PartSink(str(tmp_path), "w1", rotate_s=10.0, clock=lambda: now[0])
    s.add(rec(0))
    now[0] = 5.0
    s.add(rec(1))
    assert s.wait_written()
    assert part_files(str(tmp_path), "requests") == []  # still the open part
    now[0] = 10.5
    s.add(rec(2))  # 10.5 s after opening: this add closes the part
    assert s.wait_written()
    assert len(part_files(str(tmp_path), "requests")) == 1
    s.close()
    assert read_table(str(tmp_path), "requests").num_rows == 3


def test_writes_happen_on_a_native_thread_not_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    real = pq.write_table

    def spy(*args: object, **kw: object) -> None:
        seen.append(threading.get_ident())
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sink.pq, "write_table", spy)
    s = PartSink(str(tmp_path), "w1", rotate_rows=1)
    s.add(rec(0), tokens(0))
    s.close()
    assert seen and threading.get_ident() not in seen


def test_flush_polling_lets_the_event_loop_run_while_the_writer_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cell's end flushes the sink: waiting must not stall the loop (the self-watch
    would count the stall as client saturation)."""
    import time

    import gevent

    real = pq.write_table

    def slow(*args: object, **kw: object) -> None:
        time.sleep(0.05)  # on the writer thread
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sink.pq, "write_table", slow)
    s = PartSink(str(tmp_path), "w1", rotate_s=1e9)
    for i in range(5):
        s.add(rec(i), tokens(i))
    ticks: list[float] = []

    def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            gevent.sleep(0.005)

    g = gevent.spawn(ticker)
    gevent.sleep(0)
    before = len(ticks)
    assert gevent.spawn(s.flush_polling, gevent.sleep).get(timeout=10) is True
    during = len(ticks) - before
    g.kill()
    assert during >= 3, during  # the loop ran while the parts (>= 100 ms) were written
    assert len(part_files(str(tmp_path), "requests")) == 1  # and the part is on disk
    s.close()


def test_no_partial_part_is_ever_visible_and_tmp_files_are_ignored(tmp_path: Path) -> None:
    s = PartSink(str(tmp_path), "w1", rotate_rows=2)
    for i in range(4):
        s.add(rec(i))
    s.close()
    d = tmp_path / "client" / "w1"
    assert not list(d.glob(".*tmp"))
    (d / ".part-00009.requests.parquet.tmp").write_bytes(b"PAR1 half a file")
    assert len(read_records(str(tmp_path))) == 4


def test_two_workers_and_a_restarted_worker_are_read_together(tmp_path: Path) -> None:
    a = PartSink(str(tmp_path), "w1", rotate_rows=2)
    b = PartSink(str(tmp_path), "w2", rotate_rows=2)
    for i in range(3):
        a.add(rec(i, "w1"))
        b.add(rec(i, "w2"))
    a.close()
    b.close()
    again = PartSink(str(tmp_path), "w1")  # the worker restarted: numbering continues
    again.add(rec(3, "w1"))
    again.close()
    names = sorted(Path(f).name for f in part_files(str(tmp_path), "requests"))
    assert names.count("part-00003.requests.parquet") == 1  # w1's new part, no overwrite
    ids = sorted(r.request_id for r in read_records(str(tmp_path)))
    assert ids == sorted([f"w1-{i:04d}" for i in range(4)] + [f"w2-{i:04d}" for i in range(3)])


def test_selfwatch_rows_are_written_beside_the_records(tmp_path: Path) -> None:
    s = PartSink(str(tmp_path), "w1")
    s.add_selfwatch(SelfWatchRow("w1", 1, 2, 0.25, 12.5, 1 << 20, 3, 100.0))
    s.close()
    table = read_table(str(tmp_path), "selfwatch")
    assert table.column("loop_lag_ms").to_pylist() == [0.25]


def test_a_part_with_a_newer_schema_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "client" / "w1"
    d.mkdir(parents=True)
    table = records_table([rec(0)])
    table = table.replace_schema_metadata({"schema": "calculet-perf-request/v2"})
    pq.write_table(table, d / "part-00001.requests.parquet")
    with pytest.raises(SchemaVersionError, match="newer"):
        read_records(str(tmp_path))


def test_empty_run_folder_reads_as_empty_tables(tmp_path: Path) -> None:
    assert read_table(str(tmp_path), "requests").num_rows == 0
    with pytest.raises(ValueError, match="unknown"):
        runfolder.part_files(str(tmp_path), "nope")


def test_adding_after_close_is_an_error_not_a_silent_loss(tmp_path: Path) -> None:
    s = PartSink(str(tmp_path), "w1")
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.add(rec(0))
    assert s.close() is s.stats  # idempotent


def test_jsonl_export_is_the_spec3_shape(tmp_path: Path) -> None:
    s = PartSink(str(tmp_path), "w1")
    s.add(rec(0))
    s.add(rec(1))
    s.close()
    out = io.StringIO()
    assert export_jsonl(str(tmp_path), out) == 2
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [list(obj) for obj in lines] == [list(SPEC3_ORDER)] * 2
    assert lines[1]["client_ns"]["response_end"] == 11
    full = io.StringIO()
    export_jsonl(str(tmp_path), full, strict=False)
    assert json.loads(full.getvalue().splitlines()[0])["ext"]["worker"] == "w1"


_WRITER = textwrap.dedent(
    """
    import sys, time
    from calculet_load.sink import PartSink, install_signal_handlers
    from calculet_load.schema.records import RequestRecord
    s = PartSink(sys.argv[1], "w1", rotate_rows=10, rotate_s=1e9)
    install_signal_handlers(s)
    for i in range(20):
        s.add(RequestRecord("run", f"r{i}"))
    s.wait_written()
    for i in range(20, 25):
        s.add(RequestRecord("run", f"r{i}"))
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("sig", "survivors", "code"),
    [(signal.SIGTERM, 25, 128 + signal.SIGTERM), (signal.SIGKILL, 20, -signal.SIGKILL)],
)
def test_sigterm_flushes_everything_and_a_kill_loses_only_the_open_part(
    tmp_path: Path, sig: signal.Signals, survivors: int, code: int
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(sig)
    assert proc.wait(30) == code
    proc.stdout.close()
    assert len(read_records(str(tmp_path))) == survivors
