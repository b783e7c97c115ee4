# size: §16: one evidence table per kind of counter-example
"""The counter-examples every report shows (spec §16): the 20 slowest requests with
their server breakdown, every non-success (client-side and in the server's runtime,
even when a retry succeeded), every reset/reconfigure with its recovery time, the
excluded samples with their reasons, and the long-context TPOT curve."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from analysis.tables.join import positions
from analysis.tables.runfiles import LIFECYCLE_EVENTS, RUNTIME_EVENTS, ServerScan, redact
from analysis.tables.vendor import GRAPH_SERVICE_ONLY
from analysis.views import plots
from analysis.views.model import (
    DASH,
    RunView,
    Section,
    cap_rows,
    figure,
    fmt_int,
    fmt_ms,
    fmt_rel,
    table,
)

__all__ = [
    "BREAKDOWN",
    "SLOWEST",
    "excluded_section",
    "long_context_section",
    "nonsuccess_section",
    "resets_section",
    "runtime_section",
    "slowest_section",
]

SLOWEST = 20
_MAX_ROWS = 200
_FOLD = 25  # a longer list is shown collapsed, below its counts
_SCATTER = 1000  # requests drawn in the TPOT-vs-context scatter
_DETAIL_CHARS = 200
BREAKDOWN = (
    "queue",
    "prefill (host)",
    "prefill (device)",
    "decode (host)",
    "decode (device)",
    "post-process",
    "unattributed",
    "no server trace",
    "trace inconsistent",
)
_COLORS = {
    "queue": "#9467bd",
    "prefill (host)": "#aec7e8",
    "prefill (device)": "#1f77b4",
    "decode (host)": "#98df8a",
    "decode (device)": "#2ca02c",
    "post-process": "#ff7f0e",
    "unattributed": "#7f7f7f",
    "no server trace": "#d62728",
    "trace inconsistent": "#e377c2",
}
_TOLERANCE_MS = 1.0


def _short(text: str, n: int = _DETAIL_CHARS) -> str:
    return text if len(text) <= n else text[:n] + "…"


def slowest_section(rv: RunView) -> Section:
    s = Section("slowest", f"The {SLOWEST} slowest requests")
    if rv.table is None:
        return s.empty(rv.load_error or "no request records")
    e2e = rv.col("durations_ms.e2e")
    sel = np.flatnonzero(rv.success() & rv.partition_in("measured", "throttled") & np.isfinite(e2e))
    if sel.size == 0:
        return s.empty("no successful measured request")
    top = sel[np.argsort(-e2e[sel], kind="stable")[:SLOWEST]]
    c = {
        k: rv.col(k)[top]
        for k in (
            "durations_ms.ttft",
            "server_ms.queue",
            "join.slot_wait_ms",
            "join.admission_wait_ms",
            "server_ms.prefill",
            "server_ms.decode_total",
            "server_ms.postprocess",
            "runtime_ms.infer_prefill",
            "runtime_ms.infer_decode",
            "join.unattributed_e2e_ms",
            "workload.prompt_tokens",
            "workload.actual_output_tokens",
            "join.wall_start_ns",
            "vendor.cycles",
        )
    }
    joined = rv.col("quality.server_trace_joined", False, bool)[top]
    ids = rv.col("request_id", "", object)[top]
    parts = rv.col("quality.partition", "", object)[top]
    labels = [rv.cell_labels[i] for i in rv.cell_code[top]] if rv.cell_code is not None else []
    rows, bars, classes = [], [], []
    inconsistent = 0
    for j, i in enumerate(top):
        q, pf, dec = (
            c["server_ms.queue"][j],
            c["server_ms.prefill"][j],
            c["server_ms.decode_total"][j],
        )
        ip, idc = c["runtime_ms.infer_prefill"][j], c["runtime_ms.infer_decode"][j]
        post, un = c["server_ms.postprocess"][j], c["join.unattributed_e2e_ms"][j]
        device = np.nansum([ip, idc]) if np.isfinite(ip) or np.isfinite(idc) else np.nan
        rows.append(
            (
                str(j + 1),
                str(ids[j]),
                labels[j],
                str(parts[j]),
                fmt_int(c["workload.prompt_tokens"][j]),
                fmt_int(c["workload.actual_output_tokens"][j]),
                fmt_ms(e2e[i]),
                fmt_ms(c["durations_ms.ttft"][j]),
                fmt_ms(q),
                fmt_ms(c["join.slot_wait_ms"][j]),
                fmt_ms(c["join.admission_wait_ms"][j]),
                fmt_ms(pf),
                fmt_ms(dec),
                fmt_ms(device),
                fmt_ms(post),
                fmt_ms(un),
                fmt_int(c["vendor.cycles"][j]),
                fmt_rel(rv.rel_s(c["join.wall_start_ns"][j])),
            )
        )
        if not joined[j]:
            seg = {"no server trace": float(e2e[i])}
            classes.append("")
        elif np.isfinite(un) and un < -_TOLERANCE_MS:
            # the server's span is longer than the client's E2E: two clocks or a reused
            # request id; the phases are not shown as if they explained the request
            seg = {"trace inconsistent": float(e2e[i])}
            classes.append("warn")
            inconsistent += 1
        else:
            seg = _segments(q, pf, dec, ip, idc, post, un)
            classes.append("")
        bars.append(plots.BreakdownBar(f"#{j + 1} {labels[j]}", seg))
    s.intro.append(
        "Successful requests of the measured and throttled partitions, slowest end-to-end "
        "first. E2E = queue + prefill + decode + post-process + unattributed; device is the "
        "device wait inside prefill and decode (steps.jsonl). Unattributed is time no server "
        "trace explains: the client and the network. Queue holds the slot wait (accepted "
        "→ slot assigned) and the admission wait (slot assigned → admitted: KV and an "
        "OutputBuf lease), spec §10.1."
    )
    if rv.vendor is None:
        s.notes.append(
            f"device time per op and per chip: {GRAPH_SERVICE_ONLY}: no vendor trace "
            "(server/vendor.jsonl), so device is the service's device wait, never a kernel"
        )
    s.figures.append(
        figure(
            plots.breakdown_bars(bars, BREAKDOWN, _COLORS),
            "where the slowest requests spent their time (stacked, ms)",
            name="breakdown",
        )
    )
    s.tables.append(
        table(
            (
                "#",
                "request id",
                "cell",
                "partition",
                "prompt tok",
                "output tok",
                "E2E ms",
                "TTFT ms",
                "queue",
                "slot wait",
                "admission wait",
                "prefill",
                "decode",
                "device",
                "post-process",
                "unattributed",
                "vendor cycles",
                "started",
            ),
            rows,
            name="slowest",
            numeric=(True, False, False, False, *([True] * 13), False),
            row_class=classes,
        )
    )
    if inconsistent:
        s.notes.append(
            f"{inconsistent} request(s) have a server span longer than their client E2E "
            "(negative unattributed time): the server trace does not match the record (a "
            "request id reused across runs on one server, or a server clock fault); their "
            "phases are listed but not drawn"
        )
    return s


def _segments(*v: float) -> dict[str, float]:
    q, pf, dec, ip, idc, post, un = (0.0 if not np.isfinite(x) else float(x) for x in v)
    pdev, ddev = min(ip, pf), min(idc, dec)
    return {
        "queue": q,
        "prefill (host)": pf - pdev,
        "prefill (device)": pdev,
        "decode (host)": dec - ddev,
        "decode (device)": ddev,
        "post-process": post,
        "unattributed": max(0.0, un),
    }


def nonsuccess_section(rv: RunView) -> Section:
    s = Section("nonsuccess", "Every request that did not succeed (client side)")
    if rv.table is None:
        return s.empty(rv.load_error or "no request records")
    failed = np.flatnonzero(~rv.success() | rv.col("ext.dropped", False, bool))
    if failed.size == 0:
        s.intro.append(f"None: all {rv.table.num_rows:,} records succeeded.")
        return s
    start = rv.col("join.wall_start_ns")
    failed = failed[np.argsort(start[failed], kind="stable")]
    cls = rv.col("ext.error_class", "", object)
    labels = (
        np.asarray(rv.cell_labels, dtype=object)[rv.cell_code] if rv.cell_code is not None else cls
    )
    counts = Counter(zip(labels[failed].tolist(), cls[failed].tolist(), strict=True))
    s.tables.append(
        table(
            ("cell", "error class", "requests"),
            [(c, e or DASH, fmt_int(n)) for (c, e), n in sorted(counts.items())],
            name="nonsuccess-counts",
            caption="counts by cell and error class (all of them)",
            numeric=(False, False, True),
        )
    )
    cols = {
        k: rv.col(k, "", object)
        for k in (
            "request_id",
            "quality.partition",
            "ext.cancelled_at",
            "result.error_code",
            "ext.error_detail",
        )
    }
    http = rv.col("result.http_status")
    rterr = rv.col("join.runtime_errors")
    rows = [
        (
            fmt_rel(rv.rel_s(start[i])),
            str(cols["request_id"][i]),
            str(labels[i]),
            str(cols["quality.partition"][i]),
            str(cls[i]),
            str(cols["ext.cancelled_at"][i]) or DASH,
            fmt_int(http[i]),
            str(cols["result.error_code"][i]) or DASH,
            _short(str(cols["ext.error_detail"][i])) or DASH,
            fmt_int(rterr[i]),
        )
        for i in failed
    ]
    shown, note = cap_rows(
        rows, _MAX_ROWS, "failed requests", "the request records (calculet-load export RUN)"
    )
    s.tables.append(
        table(
            (
                "time",
                "request id",
                "cell",
                "partition",
                "error class",
                "cancelled at",
                "HTTP",
                "server code",
                "detail (as the server sent it)",
                "server runtime errors",
            ),
            shown,
            name="nonsuccess",
            folded=len(shown) > _FOLD,
            note=note,
            numeric=(False, False, False, False, False, False, True, False, False, True),
            row_class=["fail"] * len(shown),
        )
    )
    return s


def _in_run(rv: RunView, scan: ServerScan) -> tuple[list[dict[str, Any]], npt.NDArray[Any], int]:
    """Scanned rows that belong to this run (a request of its records, or a server-wide
    event inside its time window), their record row (−1: none), and how many were not."""
    rows = scan.rows
    if rv.table is None or not rows:
        return rows, np.full(len(rows), -1), 0
    ids = pa.array([r.get("request_id") for r in rows], type=pa.string())
    pos = positions(ids, rv.table.column("request_id"))
    start = rv.col("join.wall_start_ns")
    end = rv.col("join.wall_end_ns")
    lo = np.nanmin(start) if np.isfinite(start).any() else -np.inf
    hi = np.nanmax(end) if np.isfinite(end).any() else np.inf
    lo = min(lo, rv.t0_wall_ns or lo) - 1e9
    keep = [
        p >= 0 or (r.get("request_id") is None and lo <= (r.get("wall_ns") or 0) <= hi + 1e9)
        for r, p in zip(rows, pos, strict=True)
    ]
    k = np.asarray(keep, dtype=bool)
    return [r for r, x in zip(rows, keep, strict=True) if x], pos[k], int((~k).sum())


def _detail(r: dict[str, Any], drop: tuple[str, ...] = ()) -> str:
    d = r.get("detail")
    if not isinstance(d, dict):
        return DASH
    d = {k: v for k, v in d.items() if k not in drop}
    return _short(json.dumps(redact(d), sort_keys=True, default=str)) if d else DASH


def runtime_section(rv: RunView, scan: ServerScan | None) -> Section:
    s = Section("runtime", "Server runtime non-successes (even when a retry succeeded)")
    if scan is None:
        return s.empty("no server/server_events.jsonl")
    rows, pos, outside = _in_run(rv, _only(scan, RUNTIME_EVENTS))
    if not rows:
        s.intro.append(
            "None: the server trace holds no runtime error, failure, rejection, "
            "quarantine, backoff or numeric-check event for this run."
        )
        return s
    ok = rv.success() if rv.table is not None else np.zeros(0, dtype=bool)
    cls = rv.col("ext.error_class", "", object) if rv.table is not None else ok
    labels = (
        np.asarray(rv.cell_labels, dtype=object)[rv.cell_code] if rv.cell_code is not None else None
    )

    def outcome(p: int) -> str:
        if p < 0:
            return DASH
        return "succeeded (recovered)" if ok[p] else f"failed: {cls[p]}"

    out, classes, groups = [], [], Counter[tuple[str, str, str]]()
    for r, p in zip(rows, pos, strict=True):
        d: dict[str, Any] = r["detail"] if isinstance(r.get("detail"), dict) else {}
        rc = str(d.get("rc")) if d.get("rc") is not None else DASH
        result = outcome(int(p))
        groups[(str(r.get("event")), rc, result.split(":")[0])] += 1
        if r.get("event") == "backoff":  # the retry itself: counted, not listed
            continue
        out.append(
            (
                fmt_rel(rv.rel_s(r.get("wall_ns"))),
                str(r.get("event")),
                str(r.get("request_id") or DASH),
                str(labels[p]) if labels is not None and p >= 0 else DASH,
                rc,
                _detail(r, ("rc",)),
                fmt_int(r.get("generation")),
                result,
            )
        )
        classes.append("warn" if result.startswith("succeeded") else "fail")
    s.tables.append(
        table(
            ("event", "rc", "request outcome", "events"),
            [(*k, fmt_int(n)) for k, n in sorted(groups.items())],
            name="runtime-counts",
            caption="counts by event, return code and the request's "
            "outcome (all events of this run)",
            numeric=(False, False, False, True),
        )
    )
    shown, note = cap_rows(out, _MAX_ROWS, "server events", "server/server_events.jsonl")
    if scan.capped:
        note = (note + "; " if note else "") + "the trace has more such events than were parsed"
    s.tables.append(
        table(
            (
                "time",
                "event",
                "request id",
                "cell",
                "rc",
                "detail",
                "generation",
                "request outcome",
            ),
            shown,
            name="runtime",
            caption="each event (backoffs counted above, not listed)",
            note=note,
            row_class=classes[: len(shown)],
            folded=len(shown) > _FOLD,
        )
    )
    if outside:
        s.notes.append(
            f"{outside} such event(s) in the trace belong to other runs' requests "
            "or fall outside this run's time window: not shown"
        )
    return s


def _only(scan: ServerScan, names: tuple[str, ...]) -> ServerScan:
    return ServerScan(
        [r for r in scan.rows if r.get("event") in names],
        Counter({k: v for k, v in scan.counts.items() if k in names}),
        scan.capped,
    )


def resets_section(rv: RunView, scan: ServerScan | None) -> Section:
    s = Section("resets", "Resets, reconfigurations and lifecycle changes")
    if scan is None:
        return s.empty("no server/server_events.jsonl")
    rows, _, outside = _in_run(rv, _only(scan, LIFECYCLE_EVENTS))
    rows.sort(key=lambda r: r.get("mono_ns") or 0)
    ready_at = [
        r.get("mono_ns") or 0
        for r in rows
        if r.get("event") == "state_change" and (r.get("detail") or {}).get("to") == "ready"
    ]
    out, classes = [], []
    resets = 0
    for r in rows:
        ev = str(r.get("event"))
        d: dict[str, Any] = r["detail"] if isinstance(r.get("detail"), dict) else {}
        recovery = DASH
        if ev in ("reset", "reconfigure") or (ev == "state_change" and d.get("from") == "ready"):
            resets += ev in ("reset", "reconfigure")
            if isinstance(d.get("recovery_ms"), int | float):
                recovery = f"{fmt_ms(d['recovery_ms'])} ms"
            else:
                later = [t for t in ready_at if t > (r.get("mono_ns") or 0)]
                recovery = (
                    f"ready after {fmt_ms((later[0] - (r.get('mono_ns') or 0)) / 1e6)} ms"
                    if later
                    else "NOT RECOVERED in the trace"
                )
        out.append(
            (
                fmt_rel(rv.rel_s(r.get("wall_ns"))),
                ev,
                fmt_int(r.get("generation")),
                str(d.get("why") or d.get("scenario") or DASH),
                recovery,
                _detail(r, ("why", "recovery_ms")),
            )
        )
        classes.append("fail" if "NOT" in recovery else "warn" if recovery != DASH else "")
    if not rows:
        s.intro.append(
            "None: no reset, reconfiguration, generation or state change, and no "
            "fault armed during this run."
        )
    else:
        s.intro.append(
            f"{resets} reset(s)/reconfiguration(s); recovery is the server's "
            "recovery_ms, else the time until the next state change to ready."
        )
        shown, note = cap_rows(out, _MAX_ROWS, "lifecycle events", "server/server_events.jsonl")
        s.tables.append(
            table(
                ("time", "event", "generation", "why", "recovery", "detail"),
                shown,
                name="resets",
                note=note,
                row_class=classes[: len(shown)],
            )
        )
    if outside:
        s.notes.append(f"{outside} lifecycle event(s) outside this run's time window not shown")
    return s


def excluded_section(rv: RunView) -> Section:
    s = Section("excluded", "Excluded samples and their reasons")
    if rv.table is None:
        return s.empty(rv.load_error or "no request records")
    reasons = rv.col("quality.reasons", "", object)
    has = np.flatnonzero(reasons != "")
    labels = (
        np.asarray(rv.cell_labels, dtype=object)[rv.cell_code]
        if rv.cell_code is not None
        else reasons
    )
    counts: Counter[tuple[str, str]] = Counter()
    for i in has:
        for reason in str(reasons[i]).split(";"):
            counts[(str(labels[i]), reason)] += 1
    q = (rv.verdict or {}).get("quality") or {}
    thr = q.get("thresholds") or {}
    lag, share = thr.get("saturated_lag_ms", "?"), thr.get("held_share")
    share_text = f"{share:.0%}" if isinstance(share, int | float) else "?"
    s.intro.append(
        "Outliers are never removed for being outliers: only the pre-registered reasons below "
        "take a record out of the measured set (warmup, dropped arrival, cut at run stop, "
        "incomplete client clock, declared network break, client saturated: CPU > "
        f"{thr.get('saturated_cpu_percent', '?')}% of a core, or loop lag > {lag} ms; a "
        "request stamped by the kernel is judged instead by its own bounds over that (send "
        "lag, start to sent, and its first-token late bound under loop lag), and a "
        f"closed-loop one also by its cell's hold: its users waited for the client over "
        f"{lag} ms a request and over {share_text} of their time)."
    )
    if q.get("workers_without_selfwatch"):
        s.notes.append(
            "workers without self-watch samples (their saturation is no data, not "
            f"clean): {', '.join(q['workers_without_selfwatch'])}"
        )
    if not counts:
        s.intro.append("No record was excluded.")
        return s
    s.tables.append(
        table(
            ("cell", "reason", "records"),
            [(c, r, fmt_int(n)) for (c, r), n in sorted(counts.items())],
            name="excluded-counts",
            numeric=(False, False, True),
        )
    )
    part = rv.col("quality.partition", "", object)
    rows_i = [i for i in has if part[i] != "warmup"]
    start = rv.col("join.wall_start_ns")
    ids = rv.col("request_id", "", object)
    rows = [
        (fmt_rel(rv.rel_s(start[i])), str(ids[i]), str(labels[i]), str(part[i]), str(reasons[i]))
        for i in rows_i
    ]
    if rows:
        shown, note = cap_rows(
            rows, 100, "excluded records (warmup not listed)", "the request records"
        )
        s.tables.append(
            table(
                ("time", "request id", "cell", "partition", "reasons"),
                shown,
                name="excluded",
                folded=len(shown) > _FOLD,
                note=note,
                row_class=["warn"] * len(shown),
            )
        )
    return s


def long_context_section(rv: RunView) -> Section:
    s = Section("longctx", "TPOT over prompt length (long context)")
    if rv.table is None:
        return s.empty(rv.load_error or "no request records")
    tpot = rv.col("durations_ms.tpot")
    prompt = rv.col("workload.prompt_tokens")
    ok = rv.success() & rv.partition_in("measured", "throttled")
    sel = ok & np.isfinite(tpot) & np.isfinite(prompt)
    single = sel & (rv.col("workload.concurrency") == 1)
    # at concurrency 1 the curve shows the context's cost, not the load's
    at_c1 = np.unique(prompt[single]).size >= 2
    if at_c1:
        sel = single
    lengths = np.unique(prompt[sel])
    if lengths.size < 2:
        return s.empty(
            f"TPOT was measured at {lengths.size} prompt length(s); the curve needs "
            "≥ 2 (a matrix with several prompt lengths, §6.1)"
        )
    rows, xs, p50, p90 = [], [], [], []
    for length in lengths:
        v = tpot[sel & (prompt == length)]
        a, b, c = (float(np.percentile(v, q, method="higher")) for q in (50, 90, 99))
        xs.append(float(length))
        p50.append(a)
        p90.append(b)
        rows.append(
            (
                fmt_int(length),
                fmt_int(v.size),
                fmt_ms(a),
                fmt_ms(b),
                fmt_ms(c),
                fmt_ms(float(v.max())),
            )
        )
    px, py = prompt[sel], tpot[sel]
    if px.size > _SCATTER:
        pick = np.random.default_rng(0).choice(px.size, _SCATTER, replace=False)
        px, py = px[pick], py[pick]
        s.notes.append(
            f"the plot shows {_SCATTER:,} of {int(sel.sum()):,} requests (seeded sample)"
        )
    marks = [(x, t) for x, t in ((32768.0, "32K"), (40960.0, "40K")) if xs[0] <= x <= xs[-1]]
    s.intro.append(
        f"Per-request TPOT of successful measured requests "
        f"{'at concurrency 1' if at_c1 else 'at every concurrency (no two prompt lengths at 1)'}"
        " by prompt length, with the P50 and P90 per length. History shows a TPOT drop "
        "near 33K/40K tokens of context: re-measured here wherever the matrix reaches it."
    )
    s.figures.append(
        figure(
            plots.scatter_curve(
                (px.tolist(), py.tolist()),
                [plots.Line("P50", xs, p50), plots.Line("P90", xs, p90, style="--")],
                title="TPOT vs prompt length",
                xlabel="prompt tokens (log₂)",
                ylabel="TPOT ms",
                marks=marks,
            ),
            "TPOT vs prompt length",
            name="tpot-context",
        )
    )
    s.tables.append(
        table(
            ("prompt tokens", "n", "P50 ms", "P90 ms", "P99 ms", "max ms"),
            rows,
            name="longctx",
            numeric=(True,) * 6,
        )
    )
    return s
