# size: the report's time-series sections (device, server, self-watch, faults, soak)
"""Report sections over time: the device timeline under load (temperature, power,
frequency, throttling), the client's self-watch (loop lag, CPU: a saturated client is
visible), the server's runtime series and process as the harness sampled them (spec
§10.2, §10.3: server/metrics.jsonl, server/process.jsonl), resource trends for soaks
(spec §13), and the fault matrix (spec §12).

Series are downsampled to at most `MAX_POINTS` per line by time buckets that keep each
bucket's extreme (hottest, highest lag, lowest frequency), so a spike survives it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from analysis.tables.runfiles import redact
from analysis.tables.vendor import GRAPH_SERVICE_ONLY
from analysis.views import plots
from analysis.views.model import (
    DASH,
    Figure,
    RunView,
    Section,
    figure,
    fmt_int,
    fmt_num,
    fmt_rel,
    table,
)
from calculet_load.schema.selfwatch import SATURATED_CPU_PERCENT, SATURATED_LAG_MS

__all__ = [
    "MAX_POINTS",
    "bucket",
    "device_section",
    "faults_section",
    "run_window",
    "selfwatch_section",
    "server_section",
    "soak_section",
]

MAX_POINTS = 2000
F = npt.NDArray[np.float64]
_MAX_WORKERS_PLOTTED = 8
_MARGIN_NS = 2e9  # device rows this close outside the run still belong to it


def bucket(t: F, y: F, max_points: int = MAX_POINTS, reduce: Any = np.fmax) -> tuple[F, F]:
    """(t, y) in time order, at most `max_points` points: equal-time buckets, each
    reduced by `reduce` (np.fmax keeps peaks, np.fmin troughs) at its first time."""
    order = np.argsort(t, kind="stable")
    t, y = t[order], y[order]
    if t.size <= max_points:
        return t, y
    edges = np.linspace(t[0], t[-1], max_points + 1)
    b = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, max_points - 1)
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    return t[starts], reduce.reduceat(y, starts)


def run_window(rv: RunView) -> tuple[float, float] | None:
    """[start, end] wall ns of the run: the pipeline's log, else the records."""
    times = [e["wall_ns"] for e in rv.events or [] if isinstance(e.get("wall_ns"), int)]
    if rv.table is not None:
        for name in ("join.wall_start_ns", "join.wall_end_ns"):
            v = rv.col(name)
            if np.isfinite(v).any():
                times += [float(np.nanmin(v)), float(np.nanmax(v))]
    return (float(min(times)), float(max(times))) if times else None


def _axis(rv: RunView, wall: F, like: F | None = None) -> tuple[F, str]:
    """Time since the run started, in minutes when the span (of `like`, else of
    `wall`) is over 20 minutes, else in seconds."""
    rel = (wall - (rv.t0_wall_ns or 0)) / 1e9
    ref = (like if like is not None else wall) / 1e9
    if ref.size and np.nanmax(ref) - np.nanmin(ref) > 1200:
        return rel / 60.0, "minutes since the run started"
    return rel, "seconds since the run started"


def _floats(col: Any) -> F:
    return np.asarray(
        pc.fill_null(pc.cast(col, pa.float64(), safe=False), np.nan).to_numpy(zero_copy_only=False),
        dtype=np.float64,
    )


def _per_row(dev: pa.Table) -> dict[str, F]:
    chips = dev.column("chips")
    flat = pc.list_flatten(chips)
    parent = np.asarray(pc.list_parent_indices(chips).to_numpy(zero_copy_only=False))
    m = dev.num_rows
    out: dict[str, F] = {}
    for key, field, ufunc in (
        ("temperature", "temperature_c", np.fmax),
        ("frequency", "frequency_mhz", np.fmin),
    ):
        agg = np.full(m, np.nan)
        ufunc.at(agg, parent, _floats(pc.struct_field(flat, field)))
        out[key] = agg
    for key, field in (("power", "power_w"), ("memory", "memory_used_mib")):
        v = _floats(pc.struct_field(flat, field))
        ok = ~np.isnan(v)
        total = np.bincount(parent[ok], weights=v[ok], minlength=m)[:m]
        out[key] = np.where(np.bincount(parent[ok], minlength=m)[:m] > 0, total, np.nan)
    thr = np.asarray(
        pc.fill_null(pc.struct_field(flat, "throttled"), False).to_numpy(zero_copy_only=False),
        dtype=bool,
    )
    out["throttled"] = (np.bincount(parent[thr], minlength=m)[:m] > 0).astype(np.float64)
    out["pending"] = _floats(dev.column("pending_jobs"))
    out["left"] = _floats(dev.column("left_jobs"))
    out["wall"] = _floats(dev.column("wall_ns"))
    return out


