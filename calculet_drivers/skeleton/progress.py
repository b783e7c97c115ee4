"""A driver's progress lines on stdout: `[HH:MM:SS] text`, or nothing with `--quiet`."""

from __future__ import annotations

import time

__all__ = ["Progress"]


class Progress:
    """Called with a line of progress; prints it, stamped, when `shown`."""

    def __init__(self, shown: bool = True) -> None:
        self.shown = shown

    def __call__(self, text: str) -> None:
        if self.shown:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)
