"""Per-process Parquet sink: request records, token events and self-watch samples.

The event loop only appends Python objects to in-memory buffers (a list append). A
native writer thread turns each buffer into Arrow tables and writes them as one closed
part: `client/<worker>/part-NNNNN.<table>.parquet`, written to a temporary name and then
renamed, so a part on disk is always complete. A part is cut every `rotate_s` seconds or
`rotate_rows` records, so a crash loses at most the rows of the open part; `close()`
(also run at exit and on SIGTERM when `install_signal_handlers` is used) flushes it.

Paths go through pyarrow.fs, so the run folder may be local or an object-store URI.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from calculet_load.measure.threads import SINK_THREAD, name_this_thread
from calculet_load.schema.arrow import (
    SelfWatchRow,
    records_table,
    selfwatch_table,
    token_events_table,
)
from calculet_load.schema.fs import resolve_fs
from calculet_load.schema.records import RequestRecord, TokenEvent, record_to_dict
from calculet_load.schema.runfolder import sink_status as sink_status  # one, in the schema

TABLES = ("requests", "tokens", "selfwatch")


def _original(module: str, name: str) -> Any:
    """The un-monkey-patched object: the writer must be a real OS thread under gevent."""
    try:
        from gevent import monkey
    except ImportError:  # pragma: no cover - gevent is a dependency
        return getattr(__import__(module), name)
    return monkey.get_original(module, name)


@dataclasses.dataclass(slots=True)
class _Batch:
    part: int
    records: list[RequestRecord]
    tokens: list[TokenEvent]
    selfwatch: list[SelfWatchRow]


@dataclasses.dataclass(slots=True)
class SinkStats:
    parts: int = 0
    records: int = 0
    token_events: int = 0
    selfwatch: int = 0
    bytes: int = 0
    write_s: float = 0.0
    errors: list[str] = dataclasses.field(default_factory=list)
    quarantined: int = 0  # rows that could not go into a part, kept in a quarantine file
    quarantine_files: list[str] = dataclasses.field(default_factory=list)
    lost: int = 0  # rows neither in a part nor in a quarantine file

    @property
    def complete(self) -> bool:
        """Every row handed to the sink is in a Parquet part."""
        return not (self.errors or self.quarantined or self.lost)


class PartSink:
    """Buffers rows and writes rotated, closed Parquet parts from a native thread."""

    def __init__(
        self,
        run_dir: str,
        worker: str,
        *,
        rotate_s: float = 10.0,
        rotate_rows: int = 50_000,
        compression: str = "zstd",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        use_system_allocator()
        self.fs, root = resolve_fs(run_dir)
        self.dir = f"{root.rstrip('/')}/client/{worker}"
        self.fs.create_dir(self.dir, recursive=True)
        self.worker = worker
        self.rotate_s = rotate_s
        self.rotate_rows = rotate_rows
        self.compression = compression
        self.stats = SinkStats()
        self._clock = clock
        self._records: list[RequestRecord] = []
        self._tokens: list[TokenEvent] = []
        self._selfwatch: list[SelfWatchRow] = []
        self._opened = clock()
        self._part = self._first_free_part()
        self._closed = False
        self._queue = _original("queue", "SimpleQueue")()
        # A real OS thread even when gevent has patched `threading` (Locust does): the
        # patched Thread class would start a greenlet, and its blocking queue.get() would
        # stop the whole event loop. Native lock and queue only, for the same reason.
        self.writer_tid: int | None = None  # the writer thread's OS id, once it runs
        self._finished = _original("_thread", "allocate_lock")()
        self._finished.acquire()
        _original("_thread", "start_new_thread")(self._writer_main, ())
        atexit.register(self.close)

    # --- called on the event loop: appends only -------------------------------------
    def add(self, record: RequestRecord, token_events: list[TokenEvent] | None = None) -> None:
        if self._closed:
            raise RuntimeError("sink is closed")
        self._records.append(record)
        if token_events:
            self._tokens.extend(token_events)
        self._maybe_rotate()

    def add_selfwatch(self, row: SelfWatchRow) -> None:
        if not self._closed:
            self._selfwatch.append(row)
            self._maybe_rotate()

    def _maybe_rotate(self) -> None:
        if len(self._records) >= self.rotate_rows or self._clock() - self._opened >= self.rotate_s:
            self.rotate()

    def rotate(self) -> None:
        """Close the open part (hand it to the writer) and open the next one."""
        if not (self._records or self._tokens or self._selfwatch):
            self._opened = self._clock()
            return
        batch = _Batch(self._part, self._records, self._tokens, self._selfwatch)
        self._records, self._tokens, self._selfwatch = [], [], []
        self._part += 1
        self._opened = self._clock()
        self._queue.put(batch)

    def close(self) -> SinkStats:
        """Flush the open part, wait for the writer, and stop it. Idempotent."""
        if not self._closed:
            self._closed = True
            self.rotate()
            self._queue.put(None)
            self._finished.acquire()  # the writer has written everything and stopped
            atexit.unregister(self.close)
        return self.stats

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Rotate and wait until every handed-over part is on disk (blocks the caller)."""
        self.rotate()
        return self.wait_written(timeout_s)

    def flush_polling(self, sleep: Callable[[float], None], timeout_s: float = 30.0) -> bool:
        """`flush()` for an event loop: waits by polling, with `sleep` (gevent.sleep)
        between polls, so the loop's other greenlets (the self-watch among them) run
        meanwhile instead of seeing the loop stalled for the whole write."""
        self.rotate()
        if self._closed:
            return True
        done = self._written_marker()
        deadline = time.monotonic() + timeout_s
        while not done.acquire(False):
            if time.monotonic() > deadline:
                return False
            sleep(0.002)
        return True

    def wait_written(self, timeout_s: float = 30.0) -> bool:
        """Wait until the parts handed over so far are on disk; the open part stays open."""
        if self._closed:
            return True
        return bool(self._written_marker().acquire(timeout=timeout_s))

    def _written_marker(self) -> Any:
        """A held lock the writer releases once it has written what was queued before it."""
        done = _original("_thread", "allocate_lock")()
        done.acquire()
        self._queue.put(done)
        return done

    # --- the writer thread ------------------------------------------------------------
    def _writer_main(self) -> None:
        self.writer_tid = _original("_thread", "get_native_id")()
        name_this_thread(SINK_THREAD)
        _yield_the_core(self.writer_tid)
        try:
            self._writer()
        finally:
            self._finished.release()

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if not isinstance(item, _Batch):
                item.release()  # a wait_written marker: everything before it is written
                continue
            t = time.perf_counter()
            try:
                self._write(item)
            except Exception as exc:  # keep writing later parts; the loss is reported
                self.stats.errors.append(f"part {item.part}: {type(exc).__name__}: {exc}")
                self.stats.lost += len(item.records) + len(item.tokens) + len(item.selfwatch)
            self.stats.write_s += time.perf_counter() - t

    def _write(self, batch: _Batch) -> None:
        """Write the batch's tables as one part. A row whose values Arrow refuses costs
        only itself: it is found by bisection and quarantined, the rest are written."""
        plan: list[tuple[str, Sequence[Any], Callable[[Sequence[Any]], pa.Table]]] = [
            ("requests", batch.records, records_table),
            ("tokens", batch.tokens, token_events_table),
            ("selfwatch", batch.selfwatch, selfwatch_table),
        ]
        for name, rows, convert in plan:
            if not rows:
                continue
            table, refused = _convert(rows, convert)
            if refused:
                self._quarantine(batch.part, name, refused, "Arrow refused the row")
            if table is None:
                continue
            final = f"{self.dir}/part-{batch.part:05d}.{name}.parquet"
            tmp = f"{self.dir}/.part-{batch.part:05d}.{name}.parquet.tmp"
            try:
                with self.fs.open_output_stream(tmp) as stream:
                    pq.write_table(table, stream, **self._options(name))
                self.fs.move(tmp, final)
            except Exception as exc:  # the file system failed: keep the rows as JSON lines
                self.stats.errors.append(f"part {batch.part} {name}: {type(exc).__name__}: {exc}")
                good = [row for row in rows if all(row is not r for r, _ in refused)]
                unwritten = [(r, exc) for r in good]
                self._quarantine(batch.part, f"{name}.unwritten", unwritten, "write failed")
                continue
            self.stats.bytes += self.fs.get_file_info(final).size
            count = table.num_rows
            if name == "requests":
                self.stats.records += count
            elif name == "tokens":
                self.stats.token_events += count
            else:
                self.stats.selfwatch += count
        self.stats.parts += 1

    def _options(self, table: str) -> dict[str, Any]:
        """How `table`'s part is encoded (`pq.write_table`'s options)."""
        if table != "tokens":
            return {"compression": self.compression}
        level = {"compression_level": TOKENS_ZSTD_LEVEL} if self.compression == "zstd" else {}
        return {"compression": self.compression, **TOKENS_ENCODING, **level}

    def _quarantine(
        self, part: int, table: str, rows: Sequence[tuple[Any, BaseException]], why: str
    ) -> None:
        """Keep rows that could not go into a part as JSON lines beside the parts."""
        if not rows:
            return
        path = f"{self.dir}/quarantine-{part:05d}.{table}.jsonl"
        lines = [
            json.dumps(
                {
                    "table": table.split(".")[0],
                    "part": part,
                    "why": why,
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                    "row": _row_dict(row),
                },
                default=repr,
                ensure_ascii=True,  # a lone surrogate must not make the line unwritable
            )
            for row, exc in rows
        ]
        try:
            with self.fs.open_output_stream(path) as stream:
                stream.write(("\n".join(lines) + "\n").encode())
        except Exception as exc:
            self.stats.lost += len(rows)
            self.stats.errors.append(
                f"part {part} {table}: {len(rows)} row(s) lost, quarantine unwritable: "
                f"{type(exc).__name__}: {exc}"
            )
            return
        self.stats.quarantined += len(rows)
        name = path.rsplit("/", 1)[-1]
        if name not in self.stats.quarantine_files:
            self.stats.quarantine_files.append(name)
        self.stats.errors.append(f"part {part} {table}: {len(rows)} row(s) quarantined to {name}")

    def _first_free_part(self) -> int:
        """Continue numbering after existing parts (a restarted worker appends)."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.dir, allow_not_found=True))
        numbers = [
            int(i.base_name.split(".")[0].removeprefix("part-"))
            for i in infos
            if i.base_name.startswith("part-") and i.base_name.split(".")[0][5:].isdigit()
        ]
        return max(numbers, default=0) + 1


# How the token events are stored. A request's events come in one run, in order: its
# index and cumulative count rise by one an event, its tokens are mostly 1 and its
# arrivals rise by about an ITL, which delta encoding stores in a few bits each. Parquet's
# default, a dictionary for every column, fell back to plain 8-byte values for the
# arrivals (all distinct) and made the rest no smaller: 4.08 bytes a token event on the
# rows of a 160 req/s run against benchmarks/exact_server.py, 2.30 so at zstd level 5
# (2.41 at level 1), and the writer's encoding took 0.19 µs a row against 0.21 (the
# same rows re-written each way). Only request_id repeats: a dictionary for it alone.
TOKENS_ENCODING: dict[str, Any] = {
    "use_dictionary": ["request_id"],
    "column_encoding": {
        c: "DELTA_BINARY_PACKED"
        for c in ("event_index", "arrival_ns", "tokens", "server_cumulative")
    },
}
TOKENS_ZSTD_LEVEL = 5

# How much nicer than the process the writer thread runs (Linux: per thread). Its Arrow
# conversion and zstd compression come in bursts every part; on a worker's one core they
# took the CPU from the I/O engine's thread, whose reads then came after the next token
# (a token's stamp is that of the newest bytes its read copies: docs/measurement.md). At
# 320 req/s on one core, TTFT p99 error was +8.18, +4.62, +0.23, +0.98 and +2.42 ms with
# it, +10.04, +20.02, +10.07, +10.04 and +13.71 ms without (five interleaved pairs, the
# first three with TokenEvent untracked by the garbage collector). The writer still gets
# the core whenever the others wait, and a share when they do not.
WRITER_NICENESS = 10


def use_system_allocator() -> None:
    """Arrow's allocations in this process from the C library's malloc, unless the user
    named a pool (ARROW_DEFAULT_MEMORY_POOL).

    pyarrow's default, mimalloc, can spend 5-29 ms of CPU inside one `pa.array` of
    4,096 request ids (0.2 ms as a rule) while the writer converts a part, and
    `pa.array` holds the interpreter lock: the event loop and the I/O engine's thread
    stop with it, and an open loop's sends come late. With the system allocator (or
    jemalloc) they do not, at the same writer CPU a part."""
    if not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        pa.set_memory_pool(pa.system_memory_pool())


def _yield_the_core(tid: int) -> None:
    """Lower thread `tid`'s CPU priority by WRITER_NICENESS (raising one's niceness needs
    no privilege); where the platform has no per-thread niceness, nothing."""
    if not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(now + WRITER_NICENESS, 19))


def _convert(
    rows: Sequence[Any], convert: Callable[[Sequence[Any]], pa.Table]
) -> tuple[pa.Table | None, list[tuple[Any, BaseException]]]:
    """`convert(rows)`, or when Arrow refuses some row: the table of the rows it takes
    and the refused rows with their errors (found by bisection: log2(n) tries a row)."""
    try:
        return convert(rows), []
    except Exception as exc:
        if len(rows) == 1:
            return None, [(rows[0], exc)]
    half = len(rows) // 2
    left, bad_left = _convert(rows[:half], convert)
    right, bad_right = _convert(rows[half:], convert)
    tables = [t for t in (left, right) if t is not None]
    table = pa.concat_tables(tables) if tables else None
    return table, bad_left + bad_right


def _row_dict(row: Any) -> Any:
    if isinstance(row, RequestRecord):
        return record_to_dict(row)
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return dataclasses.asdict(row)
    if isinstance(row, msgspec.Struct):  # schema.records.TokenEvent
        return msgspec.structs.asdict(row)
    return repr(row)


def install_signal_handlers(sink: PartSink) -> None:
    """On SIGTERM/SIGINT: flush the sink, then exit with the conventional status."""

    def handler(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(Exception):
            sink.close()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
