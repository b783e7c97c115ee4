"""The report's "Latency over time" section, right under the headline table: TTFT, TPOT
and ITL P50/P99 per time window, output tokens/s, requests in flight and requests/s, with
each rate change of a Locust run's plan marked. It draws `timeseries.parquet` (written by
`calculet-load analyze`: analysis.tables.series); for a folder not analysed, the same
series computed from the records, and it says so.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from analysis.errors import AnalysisError
from analysis.tables.series import SERIES_FILES, SERIES_SCHEMA, series_table
from analysis.views import plots
from analysis.views.model import RunView, Section, figure, fmt_int

__all__ = ["overtime_section", "read_series"]

F = npt.NDArray[np.float64]
_FILE = SERIES_FILES[0]


def read_series(rv: RunView) -> tuple[pa.Table | None, str]:
    """The run's series and where it came from: the file `analyze` wrote, else computed
    from the records; (None, why) when neither can be had."""
    if rv.files.exists(_FILE):
        try:
            t = pq.read_table(rv.files.path(_FILE), filesystem=rv.files.fs)
        except (OSError, ValueError) as exc:
            rv.files.notes.append(f"{_FILE}: unreadable ({exc}); computed from the records")
        else:
            schema = (t.schema.metadata or {}).get(b"schema", b"").decode(errors="replace")
            if schema == SERIES_SCHEMA:
                return t, f"{_FILE} (written by calculet-load analyze)"
            rv.files.notes.append(
                f"{_FILE}: schema {schema or 'unnamed'!r}, not {SERIES_SCHEMA}; computed from "
                "the records"
            )
    if rv.table is None or rv.tokens is None:
        return None, rv.load_error or "the records could not be read"
    try:
        t = series_table(
            rv.table,
            rv.tokens,
            selfwatch=rv.selfwatch,
            index=rv.index,
            client_offsets_ns=rv.client_offsets_ns,
        )
    except AnalysisError as exc:
        return None, f"the token events could not be read: {exc}"
    if t is None:
        return None, "no request was sent"
    return t, f"computed from the records ({_FILE} is missing: run `calculet-load analyze RUN`)"


_EMPTY = {
    "ttft": "no timed success",
    "tpot": "no timed success of more than one token",
    "itl": "no token events: the responses were not streamed, or their events not kept",
}


def _col(t: pa.Table, name: str) -> F:
    return np.asarray(t.column(name).to_numpy(zero_copy_only=False), dtype=np.float64)


def _meta(t: pa.Table, key: str) -> Any:
    raw = (t.schema.metadata or {}).get(key.encode())
    return None if raw is None else json.loads(raw)


def _pair(x: F, t: pa.Table, metric: str) -> list[plots.Line]:
    return [
        plots.Line("P50", x.tolist(), _col(t, f"{metric}_p50_ms").tolist(), color=0),
        plots.Line("P99", x.tolist(), _col(t, f"{metric}_p99_ms").tolist(), style="--", color=3),
    ]


def overtime_section(rv: RunView) -> Section:
    s = Section("overtime", "Latency over time")
    t, source = read_series(rv)
    if t is None:
        return s.empty(source)
    start = _col(t, "start_wall_ns")
    width = _col(t, "width_s")
    t0 = float(rv.t0_wall_ns) if rv.t0_wall_ns is not None else float(start[0])
    rel = (start - t0) / 1e9 + width / 2  # each window at its middle
    scale, unit = (60.0, "minutes") if rel[-1] - rel[0] > 1200 else (1.0, "seconds")
    x = rel / scale
    marks = []
    for wall_ns, rate in _meta(t, "rate_changes") or []:
        marks.append(((wall_ns - t0) / 1e9 / scale, f"rate → {rate:g}/s"))
    flight = [plots.Line("mean (records)", x.tolist(), _col(t, "in_flight_mean").tolist())]
    sampled = _col(t, "in_flight_max")
    if np.isfinite(sampled).any():
        flight.append(
            plots.Line("max (self-watch)", x.tolist(), sampled.tolist(), style="--", color=1)
        )
    rate = [plots.Line("started/s", x.tolist(), (_col(t, "started") / width).tolist())]
    target = _col(t, "target_rate")
    if np.isfinite(target).any():
        rate.append(plots.Line("plan's rate", x.tolist(), target.tolist(), style="--", color=3))
    tokens = _col(t, "output_tokens_per_s")
    panels = []
    for label, metric in (("TTFT ms", "ttft"), ("TPOT ms", "tpot"), ("ITL ms", "itl")):
        if np.isfinite(_col(t, f"{metric}_p50_ms")).any():
            panels.append(plots.Panel(label, _pair(x, t, metric), marks=marks))
        else:  # an empty axis would read as a scale with nothing on it
            s.notes.append(f"{label.split()[0]}: no value in any window ({_EMPTY[metric]})")
    panels += [
        plots.Panel(
            "output tokens/s",
            [plots.Line("output tokens/s", x.tolist(), tokens.tolist())],
            marks=marks,
        ),
        plots.Panel("requests in flight", flight, marks=marks),
        plots.Panel("requests/s", rate, marks=marks),
    ]
    s.figures.append(
        figure(
            plots.timeseries_figure(panels, xlabel=f"{unit} since the run started", ncols=2),
            f"per {float(width[0]):g}-s window (the last one ends with the run): P50 "
            "(solid) and P99 (dashed) of TTFT and TPOT by the request's start, of ITL by the "
            "token's arrival; dotted lines: the open-loop rate changed. A gap is a window "
            "without that figure",
            name="overtime",
        )
    )
    s.intro.append(
        f"{len(start):,} windows of {float(width[0]):g} s from {source}: "
        f"{fmt_int(int(_col(t, 'started').sum()))} requests started, "
        f"{fmt_int(int(_col(t, 'ttft_n').sum()))} successes timed (measured, throttled and "
        "warmup; excluded records are not), every sent request in flight. All cells "
        "together: the per-cell figures are in 'Per-cell statistics'. The columns and "
        "methods: docs/analysis.md (timeseries.csv)."
    )
    if marks:
        s.notes.append(
            "rate changes (client/index.json plan): "
            + ", ".join(f"{text} at {pos * scale:.1f} s" for pos, text in marks)
        )
    return s
