"""Joining client records with server traces (by request id) and device rows (as-of by
time): spec §1 (attribution), §2.3 (server events), §4 (steps, device).

Per request, from `server_events.jsonl` on the server's monotonic clock (ns):

    A  = accepted                 P0 = job_prepared, step 0     S0 = sampled, step 0
    F0 = token_flushed, step 0    SL = last sampled             FL = last token_flushed

    server_ms.queue        = P0 − A                 admission + wait for the prefill job
    join.slot_wait_ms      = SA − A                 SA = slot_assigned: waiting for a slot
    join.admission_wait_ms = AD − SA                AD = admitted: holding a slot, waiting
                                                    for KV and an OutputBuf lease (§10.1)
    server_ms.prefill      = S0 − P0                prepare, H2D, device, D2H, sampling
    server_ms.decode_total = SL − F0                (null with one step)
    server_ms.postprocess  = (F0 − S0) + (FL − max(SL, F0))   first and last flush
    server_ms.sampling     = Σ steps.sampling_ms
    runtime_ms.{h2d,infer,d2h}_{prefill,decode} = Σ steps.{h2d_ms, device_wait_ms, d2h_ms}
                                                  over the request's steps of that kind
    join.server_span_ms        = FL − A  (A to the last outcome event if no token flushed)
    join.unattributed_ttft_ms  = TTFT − (F0 − A)    client and network time before the
    join.unattributed_e2e_ms   = E2E − join.server_span_ms       server saw / after it sent

Vendor counters (`server/vendor.jsonl`, spec §17; absent for most targets): per
request, the sums over its `op` rows of

    vendor.cycles, vendor.d2d_bytes, vendor.ddr_bytes, vendor.pcie_bytes

joined by request id as the steps are (null where the request has no row, or no row
with that counter).

Coalesced events (a proxy or gateway buffering the stream): per streamed request,

    join.server_flush_span_ms  = FL − F0   how long the server took to send its tokens
    join.coalesced             = ext.max_events_per_read ≥ COALESCED_EVENTS (4)
                                 and FL − F0 ≥ COALESCED_SPAN_MS (20 ms)
                                 and the client's t5 − t4 < FL − F0 / 2

i.e. many events came in one read while the server's own trace shows them spread out:
the client's inter-token times are then the buffer's, not the server's. Null where it
cannot be told (no server trace, a part written before ext.max_events_per_read, a
whole response, a failed request); `coalesced_note` names the cells.

The four server terms partition [A, FL] when the chain is in order, so TTFT = queue +
prefill + first flush + unattributed: time no trace explains stays `unattributed` and
is never folded into a server phase (spec §1). Client and server durations each come
from their own monotonic clock; no cross-host clock is subtracted.

A record without an `accepted` event keeps all of this null and
`quality.server_trace_joined = false`; it stays in the table.

Device (`device.jsonl`): per row the hottest chip, total power (null if no chip could
be read, never 0), lowest frequency and whether any chip throttled. A request takes the
last row at or before its start (as-of, within 2.5 sampling intervals) and
`device.throttled` is true if any row from that one to its end throttled;
`quality.throttled` becomes the record's flag OR that. Request times are on the
server's wall clock: the `accepted` event's when joined, else the client's wall anchor
with both hosts' recorded NTP offsets applied (calculet_load.schema.clocks: onto the NTP
reference with the client's offset, then onto the server's clock with the server's).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from analysis.tables.load import Progress, RunData, read_run_files
from calculet_load.schema.clocks import from_reference_ns, to_reference_ns

__all__ = [
    "COALESCED_EVENTS",
    "COALESCED_SPAN_MS",
    "JOIN_COLUMNS",
    "VENDOR_COUNTERS",
    "coalesced_note",
    "device_extremes",
    "join_run",
    "load_run",
    "positions",
]

VENDOR_COUNTERS = ("cycles", "d2d_bytes", "ddr_bytes", "pcie_bytes")
COALESCED_EVENTS = 4  # events in one read, at least
COALESCED_SPAN_MS = 20.0  # the server's own first-to-last token flush, at least

JOIN_COLUMNS: dict[str, pa.DataType] = {
    "join.server_span_ms": pa.float64(),
    "join.unattributed_ttft_ms": pa.float64(),
    "join.unattributed_e2e_ms": pa.float64(),
    "join.server_steps": pa.int64(),
    "join.runtime_errors": pa.int64(),
    "join.wall_start_ns": pa.int64(),
    "join.wall_end_ns": pa.int64(),
    "device.temperature_c_max": pa.float64(),
    "device.power_w_total": pa.float64(),
    "device.frequency_mhz_min": pa.float64(),
    "device.throttled": pa.bool_(),
    "join.server_flush_span_ms": pa.float64(),
    "join.coalesced": pa.bool_(),
    "join.slot_wait_ms": pa.float64(),
    "join.admission_wait_ms": pa.float64(),
    **{f"vendor.{c}": pa.int64() for c in VENDOR_COUNTERS},
}
"""Columns `join_run` adds to `RunData.requests` (it also fills server_ms.*, runtime_ms.*,
quality.server_trace_joined and quality.throttled of the record schema)."""

_I64_MAX = np.iinfo(np.int64).max
_I64_MIN = np.iinfo(np.int64).min
_OUTCOMES = ("finished", "failed", "cancelled", "rejected")
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def positions(ids: Any, request_ids: Any) -> IntArray:
    """Row of `request_ids` each of `ids` refers to; −1 where none (vectorized).

    Dictionary-encoded ids (token events and Parquet traces are read that way: tens of
    millions of rows naming a million requests) are looked up once per distinct id."""
    if pa.types.is_dictionary(ids.type):
        chunks = ids.chunks if isinstance(ids, pa.ChunkedArray) else [ids]
        parts: list[IntArray] = []
        seen: tuple[Any, IntArray] | None = None
        for chunk in chunks:
            d = chunk.dictionary
            if seen is None or not seen[0].equals(d):  # a part's row groups share one
                # hash the (smaller) dictionary and probe the requests with it
                at = pc.index_in(request_ids, value_set=d)
                rows = np.flatnonzero(np.asarray(pc.is_valid(at), dtype=bool))
                lookup = np.full(len(d) + 1, -1, dtype=np.int64)  # [-1]: a null id
                lookup[np.asarray(pc.take(at, pa.array(rows)), dtype=np.int64)] = rows
                seen = (d, lookup)
            idx = chunk.indices
            if idx.null_count:
                idx = pc.fill_null(idx, -1)
            parts.append(seen[1][np.asarray(idx, dtype=np.int64)])
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    idx = pc.index_in(ids, value_set=request_ids)
    return np.asarray(pc.fill_null(idx, -1).to_numpy(zero_copy_only=False), dtype=np.int64)


def _ints(col: Any) -> tuple[IntArray, BoolArray]:
    valid = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)
    values = np.asarray(pc.fill_null(col, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    return values, valid


def _floats(col: Any) -> FloatArray:
    return np.asarray(
        pc.fill_null(pc.cast(col, pa.float64()), np.nan).to_numpy(zero_copy_only=False),
        dtype=np.float64,
    )


def _extreme(
    pos: IntArray, rows: BoolArray, values: IntArray, n: int, *, last: bool
) -> tuple[IntArray, BoolArray]:
    """Per request, the min (or max) of `values` over the selected rows; and presence."""
    sel = rows & (pos >= 0)
    out = np.full(n, _I64_MIN if last else _I64_MAX, dtype=np.int64)
    (np.maximum if last else np.minimum).at(out, pos[sel], values[sel])
    present = out != (_I64_MIN if last else _I64_MAX)
    return out, present


def _ms(a: IntArray, am: BoolArray, b: IntArray, bm: BoolArray) -> FloatArray:
    """(a − b) / 10⁶ where both exist, NaN elsewhere (integer ns subtracted first)."""
    out = np.full(a.shape, np.nan)
    both = am & bm
    out[both] = (a[both] - b[both]) / 1e6
    return out


def _server(run: RunData, n: int, out: dict[str, Any]) -> BoolArray:
    """Fill the server breakdown into `out`; return which requests were joined."""
    ev = run.server_events
    joined = np.zeros(n, dtype=bool)
    if ev is None or ev.num_rows == 0:
        return joined
    pos = positions(ev.column("request_id"), run.requests.column("request_id"))
    name = np.asarray(ev.column("event").fill_null("").to_numpy(zero_copy_only=False))
    step, step_ok = _ints(ev.column("step_index"))
    mono, mono_ok = _ints(ev.column("mono_ns"))
    has = mono_ok & (pos >= 0)
    step0 = step_ok & (step == 0)

    def first(event: str, rows: BoolArray | None = None) -> tuple[IntArray, BoolArray]:
        sel = has & (name == event) & (True if rows is None else rows)
        return _extreme(pos, sel, mono, n, last=False)

    def last(event: str) -> tuple[IntArray, BoolArray]:
        return _extreme(pos, has & (name == event), mono, n, last=True)

    a, am = first("accepted")
    sa, sam = first("slot_assigned")
    ad, adm = first("admitted")
    out["join.slot_wait_ms"] = _ms(sa, sam, a, am)
    out["join.admission_wait_ms"] = _ms(ad, adm, sa, sam)
    p0, p0m = first("job_prepared", step0)
    s0, s0m = first("sampled", step0)
    f0, f0m = first("token_flushed", step0)
    sl, slm = last("sampled")
    fl, flm = last("token_flushed")
    end, endm = _extreme(pos, has & np.isin(name, _OUTCOMES), mono, n, last=True)
    joined = am
    steps_seen = np.bincount(pos[has & (name == "sampled")], minlength=n)[:n]
    out["join.server_steps"] = np.where(joined, steps_seen, -1)
    out["join.runtime_errors"] = np.where(
        joined, np.bincount(pos[has & (name == "runtime_error")], minlength=n)[:n], -1
    )
    out["server_ms.queue"] = _ms(p0, p0m, a, am)
    out["server_ms.prefill"] = _ms(s0, s0m, p0, p0m)
    out["server_ms.decode_total"] = np.where(steps_seen > 1, _ms(sl, slm, f0, f0m), np.nan)
    tail_from = np.maximum(sl, f0)
    out["server_ms.postprocess"] = _ms(f0, f0m, s0, s0m) + _ms(fl, flm, tail_from, slm & f0m)
    span_end = np.where(flm, fl, end)
    out["join.server_span_ms"] = _ms(span_end, flm | endm, a, am)
    d = run.requests
    out["join.server_flush_span_ms"] = np.where(am, _ms(fl, flm, f0, f0m), np.nan)
    out["join.unattributed_ttft_ms"] = _floats(d.column("durations_ms.ttft")) - _ms(f0, f0m, a, am)
    out["join.unattributed_e2e_ms"] = (
        _floats(d.column("durations_ms.e2e")) - out["join.server_span_ms"]
    )
    wall, wall_ok = _ints(ev.column("wall_ns"))
    aw, awm = _extreme(pos, has & wall_ok & (name == "accepted"), wall, n, last=False)
    out["_server_wall_start"] = np.where(awm, aw, _I64_MIN)
    span_ns = np.where(flm | endm, span_end - a, 0)
    out["_server_wall_end"] = np.where(awm, aw + np.where(joined, span_ns, 0), _I64_MIN)
    return joined


def _steps(run: RunData, n: int, out: dict[str, Any], joined: BoolArray) -> None:
    st = run.steps
    if st is None or st.num_rows == 0:
        return
    pos = positions(st.column("request_id"), run.requests.column("request_id"))
    kind = st.column("kind")
    ok = pos >= 0

    def total(column: str, rows: BoolArray) -> FloatArray:
        v = _floats(st.column(column))
        sel = ok & rows & ~np.isnan(v)
        s = np.bincount(pos[sel], weights=v[sel], minlength=n)[:n]
        seen = np.bincount(pos[ok & rows], minlength=n)[:n] > 0
        return np.where(seen & joined, s, np.nan)

    every = np.ones(st.num_rows, dtype=bool)
    out["server_ms.sampling"] = total("sampling_ms", every)
    for k in ("prefill", "decode"):
        rows = np.asarray(pc.fill_null(pc.equal(kind, k), False), dtype=bool)
        out[f"runtime_ms.h2d_{k}"] = total("h2d_ms", rows)
        out[f"runtime_ms.infer_{k}"] = total("device_wait_ms", rows)
        out[f"runtime_ms.d2h_{k}"] = total("d2h_ms", rows)


def _vendor(run: RunData, n: int, out: dict[str, Any]) -> None:
    """Per request, the sums of the vendor's `op` rows naming it (-1: none)."""
    v = run.vendor
    if v is None or v.num_rows == 0:
        return
    pos = positions(v.column("request_id"), run.requests.column("request_id"))
    op = np.asarray(pc.fill_null(pc.equal(v.column("kind"), "op"), False), dtype=bool)
    for name in VENDOR_COUNTERS:
        values, valid = _ints(v.column(name))
        sel = op & valid & (pos >= 0)
        total = np.zeros(n, dtype=np.int64)
        np.add.at(total, pos[sel], values[sel])
        seen = np.bincount(pos[sel], minlength=n)[:n] > 0
        out[f"vendor.{name}"] = np.where(seen, total, -1)


