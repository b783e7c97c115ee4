"""The client's own threads by name: the I/O engine's loop (`ENGINE_THREAD`), its native
reader (`READER_THREAD`, named in measure/reader.c) and the sink's writer (`SINK_THREAD`)
name themselves in the OS, so `top -H`, `ps -L` and
benchmarks/client_speed.py (its CPU per request per thread) tell them from the process's
main thread, where the greenlets run (Locust's users, the dispatcher, the records)."""

from __future__ import annotations

import contextlib

ENGINE_THREAD = "cl-engine"
READER_THREAD = "cl-reader"
SINK_THREAD = "cl-sink"


def name_this_thread(name: str) -> None:
    """Give the calling thread `name` in the OS (Linux: its `comm`, 15 bytes at most);
    elsewhere, or where /proc cannot be written, nothing."""
    with contextlib.suppress(OSError), open("/proc/thread-self/comm", "w") as f:
        f.write(name[:15])
