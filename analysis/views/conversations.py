"""The report's conversations section: TTFT by turn and by cached share, from
`conversations.parquet` (written by `calculet-load analyze`: analysis.tables.conversations),
and TTFT against context length with each request coloured by its cached share, from the
records.

Only a run with conversations has the section (records carrying `ext.turn`, or the
file): a run without one shows nothing, not a "no data" section.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from analysis.tables.conversations import (
    CONVERSATIONS_FILES,
    CONVERSATIONS_SCHEMA,
    NOT_REPORTED,
    cached_share,
    conversation_rows,
)
from analysis.views import plots
from analysis.views.cells import short_warnings
from analysis.views.model import (
    DASH,
    RunView,
    Section,
    Table,
    cap_rows,
    figure,
    fmt_ci,
    fmt_int,
    fmt_ms,
    fmt_pct,
    quantile_why,
    table,
)

__all__ = ["SCATTER", "conversations_section"]

SCATTER = 1000
"""Requests drawn in the TTFT-vs-context plot at most (a seeded sample beyond)."""
_MAX_ROWS = 200
_FILE = CONVERSATIONS_FILES[0]


def _has_turns(rv: RunView) -> bool:
    if rv.table is None:
        return False
    turn = rv.table.column("ext.turn")
    return bool(turn.null_count < len(turn))


def _read(rv: RunView) -> pa.Table | None:
    if not rv.files.exists(_FILE):
        return None
    try:
        stats = pq.read_table(rv.files.path(_FILE), filesystem=rv.files.fs)
    except (OSError, ValueError) as exc:
        rv.files.notes.append(f"{_FILE}: unreadable ({exc}); shown as no data")
        return None
    schema = (stats.schema.metadata or {}).get(b"schema", b"").decode(errors="replace")
    if schema != CONVERSATIONS_SCHEMA:
        rv.files.notes.append(
            f"{_FILE}: schema {schema or 'unnamed'!r}, not {CONVERSATIONS_SCHEMA}; shown as no "
            "data (run `calculet-load analyze RUN` again)"
        )
        return None
    return stats


def conversations_section(rv: RunView) -> Section | None:
    """The section, or None for a run without conversations."""
    stats = _read(rv)
    if stats is None and not _has_turns(rv):
        return None
    s = Section("conversations", "Conversations and prefix caching")
    s.intro.append(
        "Each turn of a conversation sends the whole history before it. Counted: the "
        "successful measured requests that carry a turn index (ext.turn, from 0). Context = "
        "the turn's prompt tokens (workload.prompt_tokens: the history and the new "
        "message). Cached share = cached prompt tokens / context, where the server said how "
        "many prompt tokens it served from its prefix cache; 'not reported' where it did "
        "not (never taken as 0). Shares on a bin's edge fall in the lower bin."
    )
    if stats is not None:
        level = float(stats.column("level")[0].as_py()) if stats.num_rows else 0.95
        rows = stats.to_pylist()
        s.tables.append(_stats_table(rows, "turn", level))
        s.tables.append(_stats_table(rows, "cached_share", level))
    elif rv.table is not None and conversation_rows(rv.table).size == 0:
        s.empty("no conversation turn succeeded in the measured partition")
    else:
        s.empty(f"{_FILE} is missing (run `calculet-load analyze RUN`)")
    if rv.table is not None:
        _scatter(rv, s)
    return s


def _percentile(r: dict[str, Any], p: str) -> str:
    why = quantile_why(float(p[1:]) / 100, r["count"], float(r["level"] or 0.95))
    return f"{fmt_ms(r[p])} {fmt_ci(r[p + '_lo'], r[p + '_hi'], why=why)}"


def _stats_table(rows: list[dict[str, Any]], by: str, level: float) -> Table:
    sel = [r for r in rows if r["by"] == by]
    out = [
        (
            r["cell"],
            r["group"],
            fmt_int(r["count"]),
            fmt_int(r["sessions"]),
            fmt_int(r["prompt_tokens_p50"]),
            fmt_int(r["cached_reported"]),
            DASH if r["cached_share_p50"] is None else fmt_pct(100 * r["cached_share_p50"]),
            *(_percentile(r, p) for p in ("p50", "p90", "p99")),
            short_warnings(r["warnings"]),
        )
        for r in sel
    ]
    shown, note = cap_rows(out, _MAX_ROWS, "rows", _FILE)
    what = "turn (from 0)" if by == "turn" else "cached share"
    return table(
        (
            "cell",
            what,
            "n",
            "sessions",
            "context P50 (tokens)",
            "cached reported",
            "cached share P50",
            "TTFT P50 [CI]",
            "TTFT P90 [CI]",
            "TTFT P99 [CI]",
            "warnings",
        ),
        shown,
        name=f"conversation-{by.replace('_', '-')}",
        caption=f"TTFT (ms) by {what}: {level * 100:g}% binomial order-statistic intervals "
        "(what the rules read; a missing bound says what n it needs); cached reported "
        "= requests whose server said how many prompt tokens it served from its cache",
        note=note,
        numeric=(False, by == "turn", True, True, True, True, True, True, True, True, False),
    )


def _scatter(rv: RunView, s: Section) -> None:
    assert rv.table is not None
    rows = conversation_rows(rv.table)
    context = rv.col("workload.prompt_tokens")[rows]
    ttft = rv.col("durations_ms.ttft")[rows]
    share = cached_share(rv.table)[rows]
    known = np.isfinite(context)
    if not np.any(known):
        s.notes.append("no turn has a context length: no plot of TTFT against it")
        return
    x, y, c = context[known], ttft[known], share[known]
    caption = (
        f"TTFT against context length, {x.size:,} successful measured turns, each coloured "
        f"by its cached share ({int(np.count_nonzero(~np.isfinite(c))):,} {NOT_REPORTED})"
    )
    if x.size > SCATTER:
        pick = np.random.default_rng(0).choice(x.size, SCATTER, replace=False)
        x, y, c = x[pick], y[pick], c[pick]
        caption += f"; {SCATTER:,} of them drawn (seeded sample)"
    if not np.all(known):
        s.notes.append(f"{int(np.count_nonzero(~known)):,} turn(s) without a context length")
    s.figures.append(
        figure(
            plots.shaded_scatter(
                x.tolist(),
                y.tolist(),
                c.tolist(),
                title="TTFT vs context length",
                xlabel="context (prompt tokens)",
                ylabel="TTFT ms",
                shade_label="cached share of the context",
                missing_label=f"cached tokens {NOT_REPORTED}",
            ),
            caption,
            name="ttft-context",
        )
    )
