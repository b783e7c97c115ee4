"""The JSON-lines files of a run folder: rows appended one line at a time, and read back.

A driver appends to `events.jsonl` (steps.EventLog), its samples (`client/resources.jsonl`,
`soak/health.jsonl`), the copies of the server's traces and the fault matrix's windows.
A line is written whole with one `write`, so a process killed mid-run cuts at most the
line being written; `repair_tail` cuts that line before a resumed run appends after it,
and the readers here skip any line that is not a JSON object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["JsonLines", "last_row", "parse_rows", "read_rows", "repair_tail"]


class JsonLines:
    """A JSONL file that rows are appended to (its folder made on first use)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def write(self, row: Mapping[str, Any]) -> None:
        self.write_all((row,))

    def write_all(self, rows: Iterable[Mapping[str, Any]]) -> None:
        text = "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in rows)
        if text:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(text)


def parse_rows(data: bytes) -> list[dict[str, Any]]:
    """The JSON object rows of JSON-lines bytes; a line that is not one is skipped."""
    rows = []
    for line in data.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON object rows of a JSONL file (none when it is missing)."""
    try:
        return parse_rows(path.read_bytes())
    except OSError:
        return []


def last_row(path: Path, match: Callable[[dict[str, Any]], bool] = lambda _: True) -> Any:
    """The last row of a JSONL file that `match`es (None: none does, or no file)."""
    return next((r for r in reversed(read_rows(path)) if match(r)), None)


def repair_tail(path: Path) -> int:
    """Cut a line left half-written by a killed process (appending after it would make a
    line that is not JSON); the bytes dropped."""
    try:
        with path.open("rb+") as f:
            size = f.seek(0, os.SEEK_END)
            pos, keep = size, 0
            while pos > 0:
                step = min(65536, pos)
                f.seek(pos - step)
                nl = f.read(step).rfind(b"\n")
                if nl != -1:
                    keep = pos - step + nl + 1
                    break
                pos -= step
            if keep < size:
                f.truncate(keep)
            return size - keep
    except FileNotFoundError:
        return 0
