"""Resource leaks over a run (spec §13), from `server/resources.jsonl`.

The harness samples the server during the run (calculet_load.target.resources: its /metrics
and /admin/state) into rows of `calculet_load.schema.ResourceRow`. The series judged:

    rss_bytes            server process resident memory
    device_memory_mib    device memory used, summed over chips
    leases_unavailable   OutputBuf leases not free: leases_total − leases_free (held,
                         quarantined, leaked)
    kv_allocated_tokens  KV reserved by sequences
    fds, threads         server process file descriptors and threads

Each series goes through analysis.stats.trend.detect_leak (warmup dropped, bin means,
Theil–Sen slope, Mann–Kendall with the Hamed–Rao correction, magnitude gate) with the
rule's gate for that resource. Time is **server time**: a sample's monotonic offset
divided by the simulator's `time_scale` (a rehearsal at time scale 0.02 runs 50 server
seconds per second), 1 for a real server; slopes are per hour of server time, so a gate
means the same in a rehearsal as in the soak it stands for.

**Idle baseline** (§13: "KV and leases return to baseline after each sequence"): in
every sample where no sequence is active and none is queued, KV allocated and leases
held must be 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.judge.evidence import Context, not_evaluated, verdict_for
from analysis.judge.rules import LEAK_SERIES, LeakRule, load_rules
from analysis.judge.verdict import RuleVerdict, Status, TooShort
from analysis.stats.trend import LEAK_METHOD, MIN_BINS, LeakResult, LeakStatus, detect_leak
from analysis.tables.load import RunData
from analysis.tables.runfiles import RunFiles
from calculet_load.clock import wall_iso

__all__ = [
    "HANDLERS",
    "LEAK_SERIES",
    "leak_results",
    "leak_section",
    "leak_segments",
    "resource_series",
]

"""The judged series and their units (the rule's gates are in these units per hour)."""

_FILE = "server/resources.jsonl"


def _col(t: pa.Table, name: str) -> Any:
    return np.asarray(
        pc.fill_null(pc.cast(t.column(name), pa.float64()), np.nan).to_numpy(zero_copy_only=False),
        dtype=np.float64,
    )


def resource_series(t: pa.Table) -> tuple[Any, dict[str, Any], float]:
    """(server seconds since the first sample, {series: values}, time scale) of the
    resources table, in sample order; a value not sampled is NaN."""
    mono_ok = np.asarray(pc.is_valid(t.column("mono_ns")), dtype=bool)
    name = "mono_ns" if mono_ok.all() else "wall_ns"
    clock = np.asarray(pc.fill_null(t.column(name), 0).to_numpy(zero_copy_only=False), np.int64)
    order = np.argsort(clock, kind="stable")
    scales = _col(t, "time_scale")
    scales = scales[~np.isnan(scales) & (scales > 0)]
    scale = float(np.median(scales)) if scales.size else 1.0
    t_s = (clock[order] - clock[order][0]).astype(np.float64) / 1e9 / scale
    series = {name: _col(t, name)[order] for name in LEAK_SERIES if name in t.column_names}
    series["leases_unavailable"] = (_col(t, "leases_total") - _col(t, "leases_free"))[order]
    return t_s, series, scale


def leak_results(run: RunData, rule: LeakRule) -> dict[str, LeakResult | None]:
    """Per gated series: its LeakResult, None when the series was never sampled."""
    out: dict[str, LeakResult | None] = {}
    t = run.resources
    if t is None or t.num_rows == 0:
        return {name: None for name in rule.min_slope_per_h}
    t_s, series, _ = resource_series(t)
    for name, gate in rule.min_slope_per_h.items():
        y = series[name]
        ok = ~np.isnan(y)
        if not ok.any():
            out[name] = None
            continue
        out[name] = detect_leak(
            t_s[ok],
            y[ok],
            min_slope_per_h=gate,
            warmup_s=rule.warmup_s,
            bin_s=rule.bin_s,
            alpha=rule.alpha,
            unit=LEAK_SERIES[name],
            resource=name,
        )
    return out


def _idle(run: RunData) -> dict[str, Any] | None:
    """Samples with nothing active or queued, and those still holding KV or leases."""
    t = run.resources
    if t is None or t.num_rows == 0:
        return None
    active, queued = _col(t, "sequences_active"), _col(t, "requests_queued")
    kv, leases = _col(t, "kv_allocated_tokens"), _col(t, "leases")
    idle = (active == 0) & (queued == 0)
    held = idle & ((kv > 0) | (leases > 0))
    first = int(np.flatnonzero(held)[0]) if held.any() else None
    return {
        "idle_samples": int(np.count_nonzero(idle)),
        "samples_holding": int(np.count_nonzero(held)),
        "first_holding": None
        if first is None
        else {
            "sample": first,
            "kv_allocated_tokens": float(kv[first]),
            "leases": float(leases[first]),
        },
    }


def _cached(ctx: Context, rule: LeakRule) -> dict[str, LeakResult | None]:
    key = ("leaks", rule.model_dump_json())
    if key not in ctx.cache:
        ctx.cache[key] = leak_results(ctx.candidate.run, rule)
    result: dict[str, LeakResult | None] = ctx.cache[key]
    return result


def leak_section(ctx: Context, rule: LeakRule | None) -> dict[str, Any] | None:
    """The `leaks` section of verdict.json (None: no server/resources.jsonl)."""
    t = ctx.candidate.run.resources
    if t is None or t.num_rows == 0:
        return None
    t_s, series, scale = resource_series(t)
    gated = _cached(ctx, rule) if rule is not None else {}
    out: dict[str, Any] = {}
    for name, unit in LEAK_SERIES.items():
        y = series.get(name)
        ok = ~np.isnan(y) if y is not None else np.zeros(0, dtype=bool)
        entry: dict[str, Any] = {
            "unit": unit,
            "samples": int(np.count_nonzero(ok)),
            "first": float(y[ok][0]) if ok.any() and y is not None else None,
            "last": float(y[ok][-1]) if ok.any() and y is not None else None,
            "max": float(y[ok].max()) if ok.any() and y is not None else None,
        }
        res = gated.get(name)
        if res is not None:
            entry.update(dataclasses.asdict(res))
            entry.pop("method", None)
        elif name not in gated:
            entry["status"] = "not_configured" if ok.any() else "no_data"
        else:
            entry["status"] = "no_data"
        out[name] = entry
    return {
        "file": _FILE,
        "samples": t.num_rows,
        "span_server_s": float(t_s[-1]) if t_s.size else 0.0,
        "time_scale": scale,
        "method": LEAK_METHOD,
        "series": out,
        "idle_baseline": _idle(ctx.candidate.run),
    }


def _series_verdict(
    rule: LeakRule, name: str, res: LeakResult | None, scale: float = 1.0
) -> RuleVerdict:
    unit = LEAK_SERIES[name]
    gate = rule.min_slope_per_h[name]
    threshold = f"{name} slope < {gate:g} {unit}/h (or not significant at {rule.alpha:g})"
    suffix = f".{name}"
    if res is None:
        return not_evaluated(
            rule,
            f"no data: {name} not sampled (server/resources.jsonl: sample the server during "
            "the run, calculet_load.target.resources)",
            threshold=threshold,
            suffix=suffix,
        )
    details = [dataclasses.asdict(res)]
    if res.status is LeakStatus.INSUFFICIENT_DATA:
        return verdict_for(
            rule,
            Status.INCONCLUSIVE,
            None,
            threshold,
            res.n_bins,
            f"{res.reason}: sample longer or more often",
            details,
            suffix=suffix,
            # the series' span is in server seconds; the run's is that × the time scale
            too_short=TooShort(
                f"≥ {MIN_BINS} bins of resource samples",
                None if res.min_span_s is None else res.min_span_s * scale,
            ),
        )
    if res.status is LeakStatus.LEAK:
        return verdict_for(
            rule,
            Status.FAIL,
            res.slope_per_h,
            threshold,
            res.n_bins,
            f"{res.reason}: find what holds {name} (a per-request allocation not released); "
            "compare the slope with the request rate",
            details,
            suffix=suffix,
        )
    return verdict_for(
        rule, Status.PASS, res.slope_per_h, threshold, res.n_bins, res.reason, details,
        suffix=suffix,
    )  # fmt: skip


def _leaks(rule: LeakRule, ctx: Context) -> list[RuleVerdict]:
    results = _cached(ctx, rule)
    t = ctx.candidate.run.resources
    scale = resource_series(t)[2] if t is not None and t.num_rows else 1.0
    out = [_series_verdict(rule, name, res, scale) for name, res in results.items()]
    if not rule.idle_baseline:
        return out
    idle = _idle(ctx.candidate.run)
    suffix = ".idle_baseline"
    threshold = "KV allocated = 0 and leases = 0 when idle"
    if idle is None or idle["idle_samples"] == 0:
        why = "no resource samples" if idle is None else "no sample taken while idle"
        out.append(
            not_evaluated(
                rule,
                f"no data: {why}; sample between cells and after the run",
                threshold=threshold,
                suffix=suffix,
            )
        )
    elif idle["samples_holding"]:
        f = idle["first_holding"]
        out.append(
            verdict_for(
                rule,
                Status.FAIL,
                idle["samples_holding"],
                threshold,
                idle["idle_samples"],
                f"{idle['samples_holding']} of {idle['idle_samples']} idle samples still held "
                f"resources (first: KV {f['kv_allocated_tokens']:g} tokens, {f['leases']:g} "
                "leases): a finished or cancelled sequence did not release them",
                [idle],
                suffix=suffix,
            )
        )
    else:
        out.append(
            verdict_for(
                rule,
                Status.PASS,
                0,
                threshold,
                idle["idle_samples"],
                f"KV and leases at 0 in all {idle['idle_samples']} idle samples",
                [idle],
                suffix=suffix,
            )
        )
    return out


HANDLERS: dict[str, Callable[[Any, Context], list[RuleVerdict]]] = {"leaks": _leaks}


def leak_segments(
    run_dir: Path, rules_path: str | None, attempts: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The leak rule on each attempt's stretch of server/resources.jsonl."""
    rules, _ = load_rules(rules_path)
    rule = next((r for r in rules.rules if r.kind == "leaks" and r.enabled), None)
    if rule is None:
        return []
    rows = RunFiles(str(run_dir)).read_jsonl("server/resources.jsonl") or []
    starts = [int(a["started_wall_ns"]) for a in attempts] + [2**63]
    out = []
    for i, a in enumerate(attempts):
        seg = [r for r in rows if starts[i] <= int(r.get("wall_ns", 0)) < starts[i + 1]]
        if not seg:
            continue
        t_s, series, _ = resource_series(pa.Table.from_pylist(seg))
        entry: dict[str, Any] = {
            "worker": a["worker"],
            "from": wall_iso(int(seg[0]["wall_ns"])),
            "to": wall_iso(int(seg[-1]["wall_ns"])),
            "samples": len(seg),
            "span_server_s": round(float(t_s[-1]), 1) if len(t_s) else 0.0,
            "series": [],
        }
        for name, gate in rule.min_slope_per_h.items():
            y = series.get(name)
            if y is None or not (~np.isnan(y)).any():
                continue
            ok = ~np.isnan(y)
            res = detect_leak(t_s[ok], y[ok], min_slope_per_h=gate, warmup_s=rule.warmup_s,
                              bin_s=rule.bin_s, alpha=rule.alpha, unit=LEAK_SERIES[name],
                              resource=name)  # fmt: skip
            entry["series"].append(
                {"series": name, "status": str(res.status),
                 "slope_per_h": res.slope_per_h, "reason": res.reason}
            )  # fmt: skip
        out.append(entry)
    return out
