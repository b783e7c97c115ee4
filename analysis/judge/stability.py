"""The §13 stage conditions that are rules: recovery after each burst (candidate,
release) and zero unrecovered device faults (release). The SLA is `slo` rules and
"resources stable" the `leaks` rule; the soak stages name their rules file.

**Burst recovery** (`burst_recovery`), per burst (the records sharing `ext.burst_id`,
on the server's wall clock of the join: `join.wall_start_ns`/`join.wall_end_ns`):

    t_b    the burst's first request start;  t_e  its last request end
    L      median `metric` of the background requests (not of a burst, successful,
           measured or throttled) started in [t_b − baseline_s, t_b)
    t_r    the start of the first background request after t_b from which
           `settle_requests` in a row have `metric` ≤ (1 + tolerance) · L
    recovery = max(t_e, t_r) − t_b          in server seconds (÷ time scale)

With no background request around the burst (a burst cell alone) the recovery is the
burst's drain, t_e − t_b. A burst whose background never settles before the next burst
(or the run's end) has not recovered.

**Device faults** (`device_faults`), from server_events.jsonl on the server's monotonic
clock: runtime_error, reset and a state change to recovering/resetting/failed are
faults; consecutive faults before a recovery form one episode. The episode recovers at
the next state change to ready or, when no fault of it changed the state, at the next
request finished. Unrecovered: no recovery in the trace, or later than max_recovery_s.

**Endurance** (`endurance_section`, verdict.json's `endurance`): the temperature drift
of each chip and the long-run KV fragmentation signals (free blocks, largest free
extent) where the target reports them, as trends: first and last tenth, Theil–Sen slope
per server hour with its interval, after a tenth of warmup.

Time is server time: the run's `time_scale` (server/resources.jsonl; 1 without it)
turns a time-scaled rehearsal's real seconds into the seconds the stage states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow.compute as pc

from analysis.judge.evidence import Context, column_np, not_evaluated, verdict_for
from analysis.judge.rules import BurstRecoveryRule, DeviceFaultsRule
from analysis.judge.verdict import RuleVerdict, Status
from analysis.stats.trend import theil_sen
from analysis.tables.load import RunData
from analysis.tables.runfiles import RunFiles

__all__ = [
    "FAULT_EVENTS",
    "FRAGMENTATION_SERIES",
    "HANDLERS",
    "burst_recoveries",
    "device_fault_episodes",
    "endurance_section",
    "time_scale",
]

FAULT_EVENTS = ("runtime_error", "reset", "state_change")
_FAULT_STATES = ("recovering", "resetting", "failed")
_SCAN_LIMIT = 200_000


def time_scale(run: RunData) -> float:
    """Real seconds per server second: the median `time_scale` the resource samples
    recorded (a time-scaled simulator), else 1."""
    t = run.resources
    if t is None or t.num_rows == 0 or "time_scale" not in t.column_names:
        return 1.0
    v = column_np(t.column("time_scale"), np.nan, float)
    v = v[np.isfinite(v) & (v > 0)]
    return float(np.median(v)) if v.size else 1.0


def burst_recoveries(ctx: Context, rule: BurstRecoveryRule) -> list[dict[str, Any]]:
    """One entry per burst: its id, size, server-time start, drain and recovery (s)."""
    t = ctx.candidate.table
    if "ext.burst_id" not in t.column_names:
        return []
    scale = time_scale(ctx.candidate.run)
    burst = column_np(t.column("ext.burst_id"), "", object)
    start, end = _ns_from_first(t.column("join.wall_start_ns"), t.column("join.wall_end_ns"))
    part = column_np(t.column("quality.partition"), "", object)
    ok = column_np(pc.is_null(t.column("ext.error_class")), False, bool)
    values = column_np(pc.cast(t.column(_column(rule.metric)), "float64"), np.nan, float)
    background = (
        (burst == "")
        & ok
        & np.isin(part, ("measured", "throttled"))
        & np.isfinite(start)
        & np.isfinite(values)
    )
    order = np.flatnonzero(background)[np.argsort(start[background], kind="stable")]
    b_start, b_val = start[order], values[order]
    ids = sorted({str(b) for b in burst if b}, key=lambda b: np.nanmin(start[burst == b]))
    t0s = [float(np.nanmin(start[burst == b])) for b in ids]
    out = []
    for i, bid in enumerate(ids):
        mine = burst == bid
        t_b, t_e = t0s[i], float(np.nanmax(np.where(np.isfinite(end), end, start)[mine]))
        t_next = t0s[i + 1] if i + 1 < len(ids) else np.inf
        window = rule.baseline_s * scale * 1e9
        before = (b_start >= t_b - window) & (b_start < t_b)
        after = np.flatnonzero((b_start >= t_b) & (b_start < t_next))
        entry: dict[str, Any] = {
            "burst": bid,
            "size": int(mine.sum()),
            "failed": int((mine & ~ok).sum()),
            "start_s": None,
            "drain_s": round((t_e - t_b) / 1e9 / scale, 3),
            "baseline_ms": None,
            "baseline_n": int(before.sum()),
            "recovery_s": None,
            "how": "",
        }
        if not before.any() and after.size == 0:
            entry["recovery_s"] = entry["drain_s"]
            entry["how"] = "no background load: the burst's drain"
        elif before.sum() < rule.min_baseline_requests:
            entry["how"] = (
                f"only {int(before.sum())} background request(s) in the {rule.baseline_s:g} s "
                f"before the burst (< {rule.min_baseline_requests}): no reference level"
            )
        else:
            level = float(np.median(b_val[before]))
            limit = level * (1 + rule.tolerance)
            entry["baseline_ms"] = round(level, 3)
            good = b_val[after] <= limit
            k = rule.settle_requests
            settled = next(
                (j for j in range(max(0, good.size - k + 1)) if good[j : j + k].all()), None
            )
            if settled is None:
                until = "the next burst" if i + 1 < len(ids) else "the end"
                entry["how"] = (
                    f"{rule.metric} never came back to ≤ {limit:.3f} ms for {k} background "
                    f"requests in a row before {until} ({after.size} started after the burst)"
                )
            else:
                t_r = float(b_start[after[settled]])
                entry["recovery_s"] = round((max(t_e, t_r) - t_b) / 1e9 / scale, 3)
                entry["how"] = f"{rule.metric} ≤ {limit:.3f} ms again, {k} in a row"
        out.append(entry)
    t_first = min(t0s) if t0s else 0.0
    for e, t_b in zip(out, t0s, strict=True):
        e["start_s"] = round((t_b - t_first) / 1e9 / scale, 3)
    return out


def _ns_from_first(*cols: Any) -> list[Any]:
    """Integer wall ns columns as float ns since the earliest of their values (NaN where
    null): a float holds differences, not 1.7e18 ns to the unit."""
    ints = [column_np(c, 0, np.int64) for c in cols]
    valid = [column_np(pc.is_valid(c), False, bool) for c in cols]
    first = min((int(v[ok].min()) for v, ok in zip(ints, valid, strict=True) if ok.any()),
                default=0)  # fmt: skip
    return [
        np.where(ok, (v - first).astype(np.float64), np.nan)
        for v, ok in zip(ints, valid, strict=True)
    ]


def _column(metric: str) -> str:
    from analysis.tables.cells import METRICS

    return next(str(m.column) for m in METRICS if m.name == metric)


def _burst_recovery(rule: BurstRecoveryRule, ctx: Context) -> list[RuleVerdict]:
    threshold = f"every burst recovered within {rule.max_recovery_s:g} s (server time)"
    bursts = burst_recoveries(ctx, rule)
    if not bursts:
        return [not_evaluated(rule, "no data: no burst in this run", threshold=threshold)]
    late = [b for b in bursts if b["recovery_s"] is None or b["recovery_s"] > rule.max_recovery_s]
    worst = max((b["recovery_s"] for b in bursts if b["recovery_s"] is not None), default=None)
    if late:
        b = late[0]
        seen = (
            f"not recovered ({b['how']})"
            if b["recovery_s"] is None
            else f"recovered after {b['recovery_s']:g} s ({b['how']})"
        )
        return [
            verdict_for(
                rule,
                Status.FAIL,
                worst,
                threshold,
                len(bursts),
                f"{len(late)} of {len(bursts)} bursts not recovered within "
                f"{rule.max_recovery_s:g} s; first: burst {b['burst']} (size {b['size']}) "
                f"{seen}: find what the burst left behind (queue, KV, leases) in the server "
                "trace around it",
                bursts,
            )
        ]
    return [
        verdict_for(
            rule,
            Status.PASS,
            worst,
            threshold,
            len(bursts),
            f"all {len(bursts)} bursts recovered; slowest after {worst:g} s "
            f"(allowed {rule.max_recovery_s:g} s)",
            bursts,
        )
    ]


def device_fault_episodes(run: RunData, rule: DeviceFaultsRule) -> list[dict[str, Any]] | None:
    """The fault episodes of the run's server trace (None: no server_events.jsonl)."""
    scan = RunFiles(run.uri).scan_server_events(
        (*FAULT_EVENTS, "fault_armed", "fault_cleared"), _SCAN_LIMIT
    )
    if scan is None:
        return None
    scale = time_scale(run)
    rows = sorted(
        (r for r in scan.rows if isinstance(r.get("mono_ns"), int)), key=lambda r: r["mono_ns"]
    )
    finished = np.zeros(0, dtype=np.int64)
    ev = run.server_events
    if ev is not None and ev.num_rows:
        names = column_np(ev.column("event"), "", object)
        mono = column_np(ev.column("mono_ns"), -1, np.int64)
        finished = np.sort(mono[(names == "finished") & (mono >= 0)])
    armed = 0
    episodes: list[dict[str, Any]] = []
    open_: dict[str, Any] | None = None
    for r in rows:
        name, t = str(r["event"]), int(r["mono_ns"])
        detail: dict[str, Any] = r["detail"] if isinstance(r.get("detail"), dict) else {}
        to = detail.get("to") if name == "state_change" else None
        if name == "fault_armed":
            armed += 1
            continue
        if name == "fault_cleared":
            armed = max(0, armed - 1)
            continue
        if to == "ready" and open_ is not None:
            open_["recovered_at_ns"], open_["recovered_by"] = t, "state_change to ready"
            open_ = None
            continue
        is_fault = name in ("runtime_error", "reset") or to in _FAULT_STATES
        if not is_fault:
            continue
        if open_ is not None and not open_["state_changed"]:
            # a fault that changed no state is over once a request was served after it
            i = int(np.searchsorted(finished, open_["start_ns"], side="right"))
            if i < finished.size and finished[i] < t:
                open_["recovered_at_ns"], open_["recovered_by"] = (
                    int(finished[i]),
                    "a request finished",
                )
                open_ = None
        if open_ is None:
            open_ = {"start_ns": t, "events": [], "state_changed": False,
                     "injected": armed > 0, "recovered_at_ns": None,
                     "recovered_by": None}  # fmt: skip
            episodes.append(open_)
        open_["events"].append(name if to is None else f"state_change to {to}")
        open_["state_changed"] |= name == "reset" or to is not None
        open_["injected"] |= armed > 0
    t_first = int(rows[0]["mono_ns"]) if rows else 0
    for e in episodes:
        if e["recovered_at_ns"] is None and not e["state_changed"]:
            i = int(np.searchsorted(finished, e["start_ns"], side="right"))
            if i < finished.size:
                e["recovered_at_ns"], e["recovered_by"] = int(finished[i]), "a request finished"
        rec = e.pop("recovered_at_ns")
        e["recovery_s"] = None if rec is None else round((rec - e["start_ns"]) / 1e9 / scale, 3)
        e["at_s"] = round((e.pop("start_ns") - t_first) / 1e9 / scale, 3)
        e["recovered"] = e["recovery_s"] is not None and e["recovery_s"] <= rule.max_recovery_s
        e["events"] = e["events"][:10]
    return episodes