def _in_window(rv: RunView, wall: F) -> npt.NDArray[np.bool_]:
    w = run_window(rv)
    if w is None:
        return np.ones(wall.size, dtype=bool)
    return (wall >= w[0] - _MARGIN_NS) & (wall <= w[1] + _MARGIN_NS)


def _spans(x: F, flag: F) -> list[tuple[float, float]]:
    out, start = [], None
    for xi, f in zip(x.tolist(), flag.tolist(), strict=True):
        if f and start is None:
            start = xi
        elif not f and start is not None:
            out.append((start, xi))
            start = None
    if start is not None:
        out.append((start, x[-1]))
    return out[:500]


def _limit(rv: RunView, rule: str) -> list[tuple[float, str]]:
    for v in (rv.verdict or {}).get("verdicts") or []:
        if v.get("rule") == rule and isinstance(v.get("threshold"), int | float):
            return [(float(v["threshold"]), f"limit {v['threshold']:g}")]
    return []


def device_section(rv: RunView) -> Section:
    s = Section("device", "Device timeline under load")
    if rv.vendor is None:
        s.notes.append(
            f"device SRAM, D2D/DDR/PCIe bytes and per-chip cycles: {GRAPH_SERVICE_ONLY}: "
            "the run has no vendor trace (server/vendor.jsonl)"
        )
    dev = rv.device
    if dev is None or dev.num_rows == 0:
        return s.empty("no server/device.jsonl (no device telemetry from the target)")
    a = _per_row(dev)
    keep = _in_window(rv, a["wall"])
    if not keep.any():
        return s.empty("no device sample inside this run's time window")
    a = {k: v[keep] for k, v in a.items()}
    x, xlabel = _axis(rv, a["wall"])
    spans = _spans(*bucket(x, a["throttled"]))
    bands = [
        (float(x0), float(x1))
        for _, lo, hi in _windows(rv)
        for x0, x1 in [_axis(rv, np.array([lo, hi], dtype=np.float64), a["wall"])[0]]
    ]
    panels = []
    for key, label, red, rule in (
        ("temperature", "hottest chip °C", np.fmax, "device_limits.temperature"),
        ("power", "total power W", np.fmax, "device_limits.power"),
        ("frequency", "lowest chip MHz", np.fmin, ""),
        ("pending", "jobs pending", np.fmax, ""),
        ("left", "jobs left on device", np.fmax, ""),
    ):
        if np.isfinite(a[key]).any():
            bx, by = bucket(x, a[key], reduce=red)
            panels.append(
                plots.Panel(
                    label,
                    [plots.Line(label, bx.tolist(), by.tolist())],
                    limits=_limit(rv, rule) if rule else (),
                    spans=spans,
                    span_label="throttled",
                    bands=bands,
                    band_label="matrix cells",
                    step=key in ("pending", "left"),
                )
            )
    if not panels:
        return s.empty("server/device.jsonl has rows but no chip could be read (all null)")
    s.figures.append(
        figure(
            plots.timeseries_figure(panels, xlabel=xlabel),
            "device state over the run (shaded: a chip throttled)",
            name="device",
        )
    )
    step = float(np.median(np.diff(np.sort(a["wall"])))) / 1e9 if a["wall"].size > 1 else None
    s.intro.append(
        f"{a['wall'].size:,} device samples (every {fmt_num(step)} s) inside the run; "
        f"{int(a['throttled'].sum()):,} with a throttling chip. Unreadable values are gaps, "
        "never 0. Jobs pending: prepared, waiting for the device; jobs left: submitted "
        "and not yet finished (spec §4, §10.2). Per cell, while it ran:"
    )
    s.tables.append(_per_cell(rv, a))
    return s


