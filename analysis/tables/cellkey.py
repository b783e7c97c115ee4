"""What names a cell: (ext.cell, workload.concurrency, ext.arrival, workload.stream), the
workload entry, the closed-loop concurrency (null in open loop), the arrival shape and
streaming (analysis.tables.cells summarizes each). Here, below the quality step, which
judges a closed-loop cell's users by what the client held them (analysis.tables.quality).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.tables.join import IntArray

__all__ = ["CELL_FIELDS", "CELL_KEY_COLUMNS", "CellKey", "rows_by_cell"]

CELL_FIELDS = ("ext.cell", "workload.concurrency", "ext.arrival", "workload.stream")


# The columns that open every per-cell table: the cell's label and its key's parts.
CELL_KEY_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("cell", pa.string()),
    ("cell_name", pa.string()),
    ("concurrency", pa.int64()),
    ("arrival", pa.string()),
    ("stream", pa.bool_()),
)


@dataclass(frozen=True, slots=True, order=True)
class CellKey:
    name: str | None
    concurrency: int | None
    arrival: str | None
    stream: bool | None

    @property
    def label(self) -> str:
        """name|cN|arrival|stream (`p16-o32|c1|closed|stream`); a missing part reads "-",
        stream/whole says whether the response streamed."""
        c = "-" if self.concurrency is None else f"c{self.concurrency}"
        s = "-" if self.stream is None else ("stream" if self.stream else "whole")
        return "|".join((self.name or "-", c, self.arrival or "-", s))


def rows_by_cell(
    table: pa.Table, rows: IntArray, by: tuple[str, ...] = ()
) -> dict[tuple[CellKey, tuple[object, ...]], IntArray]:
    """`rows` (indices into `table`) grouped by cell and then by the columns `by` (e.g.
    the worker): {(key, (values of by)): the group's rows, in the order given}."""
    if rows.size == 0:
        return {}
    sub = table.take(pa.array(rows))
    cols = [sub.column(c) for c in CELL_FIELDS]
    extra = [sub.column(c) for c in by]
    joined = pc.binary_join_element_wise(
        *[pc.fill_null(pc.cast(c, pa.string()), "\x00") for c in (*cols, *extra)], "\x1f"
    )
    codes = np.asarray(
        pa.chunked_array(joined).combine_chunks().dictionary_encode().indices, dtype=np.int64
    )
    out: dict[tuple[CellKey, tuple[object, ...]], IntArray] = {}
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    for group in np.split(order, bounds):
        first = int(group[0])
        key = CellKey(*(c[first].as_py() for c in cols))
        out[(key, tuple(c[first].as_py() for c in extra))] = rows[group]
    return out
