"""Per-cell summaries (spec §9): counts, errors by class, latency statistics with
intervals, and steady-state throughput.

A **cell** is one (ext.cell, workload.concurrency, ext.arrival, workload.stream): the
workload entry, the closed-loop concurrency (null in open loop), the arrival shape and
streaming, labelled `p16-o32|c1|closed|stream` (a missing part reads "-"). Each quality
partition (`analysis.tables.quality.Partition`) of a cell is summarized apart: `measured`
is what rules and comparisons read; `throttled` and `warmup` are reported beside it.

Latency metrics take the successes of the partition only (failed requests never enter
latency statistics); `send_lag_ms` and `turnaround_ms` take every sent request. See
METRICS.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from analysis.stats.quantiles import (
    THROUGHPUT_BATCHES,
    CellStats,
    batch_means_ci,
    summarize,
    window_tokens,
)
from analysis.tables.cellkey import CELL_FIELDS, CellKey
from analysis.tables.join import BoolArray, FloatArray, IntArray
from analysis.tables.load import TokenParts
from analysis.tables.quality import Partition, Reason
from analysis.tables.tokens import EventSums, SteadyWindows, reduce_events, token_scale
from calculet_load.schema.clocks import to_reference_ns

__all__ = [
    "CELL_FIELDS",
    "ERROR_GROUPS",
    "METRICS",
    "SUMMARY_PARTITIONS",
    "CellData",
    "CellKey",
    "CellSummary",
    "Metric",
    "client_wall_span",
    "group_cells",
    "summarize_cells",
]

SUMMARY_PARTITIONS = (Partition.MEASURED, Partition.THROTTLED, Partition.WARMUP)

ERROR_GROUPS: dict[str, tuple[str, ...]] = {
    "http_4xx": ("http_4xx", "auth", "not_found"),  # every 4xx answer (401/403, 404)
    "http_5xx": ("http_5xx", "server_error_event"),
    "timeout": ("connect_timeout", "first_byte_timeout", "idle_timeout", "total_timeout"),
}
"""Spec §10's request panel: 4xx / 5xx / timeout; every other error class counts as
`other_errors`. A deliberate client cancellation (`cancelled`, not at run stop) is
counted as `cancelled`, not as an error."""


@dataclass(frozen=True, slots=True)
class Metric:
    """One per-cell metric: name with its unit, the record column it reads (None:
    computed from token events), the formula, and whether failures count."""

    name: str
    column: str | None
    formula: str
    successes_only: bool = True


METRICS: tuple[Metric, ...] = (
    Metric("ttft_ms", "durations_ms.ttft", "t4 − t0 per request (client clock)"),
    # reasoning models: t4 is the first generated token of any kind, often reasoning
    Metric(
        "ttft_answer_ms",
        "ext.ttft_answer_ms",
        "first token event with answer text (not only whitespace) − t0, where the stream "
        "carried reasoning apart from the answer",
    ),
    Metric("tpot_ms", "durations_ms.tpot", "(t5 − t4) / (output_tokens − 1) per request"),
    Metric("e2e_ms", "durations_ms.e2e", "t6 − t0 per request"),
    Metric(
        "itl_ms",
        None,
        "per token: gap between consecutive token events of a request / tokens of the later",
    ),
    Metric("ttft_from_intended_ms", "ext.ttft_from_intended_ms", "t4 − intended start (open loop)"),
    Metric("e2e_from_intended_ms", "ext.e2e_from_intended_ms", "t6 − intended start (open loop)"),
    Metric("send_lag_ms", "ext.send_lag_ms", "t0 − intended start, every sent request", False),
    Metric(
        "turnaround_ms",
        "ext.turnaround_ms",
        "the client's own time around a request: its send to t0, t6 to the outcome back",
        False,
    ),
    Metric("server_queue_ms", "server_ms.queue", "first job_prepared − accepted (server trace)"),
    # spec §10.1: the queue's two waits apart (analysis.tables.join)
    Metric("slot_wait_ms", "join.slot_wait_ms", "slot_assigned − accepted (server trace)"),
    Metric("admission_wait_ms", "join.admission_wait_ms", "admitted − slot_assigned (server)"),
    Metric("unattributed_ttft_ms", "join.unattributed_ttft_ms", "TTFT − (first flush − accepted)"),
)
_ALWAYS = ("ttft_ms", "tpot_ms", "e2e_ms")


@dataclass(frozen=True, slots=True)
class CellData:
    """The rows of one cell and partition (indices into the quality table), and the
    metric values they give; what comparisons and rules read."""

    key: CellKey
    partition: str
    rows: IntArray
    values: dict[str, FloatArray]


@dataclass(frozen=True, slots=True)
class CellSummary:
    key: CellKey
    partition: str
    records: int
    ok: int
    errors: int
    cancelled: int
    errors_by_class: dict[str, int]
    dropped: int
    cut_at_stop: int
    excluded_by_reason: dict[str, int]
    output_tokens: int
    steady_output_tokens_per_s: float | None
    steady_requests_per_s: float | None
    steady_window_s: float | None
    metrics: dict[str, CellStats] = field(default_factory=dict)
    # the steady window's output tokens/s per batch (THROUGHPUT_CI_METHOD) and the
    # interval of their mean (steady_output_tokens_per_s)
    throughput_batches: tuple[float, ...] = ()
    steady_output_tokens_per_s_ci: tuple[float, float] | None = None
    # requests the server served partly from its prefix cache beyond the prompt's shared
    # part (ext.cached_prompt_tokens > ext.prompt_unique_from): their TTFT is not a cold prefill
    served_from_cache: int = 0
    cached_prompt_tokens: int = 0
    # reasoning models: the successes whose stream carried reasoning apart from the answer,
    # and their generated tokens of each phase (None: no success of the cell showed any)
    reasoning_requests: int = 0
    reasoning_tokens: int | None = None
    answer_tokens: int | None = None
    # the steady window [start, end] on the client's wall clock (client_wall_span), None
    # without one (no success)
    steady_window_ns: tuple[int, int] | None = None

    @property
    def error_rate(self) -> float | None:
        attempts = self.records - self.cancelled
        return self.errors / attempts if attempts > 0 else None


def _np(col: Any, dtype: Any, fill: Any) -> npt.NDArray[Any]:
    if col.null_count:
        col = pc.fill_null(col, fill)
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=dtype)


def _valid(col: Any) -> BoolArray:
    return np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)


def _cache_use(table: pa.Table) -> tuple[IntArray, BoolArray]:
    """Per row: prompt tokens the server served from cache, and whether that is more
    than the part every request shares (a chat template); a reused prompt shares all."""
    names = table.column_names
    if "ext.cached_prompt_tokens" not in names:
        zeros = np.zeros(table.num_rows, dtype=np.int64)
        return zeros, zeros.astype(bool)
    cached = _np(table.column("ext.cached_prompt_tokens"), np.int64, 0)
    shared = np.zeros(table.num_rows, dtype=np.int64)
    if "ext.prompt_unique_from" in names:
        shared = _np(table.column("ext.prompt_unique_from"), np.int64, 0)
    return cached, cached > shared


def _phase_tokens(table: pa.Table, column: str, rows: IntArray) -> int | None:
    """The sum of a reasoning model's per-phase token count over `rows`, None where no
    row has one (a stream without reasoning: null, never 0)."""
    col = table.column(column).take(pa.array(rows, type=pa.int64()))
    return None if col.null_count == len(col) else int(pc.sum(col).as_py() or 0)


def _sort_key(k: CellKey) -> tuple[Any, ...]:
    return (
        k.name or "",
        -1 if k.concurrency is None else k.concurrency,
        k.arrival or "",
        -1 if k.stream is None else int(k.stream),
    )


@dataclass(frozen=True, slots=True)
class _Split:
    """Items sorted by a group id; group g is `order[bounds[g]:bounds[g + 1]]`."""

    order: IntArray
    bounds: IntArray

    @classmethod
    def of(cls, group: IntArray, groups: int) -> _Split:
        order = np.argsort(group, kind="stable")
        return cls(order, np.searchsorted(group[order], np.arange(groups + 1)))

    def __getitem__(self, g: int) -> IntArray:
        return self.order[self.bounds[g] : self.bounds[g + 1]]


@dataclass(frozen=True, slots=True)
class _Cells:
    """Every row's cell and partition, computed once (vectorized)."""

    keys: list[CellKey]
    partitions: tuple[str, ...]
    group: IntArray  # cell * len(partitions) + partition; −1 for other partitions
    ok: BoolArray
    by_cell: _Split
    by_group: _Split

    @classmethod
    def of(cls, table: pa.Table, partitions: tuple[str, ...]) -> _Cells:
        cols = [table.column(c) for c in CELL_FIELDS]
        encoded = [pc.fill_null(pc.cast(c, pa.string()), "\x00") for c in cols]
        label = pc.binary_join_element_wise(*encoded, "\x1f")
        enc = pa.chunked_array(label).combine_chunks().dictionary_encode()
        codes = np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
        first = np.full(len(enc.dictionary), -1, dtype=np.int64)
        first[codes[::-1]] = np.arange(codes.size)[::-1]
        raw = [CellKey(*(c[int(r)].as_py() for c in cols)) for r in first]
        order = sorted(range(len(raw)), key=lambda i: _sort_key(raw[i]))
        remap = np.empty(len(raw), dtype=np.int64)
        remap[order] = np.arange(len(raw))
        cell = remap[codes]
        part = _np(table.column("quality.partition"), object, "")
        pidx = np.full(table.num_rows, -1, dtype=np.int64)
        for i, p in enumerate(partitions):
            pidx[part == p] = i
        group = np.where(pidx >= 0, cell * len(partitions) + pidx, -1)
        ok = np.asarray(pc.is_null(table.column("ext.error_class")).to_numpy(), dtype=bool)
        n_groups = len(raw) * len(partitions)
        return cls(
            keys=[raw[i] for i in order],
            partitions=partitions,
            group=group,
            ok=ok,
            by_cell=_Split.of(cell, len(raw)),
            by_group=_Split.of(np.where(group >= 0, group, n_groups), n_groups),
        )

    def each(self) -> list[tuple[int, CellKey, str, IntArray]]:
        """(group id, cell key, partition, rows) of every non-empty group, in order."""
        out = []
        for g in range(len(self.keys) * len(self.partitions)):
            rows = self.by_group[g]
            if rows.size:
                c, p = divmod(g, len(self.partitions))
                out.append((g, self.keys[c], self.partitions[p], rows))
        return out