def _windows(rv: RunView) -> list[tuple[str, float, float]]:
    """(cell, start, end) wall ns of every executed cell: the plan's, else the records'."""
    windows: list[tuple[str, float, float]] = []
    for c in (rv.plan or {}).get("cells") or []:
        if c.get("started_wall_ns") and c.get("ended_wall_ns"):
            windows.append((str(c.get("name")), c["started_wall_ns"], c["ended_wall_ns"]))
    if not windows and rv.table is not None:
        start, end = rv.col("join.wall_start_ns"), rv.col("join.wall_end_ns")
        for label, rows in rv.groups(np.isfinite(start) & np.isfinite(end)).items():
            windows.append((label, float(start[rows].min()), float(end[rows].max())))
    return sorted(windows, key=lambda w: w[1])


def _per_cell(rv: RunView, a: dict[str, F]) -> Any:
    rows = []
    for name, lo, hi in _windows(rv):
        m = (a["wall"] >= lo) & (a["wall"] <= hi)

        def agg(key: str, fn: Callable[[F], Any], m: Any = m) -> Any:
            v = a[key][m]
            return fn(v[np.isfinite(v)]) if np.isfinite(v).any() else None

        rows.append(
            (
                name,
                fmt_rel(rv.rel_s(lo)),
                fmt_num((hi - lo) / 1e9),
                fmt_int(int(m.sum())),
                fmt_num(agg("temperature", np.max)),
                fmt_num(agg("power", np.max)),
                fmt_num(agg("frequency", np.min)),
                fmt_int(int(a["throttled"][m].sum())),
            )
        )
    return table(
        ("cell", "started", "s", "samples", "max °C", "max W", "min MHz", "throttled"),
        rows,
        name="device-cells",
        numeric=(False, False, True, True, True, True, True, True),
        row_class=["warn" if r[-1] not in ("0", DASH) else "" for r in rows],
    )


def selfwatch_section(rv: RunView) -> Section:
    s = Section("selfwatch", "Client self-watch")
    sw = rv.selfwatch
    if sw is None or sw.num_rows == 0:
        return s.empty("no client self-watch samples: client saturation cannot be ruled out")
    worker = np.asarray(
        sw.column("worker").fill_null("").to_numpy(zero_copy_only=False), dtype=object
    )
    wall = _floats(sw.column("wall_ns"))
    lag, cpu = _floats(sw.column("loop_lag_ms")), _floats(sw.column("cpu_percent"))
    inflight, rss = _floats(sw.column("in_flight")), _floats(sw.column("rss_bytes"))
    x, xlabel = _axis(rv, wall)
    rows: list[tuple[str, ...]] = []
    lag_lines: list[plots.Line] = []
    cpu_lines: list[plots.Line] = []
    fl_lines: list[plots.Line] = []
    rss_lines: list[plots.Line] = []
    for i, w in enumerate(sorted(set(worker.tolist()))):
        m = worker == w
        bad = (lag[m] > SATURATED_LAG_MS) | (cpu[m] > SATURATED_CPU_PERCENT)
        rows.append(
            (
                str(w),
                fmt_int(int(m.sum())),
                fmt_num(np.nanmax(lag[m])),
                fmt_num(np.nanpercentile(lag[m], 99)),
                fmt_num(_nanmax(cpu[m])),
                fmt_int(int(bad.sum())),
                fmt_int(_nanmax(inflight[m])),
                fmt_num(_nanmax(rss[m] / 2**20)),
            )
        )
        if i < _MAX_WORKERS_PLOTTED:
            for series, out in (
                (lag, lag_lines),
                (cpu, cpu_lines),
                (inflight, fl_lines),
                (rss / 2**20, rss_lines),
            ):
                if np.isfinite(series[m]).any():
                    bx, by = bucket(x[m], series[m])
                    out.append(plots.Line(str(w), bx.tolist(), by.tolist()))
    panels = [plots.Panel("loop lag ms", lag_lines, limits=[(SATURATED_LAG_MS, "saturated above")])]
    if cpu_lines:
        panels.append(
            plots.Panel(
                "CPU % of a core", cpu_lines, limits=[(SATURATED_CPU_PERCENT, "saturated above")]
            )
        )
    if fl_lines:
        panels.append(plots.Panel("in flight", fl_lines, step=True))
    if rss_lines:
        panels.append(plots.Panel("client RSS MiB", rss_lines))
    s.figures.append(
        figure(
            plots.timeseries_figure(panels, xlabel=xlabel),
            "the client's own "
            "event-loop lag and CPU: above the dashed line it was saturated and "
            "its records are excluded",
            name="selfwatch",
        )
    )
    verdict = next(
        (
            v
            for v in (rv.verdict or {}).get("verdicts") or []
            if v.get("rule") == "client_saturation"
        ),
        None,
    )
    if verdict is not None:
        s.intro.append(f"client_saturation: {verdict.get('status')}: {verdict.get('reason')}")
    s.tables.append(
        table(
            (
                "worker",
                "samples",
                "max lag ms",
                "P99 lag ms",
                "max CPU %",
                "saturated samples",
                "max in flight",
                "max RSS MiB",
            ),
            rows,
            name="selfwatch",
            numeric=(False,) + (True,) * 7,
            row_class=["fail" if r[5] not in ("0", DASH) else "" for r in rows],
        )
    )
    return s


