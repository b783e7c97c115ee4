"""Token events reduced part by part: what the cell summaries (`analysis.tables.cells`) need of
tens of millions of events, without ever holding them at once.

One pass over the parts (`analysis.tables.load.TokenParts`) gives, per group (a cell and
partition of `analysis.tables.cells`; the events of failed requests and of other partitions
belong to none):

    itl[g]            ITL values in ms, one per generated token after a request's first:
                      gap between consecutive token-carrying events / tokens of the later
                      event, repeated that many times; in (request row, event index) order
    window_tokens[g]  tokens of the events stamped inside the group's steady window
                      [w0, w1) on the client's wall clock
    touched[g]        whether any event (even one carrying no token) is inside it
    batch_tokens[g]   window_tokens[g] split over THROUGHPUT_BATCHES equal batches of the
                      window (the batch means of the throughput's interval)
    tokens[g]         tokens of all its events

Token counts are the request's confirmed total (`confirmed_scale`): the per-event counts
place a request's tokens in time, and where their sum differs from its total (the
server's usage, where it sent one) each event's count is scaled by total / sum, so the
difference is spread over the request's events in proportion to them and a window's
tokens sum to the totals. ITL keeps the events' own counts (a gap divided among the
tokens that event carried).

and, per request row, `has_events`. A part is read, reduced and dropped before the next.
The sink writes a record's events into one part; a request whose events turn up in
several parts (a restarted worker reusing ids) has its ITL recomputed from all of them
at the end, so the values do not depend on how the events were split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.errors import ArtifactError
from analysis.stats.quantiles import THROUGHPUT_BATCHES
from analysis.tables.columns import floats
from analysis.tables.join import BoolArray, FloatArray, IntArray, positions
from analysis.tables.load import TokenParts

__all__ = [
    "EventSums",
    "SteadyWindows",
    "batch_of",
    "confirmed_scale",
    "event_columns",
    "itl_gaps",
    "reduce_events",
    "split_events",
    "token_scale",
]

_IDX_BITS = 24  # event index bits of the (request row, event index) sort key


@dataclass(frozen=True, slots=True)
class EventSums:
    """The reduction of every token event (see the module docstring); without windows
    only `itl` is filled."""

    itl: list[FloatArray]
    has_events: BoolArray
    window_tokens: FloatArray
    touched: BoolArray
    tokens: IntArray
    batch_tokens: FloatArray  # [group, THROUGHPUT_BATCHES]


def batch_of(wall_ns: IntArray, start_ns: IntArray, end_ns: IntArray) -> IntArray:
    """The batch (0..THROUGHPUT_BATCHES − 1) of stamps inside their window [start, end):
    ⌊(t − start) · K / (end − start)⌋, in integer ns."""
    span = np.maximum(end_ns - start_ns, 1)
    return np.asarray(((wall_ns - start_ns) * THROUGHPUT_BATCHES) // span, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class SteadyWindows:
    """Per group, its steady window [start_ns, end_ns) on the client's wall clock; per
    request row, the offset that puts its events' arrival stamps on that clock."""

    start_ns: IntArray
    end_ns: IntArray
    wall_offset_ns: IntArray


def _ints(col: Any) -> IntArray:
    return np.asarray(pc.fill_null(col, 0).to_numpy(zero_copy_only=False), dtype=np.int64)


def event_columns(part: pa.Table, request_ids: Any) -> tuple[IntArray, IntArray, IntArray]:
    """A token part's (request row or −1, tokens, arrival ns) per event."""
    pos = positions(part.column("request_id"), request_ids)
    return pos, _ints(part.column("tokens")), _ints(part.column("arrival_ns"))


def itl_gaps(
    pos: IntArray, count: IntArray, idx: IntArray, t: IntArray, *, with_times: bool = False
) -> tuple[IntArray, FloatArray, IntArray | None]:
    """(request row, ms, and with `with_times` the arrival ns of the later event) per
    generated token after the first, in (row, event index) order, from the
    token-carrying events of known requests (`pos` ≥ 0): the one ITL definition."""
    keep = (pos >= 0) & (count > 0)
    if not keep.all():
        pos, count, idx, t = pos[keep], count[keep], idx[keep], t[keep]
    del keep
    # one int64 key (request row, event index): a part written request by request is
    # already in order and is not sorted again; interleaved streams are, once
    key = pos << _IDX_BITS
    key |= np.minimum(idx, (1 << _IDX_BITS) - 1)
    if key.size > 1 and not bool(np.all(key[1:] >= key[:-1])):
        order = np.argsort(key, kind="stable")
        pos, count, t = pos[order], count[order], t[order]
        del order
    del key
    same = pos[1:] == pos[:-1]
    gap_ms = (t[1:] - t[:-1])[same] / 1e6
    k = count[1:][same]
    at = t[1:][same] if with_times else None
    if bool(np.all(k == 1)):  # one token per event: nothing to repeat
        return pos[1:][same], gap_ms, at
    rep = None if at is None else np.repeat(at, k)
    return np.repeat(pos[1:][same], k), np.repeat(gap_ms / k, k), rep


