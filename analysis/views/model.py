"""The report's view model: what the templates show, already formatted.

The section builders (`analysis.views.provenance`, `analysis.views.cells`,
`analysis.views.counterexamples`, `analysis.views.timelines`) turn a loaded run (`RunView`: the run
folder's files, `verdict.json`, `summary.parquet` and the joined records with their
quality partitions) into `Section`s of `Table`s and `Figure`s whose every cell is a
display string. The templates only lay these out; nothing in them computes. A section
without data carries `nodata` ("no data in this run: …"), never made-up numbers.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
from markupsafe import Markup

from analysis.stats.quantiles import MIN_N_BOOTSTRAP, min_n_for_ci
from analysis.tables.load import TokenParts
from analysis.tables.runfiles import RunFiles

__all__ = [
    "DASH",
    "NO_DATA",
    "Banner",
    "Cell",
    "Figure",
    "ReportView",
    "RunView",
    "Section",
    "Table",
    "cap_rows",
    "comparison_why",
    "figure",
    "fmt_ci",
    "fmt_int",
    "fmt_ms",
    "fmt_num",
    "fmt_pct",
    "fmt_rel",
    "fmt_wall",
    "label_column",
    "quantile_why",
    "spread_why",
    "table",
]

NO_DATA = "no data in this run"
DASH = "–"


@dataclass(frozen=True, slots=True)
class Cell:
    """A table cell of two lines: the figure, and under it in small type what qualifies
    it (its interval, or why it has none)."""

    main: str
    sub: str = ""

    def __str__(self) -> str:
        return f"{self.main} {self.sub}".strip()


@dataclass(frozen=True, slots=True)
class Table:
    """A table of display strings (or two-line `Cell`s). `numeric[i]` right-aligns column
    i; `row_class[j]` marks row j ("fail", "warn", "pass", ""); `note` says what was
    capped."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str | Cell, ...], ...]
    name: str = ""
    caption: str = ""
    note: str = ""
    numeric: tuple[bool, ...] = ()
    row_class: tuple[str, ...] = ()
    folded: bool = False  # shown collapsed (<details>)

    def align(self, i: int) -> str:
        return "num" if i < len(self.numeric) and self.numeric[i] else ""

    def css(self, j: int) -> str:
        return self.row_class[j] if j < len(self.row_class) else ""


@dataclass(frozen=True, slots=True)
class Figure:
    """One inline SVG (from `analysis.views.plots`, whose text matplotlib already escaped)."""

    svg: Markup
    caption: str
    name: str = ""


def figure(svg: str, caption: str, name: str = "") -> Figure:
    """A figure from `analysis.views.plots` output: matplotlib escaped every text in it, so it
    goes into the page as markup."""
    return Figure(Markup(svg), caption, name)


@dataclass(slots=True)
class Section:
    id: str
    title: str
    intro: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    nodata: str | None = None

    def empty(self, why: str) -> Section:
        self.nodata = f"{NO_DATA}: {why}"
        return self


@dataclass(frozen=True, slots=True)
class Banner:
    exit_code: int | None
    status: str
    meaning: str
    css: str
    run_id: str
    purpose: str
    facts: tuple[tuple[str, str], ...]
    failing: tuple[tuple[str, str, str], ...]  # (rule, status, reason), the first few
    rehearsal: str | None = None  # "rehearsal: not an acceptance" (spec §8), else None
    more_failing: int = 0  # failed or inconclusive rules beyond `failing`
    too_short: tuple[str, ...] = ()  # "6 leak rules need ≥ 20 bins …: run ≥ 2 min"


@dataclass(frozen=True, slots=True)
class ReportView:
    """`lead` is shown right under the banner, before the table of contents (the first
    screen: how fast, and over time); `sections` after it."""

    title: str
    banner: Banner
    sections: tuple[Section, ...]
    notes: tuple[str, ...]
    tool: str
    lead: tuple[Section, ...] = ()