# (panel label, [(series name in server/metrics.jsonl, line label)]): labelled variants
# of a series are summed; a panel is drawn when the server exposed any of its series.
_SERVER_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("jobs and sequences", (("calculet_jobs_in_flight", "jobs in flight"),
                            ("calculet_jobs_pending", "jobs pending"),
                            ("calculet_requests_queued", "requests queued"),
                            ("calculet_sequences_active", "sequences active"))),
    ("KV tokens", (("calculet_kv_allocated_tokens", "allocated"),
                   ("calculet_kv_quarantined_tokens", "quarantined"))),
    ("output buffer pool", (("calculet_buffer_pool_leased", "leased"),
                            ("calculet_buffer_pool_free", "free"),
                            ("calculet_buffer_pool_quarantine", "quarantine"))),
)  # fmt: skip
_PROCESS_PANELS: tuple[tuple[str, str, float], ...] = (
    ("rss_bytes", "server RSS MiB", 1 / 2**20),
    ("cpu_percent", "server CPU %", 1.0),
    ("threads", "server threads", 1.0),
    ("fds", "server open FDs", 1.0),
)


def _scrape_series(rows: list[dict[str, Any]]) -> tuple[F, dict[str, F]]:
    """Wall ns of each successful scrape and every unlabelled series name's value
    (labelled variants summed; a missing or null value is NaN, never 0)."""
    ok = [r for r in rows if r.get("ok") and isinstance(r.get("samples"), dict)]
    wall = np.array([float(r.get("wall_ns") or np.nan) for r in ok], dtype=np.float64)
    wanted = {name for _, series in _SERVER_PANELS for name, _ in series}
    out = {name: np.full(len(ok), np.nan) for name in wanted}
    for i, r in enumerate(ok):
        for key, value in r["samples"].items():
            name = str(key).split("{", 1)[0]
            if name in out and isinstance(value, int | float):
                cur = out[name][i]
                out[name][i] = float(value) if np.isnan(cur) else cur + float(value)
    return wall, out