class _ItlChunks:
    """ITL values per group, gathered part by part. A chunk is one part's values of one
    group, in row order, with its rows run-length encoded (a request's values are
    contiguous): groups are put in row order at the end without keeping a row per value."""

    def __init__(self, n_groups: int) -> None:
        self.chunks: list[list[tuple[IntArray, IntArray, FloatArray]]] = [
            [] for _ in range(n_groups)
        ]

    def add(self, rows: IntArray, ms: FloatArray, group: IntArray) -> None:
        """Add one part's values (`rows` in order) to the groups of their rows."""
        if rows.size == 0:
            return
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        runs, counts = rows[starts], np.diff(np.r_[starts, rows.size])
        g = group[runs]
        for i in np.unique(g[g < len(self.chunks)]):
            mine = g == i
            self.chunks[i].append((runs[mine], counts[mine], ms[np.repeat(mine, counts)]))

    def drop(self, rows: BoolArray) -> None:
        """Forget the values of the rows marked."""
        for chunks in self.chunks:
            for j, (r, counts, ms) in enumerate(chunks):
                gone = rows[r]
                if gone.any():
                    chunks[j] = (r[~gone], counts[~gone], ms[np.repeat(~gone, counts)])

    def values(self) -> list[FloatArray]:
        """Each group's values in (request row, event index) order; the chunks are freed."""
        out = []
        for g, chunks in enumerate(self.chunks):
            self.chunks[g] = []
            if not chunks:
                out.append(np.empty(0))
                continue
            rows = np.concatenate([c[0] for c in chunks])
            counts = np.concatenate([c[1] for c in chunks])
            ms = np.concatenate([c[2] for c in chunks]) if len(chunks) > 1 else chunks[0][2]
            if rows.size > 1 and not bool(np.all(rows[1:] > rows[:-1])):
                order = np.argsort(rows, kind="stable")
                first = (np.cumsum(counts) - counts)[order]  # each request's run in `ms`
                n = counts[order]
                ms = ms[np.repeat(first - (np.cumsum(n) - n), n) + np.arange(ms.size)]
            out.append(ms)
        return out


class _Reduction:
    """The running sums of `reduce_events`, one part at a time."""

    def __init__(
        self,
        request_ids: Any,
        group: IntArray,
        n_groups: int,
        windows: SteadyWindows | None,
        scale: FloatArray | None,
    ) -> None:
        rows = len(group)
        self.request_ids = request_ids
        self.group = group
        self.n_groups = n_groups
        self.windows = windows
        self.scale = scale
        self.itl = _ItlChunks(n_groups)
        self.seen = np.zeros(rows, dtype=bool)  # requests with token-carrying events so far
        self.split = np.zeros(rows, dtype=bool)  # requests with such events in several parts
        self.has = np.zeros(rows, dtype=bool)
        # [n_groups] collects the events of no group: its window is empty
        self.window_tokens = np.zeros(n_groups + 1)
        self.touched = np.zeros(n_groups + 1, dtype=bool)
        self.tokens = np.zeros(n_groups + 1)
        self.batch_tokens = np.zeros((n_groups + 1) * THROUGHPUT_BATCHES)

    def add(self, path: str, part: pa.Table) -> None:
        pos, count, t = event_columns(part, self.request_ids)
        here = np.zeros(self.seen.size, dtype=bool)
        here[pos[(pos >= 0) & (count > 0)]] = True
        self.split |= here & self.seen
        self.seen |= here
        rows, ms, _ = itl_gaps(pos, count, _ints(part.column("event_index")), t)
        self.itl.add(rows, ms, self.group)
        if self.windows is not None:
            self._add_windows(path, pos, count, t, self.windows)

    def _add_windows(
        self, path: str, pos: IntArray, count: IntArray, t: IntArray, windows: SteadyWindows
    ) -> None:
        known = pos >= 0
        if not known.all():
            pos, count, t = pos[known], count[known], t[known]
        n = self.n_groups
        g = self.group[pos]
        if bool(np.any(count < 0)) and bool(np.any(count[g < n] < 0)):
            raise ArtifactError(f"{path}: a successful request's token event has a negative count")
        self.has[pos] = True
        wall = t + windows.wall_offset_ns[pos]
        inside = (wall >= np.r_[windows.start_ns, 0][g]) & (wall < np.r_[windows.end_ns, 0][g])
        weight = count if self.scale is None else count * self.scale[pos]
        self.tokens += np.bincount(g, weights=weight, minlength=n + 1)
        self.window_tokens += np.bincount(g[inside], weights=weight[inside], minlength=n + 1)
        self.touched |= np.bincount(g[inside], minlength=n + 1) > 0
        gi = g[inside]
        b = batch_of(wall[inside], windows.start_ns[gi], windows.end_ns[gi])
        self.batch_tokens += np.bincount(
            gi * THROUGHPUT_BATCHES + b,
            weights=weight[inside],
            minlength=(n + 1) * THROUGHPUT_BATCHES,
        )

    def rejoin_split(self, parts: TokenParts) -> None:
        """Recompute the ITL of requests whose events are in several parts, as one."""
        self.itl.drop(self.split)
        joined = [split_events(part, self.request_ids, self.split) for _, part in parts]
        pos, count, idx, t = (np.concatenate(c) for c in zip(*joined, strict=True))
        rows, ms, _ = itl_gaps(pos, count, idx, t)
        self.itl.add(rows, ms, self.group)

    def sums(self) -> EventSums:
        n = self.n_groups
        return EventSums(
            self.itl.values(),
            self.has,
            self.window_tokens[:n],
            self.touched[:n],
            np.rint(self.tokens[:n]).astype(np.int64),
            self.batch_tokens.reshape(n + 1, THROUGHPUT_BATCHES)[:n],
        )


