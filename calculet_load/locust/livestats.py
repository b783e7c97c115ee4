"""Live figures of a run (the run's counters, Prometheus): bounded, mergeable, exact to 1 %.

`LogHistogram` is also what the web UI's per-cell LLM table is built of
(calculet_load.locust.llmstats); that table, unlike these figures, follows Locust's reset.

Workers never ship raw values to the master (a single-threaded master drowns in them,
`research/locust.md` §5.3). Each worker keeps log-bucket histograms — bucket i holds
values in [G^i, G^(i+1)) with G = 1.02, so a quantile read from a bucket's geometric
middle is within 1 % of the exact order statistic — and counters, and ships what
changed since its last report; the master adds them up. These figures serve the live
view only: every figure in a report is recomputed from the raw records.

For Prometheus (`calculet_load.locust.prom`) the same reports also carry fixed-bound
histograms (Prometheus needs cumulative `le` buckets that never change between
scrapes) and per-series counters labelled by model, prompt bucket, output bucket and
concurrency. Every label value is a bucket of a fixed list, and the number of label sets
is capped (`MAX_SERIES`; more fold into one `other` set), so a report stays bounded
whatever the workload.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from calculet_load.schema.records import RequestRecord

GROWTH = 1.02  # bucket width; the midpoint is within sqrt(1.02) - 1 < 1 % of any value in it
_LOG_G = math.log(GROWTH)
_ZERO = -(10**6)  # bucket of values <= 0 (a clock can give 0 ns on a coarse platform)

HISTOGRAMS = ("ttft", "tpot", "e2e", "ttft_sched", "send_lag", "loop_lag")
COUNTERS = (
    "requests",
    "ok",
    "failed",
    "cancelled",
    "late",
    "dropped",
    "output_tokens",
    "prompt_tokens",
    "token_events",
    "count_mismatch",
)


# Prometheus buckets, in seconds. Latencies: 1 ms .. 15 min (the default request timeout).
LATENCY_BOUNDS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 900.0,
)  # fmt: skip
# Client-side lags: 0.1 ms .. 1 s (a lag near a second means a saturated client).
LAG_BOUNDS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Unlabelled fixed histograms fed by `observe` (name -> bounds).
FIXED_HISTOGRAMS = {
    "ttft_sched": LATENCY_BOUNDS_S,
    "send_lag": LAG_BOUNDS_S,
    "loop_lag": LAG_BOUNDS_S,
}
SERIES_HISTOGRAMS = ("ttft", "tpot", "e2e")  # per label set, successful requests only
SERIES_LABELS = ("model", "prompt_bucket", "output_bucket", "concurrency")
# Label buckets: a value is labelled with the smallest bound >= it ("inf" above the last).
PROMPT_BOUNDS = (1, 16, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 40960)  # §6.1
OUTPUT_BOUNDS = (1, 32, 256, 1024, 4096)
CONCURRENCY_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # §6.2 closed loop
OUTCOMES = ("ok", "4xx", "5xx", "timeout", "cancel", "error")
_OUTCOME_OF = {
    "http_4xx": "4xx",
    "http_5xx": "5xx",
    "connect_timeout": "timeout",
    "first_byte_timeout": "timeout",
    "idle_timeout": "timeout",
    "total_timeout": "timeout",
    "cancelled": "cancel",
}
MAX_SERIES = 64
MAX_MODEL_CHARS = 64
OVERFLOW = ("other", "other", "other", "other")

SeriesKey = tuple[str, str, str, str]


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

    def add(self, value: float, n: int = 1) -> None:
        """Count `value` `n` times (a per-token figure weighs each token of an event)."""
        self.buckets[self.bucket_of(value)] += n
        self.count += n
        self.sum += value * n
        self.min = min(self.min, value)
        self.max = max(self.max, value)

    def add_all(self, pairs: Iterable[tuple[float, int]]) -> None:
        """`add` each (value, n): the same counts, in one loop (a request's token gaps)."""
        buckets, log, floor, step = self.buckets, math.log, math.floor, _LOG_G
        count, total, low, high = self.count, self.sum, self.min, self.max
        for value, n in pairs:
            buckets[floor(log(value) / step) if value > 0 else _ZERO] += n
            count += n
            total += value * n
            if value < low:
                low = value
            if value > high:
                high = value
        self.count, self.sum, self.min, self.max = count, total, low, high

    def merge(self, other: LogHistogram) -> None:
        for bucket, n in other.buckets.items():
            self.buckets[bucket] += n
        self.count += other.count
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """The `higher` order statistic x_(k), k = ceil(q·(n−1)) + 1 — analyze's
        percentile method (analysis.stats.quantiles.quantile) — read from its bucket; None with
        no data."""
        if not self.count:
            return None
        rank = math.ceil((self.count - 1) * q) + 1
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


class FixedHistogram:
    """Counts per fixed bucket (value <= bound, as Prometheus' `le`), plus an overflow
    bucket; `sum` is in the same unit as the bounds."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, int]]:
        """(le, cumulative count) per bound, ending with (+inf, count)."""
        out, seen = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            seen += n
            out.append((bound, seen))
        return out

    def to_wire(self) -> list[float]:
        return [*self.counts, self.sum]

    def merge_wire(self, wire: list[float]) -> None:
        if len(wire) != len(self.counts) + 1:
            return  # another version's buckets: not mergeable, and only the live view
        for i, n in enumerate(wire[:-1]):
            self.counts[i] += int(n)
            self.count += int(n)
        self.sum += float(wire[-1])


def _bucket_label(value: int | None, bounds: tuple[int, ...]) -> str:
    if value is None:
        return "unknown"
    i = bisect.bisect_left(bounds, value)
    return str(bounds[i]) if i < len(bounds) else "inf"


def series_key(record: RequestRecord, model: str = "") -> SeriesKey:
    """The bounded label set of a record: model, prompt/output bucket, concurrency.

    The model is the manifest's alias, else `model` (the --model sent to the target);
    concurrency is the closed loop's target (bucketed), else the arrival kind
    (`open`, `burst`)."""
    w = record.workload
    name = (record.model_alias or model or "unknown")[:MAX_MODEL_CHARS]
    if w.concurrency is not None and record.ext.arrival in (None, "closed", "single"):
        conc = _bucket_label(w.concurrency, CONCURRENCY_BOUNDS)
    else:
        conc = "burst" if record.ext.arrival == "burst" else "open"
    return (
        name,
        _bucket_label(w.prompt_tokens, PROMPT_BOUNDS),
        _bucket_label(w.requested_output_tokens, OUTPUT_BOUNDS),
        conc,
    )


def outcome_of(error_class: str | None) -> str:
    """ok, 4xx, 5xx, timeout, cancel, or error (every other class)."""
    return "ok" if error_class is None else _OUTCOME_OF.get(error_class, "error")


@dataclasses.dataclass
class SeriesStats:
    """The figures of one label set."""

    hist: dict[str, FixedHistogram] = dataclasses.field(
        default_factory=lambda: {n: FixedHistogram(LATENCY_BOUNDS_S) for n in SERIES_HISTOGRAMS}
    )
    outcomes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    output_tokens: int = 0
    prompt_tokens: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "h": {k: h.to_wire() for k, h in self.hist.items() if h.count},
            "o": dict(self.outcomes),
            "ot": self.output_tokens,
            "pt": self.prompt_tokens,
        }

    def merge_wire(self, wire: dict[str, Any]) -> None:
        for name, h in wire.get("h", {}).items():
            if name in self.hist:
                self.hist[name].merge_wire(h)
        self.outcomes.update({k: int(v) for k, v in wire.get("o", {}).items() if k in OUTCOMES})
        self.output_tokens += int(wire.get("ot", 0))
        self.prompt_tokens += int(wire.get("pt", 0))


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
    fixed: dict[str, FixedHistogram] = dataclasses.field(
        default_factory=lambda: {n: FixedHistogram(b) for n, b in FIXED_HISTOGRAMS.items()}
    )
    series: dict[SeriesKey, SeriesStats] = dataclasses.field(default_factory=dict)

    def observe(self, name: str, value_ms: float | None) -> None:
        if value_ms is not None:
            self.hist[name].add(value_ms)
            fixed = self.fixed.get(name)
            if fixed is not None:
                fixed.add(value_ms / 1e3)

    def series_for(self, key: SeriesKey) -> SeriesStats:
        """The stats of a label set; past MAX_SERIES sets, new ones fold into OVERFLOW."""
        s = self.series.get(key)
        if s is None:
            if len(self.series) >= MAX_SERIES and key != OVERFLOW:
                return self.series_for(OVERFLOW)
            s = self.series[key] = SeriesStats()
        return s

    def observe_series(self, record: RequestRecord, model: str = "") -> None:
        """Count a sent request in its label set (dropped arrivals are not sent)."""
        s = self.series_for(series_key(record, model))
        outcome = outcome_of(record.ext.error_class)
        s.outcomes[outcome] += 1
        s.output_tokens += record.workload.actual_output_tokens or 0  # confirmed totals
        s.prompt_tokens += record.workload.prompt_tokens or 0
        if outcome == "ok":  # failed requests never enter latency statistics
            d = record.durations_ms
            for name, value in (("ttft", d.ttft), ("tpot", d.tpot), ("e2e", d.e2e)):
                if value is not None:
                    s.hist[name].add(value / 1e3)

    def to_wire(self) -> dict[str, Any]:
        return {
            "hist": {k: h.to_wire() for k, h in self.hist.items() if h.count},
            "counters": dict(self.counters),
            "errors": dict(self.errors),
            "fixed": {k: h.to_wire() for k, h in self.fixed.items() if h.count},
            "series": [[*key, s.to_wire()] for key, s in self.series.items()],
        }

    def merge_wire(self, wire: dict[str, Any], process: str | None = None) -> None:
        for name, h in wire.get("hist", {}).items():
            if name in self.hist:
                self.hist[name].merge_wire(h)
        self.counters.update(wire.get("counters", {}))
        self.errors.update(wire.get("errors", {}))
        for name, h in wire.get("fixed", {}).items():
            if name in self.fixed:
                self.fixed[name].merge_wire(h)
        for item in wire.get("series", []):
            if len(item) == len(SERIES_LABELS) + 1:
                model, prompt, output, conc, payload = item
                key = (str(model)[:MAX_MODEL_CHARS], str(prompt), str(output), str(conc))
                self.series_for(key).merge_wire(payload)
        if process is not None:
            if "in_flight" in wire:
                self.in_flight[process] = int(wire["in_flight"])
            if "cpu_percent" in wire:
                self.cpu_percent[process] = float(wire["cpu_percent"])
