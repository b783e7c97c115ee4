"""The vendor's counters (spec §10.3, §17) of `server/vendor.jsonl`, summarised.

Rows are `calculet_load.schema.traces.VendorRow`; their per-request sums are joined to
the records by `analysis.tables.join` (`vendor.*` columns). This module reduces the
file to what a verdict and a report show:

    ops     per operator: rows, cycles (sum), share of all op cycles, bytes (sums)
    chips   per chip: cycles and bytes (from its `op` rows, else its `chip` rows'
            increments), SRAM in use (peak and last, KiB) and total
    joined  how many request records the op rows were joined to

Without the file, nothing below the service's own phases can be attributed: every
figure that would need it says GRAPH_SERVICE_ONLY instead, and no kernel or chip
bottleneck is inferred (spec §17).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.tables.join import VENDOR_COUNTERS
from calculet_load.schema.traces import VENDOR_TRACE_SCHEMA

__all__ = ["GRAPH_SERVICE_ONLY", "VENDOR_FILE", "vendor_summary"]

GRAPH_SERVICE_ONLY = "graph/service level only (§17)"
"""The one sentence every figure that needs the vendor's data carries without it."""

VENDOR_FILE = "server/vendor.jsonl"
_MAX_OPS = 50


def _sums(t: pa.Table) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name in VENDOR_COUNTERS:
        col = t.column(name)
        out[name] = None if col.null_count == t.num_rows else int(pc.sum(col).as_py() or 0)
    return out


def _sram(t: pa.Table) -> dict[str, float | None]:
    used = t.column("sram_used_kib").drop_null()
    total = t.column("sram_total_kib").drop_null()
    return {
        "sram_used_kib_max": float(pc.max(used).as_py()) if len(used) else None,
        "sram_used_kib_last": float(used[-1].as_py()) if len(used) else None,
        "sram_total_kib": float(pc.max(total).as_py()) if len(total) else None,
    }


def vendor_summary(vendor: pa.Table | None, requests: pa.Table) -> dict[str, Any]:
    """The `vendor` section of verdict.json: `present` false with the §17 note when the
    run has no vendor rows; else per-op and per-chip totals and the joined count."""
    if vendor is None or vendor.num_rows == 0:
        return {
            "present": False,
            "file": VENDOR_FILE,
            "schema": VENDOR_TRACE_SCHEMA,
            "note": f"no vendor trace: {GRAPH_SERVICE_ONLY}; per-op/per-chip cycles, "
            "D2D/DDR/PCIe bytes and SRAM are not attributed",
        }
    v = vendor.sort_by([("mono_ns", "ascending")])
    kind = v.column("kind")
    ops = v.filter(pc.fill_null(pc.equal(kind, "op"), False))
    chip_rows = v.filter(pc.fill_null(pc.equal(kind, "chip"), False))
    total_cycles = _sums(ops)["cycles"] or 0
    per_op = []
    names = ops.column("op").fill_null("(unnamed)")
    for name in sorted(set(names.to_pylist())):
        rows = ops.filter(pc.equal(names, name))
        sums = _sums(rows)
        share = (sums["cycles"] or 0) / total_cycles if total_cycles else None
        per_op.append({"op": name, "rows": rows.num_rows, **sums, "cycles_share": share})
    per_op.sort(key=lambda r: -(r["cycles"] or 0))
    per_chip = []
    chips = pc.unique(v.column("chip").drop_null()).to_pylist()
    for chip in sorted(chips):
        mine_ops = ops.filter(pc.fill_null(pc.equal(ops.column("chip"), chip), False))
        mine = chip_rows.filter(pc.fill_null(pc.equal(chip_rows.column("chip"), chip), False))
        counted = mine_ops if mine_ops.num_rows else mine
        per_chip.append(
            {
                "chip": chip,
                "counted_from": "op" if mine_ops.num_rows else "chip",
                **_sums(counted),
                **_sram(mine),
            }
        )
    joined = 0
    if "vendor.cycles" in requests.column_names:
        seen = np.zeros(requests.num_rows, dtype=bool)
        for name in VENDOR_COUNTERS:
            seen |= np.asarray(pc.is_valid(requests.column(f"vendor.{name}")), dtype=bool)
        joined = int(np.count_nonzero(seen))
    return {
        "present": True,
        "file": VENDOR_FILE,
        "schema": VENDOR_TRACE_SCHEMA,
        "rows": v.num_rows,
        "op_rows": ops.num_rows,
        "chip_rows": chip_rows.num_rows,
        "joined_records": joined,
        "totals": _sums(ops),
        "ops": per_op[:_MAX_OPS],
        "ops_not_listed": max(0, len(per_op) - _MAX_OPS),
        "chips": per_chip,
    }