def server_section(rv: RunView) -> Section:
    """The server's runtime series (its /metrics, scraped by the harness into
    server/metrics.jsonl) and its process (server/process.jsonl) over the run."""
    s = Section("server", "Server runtime and process over the run (spec §10.2, §10.3)")
    mrows = rv.files.read_jsonl("server/metrics.jsonl") or []
    prows = [
        r
        for r in rv.files.read_jsonl("server/process.jsonl") or []
        if r.get("alive") and isinstance(r.get("wall_ns"), int)
    ]
    if not mrows and not prows:
        return s.empty(
            "no server/metrics.jsonl or server/process.jsonl: the harness did not sample the "
            "server's /metrics or process during the run (Locust --scrape-interval)"
        )
    panels: list[plots.Panel] = []
    rows: list[tuple[str, ...]] = []
    walls = []
    mwall, series = _scrape_series(mrows)
    pwall = np.array([float(r["wall_ns"]) for r in prows], dtype=np.float64)
    for w in (mwall, pwall):
        if w.size and np.isfinite(w).any():
            walls.append(w[np.isfinite(w)])
    ref = np.concatenate(walls) if walls else np.zeros(0)

    def add(label: str, named: list[tuple[str, F, F]], source: str) -> None:
        lines = []
        for line_label, wall, y in named:
            ok = np.isfinite(y) & np.isfinite(wall)
            if not ok.any():
                continue
            x, _ = _axis(rv, wall[ok], ref)
            bx, by = bucket(x, y[ok])
            lines.append(plots.Line(line_label, bx.tolist(), by.tolist()))
            v = y[ok]
            first, last, peak = (fmt_num(float(a)) for a in (v[0], v[-1], v.max()))
            rows.append((source, f"{label}: {line_label}", fmt_int(int(v.size)), first, last, peak))
        if lines:
            panels.append(plots.Panel(label, lines))

    for label, named in _SERVER_PANELS:
        add(label, [(ll, mwall, series[name]) for name, ll in named], "metrics.jsonl")
    for field, label, scale in _PROCESS_PANELS:
        y = np.array(
            [float(r[field]) * scale if isinstance(r.get(field), int | float) else np.nan
             for r in prows], dtype=np.float64,
        )  # fmt: skip
        add(label, [(field, pwall, y)], "process.jsonl")
    failed = sum(1 for r in mrows if not r.get("ok"))
    s.intro.append(
        f"{fmt_int(len(mrows))} scrapes of the server's /metrics (server/metrics.jsonl"
        + (f", {fmt_int(failed)} failed" if failed else "")
        + f") and {fmt_int(len(prows))} samples of its process (server/process.jsonl), "
        "taken by the harness while the run went on; each line keeps each time bucket's "
        "maximum. Values the server did not expose are gaps, never 0."
    )
    if not panels:
        return s.empty(
            "server/metrics.jsonl and server/process.jsonl hold no readable value of the "
            "series this section draws"
        )
    x_label = _axis(rv, ref)[1] if ref.size else "seconds since the run started"
    s.figures.append(
        figure(
            plots.timeseries_figure(panels, xlabel=x_label),
            "server runtime (from /metrics) and process (RSS, CPU, threads, FDs) over the run",
            name="server",
        )
    )
    s.tables.append(
        table(
            ("file", "series", "samples", "first", "last", "max"),
            rows,
            name="server-series",
            numeric=(False, False, True, True, True, True),
        )
    )
    return s


def _nanmax(v: F) -> float | None:
    return float(np.nanmax(v)) if np.isfinite(v).any() else None