def reduce_events(
    parts: TokenParts,
    request_ids: Any,
    group: IntArray,
    n_groups: int,
    windows: SteadyWindows | None = None,
    scale: FloatArray | None = None,
) -> EventSums:
    """Reduce the token events of `parts` to EventSums. `group` is each request row's
    group, `n_groups` for none; without `windows` only the ITL is computed; `scale`, per
    request row, what its events' counts are multiplied by in the window, batch and
    total sums (`confirmed_scale`). A successful request's event with a negative token
    count raises ArtifactError."""
    reduction = _Reduction(request_ids, group, n_groups, windows, scale)
    for path, part in parts:
        reduction.add(path, part)
        del part  # freed before the next part is read
    if reduction.split.any():
        reduction.rejoin_split(parts)
    # the parts' pages, freed, would stay with Arrow's allocator (~0.4 GB for 50 M events)
    pa.default_memory_pool().release_unused()
    return reduction.sums()


def token_scale(table: pa.Table, tokens: TokenParts, ids: Any) -> FloatArray:
    """Per row, what its events' counts are scaled by to sum to its confirmed total,
    `workload.actual_output_tokens` (the server's usage where it sent one, else the
    chosen per-event source's sum: `ext.token_total_source`). The events' own sum is
    `ext.client_output_tokens`, except in records written before the total's source was
    (the column null): there a count that took the server's total in place of the
    events' ("+usage_total") left it unrecorded, and it is summed from the events."""
    confirmed = floats(table, "workload.actual_output_tokens")
    sums = floats(table, "ext.client_output_tokens")
    legacy = np.asarray(
        pc.is_null(table.column("ext.token_total_source")).to_numpy(zero_copy_only=False),
        dtype=bool,
    )
    source = pc.fill_null(table.column("ext.token_count_source"), "")
    ends = pc.ends_with(source, "+usage_total").to_numpy(zero_copy_only=False)
    replaced = legacy & np.asarray(ends, dtype=bool)
    return confirmed_scale(tokens, ids, confirmed, np.where(replaced, np.nan, sums))


def confirmed_scale(
    parts: TokenParts,
    request_ids: Any,
    confirmed: FloatArray,
    event_sums: FloatArray,
) -> FloatArray:
    """Per request row, total / sum: `confirmed` its confirmed total (NaN: none, its
    events count as they are), `event_sums` the sum of its events' counts (NaN: not
    recorded; summed here from `parts`, one pass). 1 where either is missing or the sum
    is 0 (no event to spread a total over: the caller places those tokens otherwise).

    Example: events of 3, 2, 3 tokens (sum 8) and the server's usage 10 → 1.25 each:
    3.75, 2.5, 3.75 tokens, 10 in all."""
    sums = np.array(event_sums, dtype=np.float64)
    unknown = np.isnan(sums) & ~np.isnan(confirmed)
    if unknown.any():
        counted = np.zeros(sums.size)
        for _, part in parts:
            pos = positions(part.column("request_id"), request_ids)
            known = pos >= 0
            counted += np.bincount(
                pos[known], weights=_ints(part.column("tokens"))[known], minlength=sums.size
            )
        sums = np.where(unknown, counted, sums)
    ok = ~np.isnan(confirmed) & ~np.isnan(sums) & (sums > 0)
    return np.where(ok, confirmed / np.where(ok, sums, 1.0), 1.0)


def split_events(part: pa.Table, request_ids: Any, split: BoolArray) -> list[IntArray]:
    """(row, count, event index, arrival) of the part's events of the `split` requests."""
    pos = positions(part.column("request_id"), request_ids)
    mine = np.flatnonzero((pos >= 0) & split[np.maximum(pos, 0)])
    cols = (part.column(c).take(pa.array(mine)) for c in ("tokens", "event_index", "arrival_ns"))
    return [pos[mine], *(_ints(c) for c in cols)]