@dataclass(slots=True)
class RunView:
    """One run folder as the section builders read it."""

    files: RunFiles
    verdict: dict[str, Any] | None = None
    summary: pa.Table | None = None
    table: pa.Table | None = None  # joined records + quality columns
    cell_code: npt.NDArray[np.int64] | None = None  # per record: index into cell_labels
    cell_labels: list[str] = field(default_factory=list)
    load_error: str | None = None
    manifest: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None
    events: list[dict[str, Any]] | None = None
    device: pa.Table | None = None
    selfwatch: pa.Table | None = None
    index: dict[str, Any] | None = None
    client_offsets_ns: dict[str, int] = field(default_factory=dict)
    server_offset_ns: int = 0
    steps: pa.Table | None = None
    resources: pa.Table | None = None
    vendor: pa.Table | None = None  # server/vendor.jsonl (spec §17), None without one
    t0_wall_ns: int | None = None  # the run's start: relative times count from it
    tokens: TokenParts | None = None  # the token-event parts (read only on demand)

    def col(self, name: str, fill: Any = None, dtype: Any = None) -> npt.NDArray[Any]:
        """A record column as numpy (nulls → `fill`, NaN for floats by default)."""
        assert self.table is not None
        c = self.table.column(name)
        if fill is None:
            if pa.types.is_floating(c.type) or pa.types.is_integer(c.type):
                c, fill, dtype = pc.cast(c, pa.float64(), safe=False), np.nan, dtype or np.float64
            else:
                fill = ""
        return np.asarray(pc.fill_null(c, fill).to_numpy(zero_copy_only=False), dtype=dtype)

    def groups(self, mask: npt.NDArray[np.bool_]) -> dict[str, npt.NDArray[np.int64]]:
        """Row indices of the selected records, per cell label, in label order."""
        assert self.cell_code is not None
        idx = np.flatnonzero(mask)
        codes = self.cell_code[idx]
        order = np.argsort(codes, kind="stable")
        counts = np.bincount(codes, minlength=len(self.cell_labels))
        parts = np.split(idx[order], np.cumsum(counts)[:-1])
        return {
            self.cell_labels[c]: parts[c]
            for c in sorted(range(len(self.cell_labels)), key=lambda c: self.cell_labels[c])
            if counts[c]
        }

    def success(self) -> npt.NDArray[np.bool_]:
        """Records that succeeded (no error class, not a dropped arrival)."""
        assert self.table is not None
        ok = np.asarray(pc.is_null(self.table.column("ext.error_class")).to_numpy(), dtype=bool)
        dropped: npt.NDArray[np.bool_] = self.col("ext.dropped", False, bool)
        return ok & ~dropped

    def partition_in(self, *parts: str) -> npt.NDArray[np.bool_]:
        return np.asarray(np.isin(self.col("quality.partition", "", object), parts), dtype=bool)

    def rel_s(self, wall_ns: float | None) -> float | None:
        if wall_ns is None or self.t0_wall_ns is None or not math.isfinite(wall_ns):
            return None
        return (wall_ns - self.t0_wall_ns) / 1e9


def label_column(table: pa.Table) -> tuple[npt.NDArray[np.int64], list[str]]:
    """Each record's cell label as (code per record, labels): the vectorized
    `analysis.tables.cells.CellKey.label`, name|cN|arrival|stream with a missing part "-"
    (a test pins the two together)."""
    name = pc.fill_null(table.column("ext.cell"), "-")
    conc = table.column("workload.concurrency")
    c = pc.if_else(
        pc.is_null(conc), "-", pc.binary_join_element_wise("c", pc.cast(conc, pa.string()), "")
    )
    arrival = pc.fill_null(table.column("ext.arrival"), "-")
    stream = table.column("workload.stream")
    s = pc.if_else(pc.is_null(stream), "-", pc.if_else(stream, "stream", "whole"))
    label = pc.binary_join_element_wise(name, pc.fill_null(c, "-"), arrival, s, "|")
    enc = pc.dictionary_encode(label).combine_chunks()
    codes = np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    return codes, [str(x) for x in enc.dictionary.to_pylist()]