def _client_wall(run: RunData) -> tuple[IntArray, IntArray, BoolArray]:
    """Request start and end on the server's wall clock, from the client's anchor."""
    d = run.requests
    anchor, anchor_ok = _ints(d.column("ext.wall_anchor_ns"))
    t0, t0_ok = _ints(d.column("client_ns.request_start"))
    stamps = [_ints(d.column(f"client_ns.{f}")) for f in ("response_end", "last_token")]
    end = t0.copy()
    for v, m in stamps[::-1]:
        end = np.where(m, np.maximum(end, v), end)
    offset = np.zeros(d.num_rows, dtype=np.int64)
    if run.client_offsets_ns:
        workers = d.column("ext.worker").fill_null("").to_numpy(zero_copy_only=False)
        for w, off in run.client_offsets_ns.items():
            offset[np.asarray(workers) == w] = off
    start = from_reference_ns(to_reference_ns(anchor, offset), run.server_offset_ns)
    return start, start + np.where(t0_ok, end - t0, 0), anchor_ok


def _device_rows(dev: pa.Table) -> tuple[IntArray, dict[str, Any]]:
    """Per device row: wall time (server clock) and its per-chip aggregates."""
    m = dev.num_rows
    chips = dev.column("chips")
    flat = pc.list_flatten(chips)
    parent = np.asarray(pc.list_parent_indices(chips).to_numpy(zero_copy_only=False))
    temp = _floats(pc.struct_field(flat, "temperature_c"))
    power = _floats(pc.struct_field(flat, "power_w"))
    freq = _floats(pc.struct_field(flat, "frequency_mhz"))
    thr = pc.struct_field(flat, "throttled")
    thr_true = np.asarray(pc.fill_null(thr, False).to_numpy(zero_copy_only=False), dtype=bool)
    thr_known = np.asarray(pc.is_valid(thr).to_numpy(zero_copy_only=False), dtype=bool)
    t_max = np.full(m, np.nan)
    np.fmax.at(t_max, parent, temp)
    f_min = np.full(m, np.nan)
    np.fmin.at(f_min, parent, freq)
    p_ok = ~np.isnan(power)
    p_sum = np.bincount(parent[p_ok], weights=power[p_ok], minlength=m)[:m]
    p_seen = np.bincount(parent[p_ok], minlength=m)[:m] > 0
    throttled = np.bincount(parent[thr_true], minlength=m)[:m] > 0
    known = np.bincount(parent[thr_known], minlength=m)[:m] > 0
    wall, _ = _ints(dev.column("wall_ns"))
    return wall, {
        "temperature": t_max,
        "power": np.where(p_seen, p_sum, np.nan),
        "frequency": f_min,
        "throttled": throttled,
        "known": known,
    }


