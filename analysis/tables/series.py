"""Latency over time: the run cut into equal time windows, each with its TTFT, TPOT and
ITL P50/P99, output tokens/s, requests in flight and requests started, succeeded and
failed, and the open-loop rate the plan had set. `analyze` writes it as
`timeseries.parquet` and `timeseries.csv` (SERIES_FILES); the report draws it.

Windows (client wall clock, each worker's NTP offset applied, as the steady windows):
from the first sent request's start, of the narrowest width of WIDTHS_S that cuts the
run (first start → last end) into at most MAX_WINDOWS.

    started, ok, failed   sent requests (not dropped arrivals) by their start: all of
                          them, the successes, and the failures (a cancellation, on
                          purpose or at the run's stop, is neither)
    ttft_*, tpot_*        P50 and P99 (numpy "higher", as the cells) of the successes
                          of the measured, throttled and warmup partitions (excluded
                          records are not trusted), by their start; `*_n` how many
    itl_*                 P50 and P99 of the ITL values of those successes (gap between
                          token events / tokens of the later event), by the later
                          event's arrival; from a log histogram of ITL_BINS_PER_DECADE
                          bins a decade (ITL_METHOD): within 0.12% of the order
                          statistic, or 1 µs below 1 µs
    output_tokens_per_s   their tokens by arrival / window width, each request's
                          events scaled to its confirmed total (as the cells'); a
                          whole (not streamed) response's tokens spread over t4..t5
    in_flight_mean        the time average of the requests in flight (every sent
                          request from its start to its last stamp, whatever its
                          outcome): Σ overlap with the window / width
    in_flight_max         the self-watch's sampled in-flight count: each worker's
                          highest in the window, summed over workers (null without)
    target_rate           the rate a Locust open-loop plan had set at the window's
                          start (client/index.json plan: rate, rate_changes); null
                          otherwise

A window without a value has null, never 0 (tokens/s and counts are 0 when nothing
happened). The Parquet schema's metadata carries `schema` (SERIES_SCHEMA), the width,
the origin, `initial_rate` ([wall ns, rate] of the plan's start) and `rate_changes`
([[wall ns, rate], ...], exact times) for the report's marks. The last window ends with
the run: its `width_s` is what it has, and its rates are over that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from analysis.stats.quantiles import PERCENTILE_METHOD, quantile, quantile_rank, window_tokens
from analysis.tables.cells import client_wall_span
from analysis.tables.columns import floats
from analysis.tables.join import BoolArray, FloatArray, IntArray
from analysis.tables.load import TokenParts
from analysis.tables.quality import Partition
from analysis.tables.tokens import event_columns, itl_gaps, split_events, token_scale
from calculet_load.schema.clocks import to_reference_ns

__all__ = [
    "ITL_BINS_PER_DECADE",
    "ITL_METHOD",
    "MAX_WINDOWS",
    "SERIES_FILES",
    "SERIES_SCHEMA",
    "WIDTHS_S",
    "RateChange",
    "itl_bin",
    "itl_bin_value",
    "rate_changes",
    "series_table",
]

SERIES_SCHEMA = "calculet-timeseries/v1"
SERIES_FILES = ("timeseries.parquet", "timeseries.csv")
WIDTHS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200)
MAX_WINDOWS = 150
ITL_BINS_PER_DECADE = 1000
_ITL_FLOOR_MS = 1e-3  # bin 0 holds [0, 1 µs)
_ITL_DECADES = 9  # up to 10⁶ ms; a longer gap falls in the top bin
_ITL_BINS = 1 + ITL_BINS_PER_DECADE * _ITL_DECADES
ITL_METHOD = (
    f"log histogram, {ITL_BINS_PER_DECADE} bins a decade from 1 µs: the bin of the "
    f"'{PERCENTILE_METHOD}' order statistic, at its geometric middle (0 below 1 µs)"
)
_LATENCY_PARTS = (Partition.MEASURED.value, Partition.THROTTLED.value, Partition.WARMUP.value)
_QS = (0.5, 0.99)


@dataclass(frozen=True, slots=True)
class RateChange:
    wall_ns: int
    rate: float


def rate_changes(index: Mapping[str, Any] | None) -> tuple[RateChange | None, list[RateChange]]:
    """A Locust open-loop plan's starting rate (at its origin) and its changes (wall ns),
    from client/index.json; (None, []) for another run."""
    plan = (index or {}).get("plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("origin_wall_ns"), int):
        return None, []
    if plan.get("arrival") in (None, "closed", "burst"):
        return None, []
    origin = int(plan["origin_wall_ns"])
    rate = plan.get("rate")
    first = RateChange(origin, float(rate)) if isinstance(rate, int | float) else None
    changes = []
    for item in plan.get("rate_changes") or []:
        if isinstance(item, list | tuple) and len(item) == 2:
            at, r = item
            if isinstance(at, int | float) and isinstance(r, int | float):
                changes.append(RateChange(origin + int(at), float(r)))
    return first, sorted(changes, key=lambda c: c.wall_ns)


def itl_bin(ms: FloatArray) -> IntArray:
    """The histogram bin of each ITL value (ms ≥ 0): 0 below 1 µs, then
    ITL_BINS_PER_DECADE a decade (the top bin holds what is longer)."""
    x = np.maximum(ms, _ITL_FLOOR_MS)
    x /= _ITL_FLOOR_MS
    np.log10(x, out=x)
    x *= ITL_BINS_PER_DECADE
    np.floor(x, out=x)
    np.minimum(x, _ITL_BINS - 2, out=x)
    b = x.astype(np.int64)
    b += 1
    b[ms < _ITL_FLOOR_MS] = 0
    return b


def itl_bin_value(b: IntArray) -> FloatArray:
    """The value a bin stands for: its geometric middle (0 for bin 0)."""
    mid = _ITL_FLOOR_MS * 10 ** ((np.asarray(b, dtype=np.float64) - 0.5) / ITL_BINS_PER_DECADE)
    return np.where(np.asarray(b) == 0, 0.0, mid)


def _strings(table: pa.Table, name: str) -> Any:
    return np.asarray(table.column(name).fill_null("").to_numpy(zero_copy_only=False))


def _width_s(span_ns: int) -> int:
    """The narrowest width that gives at most MAX_WINDOWS windows (span // width + 1)."""
    for w in WIDTHS_S:
        if span_ns < w * MAX_WINDOWS * 1_000_000_000:
            return w
    return span_ns // (MAX_WINDOWS - 1) // 1_000_000_000 + 1


def _quantiles(win: IntArray, values: FloatArray, n_win: int) -> tuple[IntArray, FloatArray]:
    """Per window: how many finite values, and their P50 and P99 (NaN without)."""
    keep = np.isfinite(values) & (win >= 0) & (win < n_win)
    win, values = win[keep], values[keep]
    order = np.argsort(win, kind="stable")
    win, values = win[order], values[order]
    bounds = np.searchsorted(win, np.arange(n_win + 1))
    out = np.full((len(_QS), n_win), np.nan)
    for w in np.flatnonzero(np.diff(bounds)):
        chunk = values[bounds[w] : bounds[w + 1]]
        for i, q in enumerate(_QS):
            out[i, w] = quantile(chunk, q)
    return np.diff(bounds), out


def _hist_quantiles(hist: IntArray) -> tuple[IntArray, FloatArray]:
    """Per window (a row of bin counts): its count and the P50 and P99 bins' values."""
    n = hist.sum(axis=1)
    cum = np.cumsum(hist, axis=1)
    out = np.full((len(_QS), hist.shape[0]), np.nan)
    for w in np.flatnonzero(n):
        for i, q in enumerate(_QS):
            k = quantile_rank(int(n[w]), q)
            b = np.searchsorted(cum[w], k, side="left")
            out[i, w] = float(itl_bin_value(np.asarray([b], dtype=np.int64))[0])
    return n, out


def _in_flight_mean(start: IntArray, end: IntArray, origin: int, widths: FloatArray) -> FloatArray:
    """Time average of the requests in flight per window: (F(b) − F(a)) / (b − a),
    F(x) = ∫ N = Σ clip(x − sᵢ, 0, eᵢ − sᵢ) = Σ_{sᵢ ≤ x}(x − sᵢ) − Σ_{eᵢ ≤ x}(x − eᵢ)."""
    edges = origin + np.r_[0, np.cumsum(widths)].astype(np.int64)
    s, e = np.sort(start), np.sort(end)
    cs = np.r_[0, np.cumsum(s - origin, dtype=np.float64)]
    ce = np.r_[0, np.cumsum(e - origin, dtype=np.float64)]
    ks = np.searchsorted(s, edges, side="right")
    ke = np.searchsorted(e, edges, side="right")
    x = (edges - origin).astype(np.float64)
    integral = (ks * x - cs[ks]) - (ke * x - ce[ke])
    mean: FloatArray = np.diff(integral) / widths
    return mean


def _selfwatch_max(
    sw: pa.Table | None, offsets: Mapping[str, int], origin: int, width: int, n_win: int
) -> FloatArray:
    out = np.full(n_win, np.nan)
    if sw is None or sw.num_rows == 0:
        return out
    worker = np.asarray(sw.column("worker").fill_null("").to_numpy(zero_copy_only=False))
    wall = np.asarray(sw.column("wall_ns").fill_null(0).to_numpy(zero_copy_only=False), np.int64)
    flight = floats(sw, "in_flight")
    for w in np.unique(worker):
        m = (worker == w) & np.isfinite(flight) & (wall > 0)
        at = np.asarray(to_reference_ns(wall[m], offsets.get(str(w), 0)), dtype=np.int64)
        win = (at - origin) // width
        ok = (win >= 0) & (win < n_win)
        peak = np.full(n_win, np.nan)
        np.fmax.at(peak, win[ok], flight[m][ok])
        out = np.where(np.isnan(out), peak, np.where(np.isnan(peak), out, out + peak))
    return out


_CHUNK = 1 << 20  # events placed in windows and bins at once: bounds the transients


@dataclass(slots=True)
class _Tokens:
    """The token events of the chosen requests, window by window. Events are placed a
    chunk at a time, in place, so that a part of tens of millions of events costs a few
    arrays of its size and no more."""

    origin: int
    width: int
    wall_offset: IntArray  # per request row: arrival ns → client wall ns
    tokens: FloatArray
    hist: IntArray
    has_events: BoolArray  # per request row: any event of it was seen (it streamed)

    def _window(self, at: IntArray, rows: IntArray) -> IntArray:
        w = self.wall_offset[rows]
        w += at
        w -= self.origin
        w //= self.width
        return w

    def add_tokens(self, rows: IntArray, at: IntArray, count: IntArray, scale: FloatArray) -> None:
        """Each event's tokens, scaled by its request's `scale` (to its confirmed total,
        as the cells count them), into the window of its arrival."""
        n_win = self.tokens.size
        for s in range(0, rows.size, _CHUNK):
            r = rows[s : s + _CHUNK]
            w = self._window(at[s : s + _CHUNK], r)
            ok = (w >= 0) & (w < n_win)
            weights = count[s : s + _CHUNK][ok] * scale[r[ok]]
            self.tokens += np.bincount(w[ok], weights=weights, minlength=n_win)

    def add_itl(self, rows: IntArray, at: IntArray, ms: FloatArray, sign: int = 1) -> None:
        n_win = self.hist.shape[0]
        for s in range(0, rows.size, _CHUNK):
            w = self._window(at[s : s + _CHUNK], rows[s : s + _CHUNK])
            ok = (w >= 0) & (w < n_win)
            flat = w[ok]
            flat *= _ITL_BINS
            flat += itl_bin(ms[s : s + _CHUNK][ok])
            counts = np.bincount(flat, minlength=n_win * _ITL_BINS)
            self.hist += sign * counts.reshape(self.hist.shape)


def _token_pass(
    table: pa.Table,
    parts: TokenParts,
    chosen: BoolArray,
    wall_offset: IntArray,
    origin: int,
    width: int,
    n_win: int,
) -> _Tokens:
    """One pass over the token parts: tokens and the ITL histogram per window of the
    `chosen` requests' events, a part at a time (dropped before the next is read). A
    request whose events turn up in several parts (a restarted worker reusing ids) has
    what each part gave alone taken back and its ITL recomputed from all its events, as
    the cells' ITL is (analysis.tables.tokens)."""
    acc = _Tokens(
        origin,
        width,
        wall_offset,
        np.zeros(n_win),
        np.zeros((n_win, _ITL_BINS), dtype=np.int64),
        np.zeros(table.num_rows, dtype=bool),
    )
    ids = table.column("request_id")
    scale = token_scale(table, parts, ids)
    seen = np.zeros(table.num_rows, dtype=bool)
    split = np.zeros(table.num_rows, dtype=bool)

    def itl(pos: IntArray, count: IntArray, idx: IntArray, t: IntArray, sign: int = 1) -> None:
        rows, ms, at = itl_gaps(pos, count, idx, t, with_times=True)
        assert at is not None
        acc.add_itl(rows, at, ms, sign)

    for _, part in parts:
        pos, count, t = event_columns(part, ids)
        idx = np.asarray(part.column("event_index").to_numpy(zero_copy_only=False), np.int64)
        del part  # its pages go back before the next part is read
        mine = (pos >= 0) & chosen[np.maximum(pos, 0)]
        if not mine.all():
            pos, count, t, idx = pos[mine], count[mine], t[mine], idx[mine]
        del mine
        acc.has_events[pos] = True
        here = np.zeros(table.num_rows, dtype=bool)
        here[pos[count > 0]] = True
        split |= here & seen
        seen |= here
        acc.add_tokens(pos, t, count, scale)
        itl(pos, count, idx, t)
        del pos, count, t, idx
    if split.any():
        again = [split_events(part, ids, split) for _, part in parts]
        for pos, count, idx, t in again:
            itl(pos, count, idx, t, sign=-1)
        pos, count, idx, t = (np.concatenate(c) for c in zip(*again, strict=True))
        itl(pos, count, idx, t)
    # the parts' pages, freed, would stay with Arrow's allocator (as tables.tokens says)
    pa.default_memory_pool().release_unused()
    return acc


def _whole_tokens(
    table: pa.Table,
    rows: IntArray,
    start: IntArray,
    origin: int,
    width: int,
    n_win: int,
) -> FloatArray:
    """Tokens per window of whole (not streamed) responses `rows`: each one's output
    tokens spread evenly from t4 to t5 (a point at t4 when they coincide), as the
    cells' throughput spreads them."""
    out = np.zeros(n_win)
    if rows.size == 0:
        return out
    t0 = floats(table, "client_ns.request_start")[rows]
    t4 = floats(table, "client_ns.first_token")[rows]
    t5 = floats(table, "client_ns.last_token")[rows]
    tok = floats(table, "workload.actual_output_tokens")[rows]
    ok = np.isfinite(t0) & np.isfinite(t4) & np.isfinite(tok) & (tok > 0)
    t5 = np.where(np.isfinite(t5), np.maximum(t5, t4), t4)
    base = start[rows][ok]
    s = (base + (t4[ok] - t0[ok])).astype(np.int64)
    e = (base + (t5[ok] - t0[ok])).astype(np.int64)
    first = np.clip((s - origin) // width, 0, n_win - 1)
    last = np.clip((e - origin) // width, 0, n_win - 1)
    for w in range(int(first.min()), int(last.max()) + 1) if s.size else ():
        touch = (first <= w) & (last >= w)
        if touch.any():
            lo = origin + w * width
            got = window_tokens(s[touch], e[touch], tok[ok][touch], (lo, lo + width))
            out[w] += got or 0.0
    return out


def series_table(
    table: pa.Table,
    parts: TokenParts,
    *,
    selfwatch: pa.Table | None = None,
    index: Mapping[str, Any] | None = None,
    client_offsets_ns: Mapping[str, int] | None = None,
) -> pa.Table | None:
    """The run's windows (module docstring) from its quality table (joined records with
    their partitions), token parts and self-watch; None when no request was sent."""
    offsets = client_offsets_ns or {}
    start, end = client_wall_span(table, offsets)
    part = np.asarray(
        table.column("quality.partition").fill_null("").to_numpy(zero_copy_only=False)
    )
    err = np.asarray(table.column("ext.error_class").fill_null("").to_numpy(zero_copy_only=False))
    # a sent request has its wall anchor; a record without one is placed nowhere
    sent = (part != Partition.DROPPED.value) & (start > 0)
    if not sent.any():
        return None
    origin = int(start[sent].min())
    span = int(end[sent].max()) - origin
    width_s = _width_s(span)
    width = width_s * 1_000_000_000
    n_win = span // width + 1
    win = (start - origin) // width

    ok = sent & (err == "")
    failed = sent & (err != "") & (err != "cancelled")
    timed = ok & np.isin(part, _LATENCY_PARTS)
    started = np.bincount(win[sent], minlength=n_win)
    n_ok = np.bincount(win[ok], minlength=n_win)
    n_failed = np.bincount(win[failed], minlength=n_win)
    ttft_n, ttft = _quantiles(win[timed], floats(table, "durations_ms.ttft")[timed], n_win)
    tpot_n, tpot = _quantiles(win[timed], floats(table, "durations_ms.tpot")[timed], n_win)

    t0 = floats(table, "client_ns.request_start")
    wall_offset = np.where(np.isfinite(t0), start - np.nan_to_num(t0).astype(np.int64), 0)
    acc = _token_pass(table, parts, timed, wall_offset, origin, width, n_win)
    whole = np.flatnonzero(timed & ~acc.has_events)
    tokens = acc.tokens + _whole_tokens(table, whole, start, origin, width, n_win)
    itl_n, itl = _hist_quantiles(acc.hist)

    first, changes = rate_changes(index)
    edges = origin + width * np.arange(n_win, dtype=np.int64)
    target = np.full(n_win, np.nan)
    for c in ([first] if first is not None else []) + changes:
        target[edges >= c.wall_ns] = c.rate
    # the last window ends with the run: its rates are over what it has of its width
    widths = np.full(n_win, float(width))
    widths[-1] = float(max(origin + span - edges[-1], 1))

    def col(values: Any, kind: pa.DataType) -> pa.Array:
        arr = np.asarray(values)
        if kind == pa.float64():
            return pa.array(arr, type=kind, from_pandas=True)  # NaN → null
        return pa.array(arr, type=kind)

    f64, i64 = pa.float64(), pa.int64()
    columns = {
        "window": col(np.arange(n_win), i64),
        "start_wall_ns": col(edges, i64),
        "start_s": col((edges - origin) / 1e9, f64),
        "width_s": col(widths / 1e9, f64),
        "started": col(started, i64),
        "ok": col(n_ok, i64),
        "failed": col(n_failed, i64),
        "ttft_n": col(ttft_n, i64),
        "ttft_p50_ms": col(ttft[0], f64),
        "ttft_p99_ms": col(ttft[1], f64),
        "tpot_n": col(tpot_n, i64),
        "tpot_p50_ms": col(tpot[0], f64),
        "tpot_p99_ms": col(tpot[1], f64),
        "itl_n": col(itl_n, i64),
        "itl_p50_ms": col(itl[0], f64),
        "itl_p99_ms": col(itl[1], f64),
        "output_tokens_per_s": col(tokens / (widths / 1e9), f64),
        "in_flight_mean": col(_in_flight_mean(start[sent], end[sent], origin, widths), f64),
        "in_flight_max": col(_selfwatch_max(selfwatch, offsets, origin, width, n_win), f64),
        "target_rate": col(target, f64),
    }
    meta = {
        "schema": SERIES_SCHEMA,
        "origin_wall_ns": str(origin),
        "width_s": str(width_s),
        "percentile_method": PERCENTILE_METHOD,
        "itl_method": ITL_METHOD,
        "initial_rate": json.dumps(None if first is None else [first.wall_ns, first.rate]),
        "rate_changes": json.dumps([[c.wall_ns, c.rate] for c in changes]),
    }
    return pa.table(columns).replace_schema_metadata(meta)
