"""The LLM figures of a Locust run, per cell: the web UI's LLM tab, the LLM CSV and the
`--html` report's LLM section all read one `LLMTable`.

Locust's own table gets one `request` event per request (its E2E; see
calculet_load.locust.worker): the token-level figures cannot live there without
counting each request several times. They live here, one entry per cell (a mix entry,
`ext.cell`) plus `Aggregated`, with the definitions `calculet-load analyze` uses
(analysis.tables.cells.METRICS), so that the live figures and the report agree within the
histograms' 1 %:

    ttft_ms                t4 − t0, successes
    tpot_ms                (t5 − t4) / (output tokens − 1), successes
    itl_ms                 per token: gap between consecutive token-carrying events of a
                           request / tokens of the later event, that many times; successes
    ttft_from_intended_ms  t4 − intended start (open loop), successes
    send_lag_ms            t0 − intended start (open loop), every sent request
    e2e_ms                 t6 − t0, successes
    ttft_answer_ms         first answer token − t0, successes of a reasoning model (its
                           thinking streamed apart, or in a leading <think>)

Quantiles are analyze's `higher` order statistic x_(k), k = ceil(q·(n−1)) + 1, read
from a log bucket (calculet_load.locust.livestats.LogHistogram: within 1 %); max and mean are
exact. A request cancelled on purpose (by its user, or cut by the run's stop) counts as
`cancelled`, never as a failure, and is out of the latency figures, as analyze has it.

The figures are cumulative since the last reset (Locust's "Reset stats", or
`--reset-stats` once spawning completes) and, beside them, over the last `WINDOW_S`
seconds, so that a change of rate shows at once. Workers ship what changed since their
last report (bounded: histograms, never raw values); the master adds them up, and its
window counts a worker's report in the second it arrived (reports come every 3 s).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from calculet_load.locust.livestats import LogHistogram

if TYPE_CHECKING:
    from calculet_load.schema.records import RequestRecord, TokenEvent

METRICS = (
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "ttft_from_intended_ms",
    "send_lag_ms",
    "e2e_ms",
    "ttft_answer_ms",
)
OPTIONAL_METRICS = ("ttft_answer_ms",)  # shown where a run has them
TITLES = {
    "ttft_ms": "TTFT ms (from send)",
    "tpot_ms": "TPOT ms",
    "itl_ms": "ITL ms (per token)",
    "ttft_from_intended_ms": "TTFT ms (from intended arrival)",
    "send_lag_ms": "send lag ms (open loop)",
    "e2e_ms": "E2E ms",
    "ttft_answer_ms": "TTFT ms (first answer token)",
}
QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p95", 0.95), ("p99", 0.99))
FIGURES = ("n", *(q for q, _ in QUANTILES), "max", "mean")  # per metric, in every output
COUNTS = (
    "requests",
    "failures",
    "cancelled",
    "late",
    "dropped",
    "output_tokens",
    "count_mismatch",
    "answered",  # an HTTP status came back (the end-of-run check: nothing_answered)
)
AGGREGATED = "Aggregated"
WINDOW_S = 10
MAX_NAMES = 64  # a mix has a handful of entries; more fold into one name
OVERFLOW_NAME = "other"
NO_CELL = "request"  # a record without a cell (no mix entry named it)


def cell_name(record: RequestRecord) -> str:
    """The name a request is counted under: its cell (mix entry), else its shape."""
    if record.ext.cell:
        return record.ext.cell
    w = record.workload
    if w.prompt_tokens is not None and w.requested_output_tokens is not None:
        return f"p{w.prompt_tokens}-o{w.requested_output_tokens}"
    return NO_CELL


def failure_name(error_class: str, error_code: str | None) -> str:
    """What a failed request is counted under in Locust's failures table: its class, and
    the server's code when it has one (`http_5xx: 503`). Never the detail: Locust keys
    its errors by this text, and each worker ships every key it saw in each report to
    the master, so a detail that varies per request (a request id, a token count in the
    message) would make one entry per failed request, on the wire and in the master's
    memory. The detail is in the request's record."""
    if error_code and error_code != error_class:
        return f"{error_class}: {error_code}"
    return error_class


