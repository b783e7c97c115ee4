"""One analysed run (the joined run folder, its quality table and its cell summaries),
the context rule handlers read, and their small shared helpers."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.judge.rules import RULE_CLASS, AnalysisSettings
from analysis.judge.verdict import RuleClass, RuleVerdict, Status, TooShort
from analysis.stats.quantiles import FloatArray
from analysis.tables.cells import CellData, CellKey, CellSummary, summarize_cells
from analysis.tables.load import RunData
from analysis.tables.quality import Partition, QualityReport, apply_quality

__all__ = [
    "Context",
    "Evidence",
    "build_evidence",
    "column_np",
    "not_evaluated",
    "sent_mask",
    "verdict_for",
]


@dataclass(frozen=True, slots=True)
class Evidence:
    """`summaries` and `cells` are the performance cells; the boundary cells (spec §6.1,
    judged only by their overflow policy: analysis.judge.boundary) are named in
    `boundary_names`, summarized in `boundary_summaries`, and in no rule's statistics."""

    run: RunData
    table: pa.Table  # joined records + quality columns
    quality: QualityReport
    summaries: list[CellSummary]
    cells: list[CellData]
    boundary_names: frozenset[str] = frozenset()
    boundary_summaries: list[CellSummary] = field(default_factory=list)

    def in_boundary(self) -> Any:
        """Per record of `table`: whether it belongs to a boundary cell."""
        if not self.boundary_names:
            return np.zeros(self.table.num_rows, dtype=bool)
        names = pa.array(sorted(self.boundary_names), pa.string())
        return column_np(pc.is_in(self.table.column("ext.cell"), value_set=names), False, bool)

    def values(
        self, partition: str = Partition.MEASURED.value
    ) -> dict[CellKey, dict[str, FloatArray]]:
        """Metric values per cell of one partition (what comparisons read)."""
        return {c.key: c.values for c in self.cells if c.partition == partition}

    def cell_data(self, partition: str = Partition.MEASURED.value) -> dict[CellKey, CellData]:
        return {c.key: c for c in self.cells if c.partition == partition}

    def summary(
        self, key: CellKey, partition: str = Partition.MEASURED.value
    ) -> CellSummary | None:
        for s in self.summaries:
            if s.key == key and s.partition == partition:
                return s
        return None


def build_evidence(
    run: RunData,
    *,
    level: float = 0.95,
    trim_fraction: float = 0.1,
    n_resamples: int = 1000,
    bootstrap_max_n: int = 2000,
    progress: Callable[[str], None] | None = None,
    boundary: Sequence[str] = (),
) -> Evidence:
    """Quality partitions, then per-cell summaries, of a loaded (joined) run; cells
    whose name matches a `boundary` pattern are set apart (Evidence)."""
    table, report = apply_quality(run)
    summaries, cells = summarize_cells(
        table,
        run.tokens,
        level=level,
        trim_fraction=trim_fraction,
        client_offsets_ns=run.client_offsets_ns,
        n_resamples=n_resamples,
        bootstrap_max_n=bootstrap_max_n,
        progress=progress,
    )
    names = table.column("ext.cell").unique().drop_null().to_pylist()
    apart = frozenset(
        str(n) for n in names if any(fnmatch.fnmatchcase(str(n), p) for p in boundary)
    )
    if not apart:
        return Evidence(run, table, report, summaries, cells)
    return Evidence(
        run,
        table,
        report,
        [s for s in summaries if s.key.name not in apart],
        [c for c in cells if c.key.name not in apart],
        apart,
        [s for s in summaries if s.key.name in apart],
    )


@dataclass(frozen=True, slots=True)
class Context:
    """What a rule handler reads: the candidate, the baseline if any, the settings; and a
    cache where an analysis a section and a rule both need is computed once."""

    candidate: Evidence
    baseline: Evidence | None
    settings: AnalysisSettings
    cache: dict[Any, Any] = field(default_factory=dict)


def verdict_for(
    rule: Any,
    status: Status,
    observed: Any,
    threshold: Any,
    n: int,
    reason: str,
    details: Sequence[dict[str, Any]] = (),
    *,
    suffix: str = "",
    too_short: TooShort | None = None,
) -> RuleVerdict:
    return RuleVerdict(
        rule=rule.id + suffix,
        kind=rule.kind,
        # a kind outside the rules file's (the infrastructure checks) is its own class
        rule_class=RuleClass(RULE_CLASS.get(rule.kind, rule.kind)),
        status=status,
        observed=observed,
        threshold=threshold,
        n=n,
        reason=reason,
        details=tuple(details),
        too_short=too_short,
    )


def not_evaluated(
    rule: Any,
    reason: str,
    *,
    observed: Any = None,
    threshold: Any = None,
    n: int = 0,
    details: Sequence[dict[str, Any]] = (),
    suffix: str = "",
) -> RuleVerdict:
    """The one constructor of a `not_evaluated` verdict: disabled, not configured
    ("not configured: set <field> ..."), no data, or not available on the
    target. The reason says which, and what to do next."""
    return verdict_for(
        rule, Status.NOT_EVALUATED, observed, threshold, n, reason, details, suffix=suffix
    )


def column_np(col: Any, fill: Any, dtype: Any = None) -> Any:
    return np.asarray(pc.fill_null(col, fill).to_numpy(zero_copy_only=False), dtype=dtype)


def sent_mask(t: pa.Table) -> Any:
    part = column_np(t.column("quality.partition"), "", object)
    return (part != Partition.DROPPED.value) & (part != Partition.CUT_AT_STOP.value)
