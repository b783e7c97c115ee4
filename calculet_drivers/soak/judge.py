"""A soak stage's pass conditions, judged from the run folder after the load.

Each condition has a class: `target` (the service under test, exit 1), `client` (this
load generator's own flatness, exit 1, as the stage asks for it) or `infrastructure`
(the measurement itself: exit 3 when nothing else failed). The target's conditions are
judged from its own samples: with gaps (calculet_drivers/soak/state.py) the leak per segment
between them, and over the joined series where the clocks are comparable.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from analysis.judge.resources import leak_segments
from analysis.stats.trend import theil_sen
from calculet_drivers.skeleton.finish import analyze
from calculet_drivers.skeleton.jsonl import read_rows
from calculet_drivers.soak.stage import PassConditions
from calculet_load.errors import EXIT_FAIL, EXIT_INFRA, EXIT_INVALID, EXIT_OK

# Spec §13's conditions that are acceptance rules (configs/acceptance/soak-*.yaml): each
# is a condition of the stage when the stage's rules have a rule of that kind
STAGE_RULES: dict[str, tuple[str, ...]] = {
    "SLA held": ("slo",),
    "recovery after each burst": ("burst_recovery",),
    "zero unrecovered device faults": ("device_faults",),
}
MIN_CLIENT_SAMPLES = 20  # client RSS samples needed to judge its slope
# ... and the real seconds they must span after the warmup: a process' own warmup
# (imports, connection pool, Parquet writer, allocator arenas) takes seconds of real time
# whatever the stage, and a per-hour slope over less is that warmup, not a trend
MIN_CLIENT_SPAN_S = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class StageResult:
    """What the judging reads besides the run folder's files."""

    run_dir: Path
    conditions: PassConditions
    scale: float  # real seconds per target second
    planned_real_s: float  # the stage's planned duration in real seconds
    hung_at_end: int  # requests still in flight after the hang limit
    rules: str | None  # acceptance rules for the analysis (None: the default)
    attempts: list[dict[str, Any]]  # soak/state.json's
    gaps: list[dict[str, Any]]
    golden_before: dict[str, Any] | None
    golden_after: dict[str, Any] | None


@dataclasses.dataclass(frozen=True, slots=True)
class Judgement:
    code: int
    verdict: str  # PASS, FAIL, INCOMPLETE or INVALID
    conditions: list[dict[str, Any]]
    notes: list[str]


