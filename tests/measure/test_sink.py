"""The Parquet sink: rotation, closed parts, off-loop writes, SIGTERM flush, crash loss bound,
and reading a run folder with parts from several workers."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest

from calculet_load.measure import sink
from calculet_load.measure.sink import PartSink
from calculet_load.schema import runfolder
from calculet_load.schema.arrow import SelfWatchRow, records_table
from calculet_load.schema.records import (
    SPEC3_ORDER,
    ClientNs,
    Ext,
    RequestRecord,
    SchemaVersionError,
    TokenEvent,
)
from calculet_load.schema.runfolder import export_jsonl, part_files, read_records, read_table
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
    # The writer thread holds its first write until the loop has ticked 3 times during
    # the flush (a condition, not a time: a loaded machine may not run the loop in a
    # fixed 100 ms); a flush that stalled the loop would leave it the whole 10 s.
    ticked = sink._original("_thread", "allocate_lock")()
    ticked.acquire()
    held: list[bool] = []

    def slow(*args: object, **kw: object) -> None:
        if not held:  # on the writer thread
            held.append(ticked.acquire(timeout=10))
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sink.pq, "write_table", slow)
    s = PartSink(str(tmp_path), "w1", rotate_s=1e9)
    for i in range(5):
        s.add(rec(i), tokens(i))
    ticks: list[float] = []
    flushing: list[int] = []  # the tick count when the flush began

    def ticker() -> None:
        while True:
            ticks.append(time.monotonic())
            if flushing and len(ticks) - flushing[0] == 3:
                ticked.release()
            gevent.sleep(0.005)

    g = gevent.spawn(ticker)
    gevent.sleep(0)
    before = len(ticks)
    flushing.append(before)
    assert gevent.spawn(s.flush_polling, gevent.sleep).get(timeout=30) is True
    during = len(ticks) - before
    g.kill()
    assert held == [True]  # the loop ran while the part was being written
    assert during >= 3, during
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
    from calculet_load.measure.sink import PartSink, install_signal_handlers
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


# --- no record is lost to another record's value ------------------------------------------


def _quarantine_lines(folder: Path) -> list[dict[str, object]]:
    return [
        json.loads(line)
        for path in sorted(folder.glob("quarantine-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_a_row_arrow_refuses_costs_only_itself(tmp_path: Path) -> None:
    # A value that escaped every check upstream (2**70 does not fit int64) among 500 good
    # records and their token events: the 500 are written, the one is quarantined.
    s = PartSink(str(tmp_path), "w1", rotate_rows=10_000, rotate_s=1e9)
    bad_at = 317
    for i in range(501):
        r = rec(i)
        if i == bad_at:
            r = RequestRecord("run", r.request_id, ext=Ext(worker="w1", server_output_tokens=2**70))
        s.add(r, tokens(i))
    s.add(rec(999), [TokenEvent("w1-0999", 0, 5, 1, 2**64)])  # a bad token event alone
    stats = s.close()
    ids = [r.request_id for r in read_records(str(tmp_path))]
    assert len(ids) == 501 and f"w1-{bad_at:04d}" not in ids and "w1-0999" in ids
    assert read_table(str(tmp_path), "tokens").num_rows == 501 * 3
    assert stats.records == 501 and stats.token_events == 1503
    assert stats.quarantined == 2 and not stats.complete and stats.lost == 0
    assert stats.quarantine_files == [
        "quarantine-00001.requests.jsonl",
        "quarantine-00001.tokens.jsonl",
    ]
    lines = _quarantine_lines(tmp_path / "client" / "w1")
    assert [(x["table"], x["part"]) for x in lines] == [("requests", 1), ("tokens", 1)]
    row = lines[0]["row"]
    assert isinstance(row, dict) and row["request_id"] == f"w1-{bad_at:04d}"
    assert row["ext"]["server_output_tokens"] == 2**70  # the raw value is kept
    assert "OverflowError" in str(lines[0]["error"]) or "out of range" in str(lines[0]["error"])
    problem = sink.sink_status(dataclasses.asdict(stats))
    assert problem is not None and "2 row(s) quarantined" in problem


def test_a_part_the_file_system_refuses_goes_to_a_quarantine_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = pq.write_table

    def failing(table: object, where: object, **kw: object) -> None:
        if "client_ns.request_start" in getattr(table, "column_names", []):
            raise OSError("disk full")
        real(table, where, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sink.pq, "write_table", failing)
    s = PartSink(str(tmp_path), "w1", rotate_rows=10_000, rotate_s=1e9)
    for i in range(4):
        s.add(rec(i), tokens(i))
    stats = s.close()
    assert stats.records == 0 and stats.token_events == 12
    assert stats.quarantined == 4 and stats.lost == 0
    assert any("disk full" in e for e in stats.errors)
    lines = _quarantine_lines(tmp_path / "client" / "w1")
    assert [x["row"]["request_id"] for x in lines] == [f"w1-{i:04d}" for i in range(4)]  # type: ignore[index]
    assert {x["why"] for x in lines} == {"write failed"}


def test_a_clean_sink_is_complete(tmp_path: Path) -> None:
    s = PartSink(str(tmp_path), "w1")
    s.add(rec(1), tokens(1))
    stats = s.close()
    assert stats.complete and sink.sink_status(dataclasses.asdict(stats)) is None
    assert not list((tmp_path / "client" / "w1").glob("quarantine-*"))


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread niceness here")
def test_the_writer_thread_yields_the_core(tmp_path: Path) -> None:
    """The writer runs WRITER_NICENESS nicer than the process: its bursts of conversion
    and compression must not take the core from the I/O engine's reads."""
    s = PartSink(str(tmp_path), "w1")
    deadline = time.monotonic() + 5
    while s.writer_tid is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.writer_tid is not None and s.writer_tid != threading.get_native_id()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, s.writer_tid) == min(mine + sink.WRITER_NICENESS, 19)
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the process's own is untouched
    s.add(rec(0), tokens(0))
    assert s.close().complete