def soak_section(rv: RunView) -> Section:
    """verdict.json's `leaks` section (analysis.judge.resources) and the sampled series."""
    s = Section("soak", "Resources over the run: leaks (spec §13)")
    judged = [
        v
        for v in (rv.verdict or {}).get("verdicts") or []
        if str(v.get("rule", "")).startswith("leaks")
    ]
    if judged:
        s.tables.append(
            table(
                ("rule", "status", "reason"),
                [(str(v.get("rule")), str(v.get("status")), str(v.get("reason"))) for v in judged],
                name="verdicts",
                row_class=[str(v.get("status")) for v in judged],
            )
        )
    leaks = (rv.verdict or {}).get("leaks")
    if not isinstance(leaks, dict):
        why = (
            "no server/resources.jsonl: the server's RSS, device memory, buffer leases, KV, "
            "FDs and threads were not sampled during the run"
        )
        if rv.verdict is not None and "leaks" not in rv.verdict:
            why = "verdict.json has no leaks section (run `calculet-load analyze` again)"
        return s.empty(why)
    s.intro.append(
        f"{fmt_int(leaks.get('samples'))} samples of {leaks.get('file')} over "
        f"{fmt_num(leaks.get('span_server_s'))} s of server time (time scale "
        f"{fmt_num(leaks.get('time_scale'))}); slopes per hour of server time. Method: "
        f"{leaks.get('method', '?')}. Never only the final value: a leak is a trend."
    )
    rows, classes = [], []
    for name, e in (leaks.get("series") or {}).items():
        ci = e.get("ci_per_h")
        rows.append(
            (
                name,
                str(e.get("unit")),
                fmt_int(e.get("samples")),
                fmt_num(e.get("first")),
                fmt_num(e.get("last")),
                fmt_num(e.get("max")),
                str(e.get("status")).replace("_", " "),
                fmt_num(e.get("slope_per_h")),
                f"[{fmt_num(ci[0])}, {fmt_num(ci[1])}]" if isinstance(ci, list | tuple) else DASH,
                fmt_num(e.get("p_value")),
                fmt_num(e.get("threshold_per_h")),
                str(e.get("reason") or ""),
            )
        )
        classes.append("fail" if e.get("status") == "leak" else "")
    s.tables.append(
        table(
            (
                "series",
                "unit",
                "samples",
                "first",
                "last",
                "max",
                "trend",
                "slope /h",
                "95% CI /h",
                "p",
                "gate /h",
                "reason",
            ),
            rows,
            name="leaks",
            numeric=(False, False, *([True] * 4), False, *([True] * 4), False),
            row_class=classes,
        )
    )
    idle = leaks.get("idle_baseline")
    if isinstance(idle, dict):
        s.intro.append(
            f"Idle baseline (§13: KV and leases return to 0 when nothing runs): "
            f"{fmt_int(idle.get('samples_holding'))} of {fmt_int(idle.get('idle_samples'))} idle "
            f"samples still held KV or leases"
            + (f"; first: {json.dumps(idle['first_holding'])}" if idle.get("first_holding") else "")
            + "."
        )
    fig = _resource_figure(rv)
    if fig is not None:
        s.figures.append(fig)
    return s


def _resource_figure(rv: RunView) -> Figure | None:
    t = rv.resources
    if t is None or t.num_rows == 0:
        return None
    from analysis.judge.resources import LEAK_SERIES, resource_series

    t_s, series, _ = resource_series(t)
    hours = t_s.size and t_s[-1] > 7200
    x = t_s / 3600 if hours else t_s
    panels = []
    for name, unit in LEAK_SERIES.items():
        y = series.get(name)
        if y is None or not np.isfinite(y).any():
            continue
        bx, by = bucket(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64))
        panels.append(plots.Panel(f"{name} ({unit})", [plots.Line(name, bx.tolist(), by.tolist())]))
    if not panels:
        return None
    label = f"server {'hours' if hours else 'seconds'} since the first sample"
    return figure(
        plots.timeseries_figure(panels, xlabel=label),
        "sampled resources (each bucket's maximum)",
        name="resources",
    )


