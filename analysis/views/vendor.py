"""Report sections of data the harness does not measure itself: the vendor's counters
(spec §17, `server/vendor.jsonl`) and the old benchmark CSV as a trend line (spec §1,
non-authoritative, `calculet-load report --legacy DIR`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.tables.join import VENDOR_COUNTERS
from analysis.tables.vendor import GRAPH_SERVICE_ONLY, VENDOR_FILE, vendor_summary
from analysis.views import plots
from analysis.views.model import RunView, Section, figure, fmt_int, fmt_num, fmt_pct, table

__all__ = ["LEGACY_BANNER", "legacy_section", "vendor_section"]

LEGACY_BANNER = "NON-AUTHORITATIVE: trend reference only (spec §1)"
_PROMPT_COLUMNS = ("prompt_tokens", "prompt_n", "n_prompt", "prompt_len", "tokens_evaluated")


def vendor_section(rv: RunView) -> Section:
    s = Section("vendor", "Vendor data (spec §17)")
    if rv.vendor is None or rv.vendor.num_rows == 0:
        s.intro.append(
            f"No vendor trace ({VENDOR_FILE}): {GRAPH_SERVICE_ONLY}. Per-op and per-chip "
            "cycles, D2D/DDR/PCIe bytes, device SRAM, queue counter semantics and the "
            "vendor's temperature/power/frequency APIs are not in this run's files. "
            "End-to-end A/B comparisons hold, but conclusions stop at graph/service level: "
            "the breakdowns attribute time to server phases (queue, prefill, decode, "
            "post-process) and device waits as the service's trace reports them, never to "
            "kernels or chips. The file's schema: `calculet-load schema vendor`."
        )
        if rv.device is None:
            s.notes.append(
                "no server/device.jsonl: device state (temperature, power, frequency, "
                "throttling) is no data for this run"
            )
        return s
    requests = rv.table if rv.table is not None else pa.table({})
    v = vendor_summary(rv.vendor, requests)
    s.intro.append(
        f"{fmt_int(v['rows'])} rows of {VENDOR_FILE} ({v['schema']}): {fmt_int(v['op_rows'])} "
        f"per-op rows joined by request id to {fmt_int(v['joined_records'])} records, "
        f"{fmt_int(v['chip_rows'])} per-chip samples. The figures are the vendor's counters "
        "as written; the harness does not check their semantics."
    )
    s.tables.append(
        table(
            ("op", "rows", "cycles", "share of cycles", "D2D bytes", "DDR bytes", "PCIe bytes"),
            [
                (
                    str(o["op"]),
                    fmt_int(o["rows"]),
                    fmt_int(o["cycles"]),
                    fmt_pct(None if o["cycles_share"] is None else 100 * o["cycles_share"]),
                    fmt_int(o["d2d_bytes"]),
                    fmt_int(o["ddr_bytes"]),
                    fmt_int(o["pcie_bytes"]),
                )
                for o in v["ops"]
            ],
            name="vendor_ops",
            caption="per operator, most cycles first",
            note=f"{v['ops_not_listed']} more ops not listed" if v["ops_not_listed"] else "",
            numeric=(False, *([True] * 6)),
        )
    )
    s.tables.append(
        table(
            (
                "chip",
                "counted from",
                "cycles",
                "D2D bytes",
                "DDR bytes",
                "PCIe bytes",
                "SRAM peak KiB",
                "SRAM last KiB",
                "SRAM total KiB",
            ),
            [
                (
                    str(c["chip"]),
                    c["counted_from"],
                    fmt_int(c["cycles"]),
                    fmt_int(c["d2d_bytes"]),
                    fmt_int(c["ddr_bytes"]),
                    fmt_int(c["pcie_bytes"]),
                    fmt_num(c["sram_used_kib_max"]),
                    fmt_num(c["sram_used_kib_last"]),
                    fmt_num(c["sram_total_kib"]),
                )
                for c in v["chips"]
            ],
            name="vendor_chips",
            caption="per chip (counted from its op rows, else its chip samples)",
            numeric=(True, False, *([True] * 7)),
        )
    )
    if rv.table is not None and rv.table.num_rows:
        s.tables.append(_per_cell(rv))
    return s


def _per_cell(rv: RunView) -> Any:
    """Per cell: requests with vendor rows, and their per-request medians."""
    cols = {c: rv.col(f"vendor.{c}") for c in VENDOR_COUNTERS}
    seen = np.zeros(len(cols["cycles"]), dtype=bool)
    for values in cols.values():
        seen |= np.isfinite(values)
    rows = []
    for label, idx in rv.groups(seen).items():

        def med(c: str, idx: Any = idx) -> str:
            x = cols[c][idx]
            x = x[np.isfinite(x)]
            return fmt_int(float(np.median(x))) if x.size else "–"

        rows.append((label, fmt_int(idx.size), *(med(c) for c in VENDOR_COUNTERS)))
    return table(
        ("cell", "requests", "cycles p50", "D2D bytes p50", "DDR bytes p50", "PCIe bytes p50"),
        rows,
        name="vendor_cells",
        caption="per request, joined by request id (medians over the cell's requests)",
        numeric=(False, *([True] * 5)),
    )


def legacy_section(
    uri: str, trend: pa.Table | None, index: dict[str, Any] | None, rv: RunView, error: str = ""
) -> Section:
    """The old CSV's "TTFT" (a legacy import's trend table and index, as
    analysis.legacy reads them) as a trend line beside this run's client TTFT P50, marked
    non-authoritative; `error` when the import could not be read."""
    s = Section("legacy", f"Legacy CSV trend ({LEGACY_BANNER})")
    if trend is None:
        return s.empty(f"the legacy import could not be read: {error}")
    index = index or {}
    source = index.get("source") or {}
    s.intro.append(
        f"{LEGACY_BANNER}. {fmt_int(trend.num_rows)} rows of {source.get('file', uri)} "
        f"(sha256 {str(source.get('sha256', '–'))[:12]}…, imported with `calculet-load "
        'import-legacy`). Its "TTFT" is the server\'s prompt_ms + predicted_ms, not the '
        "client's first token, and its model label was hard-coded: it shows a trend, it "
        "judges nothing and enters no statistic or rule of this report."
    )
    for note in index.get("notes") or []:
        s.notes.append(str(note))
    ttft = np.asarray(pc.fill_null(trend.column("legacy_ttft_ms"), np.nan), dtype=float)
    prompt = next((c for c in _PROMPT_COLUMNS if c in trend.column_names), None)
    lines = []
    if prompt is not None:
        x = np.asarray(pc.fill_null(pc.cast(trend.column(prompt), pa.float64()), np.nan))
        xs, ys = _medians(x, ttft)
        lines.append(plots.Line("legacy 'TTFT' p50 (non-authoritative)", xs, ys, style="--"))
        if rv.table is not None:
            mine = rv.success() & rv.partition_in("measured")
            cx, cy = _medians(
                rv.col("workload.prompt_tokens")[mine], rv.col("durations_ms.ttft")[mine]
            )
            if cx:
                lines.append(plots.Line("this run: client TTFT p50", cx, cy))
        xlabel = f"prompt tokens ({prompt})"
    else:
        ok = np.isfinite(ttft)
        lines.append(
            plots.Line(
                "legacy 'TTFT' (non-authoritative)",
                np.asarray(trend.column("row"))[ok].tolist(),
                ttft[ok].tolist(),
                style="--",
            )
        )
        xlabel = "CSV row"
    s.figures.append(
        figure(
            plots.curve_figure([("legacy trend (non-authoritative)", xlabel, lines)]),
            f"{LEGACY_BANNER}: the old CSV's server-side 'TTFT' (dashed)",
            name="legacy",
        )
    )
    return s


def _medians(x: Any, y: Any) -> tuple[list[float], list[float]]:
    ok = np.isfinite(x) & np.isfinite(y)
    xs = sorted(set(x[ok].tolist()))
    return xs, [float(np.median(y[ok][x[ok] == v])) for v in xs]