def _device_faults(rule: DeviceFaultsRule, ctx: Context) -> list[RuleVerdict]:
    threshold = (
        f"at most {rule.max_unrecovered} device fault(s) not recovered within "
        f"{rule.max_recovery_s:g} s (server time)"
    )
    episodes = device_fault_episodes(ctx.candidate.run, rule)
    if episodes is None:
        return [not_evaluated(rule, "no data: no server/server_events.jsonl", threshold=threshold)]
    injected = [e for e in episodes if e["injected"]] if rule.exclude_injected else []
    judged = [e for e in episodes if not (rule.exclude_injected and e["injected"])]
    bad = [e for e in judged if not e["recovered"]]
    details = judged + [{**e, "note": "while a fault was armed: left to the fault matrix"}
                        for e in injected]  # fmt: skip
    also = f"; {len(injected)} while a fault was armed (the fault matrix's)" if injected else ""
    if len(bad) > rule.max_unrecovered:
        e = bad[0]
        how = (
            "never recovered in the trace"
            if e["recovery_s"] is None
            else f"recovered only after {e['recovery_s']:g} s"
        )
        return [
            verdict_for(
                rule,
                Status.FAIL,
                len(bad),
                threshold,
                len(judged),
                f"{len(bad)} unrecovered device fault(s) of {len(judged)}{also}; first at "
                f"{e['at_s']:g} s ({', '.join(e['events'])}): {how}; read the server's "
                "lifecycle events (report: resets) and its health around it",
                details,
            )
        ]
    seen = (
        f"{len(judged)} device fault(s), all recovered within {rule.max_recovery_s:g} s"
        if judged
        else "no device fault in the server trace"
    )
    return [verdict_for(rule, Status.PASS, len(bad), threshold, len(judged), seen + also, details)]