def faults_section(rv: RunView) -> Section:
    """`faults.json` (calculet-load faults): each scenario's expected vs observed."""
    s = Section("faults", "Fault matrix (spec §12)")
    doc = rv.files.read_json("faults.json")
    if not isinstance(doc, dict) or not isinstance(doc.get("scenarios"), list):
        return s.empty(
            "no faults.json: the fault matrix (calculet-load faults) did not run "
            "against this run folder"
        )
    summary = doc.get("summary") or {}
    s.intro.append(
        f"{len(doc['scenarios'])} scenario(s): "
        + ", ".join(f"{fmt_int(v)} {k}" for k, v in summary.items())
        + f"; exit code {doc.get('exit_code')}"
        + (
            f"; broken rehearsal of {', '.join(map(str, doc['broken_rehearsal']))} (these must "
            "FAIL)"
            if doc.get("broken_rehearsal")
            else ""
        )
        + ". Each scenario arms its fault through the service's admin API, runs its load and "
        "actions, and checks every designed state transition; golden runs after recovery."
    )
    rows, classes = [], []
    for sc in doc["scenarios"]:
        golden = sc.get("golden_after")
        rows.append(
            (
                str(sc.get("section", "")),
                str(sc.get("name")),
                str(sc.get("title", "")),
                str(sc.get("target_fault") or DASH),
                "yes" if sc.get("broken_rehearsal") else "no",
                str(sc.get("verdict")),
                fmt_num(sc.get("duration_s")),
                DASH
                if not isinstance(golden, dict)
                else ("passed" if golden.get("passed") else f"FAILED: {golden.get('detail')}"),
                str(sc.get("reason") or ""),
            )
        )
        classes.append(
            {"PASS": "pass", "FAIL": "fail", "ERROR": "fail", "NOT_RUN": "fail"}.get(
                str(sc.get("verdict")).upper(), "warn"
            )
        )
    s.tables.append(
        table(
            ("§", "scenario", "title", "fault", "broken", "verdict", "s", "golden after", "reason"),
            rows,
            name="faults",
            row_class=classes,
        )
    )
    fig = _fault_requests_figure(doc["scenarios"])
    if fig is not None:
        s.figures.append(fig)
    for sc in doc["scenarios"]:
        checks = [c for c in sc.get("checks") or [] if isinstance(c, dict)]
        if not checks:
            continue
        crow = [
            (
                str(c.get("check")),
                "ok" if c.get("ok") else "FAILED",
                _brief(c.get("expected")),
                _brief(c.get("observed")),
            )
            for c in checks[:_MAX_CHECKS]
        ]
        s.tables.append(
            table(
                ("check", "result", "expected", "observed"),
                crow,
                name=f"fault-{sc.get('name')}",
                caption=f"{sc.get('name')}: expected vs observed ({sc.get('verdict')})",
                note=""
                if len(checks) <= _MAX_CHECKS
                else f"showing {_MAX_CHECKS} of {len(checks)} checks; the rest are in faults.json",
                row_class=["" if c.get("ok") else "fail" for c in checks[:_MAX_CHECKS]],
                folded=bool(all(c.get("ok") for c in checks)),
            )
        )
    return s


_MAX_CHECKS = 60
_MAX_FAULT_POINTS = 5000


def _fault_requests_figure(scenarios: list[Any]) -> Figure | None:
    """Every scenario request's latency in the order the matrix sent them, by outcome
    (faults.json `requests`: status, error, latency_s), scenario names on the axis."""
    by: dict[str, tuple[list[float], list[float]]] = {}
    ticks: list[tuple[float, str]] = []
    n = 0
    for sc in scenarios:
        reqs = [r for r in (sc.get("requests") or []) if isinstance(r, dict)]
        if reqs:
            ticks.append((float(n + 1), str(sc.get("name"))))
        for r in reqs:
            n += 1
            lat = r.get("latency_s")
            if not isinstance(lat, int | float) or n > _MAX_FAULT_POINTS:
                continue
            status = r.get("status")
            outcome = (
                "ok"
                if status == 200 and not r.get("error")
                else f"HTTP {status}"
                if isinstance(status, int)
                else "no response"
            )
            xs, ys = by.setdefault(outcome, ([], []))
            xs.append(float(n))
            ys.append(float(lat) * 1e3)
    if not by:
        return None
    lines = [
        plots.Line(
            f"{k} ({len(v[0]):,})", v[0], v[1], style="none", marker="o" if k == "ok" else "x"
        )
        for k, v in sorted(by.items(), key=lambda kv: kv[0] != "ok")
    ]
    title = "scenario requests: " + ", ".join(f"{name} from #{x:g}" for x, name in ticks[:12])
    return figure(
        plots.curve_figure([(title[:160], "request # (in the order sent)", lines)]),
        "every fault-scenario request's latency (ms) by outcome",
        name="fault-requests",
    )


def _brief(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(redact(v), sort_keys=True, default=str)
    return text if len(text) <= 300 else text[:300] + "…"
