"""Numbers a user gives (an option, a form field, a REST body), checked against their
range in one place, and a command line that refuses a bad value in one line.

`Number(int, 1, 100)` is a number's kind and range: `parse` gives the value or one line
naming the option, its range and what was given; as an argparse `type` it raises that
line. `OneLineParser` is the argparse parser whose errors are that one line (prefixed by
the command) and exit 2, never argparse's usage block or a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any, NoReturn

from calculet_load.errors import ExitCode


@dataclasses.dataclass(frozen=True)
class Number:
    """A number's kind and range: `lo` <= value (< with `lo_open`) <= `hi`."""

    kind: type[int] | type[float]
    lo: float
    hi: float
    lo_open: bool = False

    def parse(self, flag: str, raw: Any) -> tuple[int | float | None, str | None]:
        """(the value, None) or (None, the one-line problem naming `flag`)."""
        value: int | float | None = None
        text = raw.strip() if isinstance(raw, str) else raw
        try:
            if isinstance(text, bool):
                raise ValueError
            if self.kind is int:
                value = text if isinstance(text, int) else int(str(text), 10)
            else:
                value = float(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not math.isfinite(value) or not self._within(value):
            return None, f"{flag} must be {self.describe()}, got {raw!r}"
        return value, None

    def __call__(self, raw: str) -> int | float:
        """argparse's `type`: the value, or ArgumentTypeError saying the range."""
        value, _ = self.parse("", raw)
        if value is None:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {raw!r}")
        return value

    def _within(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and value <= self.hi

    def describe(self) -> str:
        kind = "a whole number" if self.kind is int else "a number"
        low = f"> {_plain(self.lo)}" if self.lo_open else f">= {_plain(self.lo)}"
        return f"{kind} {low} and <= {_plain(self.hi)}"


def _plain(x: float) -> str:
    """A bound as people write it: 1048576, 0.5 (never 1.04858e+06)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and exit 2 (invalid input)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(int(ExitCode.INVALID_ARTIFACT))


# The ranges the command lines share (each option names one)
SEED = Number(int, 0, 2**63 - 1)
SECONDS = Number(float, 0, 86_400)  # 0 allowed: off, or none
POSITIVE_SECONDS = Number(float, 0, 86_400, lo_open=True)
SCALE = Number(float, 0, 1e6, lo_open=True)  # a time or duration scale factor
RATE = Number(float, 0, 1e6)
POSITIVE_RATE = Number(float, 0, 1e6, lo_open=True)
COUNT = Number(int, 1, 100_000)  # users, workers, requests in flight
REPETITIONS = Number(int, 1, 1_000_000)
PORT = Number(int, 1, 65_535)
FRACTION = Number(float, 0, 1)
POSITIVE_FRACTION = Number(float, 0, 1, lo_open=True)
MILLISECONDS = Number(float, 0, 3_600_000, lo_open=True)
# 40,959: the Calculet service's context (40,960) less the one token a prompt leaves for
# its output; any prompt the harness builds is at most this long (measure.prompts)
PROMPT_TOKENS = Number(int, 1, 40_959)
OUTPUT_TOKENS = Number(int, 1, 1 << 20)  # above any model's context: more is a typo