def judge(r: StageResult) -> Judgement:
    """The stage's conditions, each with what was expected and what was seen."""
    p = r.conditions
    gaps, attempts = r.gaps, r.attempts
    conditions: list[dict[str, Any]] = []
    notes: list[str] = []

    def cond(name: str, cls: str, ok: bool | None, expected: Any, observed: Any) -> None:
        conditions.append({"condition": name, "class": cls, "ok": ok,
                           "expected": expected, "observed": observed})  # fmt: skip

    counts = disk_counts(r.run_dir)
    unknown = [
        {"worker": g["before_worker"], "lost_requests_at_least": g["lost_requests_at_least"],
         "in_flight_at_last_sample": g["in_flight_at_last_sample"]}
        for g in gaps if g.get("open_part_lost")
    ]  # fmt: skip
    sent = counts["sent"]
    rate = counts["errors"] / sent if sent else 0.0
    observed: dict[str, Any] = {"rate": round(rate, 6), "errors": counts["errors_by"],
                                **{k: counts[k] for k in ("sent", "ok", "errors", "dropped",
                                                          "cut_at_stop")}}  # fmt: skip
    if unknown:
        observed["not_on_disk"] = unknown  # lost with a killed attempt's open part
    cond("error rate", "target", rate <= p.max_error_rate, f"<= {p.max_error_rate:g}",
         observed)  # fmt: skip
    hang_limit = p.max_request_s * r.scale
    observed = {"longest_real_s": counts["longest_real_s"], "in_flight_at_end": r.hung_at_end}
    if unknown:
        observed["outcome_unknown"] = unknown
    cond(
        "no hang",
        "target",
        counts["longest_real_s"] <= hang_limit + 1.0 and r.hung_at_end == 0,
        f"every request ends within {p.max_request_s:g} target s, none left in flight",
        observed,
    )
    if p.no_abort:
        health = read_rows(r.run_dir / "soak" / "health.jsonl")
        failures = [h for h in health if h.get("status") != 200]
        observed = {"samples": len(health), "failures": len(failures), "first": failures[:3]}
        if gaps:
            observed["unsampled"] = [
                {"from": g["start"], "to": g["end"], "duration_s": g["duration_s"]} for g in gaps
            ]
        cond("no abort", "target", not failures,
             "/health 200 at every sample (the target's own samples; none in a gap)",
             observed)  # fmt: skip
    if p.golden:
        fails = (r.golden_before or {}).get("failures", []) + (r.golden_after or {}).get(
            "failures", []
        )
        cond("golden before and after", "target", not fails, "every case matches",
             fails or "all match")  # fmt: skip
    if p.client_rss_max_slope_mib_per_h is not None:
        gate = p.client_rss_max_slope_mib_per_h
        client = _client_slopes(r.run_dir / "client" / "resources.jsonl")
        judged = [s for s in client["segments"] if s.get("slope_mib_per_h") is not None]
        observed = client["segments"][0] if len(client["segments"]) == 1 else client
        cond("client memory flat", "client",
             all(memory_flat(s, p) for s in judged) if judged else None,
             f"RSS slope <= {gate:g} MiB/h, or a fitted rise under "
             f"{p.client_rss_min_rise_mib:g} MiB"
             + (" in each client process (not joined across a restart)" if gaps else ""),
             observed)  # fmt: skip
    analysis_code, judged_doc = _analysis(r.run_dir, r.rules)
    leaks, verdicts = judged_doc.get("leaks"), list(judged_doc.get("verdicts") or [])
    if isinstance(judged_doc.get("endurance"), dict):
        notes.append(endurance_note(judged_doc["endurance"]))
    for name, kinds in STAGE_RULES.items():
        judged = [v for v in verdicts if v.get("kind") in kinds]
        if judged:
            cond(name, "target", *_rule_condition(judged))
    if p.no_leak:
        cond(
            "no leak",
            "target",
            *_leak_condition(r.run_dir, r.rules, leaks, attempts, gaps),
        )
    if p.analysis:
        cls = "infrastructure" if analysis_code in (EXIT_INVALID, EXIT_INFRA) else "target"
        cond("analysis", cls, analysis_code == 0,
             "calculet-load analyze exits 0", {"exit_code": analysis_code})  # fmt: skip
    planned = r.planned_real_s
    gap_s = sum(g["duration_s"] for g in gaps)
    cond(
        "client continuity",
        "infrastructure",
        not gaps,
        "one client process ran the whole stage (no restart, no gap)",
        {"attempts": [a["worker"] for a in attempts], "gaps": len(gaps),
         "gap_real_s": round(gap_s, 3), "coverage": round(max(0.0, 1 - gap_s / planned), 4),
         "detail": [{k: g[k] for k in ("start", "end", "duration_s", "reason")}
                    for g in gaps]},
    )  # fmt: skip
    failed = {c["class"] for c in conditions if c["ok"] is False}
    if failed & {"target", "client"}:
        code, verdict = EXIT_FAIL, "FAIL"
    elif "infrastructure" in failed:
        code, verdict = EXIT_INFRA, "INCOMPLETE" if gaps else "INVALID"
    else:
        code, verdict = EXIT_OK, "PASS"
    if any(c["ok"] is None for c in conditions) and code == EXIT_OK:
        notes.append("some conditions could not be evaluated (see soak.json)")
    if gaps:
        notes.append(
            f"{len(gaps)} gap(s) in the stage ({gap_s:.1f} s real, "
            f"{gap_s / planned:.1%} of it): the client restarted; the target's conditions "
            "are judged from its own samples, the run is not a clean pass"
        )
    return Judgement(code, verdict, conditions, notes)