def _trend(t_s: Any, y: Any, per: float) -> dict[str, Any]:
    """First and last tenth's means, Theil–Sen slope (per `per` seconds) with its
    interval, after a warmup of the first tenth of the span (§13: never the final value
    alone). Fewer than 5 values: the figures, no slope."""
    ok = np.isfinite(y)
    t_s, y = t_s[ok], y[ok]
    out: dict[str, Any] = {"samples": int(y.size), "first": None, "last": None,
                           "min": None, "max": None, "change": None, "slope": None,
                           "slope_lo": None, "slope_hi": None, "trend": "no data"}  # fmt: skip
    if not y.size:
        return out
    span = float(t_s.max() - t_s.min())
    keep = t_s >= t_s.min() + 0.1 * span
    tk, yk = t_s[keep], y[keep]
    tenth = max(1, yk.size // 10)
    first, last = float(np.mean(yk[:tenth])), float(np.mean(yk[-tenth:]))
    out.update(first=round(first, 3), last=round(last, 3), min=round(float(y.min()), 3),
               max=round(float(y.max()), 3), change=round(last - first, 3))  # fmt: skip
    if yk.size < 5 or span <= 0:
        out["trend"] = "too few samples"
        return out
    fit = theil_sen(tk, yk)
    out.update(slope=round(fit.slope * per, 4), slope_lo=round(fit.low * per, 4),
               slope_hi=round(fit.high * per, 4))  # fmt: skip
    out["trend"] = "rising" if fit.low > 0 else "falling" if fit.high < 0 else "flat"
    return out


FRAGMENTATION_SERIES = {
    "kv_free_blocks": "blocks",
    "kv_largest_free_extent_tokens": "tokens",
}


def endurance_section(run: RunData) -> dict[str, Any]:
    """§13 endurance: per chip the temperature drift over the run (device.jsonl), and
    the long-run KV fragmentation signals where the target reports them
    (server/resources.jsonl: free KV blocks, largest free extent), each as a trend over
    server hours; `reported: false` and why where the run has neither."""
    scale = time_scale(run)
    hour = 3600.0
    temps: list[dict[str, Any]] = []
    dev = run.device
    if dev is not None and dev.num_rows:
        chips = dev.column("chips")
        flat = pc.list_flatten(chips)
        parent = np.asarray(pc.list_parent_indices(chips), dtype=np.int64)
        mono = column_np(dev.column("mono_ns"), 0, np.int64)
        t_s = (mono[parent] - mono.min()).astype(np.float64) / 1e9 / scale
        chip = column_np(pc.struct_field(flat, "chip"), -1, np.int64)
        temp = column_np(pc.struct_field(flat, "temperature_c"), np.nan, np.float64)
        for c in sorted(set(chip.tolist()) - {-1}):
            mine = chip == c
            temps.append({"chip": c, "unit": "°C", "per": "hour",
                          **_trend(t_s[mine], temp[mine], hour)})  # fmt: skip
    frag: dict[str, Any] = {}
    res = run.resources
    if res is not None and res.num_rows:
        mono = column_np(res.column("mono_ns"), 0, np.int64)
        t_s = (mono - mono.min()).astype(np.float64) / 1e9 / scale
        for name, unit in FRAGMENTATION_SERIES.items():
            if name not in res.column_names:
                continue
            y = column_np(pc.cast(res.column(name), "float64"), np.nan, np.float64)
            if np.isfinite(y).any():
                frag[name] = {"unit": unit, "per": "hour", **_trend(t_s, y, hour)}
    return {
        "time_scale": scale,
        "temperature": {
            "reported": bool(temps) and any(t["samples"] for t in temps),
            "chips": temps,
            "note": None if temps else "no server/device.jsonl: temperature drift is no data",
        },
        "fragmentation": {
            "reported": bool(frag),
            "series": frag,
            "note": None
            if frag
            else "the target reports no KV fragmentation signal (free KV blocks: "
            "calculet_kv_free_blocks; largest free extent: "
            "calculet_kv_largest_free_extent_tokens; or /admin/state kv.free_blocks, "
            "kv.largest_free_extent_tokens): long-run fragmentation is not observable "
            "here, only KV allocated and the leak trends",
        },
    }


HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {
    "burst_recovery": _burst_recovery,
    "device_faults": _device_faults,
}