def device_extremes(dev: pa.Table) -> tuple[float | None, float | None, int]:
    """Hottest chip (°C) and highest total power (W) over the rows, and the row count;
    None where no chip could be read."""
    if dev.num_rows == 0:
        return None, None, 0
    _, agg = _device_rows(dev)
    t, p = agg["temperature"], agg["power"]
    t_max = float(np.nanmax(t)) if np.any(~np.isnan(t)) else None
    p_max = float(np.nanmax(p)) if np.any(~np.isnan(p)) else None
    return t_max, p_max, dev.num_rows


def _device(
    run: RunData, start: IntArray, end: IntArray, ok: BoolArray, out: dict[str, Any]
) -> None:
    dev = run.device
    if dev is None or dev.num_rows == 0:
        return
    wall, agg = _device_rows(dev)
    order = np.argsort(wall, kind="stable")
    wall = wall[order]
    agg = {k: v[order] for k, v in agg.items()}
    step = float(np.median(np.diff(wall))) if wall.size > 1 else 1e9
    tolerance = 2.5 * step
    i = np.searchsorted(wall, start, side="right") - 1
    hit = ok & (i >= 0)
    hit[hit] &= (start[hit] - wall[i[hit]]) <= tolerance
    j = np.clip(i, 0, wall.size - 1)
    out["device.temperature_c_max"] = np.where(hit, agg["temperature"][j], np.nan)
    out["device.power_w_total"] = np.where(hit, agg["power"][j], np.nan)
    out["device.frequency_mhz_min"] = np.where(hit, agg["frequency"][j], np.nan)
    cum = np.concatenate(([0], np.cumsum(agg["throttled"])))
    known_cum = np.concatenate(([0], np.cumsum(agg["known"])))
    # rows from the as-of one (or, when it is missing or stale, the first after the start)
    lo = np.where(hit, i, np.searchsorted(wall, start, side="left"))
    hi = np.searchsorted(wall, end, side="right")  # exclusive
    any_thr = (cum[np.maximum(hi, lo)] - cum[lo]) > 0
    any_known = (known_cum[np.maximum(hi, lo)] - known_cum[lo]) > 0
    out["device.throttled"] = np.where(ok & any_known, any_thr, False)
    out["_device_known"] = ok & any_known