def client_wall_span(table: pa.Table, offsets: Mapping[str, int]) -> tuple[IntArray, IntArray]:
    """Each request's start on the client's wall clock (its worker's NTP offset applied)
    and its end there: start + (last of t4, t5, t6 − t0). The clock of the steady
    windows; token times are placed on it."""
    anchor = _np(table.column("ext.wall_anchor_ns"), np.int64, 0)
    t0 = _np(table.column("client_ns.request_start"), np.int64, 0)
    end = t0.copy()
    for name in ("first_token", "last_token", "response_end"):
        col = table.column(f"client_ns.{name}")
        end = np.where(_valid(col), np.maximum(end, _np(col, np.int64, 0)), end)
    offset = np.zeros(table.num_rows, dtype=np.int64)
    workers = _np(table.column("ext.worker"), object, "")
    for w, off in offsets.items():
        offset[workers == w] = off
    start = np.asarray(to_reference_ns(anchor, offset), dtype=np.int64)
    return start, start + (end - t0)


def _with_client_wall(table: pa.Table, offsets: Mapping[str, int]) -> pa.Table:
    """Adds client_wall_span's start and the span t0 → last stamp as columns."""
    start, end = client_wall_span(table, offsets)
    return table.append_column(
        "join.client_wall_start_ns", pa.array(start, type=pa.int64())
    ).append_column("join.client_span_ns", pa.array(end - start, type=pa.int64()))