def itl_gaps(events: Iterable[TokenEvent]) -> Iterator[tuple[float, int]]:
    """(ms per token, tokens) per token-carrying event after a request's first: the gap
    since the previous token-carrying event / the tokens of this one, weighing that
    many tokens (analysis.tables.tokens: ITL, per token). Events are in arrival order.

    Example: tokens 1, 2, 1 at 0, 10, 14 ms → (10 / 2, 2), (4 / 1, 1): 3 values."""
    prev: int | None = None
    for ev in events:
        if ev.tokens <= 0:
            continue
        if prev is not None:
            yield (ev.arrival_ns - prev) / 1e6 / ev.tokens, ev.tokens
        prev = ev.arrival_ns


def itl_histogram(events: Iterable[TokenEvent]) -> LogHistogram:
    """A request's ITL values (itl_gaps) in one histogram: built once, merged into every
    entry it counts in (a request counts in four: cell and window, twice over)."""
    h = LogHistogram()
    h.add_all(itl_gaps(events))
    return h


@dataclasses.dataclass
class EntryStats:
    """The counts and histograms of one cell (or of all: Aggregated)."""

    counts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    hist: dict[str, LogHistogram] = dataclasses.field(
        default_factory=lambda: {m: LogHistogram() for m in METRICS}
    )

    def merge(self, other: EntryStats, metrics: Iterable[str] | None = None) -> None:
        """Add `other`'s counts and histograms (only those of `metrics`, when given)."""
        self.counts.update(other.counts)
        for m in other.hist if metrics is None else metrics:
            h = other.hist[m]
            if h.count:
                self.hist[m].merge(h)

    def to_wire(self) -> dict[str, Any]:
        return {
            "c": {k: v for k, v in self.counts.items() if v},
            "h": {m: h.to_wire() for m, h in self.hist.items() if h.count},
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> EntryStats:
        e = cls()
        e.counts.update({k: int(v) for k, v in wire.get("c", {}).items() if k in COUNTS})
        for m, h in wire.get("h", {}).items():
            if m in e.hist:
                e.hist[m].merge_wire(h)
        return e

    def figures(self, metric: str) -> dict[str, float | int | None]:
        """n, p50, p90, p95, p99, max, mean of one metric (None: no data)."""
        h = self.hist[metric]
        out: dict[str, float | int | None] = {"n": h.count}
        for key, q in QUANTILES:
            out[key] = h.quantile(q)
        out["max"] = h.max if h.count else None
        out["mean"] = h.mean
        return out


Entries = dict[str, EntryStats]


def _merge_into(target: Entries, source: Entries, metrics: Iterable[str] | None = None) -> None:
    for name, e in source.items():
        if name not in target and len(target) >= MAX_NAMES:
            name = OVERFLOW_NAME
        target.setdefault(name, EntryStats()).merge(e, metrics)


class LLMTable:
    """Per-cell figures since the last reset, and over the last `window_s` seconds."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        """Start again from nothing (Locust's "Reset stats")."""
        self.total: Entries = {}
        self.errors: collections.Counter[str] = collections.Counter()
        self.loop_lag = LogHistogram()
        self._slots: collections.deque[tuple[int, Entries]] = collections.deque()
        self.since = self.clock()

    # --- what goes in ----------------------------------------------------------------
    def _slot(self) -> Entries:
        """This second's entries of the window; older seconds fall out."""
        now = int(self.clock())
        if not self._slots or self._slots[-1][0] != now:
            self._slots.append((now, {}))
        while self._slots and self._slots[0][0] <= now - self.window_s:
            self._slots.popleft()
        return self._slots[-1][1]

    def _entries(self, name: str) -> tuple[EntryStats, EntryStats]:
        if name not in self.total and len(self.total) >= MAX_NAMES:
            name = OVERFLOW_NAME
        slot = self._slot()
        return self.total.setdefault(name, EntryStats()), slot.setdefault(name, EntryStats())

    def observe(
        self,
        record: RequestRecord,
        token_events: Iterable[TokenEvent] = (),
        *,
        itl: LogHistogram | None = None,
    ) -> None:
        """Count one finished (cancelled, dropped) request. `itl`: its token events'
        itl_histogram, when the caller has it."""
        e = record.ext
        d = record.durations_ms
        ok = e.error_class is None
        if ok and itl is None:
            itl = itl_histogram(token_events)
        for s in self._entries(cell_name(record)):
            c = s.counts
            if e.dropped:
                c["dropped"] += 1
                continue
            c["requests"] += 1
            c["answered"] += record.result.http_status is not None
            if not ok:  # cancelled on purpose (by its user, at the run's stop), or failed
                c["cancelled" if e.cancelled_at is not None else "failures"] += 1
            c["late"] += 1 if e.late else 0
            c["count_mismatch"] += 1 if e.token_count_mismatch else 0
            c["output_tokens"] += record.workload.actual_output_tokens or 0  # confirmed
            if e.send_lag_ms is not None:
                s.hist["send_lag_ms"].add(max(e.send_lag_ms, 0.0))
            if not ok:  # failed requests never enter latency statistics
                continue
            for metric, value in (
                ("ttft_ms", d.ttft),
                ("tpot_ms", d.tpot),
                ("e2e_ms", d.e2e),
                ("ttft_from_intended_ms", e.ttft_from_intended_ms),
                ("ttft_answer_ms", e.ttft_answer_ms),
            ):
                if value is not None:
                    s.hist[metric].add(value)
            if itl is not None and itl.count:
                s.hist["itl_ms"].merge(itl)
        if not ok and not e.dropped and e.error_class is not None and e.cancelled_at is None:
            self.errors[e.error_class] += 1

    def observe_loop_lag(self, ms: float) -> None:
        self.loop_lag.add(ms)

    # --- between processes -------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {
            "entries": {name: e.to_wire() for name, e in self.total.items()},
            "errors": dict(self.errors),
            "loop_lag": self.loop_lag.to_wire(),
        }

    def merge_wire(self, wire: dict[str, Any]) -> None:
        """Add a worker's report (what changed since its last one)."""
        entries = {str(k): EntryStats.from_wire(v) for k, v in wire.get("entries", {}).items()}
        _merge_into(self.total, entries)
        _merge_into(self._slot(), entries)
        self.errors.update({str(k): int(v) for k, v in wire.get("errors", {}).items()})
        self.loop_lag.merge_wire(wire.get("loop_lag", {}))

    # --- what comes out ---------------------------------------------------------------
    def entries(self, *, recent: bool = False, metrics: Iterable[str] | None = None) -> Entries:
        """Aggregated first, then each cell by name: since the reset, or the window.
        With `metrics`, the merged entries (Aggregated, and each cell of the window)
        hold only those histograms: the counts and a few figures cost a fraction of all
        (the series' point a second, the console's table)."""
        wanted = None if metrics is None else tuple(metrics)
        if recent:
            self._slot()  # drop the seconds that left the window
            source: Entries = {}
            for _, slot in self._slots:
                _merge_into(source, slot, wanted)
        else:
            source = self.total
        agg = EntryStats()
        for e in source.values():
            agg.merge(e, wanted)
        return {AGGREGATED: agg, **dict(sorted(source.items()))}

    def span_s(self, *, recent: bool = False) -> float:
        """Seconds the figures cover: since the reset, or the window (at most)."""
        since = self.clock() - self.since
        return min(since, self.window_s) if recent else since

    def per_s(self, entry: EntryStats, count: str, *, recent: bool = False) -> float | None:
        span = self.span_s(recent=recent)
        return entry.counts[count] / span if span >= 0.5 else None


def nothing_answered(table: LLMTable) -> str | None:
    """Why a run's requests measured nothing of the target (none was sent, or none got
    an answer: an HTTP status), in one phrase; None when some request was answered."""
    c = table.entries()[AGGREGATED].counts
    if c["answered"]:
        return None
    if not c["requests"]:
        what = f"{c['dropped']} arrivals dropped" if c["dropped"] else "none was sent"
        return f"no request got an answer ({what})"
    classes = ", ".join(f"{cls} {n}" for cls, n in sorted(table.errors.items())) or "none"
    return (
        f"none of its {c['requests']} requests got an answer from the target (errors: "
        f"{classes}; cancelled: {c['cancelled']})"
    )