def _coalesced(d: pa.Table, out: dict[str, Any]) -> tuple[BoolArray, BoolArray]:
    """(coalesced, known) per request (see the module's docstring)."""
    n = d.num_rows
    span = np.asarray(out.get("join.server_flush_span_ms", np.full(n, np.nan)), dtype=float)
    if d.schema.get_field_index("ext.max_events_per_read") < 0:
        return np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    per_read, per_read_ok = _ints(d.column("ext.max_events_per_read"))
    t4, t4m = _ints(d.column("client_ns.first_token"))
    t5, t5m = _ints(d.column("client_ns.last_token"))
    client_span = _ms(t5, t5m, t4, t4m)
    ok = np.asarray(pc.is_null(d.column("ext.error_class")).to_numpy(zero_copy_only=False))
    known = per_read_ok & ~np.isnan(span) & ~np.isnan(client_span) & ok.astype(bool)
    with np.errstate(invalid="ignore"):
        hit = (
            known
            & (per_read >= COALESCED_EVENTS)
            & (span >= COALESCED_SPAN_MS)
            & (client_span < span / 2)
        )
    return hit, known


def coalesced_note(d: pa.Table) -> str | None:
    """The warning that names the cells whose events arrived coalesced, or None."""
    if d.schema.get_field_index("join.coalesced") < 0:
        return None
    hit = np.asarray(d.column("join.coalesced").fill_null(False).to_numpy(zero_copy_only=False))
    if not hit.any():
        return None
    known = np.asarray(pc.is_valid(d.column("join.coalesced")).to_numpy(zero_copy_only=False))
    cells = np.asarray(d.column("ext.cell").fill_null("-").to_numpy(zero_copy_only=False))
    parts = []
    for cell in sorted(set(cells[hit].tolist())):
        mine = cells == cell
        parts.append(f"{cell} ({int((hit & mine).sum())} of {int((known & mine).sum())})")
    return (
        "events arrived coalesced in cell(s) " + ", ".join(parts) + f": {COALESCED_EVENTS} "
        "or more events came in one read while the server's own trace spread them over "
        f"{COALESCED_SPAN_MS:g} ms or more; a proxy or gateway is buffering the stream "
        "(nginx: proxy_buffering off), and these requests' inter-token times are the "
        "buffer's, not the server's"
    )