def _leak_condition(
    run_dir: Path,
    rules: str | None,
    leaks: dict[str, Any] | None,
    attempts: list[dict[str, Any]],
    gaps: list[dict[str, Any]],
) -> tuple[bool | None, str, dict[str, Any]]:
    """No leak: the analysis' leak section over the whole series; with gaps, also per
    segment (each client process' stretch of samples), and the whole series only
    where the samples' monotonic clocks are comparable (one boot of the host)."""
    rows = [
        {"series": k, "status": v.get("status"), "slope_per_h": v.get("slope_per_h"),
         "reason": v.get("reason")}
        for k, v in (leaks or {}).get("series", {}).items()
        if v.get("status") not in (None, "not_configured", "no_data")
    ]  # fmt: skip
    expected = "no resource series with a significant growth above its gate"
    observed: dict[str, Any] = {"resource_samples": (leaks or {}).get("samples", 0)}
    if not gaps:
        leaking = [r for r in rows if r["status"] == "leak"]
        observed.update(leaking=leaking, series=rows)
        return (not leaking if rows else None), expected, observed
    boots = {a.get("boot_id") for a in attempts}
    comparable = len(boots) == 1 and None not in boots
    joined = [r for r in rows if r["status"] == "leak"] if comparable else []
    segments = leak_segments(run_dir, rules, attempts)
    seg_leaks = [
        {"worker": s["worker"], **r} for s in segments for r in s["series"]
        if r["status"] == "leak"
    ]  # fmt: skip
    judged = (comparable and bool(rows)) or any(
        r["status"] in ("leak", "no_leak") for s in segments for r in s["series"]
    )
    observed.update(
        leaking=joined + seg_leaks,
        joined={
            "series": rows if comparable else [],
            "note": f"joined across {len(gaps)} gap(s): no samples in a gap, and no load"
            if comparable
            else "not judged: the host rebooted, the samples' clocks are not comparable",
        },
        segments=segments,
    )
    expected += " (per segment between gaps, and over the joined series)"
    ok = not (joined or seg_leaks) if judged else None
    return ok, expected, observed


def _rule_condition(verdicts: list[dict[str, Any]]) -> tuple[bool | None, str, dict[str, Any]]:
    """A stage condition from the analysis' verdicts of its rules: failed if one failed,
    passed if all passed, else not judged (inconclusive, or not configured)."""
    statuses = {v["status"] for v in verdicts}
    ok = False if "fail" in statuses else True if statuses == {"pass"} else None
    expected = "; ".join(f"{v['rule']}: {v['threshold']}" for v in verdicts)
    observed = {
        "rules": [{k: v.get(k) for k in ("rule", "status", "observed", "n", "reason")}
                  for v in verdicts]
    }  # fmt: skip
    return ok, expected, observed


def endurance_note(end: dict[str, Any]) -> str:
    """One line of §13's endurance observations (verdict.json's `endurance`)."""
    chips = [
        f"chip {c['chip']} {c['first']} → {c['last']} °C, slope {c['slope']} °C/h ({c['trend']})"
        for c in (end.get("temperature") or {}).get("chips") or []
        if c.get("samples")
    ]
    frag = end.get("fragmentation") or {}
    series = [
        f"{name} {t['first']} → {t['last']} {t['unit']}, slope {t['slope']}/h ({t['trend']})"
        for name, t in (frag.get("series") or {}).items()
    ]
    return (
        "endurance (§13): temperature: "
        + ("; ".join(chips) or "no device data")
        + "; KV fragmentation: "
        + ("; ".join(series) or "not reported by the target")
    )


def _analysis(run_dir: Path, rules: str | None) -> tuple[int, dict[str, Any]]:
    """`calculet-load analyze` on the run: its exit code and its verdict.json ({} when
    there is none)."""
    result = analyze(run_dir, rules=rules, quiet=True)
    code = int(result.detail["code"])
    verdict = run_dir / "verdict.json"
    doc = json.loads(verdict.read_text()) if verdict.exists() else {}
    return code, doc if isinstance(doc, dict) else {}