# --------------------------------------------------------------------- formatting
def _finite(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and math.isfinite(float(v))


def fmt_num(v: Any, digits: int = 4) -> str:
    """A number with `digits` significant digits; "–" for no data (None/NaN)."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if not _finite(v):
        return DASH
    x = float(v)
    if x == 0:
        return "0"
    if abs(x) >= 10 ** (digits + 2) or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def fmt_ms(v: Any) -> str:
    return fmt_num(v, 4)


def fmt_int(v: Any) -> str:
    return f"{int(v):,}" if _finite(v) else DASH


def fmt_pct(v: Any, digits: int = 3, signed: bool = False) -> str:
    if not _finite(v):
        return DASH
    text = fmt_num(float(v), digits)
    return f"{'+' if signed and float(v) > 0 else ''}{text}%"


def fmt_ci(lo: Any, hi: Any, unit: str = "", why: str = "") -> str:
    """ "[lo, hi]unit"; with a bound missing, what exists and why the rest does not:
    "[12.5, no upper bound: n = 222 < 368 for P99 at 95%]", "[no interval: …]"."""
    because = f": {why}" if why else ""
    if _finite(lo) and _finite(hi):
        return f"[{fmt_num(lo)}, {fmt_num(hi)}]{unit}"
    if _finite(lo):
        return f"[{fmt_num(lo)}{unit}, no upper bound{because}]"
    if _finite(hi):
        return f"[no lower bound, {fmt_num(hi)}{unit}{because}]"
    return f"[no interval{because}]"


def quantile_why(q: float, n: Any, level: float) -> str:
    """Why the q-quantile of n values has no (two-sided) order-statistic interval at this
    level: "n = 222 < 368 for P99 at 95%"; "" where n is enough (or unknown)."""
    if not _finite(n):
        return ""
    if int(n) == 0:
        return "no data"
    need = min_n_for_ci(q, level)
    if int(n) >= need:
        return ""
    # no break inside "n = 222 < 368": a table cell wraps around it, never through it
    return f"n\u00a0=\u00a0{int(n):,}\u00a0<\u00a0{need:,} for P{q * 100:g} at {level * 100:g}%"


def comparison_why(statistic: str, n_base: int, n_cand: int, level: float) -> str:
    """Why the paired comparison of a statistic has no interval: for a percentile, the
    smaller side's n (analysis.stats.compare needs min_n_for_ci on each side)."""
    if not statistic.startswith("p"):
        return "see the sample sizes"
    why = quantile_why(float(statistic[1:]) / 100, min(n_base, n_cand), level)
    return f"{why} on a side" if why else "the baseline is ≤ 0"


def spread_why(n: Any, what: str) -> str:
    """Why the mean ("mean", n < 2) or std/MAD (n < MIN_N_BOOTSTRAP) has no interval."""
    if not _finite(n):
        return ""
    need = 2 if what == "mean" else MIN_N_BOOTSTRAP
    if int(n) == 0:
        return "no data"
    return f"n\u00a0=\u00a0{int(n):,}\u00a0<\u00a0{need} for the {what}" if int(n) < need else ""


def fmt_wall(wall_ns: Any) -> str:
    if not _finite(wall_ns):
        return DASH
    t = dt.datetime.fromtimestamp(int(wall_ns) / 1e9, tz=dt.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def fmt_rel(seconds: Any) -> str:
    if not _finite(seconds):
        return DASH
    s = float(seconds)
    sign = "-" if s < 0 else "+"
    s = abs(s)
    if s < 600:
        return f"t{sign}{s:.3f} s"
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"t{sign}{int(h)}:{int(m):02d}:{sec:06.3f}"


def cap_rows(
    rows: Sequence[tuple[str, ...]], limit: int, what: str, where: str
) -> tuple[tuple[tuple[str, ...], ...], str]:
    """At most `limit` rows, and the note saying how many were left out and where the
    rest can be read."""
    if len(rows) <= limit:
        return tuple(rows), ""
    return (
        tuple(rows[:limit]),
        f"showing {limit:,} of {len(rows):,} {what}; the rest are in {where}",
    )


def table(
    columns: Iterable[str],
    rows: Iterable[Iterable[str | Cell]],
    *,
    name: str = "",
    caption: str = "",
    note: str = "",
    numeric: Iterable[bool] = (),
    row_class: Iterable[str] = (),
    folded: bool = False,
) -> Table:
    return Table(
        tuple(columns),
        tuple(tuple(r) for r in rows),
        name=name,
        caption=caption,
        note=note,
        numeric=tuple(numeric),
        row_class=tuple(row_class),
        folded=folded,
    )