def join_run(run: RunData) -> RunData:
    """Fill the server breakdown, device columns and quality flags into `run.requests`."""
    d = run.requests
    n = d.num_rows
    out: dict[str, Any] = {}
    joined = _server(run, n, out)
    _steps(run, n, out, joined)
    _vendor(run, n, out)
    cstart, cend, cok = _client_wall(run)
    sstart = out.pop("_server_wall_start", np.full(n, _I64_MIN))
    send = out.pop("_server_wall_end", np.full(n, _I64_MIN))
    start = np.where(joined, sstart, cstart)
    end = np.where(joined, send, cend)
    ok = joined | cok
    out["join.wall_start_ns"] = start
    out["join.wall_end_ns"] = end
    _device(run, start, end, ok, out)
    known = out.pop("_device_known", np.zeros(n, dtype=bool))
    coalesced, coalesced_known = _coalesced(d, out)
    out["join.coalesced"] = coalesced

    columns: dict[str, pa.Array] = {}
    for name, values in out.items():
        typ = JOIN_COLUMNS.get(name) or d.schema.field(name).type
        arr = np.asarray(values)
        if name in ("join.wall_start_ns", "join.wall_end_ns"):
            mask = ~ok
        elif name == "device.throttled":
            mask = ~known
        elif name == "join.coalesced":
            mask = ~coalesced_known
        elif arr.dtype.kind == "f":
            mask = np.isnan(arr)
        else:
            mask = arr < 0
        columns[name] = pa.array(arr, type=typ, mask=mask)
    quality_thr = np.asarray(
        d.column("quality.throttled").fill_null(False).to_numpy(zero_copy_only=False), dtype=bool
    )
    dev_thr = np.asarray(out.get("device.throttled", np.zeros(n, dtype=bool)), dtype=bool)
    was_joined = np.asarray(
        d.column("quality.server_trace_joined").fill_null(False).to_numpy(zero_copy_only=False),
        dtype=bool,
    )
    columns["quality.server_trace_joined"] = pa.array(joined | was_joined, type=pa.bool_())
    columns["quality.throttled"] = pa.array(quality_thr | (dev_thr & known), type=pa.bool_())

    joined_arr = pa.array(joined, type=pa.bool_())
    for name, arr in columns.items():
        i = d.schema.get_field_index(name)
        if i < 0:
            continue
        if name.startswith(("server_ms.", "runtime_ms.")):
            # a record that carries its own server figures keeps them unless joined here
            arr = pc.if_else(joined_arr, arr, d.column(i).combine_chunks())
        d = d.set_column(i, name, arr)
    for name, typ in JOIN_COLUMNS.items():
        if d.schema.get_field_index(name) < 0:
            d = d.append_column(name, columns.get(name, pa.nulls(n, type=typ)))
    run.requests = d
    if run.server_events is None:
        run.notes.append("no server/server_events.jsonl: no record is joined to a server trace")
    else:
        missing = int(n - np.count_nonzero(joined))
        if missing:
            run.notes.append(f"{missing} of {n} records have no server trace (kept, flagged)")
    if run.device is None:
        run.notes.append("no server/device.jsonl: device columns and throttling are no data")
    note = coalesced_note(d)
    if note is not None:
        run.notes.append(note)
    return run


def load_run(uri: str, *, progress: Progress | None = None) -> RunData:
    """Read the run folder and join it: server breakdown per request, device as-of."""
    run = read_run_files(uri, progress=progress)
    if progress is not None:
        progress(f"joining {run.requests.num_rows} records with the server traces")
    return join_run(run)