@pytest.mark.parametrize("named", [None, "jemalloc"])
def test_a_sink_puts_arrow_on_the_system_allocator_unless_a_pool_is_named(
    tmp_path: Path, named: str | None
) -> None:
    """mimalloc, pyarrow's default, now and then spent tens of ms inside one conversion
    while holding the interpreter lock (sink.use_system_allocator): a process that
    records allocates Arrow memory with malloc, unless the user named a pool. In a
    fresh process, so that the pool this one started with does not count."""
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if named:
        env["ARROW_DEFAULT_MEMORY_POOL"] = named
    code = textwrap.dedent(
        f"""
        import pyarrow as pa
        from calculet_load.measure.sink import PartSink
        before = pa.default_memory_pool().backend_name
        s = PartSink({str(tmp_path)!r}, "w1")
        stats = s.close()
        print(before, pa.default_memory_pool().backend_name, stats.complete)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    before, after, complete = out.stdout.split()
    if named:
        assert before == after == named
    else:
        assert before != "system" and after == "system"
    assert complete == "True"


def test_token_events_are_delta_encoded_and_read_back_exactly(tmp_path: Path) -> None:
    """The token parts store their integer columns delta-encoded and request_id in a
    dictionary (sink.TOKENS_ENCODING); every value reads back as written, a large
    arrival jump between requests and a count that goes back (a row is not checked
    here: the adapters refuse that) included."""
    s = PartSink(str(tmp_path), "w1", rotate_rows=10_000, rotate_s=1e9)
    written: list[TokenEvent] = []
    for i in range(50):
        start = 10**15 + i * 7_919_000_003  # requests far apart on the clock
        events = [
            TokenEvent(f"w1-{i:04d}", k, start + k * 10_000_000 + (k * k) % 997, 1 + k % 3, k + 1)
            for k in range(64)
        ]
        events.append(TokenEvent(f"w1-{i:04d}", 64, start - 5, 0, 0))
        written += events
        s.add(rec(i), events)
    stats = s.close()
    assert stats.errors == [] and stats.token_events == len(written)
    (part,) = part_files(str(tmp_path), "tokens")
    names = pq.read_schema(part).names
    assert set(sink.TOKENS_ENCODING["column_encoding"]) | {"request_id"} == set(names)
    chunks = pq.ParquetFile(part).metadata.row_group(0)
    used = {chunks.column(i).path_in_schema: chunks.column(i).encodings for i in range(5)}
    for name in ("event_index", "arrival_ns", "tokens", "server_cumulative"):
        assert "DELTA_BINARY_PACKED" in used[name], used
        assert "RLE_DICTIONARY" not in used[name], used
    assert "RLE_DICTIONARY" in used["request_id"], used
    back = read_table(str(tmp_path), "tokens").to_pylist()
    assert back == [msgspec.structs.asdict(ev) for ev in written]
