"""A request table's columns as numpy arrays, for the quality step's rules."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.tables.join import BoolArray, FloatArray, IntArray

__all__ = ["bools", "floats", "ints", "span"]


def bools(table: pa.Table, name: str) -> BoolArray:
    """A bool column, False where null."""
    col = pc.fill_null(table.column(name), False)
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=bool)


def ints(table: pa.Table, name: str) -> tuple[IntArray, BoolArray]:
    """An integer column (0 where null) and where it is valid."""
    col = table.column(name)
    ok = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)
    v = np.asarray(pc.fill_null(col, 0).to_numpy(zero_copy_only=False), dtype=np.int64)
    return v, ok


def span(d: pa.Table) -> tuple[IntArray, IntArray, BoolArray]:
    """[t0, last stamp] of each request on its worker's monotonic clock."""
    t0, ok = ints(d, "client_ns.request_start")
    end = t0.copy()
    for name in ("headers_sent", "response_headers", "first_event", "first_token"):
        v, m = ints(d, f"client_ns.{name}")
        end = np.where(m, np.maximum(end, v), end)
    for name in ("last_token", "response_end"):
        v, m = ints(d, f"client_ns.{name}")
        end = np.where(m, np.maximum(end, v), end)
    return t0, end, ok


def floats(table: pa.Table, name: str) -> FloatArray:
    """A float column, NaN where null: a comparison with NaN is False, so a figure the
    record does not have passes no limit."""
    col = pc.fill_null(pc.cast(table.column(name), pa.float64()), np.nan)
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