def disk_counts(run_dir: Path, workers: set[str] | None = None) -> dict[str, Any]:
    """Counts of the records on disk (every attempt's closed parts, or `workers`')."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    cols = ["ext.worker", "ext.dropped", "ext.error_class", "result.http_status",
            "result.error_code", "client_ns.request_start", "client_ns.response_end",
            "client_ns.last_token", "client_ns.first_event"]  # fmt: skip
    out: dict[str, Any] = {"records": 0, "sent": 0, "ok": 0, "errors": 0, "dropped": 0,
                           "cut_at_stop": 0, "errors_by": {}, "longest_real_s": 0.0,
                           "by_worker": {}}  # fmt: skip
    for part in sorted((run_dir / "client").glob("*/part-*.requests.parquet")):
        if workers is not None and part.parent.name not in workers:
            continue
        t = pq.read_table(part, columns=cols)
        n = t.num_rows
        dropped = np.asarray(pc.fill_null(t.column("ext.dropped"), False), dtype=bool)
        cls = t.column("ext.error_class").to_pylist()
        ok = np.array([c is None for c in cls], dtype=bool)
        cut = np.array([c == "cancelled" for c in cls], dtype=bool)
        err = ~ok & ~dropped & ~cut
        out["records"] += n
        out["dropped"] += int(dropped.sum())
        out["sent"] += int((~dropped).sum())
        out["ok"] += int(ok.sum())
        out["cut_at_stop"] += int(cut.sum())
        out["errors"] += int(err.sum())
        if err.any():
            st_, code = (
                t.column("result.http_status").to_pylist(),
                t.column("result.error_code").to_pylist(),
            )
            for i in np.flatnonzero(err):
                key = f"{st_[i]}:{code[i]}"
                out["errors_by"][key] = out["errors_by"].get(key, 0) + 1
        start = t.column("client_ns.request_start").to_numpy(zero_copy_only=False)
        end = None
        for name in ("client_ns.response_end", "client_ns.last_token",
                     "client_ns.first_event"):  # fmt: skip
            col = t.column(name).to_numpy(zero_copy_only=False)
            end = col if end is None else np.where(np.isnan(end.astype(float)), col, end)
        if end is not None and n:
            d = (end.astype(float) - start.astype(float)) / 1e9
            d = d[~np.isnan(d)]
            if d.size:
                out["longest_real_s"] = max(out["longest_real_s"], float(d.max()))
        w = part.parent.name
        out["by_worker"][w] = out["by_worker"].get(w, 0) + n
    out["longest_real_s"] = round(out["longest_real_s"], 3)
    return out


def _client_slope(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Theil–Sen slope of one client process' RSS (MiB per real hour), after a 10%
    warmup (the analysis's estimator)."""
    if len(rows) < MIN_CLIENT_SAMPLES:
        return {"samples": len(rows), "slope_mib_per_h": None,
                "reason": f"fewer than {MIN_CLIENT_SAMPLES} samples: not judged"}  # fmt: skip
    t = [(r["mono_ns"] - rows[0]["mono_ns"]) / 1e9 for r in rows]
    y = [r["rss_bytes"] / 2**20 for r in rows]
    keep = [i for i, ti in enumerate(t) if ti >= 0.1 * t[-1]]
    out: dict[str, Any] = {
        "samples": len(rows),
        "span_real_s": round(t[-1], 1),
        "first_mib": round(y[0], 1),
        "last_mib": round(y[-1], 1),
        "max_mib": round(max(y), 1),
    }
    if t[-1] - t[keep[0]] < MIN_CLIENT_SPAN_S:
        out["slope_mib_per_h"] = None
        out["reason"] = (
            f"{t[-1] - t[keep[0]]:.1f} s after the warmup, under {MIN_CLIENT_SPAN_S:g} s of "
            "real time: not judged (the process' own warmup would be taken for a trend)"
        )
        return out
    fit = theil_sen([t[i] for i in keep], [y[i] for i in keep])
    out["slope_mib_per_h"] = round(float(fit.slope) * 3600.0, 3)
    # the rise the fit gives over the judged span: what the per-hour slope is made of
    out["rise_mib"] = round(float(fit.slope) * (t[-1] - t[keep[0]]), 3)
    return out


def memory_flat(segment: dict[str, Any], p: PassConditions) -> bool:
    """A judged client process' RSS is flat: its slope under the gate, or the rise it
    fits over the judged span under the allocators' step."""
    gate = p.client_rss_max_slope_mib_per_h
    slope_ok = gate is None or segment["slope_mib_per_h"] <= gate
    return slope_ok or segment["rise_mib"] < p.client_rss_min_rise_mib


def _client_slopes(path: Path) -> dict[str, Any]:
    """The RSS slope of each client process (attempt) separately: a restarted process
    starts small, and joining it to the killed one would fake a drop or a rise."""
    rows = read_rows(path)
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(str(r.get("worker", "w00")), []).append(r)
    segments = [{"worker": w, **_client_slope(rs)} for w, rs in by.items()]
    if not segments:
        segments = [{"worker": None, **_client_slope([])}]
    return {"samples": len(rows), "segments": segments}