def _windows(
    table: pa.Table, cells: _Cells, succ: dict[int, IntArray], trim: float
) -> SteadyWindows:
    """Each group's steady window [w0 + trim·span, w1 − trim·span], where w0, w1 are the
    first start and the last end of its successes `succ` (an empty window without)."""
    n_groups = len(cells.keys) * len(cells.partitions)
    w_start = np.zeros(n_groups, dtype=np.int64)
    w_end = np.zeros(n_groups, dtype=np.int64)
    start = _np(table.column("join.client_wall_start_ns"), np.int64, 0)
    end = start + _np(table.column("join.client_span_ns"), np.int64, 0)
    for g, rows in succ.items():
        if rows.size:
            w0, w1 = int(start[rows].min()), int(end[rows].max())
            cut = int((w1 - w0) * trim)
            w_start[g], w_end[g] = w0 + cut, w1 - cut
    # an event's wall time = its arrival + (wall start − t0) of its request
    offset = start - _np(table.column("client_ns.request_start"), np.int64, 0)
    return SteadyWindows(w_start, w_end, offset)


@dataclass(frozen=True, slots=True)
class _Rates:
    tokens_per_s: float | None = None
    requests_per_s: float | None = None
    window_s: float | None = None
    total: int = 0
    batches: tuple[float, ...] = ()


