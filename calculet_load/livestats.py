"""Live figures for the web UI and the console: bounded, mergeable, exact to 1 %.

Workers never ship raw values to the master (a single-threaded master drowns in them,
`research/locust.md` §5.3). Each worker keeps log-bucket histograms — bucket i holds
values in [G^i, G^(i+1)) with G = 1.02, so a quantile read from a bucket's geometric
middle is within 1 % of the exact order statistic — and counters, and ships what
changed since its last report; the master adds them up. These figures serve the live
view only: every figure in a report is recomputed from the raw records.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any

GROWTH = 1.02  # bucket width; the midpoint is within sqrt(1.02) - 1 < 1 % of any value in it
_LOG_G = math.log(GROWTH)
_ZERO = -(10**6)  # bucket of values <= 0 (a clock can give 0 ns on a coarse platform)

HISTOGRAMS = ("ttft", "tpot", "e2e", "ttft_sched", "send_lag", "loop_lag")
COUNTERS = (
    "requests",
    "ok",
    "failed",
    "late",
    "dropped",
    "output_tokens",
    "prompt_tokens",
    "token_events",
    "count_mismatch",
)


class LogHistogram:
    """Counts per log bucket; `quantile` is within 1 % of the exact value."""

    __slots__ = ("buckets", "count", "max", "min", "sum")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = collections.defaultdict(int)
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    @staticmethod
    def bucket_of(value: float) -> int:
        return math.floor(math.log(value) / _LOG_G) if value > 0 else _ZERO

    @staticmethod
    def value_of(bucket: int) -> float:
        return 0.0 if bucket == _ZERO else GROWTH ** (bucket + 0.5)

    def add(self, value: float) -> None:
        self.buckets[self.bucket_of(value)] += 1
        self.count += 1
        self.sum += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)

    def quantile(self, q: float) -> float | None:
        """Nearest-rank quantile (the ceil(q*n)-th smallest), None with no data."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q * self.count))
        if rank >= self.count:
            return self.max  # the largest value is kept exactly
        seen = 0
        for bucket in sorted(self.buckets):
            seen += self.buckets[bucket]
            if seen >= rank:
                # never outside what was seen: the extreme buckets are clamped to min/max
                return min(max(self.value_of(bucket), self.min), self.max)
        return self.max

    def to_wire(self) -> dict[str, Any]:
        return {
            "b": {str(k): v for k, v in self.buckets.items()},
            "n": self.count,
            "s": self.sum,
            "lo": self.min if self.count else None,
            "hi": self.max if self.count else None,
        }

    def merge_wire(self, wire: dict[str, Any]) -> None:
        if not wire.get("n"):
            return
        for key, n in wire["b"].items():
            self.buckets[int(key)] += int(n)
        self.count += int(wire["n"])
        self.sum += float(wire["s"])
        self.min = min(self.min, float(wire["lo"]))
        self.max = max(self.max, float(wire["hi"]))


@dataclasses.dataclass
class LiveStats:
    """One process's live figures, or the master's merge of all workers'."""

    hist: dict[str, LogHistogram] = dataclasses.field(
        default_factory=lambda: {name: LogHistogram() for name in HISTOGRAMS}
    )
    counters: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    in_flight: dict[str, int] = dataclasses.field(default_factory=dict)  # per process
    cpu_percent: dict[str, float] = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.monotonic)
    _tokens_seen: collections.deque[tuple[float, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=64)
    )

    def observe(self, name: str, value_ms: float | None) -> None:
        if value_ms is not None:
            self.hist[name].add(value_ms)

    def to_wire(self) -> dict[str, Any]:
        return {
            "hist": {k: h.to_wire() for k, h in self.hist.items() if h.count},
            "counters": dict(self.counters),
            "errors": dict(self.errors),
        }

    def merge_wire(self, wire: dict[str, Any], process: str | None = None) -> None:
        for name, h in wire.get("hist", {}).items():
            if name in self.hist:
                self.hist[name].merge_wire(h)
        self.counters.update(wire.get("counters", {}))
        self.errors.update(wire.get("errors", {}))
        if process is not None:
            if "in_flight" in wire:
                self.in_flight[process] = int(wire["in_flight"])
            if "cpu_percent" in wire:
                self.cpu_percent[process] = float(wire["cpu_percent"])

    def tokens_per_s(self, window_s: float = 10.0, now: float | None = None) -> float | None:
        """Output tokens per second over about the last `window_s` seconds."""
        now = time.monotonic() if now is None else now
        total = self.counters["output_tokens"]
        seen = self._tokens_seen
        if not seen or seen[-1][0] < now - 0.5:
            seen.append((now, total))
        while len(seen) > 2 and seen[1][0] <= now - window_s:
            seen.popleft()
        t0, n0 = seen[0]
        if now - t0 < 0.5:
            return None
        return (total - n0) / (now - t0)

    def rows(self) -> list[dict[str, Any]]:
        """The web UI's table: one row per figure."""
        out: list[dict[str, Any]] = []
        labels = {
            "ttft": "TTFT ms (from send)",
            "ttft_sched": "TTFT ms (from intended arrival)",
            "tpot": "TPOT ms",
            "e2e": "E2E ms",
            "send_lag": "send lag ms (open loop)",
            "loop_lag": "client loop lag ms",
        }
        for name in HISTOGRAMS:
            h = self.hist[name]
            out.append(
                {
                    "figure": labels[name],
                    "p50": _fmt(h.quantile(0.50)),
                    "p90": _fmt(h.quantile(0.90)),
                    "p99": _fmt(h.quantile(0.99)),
                    "value": f"n={h.count}",
                }
            )
        tps = self.tokens_per_s()
        c = self.counters
        for label, value in (
            ("output tokens/s", _fmt(tps)),
            ("requests in flight", sum(self.in_flight.values())),
            ("requests done", c["requests"]),
            ("ok", c["ok"]),
            ("late arrivals", c["late"]),
            ("dropped arrivals", c["dropped"]),
            ("token count mismatches", c["count_mismatch"]),
            ("client CPU % (max process)", _fmt(max(self.cpu_percent.values(), default=None))),
        ):
            out.append({"figure": label, "p50": "", "p90": "", "p99": "", "value": value})
        for cls, n in sorted(self.errors.items()):
            out.append({"figure": f"errors: {cls}", "p50": "", "p90": "", "p99": "", "value": n})
        return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "no data"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