def _throughput(
    table: pa.Table, succ: IntArray, events: EventSums, windows: SteadyWindows, g: int
) -> _Rates:
    """Steady-state output tokens/s and completions/s of the successes `succ` of group
    `g`: tokens counted at their own arrival inside the group's window; completions/s
    counts the requests that ended inside the closed window; and the tokens/s of each of
    the window's THROUGHPUT_BATCHES batches (its interval: THROUGHPUT_CI_METHOD)."""
    if succ.size == 0:
        return _Rates()
    window = (int(windows.start_ns[g]), int(windows.end_ns[g]))
    whole = succ[~events.has_events[succ]]
    spread, total = None, int(events.tokens[g])
    per_batch = np.array(events.batch_tokens[g], dtype=np.float64)
    # batch b is [w0 + ⌈b·span/K⌉, w0 + ⌈(b+1)·span/K⌉): tokens.batch_of's batches
    span, k = window[1] - window[0], THROUGHPUT_BATCHES
    edges = [window[0] + (span * b + k - 1) // k for b in range(k + 1)]
    if whole.size:  # a whole (non-streamed) response: its tokens spread from t4 to t5
        t0 = _np(table.column("client_ns.request_start"), np.int64, 0)[whole]
        base = _np(table.column("join.client_wall_start_ns"), np.int64, 0)[whole]
        t4 = _np(table.column("client_ns.first_token"), np.int64, 0)[whole]
        t5 = _np(table.column("client_ns.last_token"), np.int64, 0)[whole]
        out_tok = _np(table.column("workload.actual_output_tokens"), np.float64, 0.0)[whole]
        s, e = base + (t4 - t0), base + (np.maximum(t5, t4) - t0)
        spread = window_tokens(s, e, out_tok, window)
        for b in range(THROUGHPUT_BATCHES):
            per_batch[b] += window_tokens(s, e, out_tok, (edges[b], edges[b + 1])) or 0.0
        total = int(events.tokens[g] + out_tok.sum())
    length_s = (window[1] - window[0]) / 1e9
    if length_s <= 0:
        return _Rates(total=total)
    rate = None
    batches: tuple[float, ...] = ()
    if events.touched[g] or spread is not None:
        rate = (float(events.window_tokens[g]) + (spread or 0.0)) / length_s
        batches = tuple(float(x) / (length_s / THROUGHPUT_BATCHES) for x in per_batch)
    start = _np(table.column("join.client_wall_start_ns"), np.int64, 0)[succ]
    end = start + _np(table.column("join.client_span_ns"), np.int64, 0)[succ]
    done = (end >= window[0]) & (end <= window[1])
    return _Rates(rate, float(np.count_nonzero(done)) / length_s, length_s, total, batches)


def group_cells(
    table: pa.Table, tokens: TokenParts, partitions: tuple[str, ...] = ("measured",)
) -> list[CellData]:
    """Metric values per (cell, partition) for the partitions asked, in cell order."""
    cells = _Cells.of(table, partitions)
    return _group(table, cells, _reduce(table, tokens, cells).itl)


def _reduce(
    table: pa.Table, tokens: TokenParts, cells: _Cells, windows: SteadyWindows | None = None
) -> EventSums:
    """The token events reduced per group of successes (failures have no ITL); with
    `windows`, each request's events counted to its confirmed total (`token_scale`)."""
    n_groups = len(cells.keys) * len(cells.partitions)
    group = np.where(cells.ok & (cells.group >= 0), cells.group, n_groups)
    ids = table.column("request_id")
    scale = None if windows is None else token_scale(table, tokens, ids)
    return reduce_events(tokens, ids, group, n_groups, windows, scale)


def _group(table: pa.Table, cells: _Cells, itl: list[FloatArray]) -> list[CellData]:
    columns = {
        m.name: _np(pc.cast(table.column(m.column), pa.float64()), np.float64, np.nan)
        for m in METRICS
        if m.column is not None
    }
    out = []
    for g, key, p, rows in cells.each():
        succ = rows[cells.ok[rows]]
        values: dict[str, FloatArray] = {}
        for m in METRICS:
            if m.column is None:
                values[m.name] = itl[g]
            else:
                values[m.name] = columns[m.name][succ if m.successes_only else rows]
        out.append(CellData(key, p, rows, values))
    return out


def summarize_cells(
    table: pa.Table,
    tokens: TokenParts,
    *,
    level: float = 0.95,
    trim_fraction: float = 0.1,
    client_offsets_ns: Mapping[str, int] | None = None,
    n_resamples: int = 1000,
    bootstrap_max_n: int = 2000,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[CellSummary], list[CellData]]:
    """Summaries of every cell and SUMMARY_PARTITIONS present, and their values."""
    table = _with_client_wall(table, client_offsets_ns or {})
    cells = _Cells.of(table, tuple(p.value for p in SUMMARY_PARTITIONS))
    part = _np(table.column("quality.partition"), object, "")
    err = _np(table.column("ext.error_class"), object, "")
    succ = {g: rows[err[rows] == ""] for g, _, _, rows in cells.each()}
    windows = _windows(table, cells, succ, trim_fraction)
    if progress is not None:
        progress(f"reducing the token events of {len(tokens)} part(s)")
    events = _reduce(table, tokens, cells, windows)
    data = _group(table, cells, events.itl)
    cut_at = _np(table.column("ext.cancelled_at"), object, "")
    reasons = table.column("quality.reasons")
    excluded = part == Partition.EXCLUDED.value
    reason_rows = {
        r.value: excluded & _np(pc.match_substring(reasons, r.value), bool, False) for r in Reason
    }
    groups = {(key, p): g for g, key, p, _ in cells.each()}
    cached, from_cache = _cache_use(table)
    reasoned = _valid(table.column("ext.reasoning_tokens"))
    cell_index = {k: i for i, k in enumerate(cells.keys)}
    summaries = []
    last_report = -math.inf
    for n_done, cell in enumerate(data):
        if progress is not None and time.monotonic() - last_report >= 1.0:
            last_report = time.monotonic()
            progress(f"summarizing {cell.key.label} {cell.partition} ({n_done + 1}/{len(data)})")
        rows = cell.rows
        e = err[rows]
        cancelled = (e == "cancelled") & (cut_at[rows] != "run_stop")
        failed = (e != "") & ~cancelled
        classes, counts = np.unique(e[failed].astype(str), return_counts=True)
        whole_cell = cells.by_cell[cell_index[cell.key]]
        g = groups[(cell.key, cell.partition)]
        rates = _throughput(table, succ[g], events, windows, g)
        ci = batch_means_ci(rates.batches, level) if rates.batches else (None, None)
        summaries.append(
            CellSummary(
                key=cell.key,
                partition=cell.partition,
                records=int(rows.size),
                ok=int(succ[g].size),
                errors=int(np.count_nonzero(failed)),
                cancelled=int(np.count_nonzero(cancelled)),
                errors_by_class={str(c): int(k) for c, k in zip(classes, counts, strict=True)},
                dropped=int(np.count_nonzero(part[whole_cell] == Partition.DROPPED.value)),
                cut_at_stop=int(np.count_nonzero(part[whole_cell] == Partition.CUT_AT_STOP.value)),
                excluded_by_reason={
                    r: c
                    for r, m in reason_rows.items()
                    if (c := int(np.count_nonzero(m[whole_cell])))
                },
                output_tokens=rates.total,
                steady_output_tokens_per_s=rates.tokens_per_s,
                steady_requests_per_s=rates.requests_per_s,
                steady_window_s=rates.window_s,
                throughput_batches=rates.batches,
                steady_output_tokens_per_s_ci=None
                if ci[0] is None or ci[1] is None
                else (ci[0], ci[1]),
                served_from_cache=int(np.count_nonzero(from_cache[rows])),
                cached_prompt_tokens=int(cached[rows].sum()),
                reasoning_requests=int(np.count_nonzero(reasoned[succ[g]])),
                reasoning_tokens=_phase_tokens(table, "ext.reasoning_tokens", succ[g]),
                answer_tokens=_phase_tokens(table, "ext.answer_tokens", succ[g]),
                steady_window_ns=(int(windows.start_ns[g]), int(windows.end_ns[g]))
                if windows.end_ns[g] > windows.start_ns[g]
                else None,
                metrics={
                    name: summarize(
                        values,
                        level=level,
                        n_resamples=n_resamples,
                        bootstrap_max_n=bootstrap_max_n,
                    )
                    for name, values in cell.values.items()
                    if name in _ALWAYS or np.count_nonzero(~np.isnan(values))
                },
            )
        )
    return summaries, data
