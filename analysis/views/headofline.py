"""The head-of-line section of the report (spec §6.3): verdict.json's `head_of_line`
(analysis.judge.headofline) laid out — the short requests' TTFT/TPOT beside a long prefill
in flight, against the control and against the same cell's short requests that
overlapped none, each change with its interval."""

from __future__ import annotations

from typing import Any

from analysis.views.model import (
    RunView,
    Section,
    comparison_why,
    fmt_ci,
    fmt_int,
    fmt_ms,
    fmt_pct,
    table,
)

__all__ = ["head_of_line_section"]


def head_of_line_section(rv: RunView) -> Section:
    s = Section("head-of-line", "Head-of-line blocking (spec §6.3)")
    h = (rv.verdict or {}).get("head_of_line")
    if not isinstance(h, dict):
        why = "no head-of-line cell (a cell named like *head-of-line*: the matrix's mix cell)"
        if rv.verdict is not None and "head_of_line" not in rv.verdict:
            why = "verdict.json has no head_of_line section (run `calculet-load analyze` again)"
        return s.empty(why)
    n = h.get("counts") or {}
    s.intro.append(
        f"Cells {', '.join(h.get('cells') or [])} against the control "
        f"{', '.join(h.get('control_cells') or []) or '(none)'}: "
        f"{fmt_int(n.get('long_prefills'))} long prefill(s) (prompt ≥ "
        f"{fmt_int(h.get('long_prompt_tokens'))} tokens), {fmt_int(n.get('short'))} short "
        f"requests: {fmt_int(n.get('ttft_ms_overlapping'))} successes waited for their first "
        f"token beside a long prefill in flight ({fmt_int(n.get('ttft_ms_not_overlapping'))} "
        f"did not), {fmt_int(n.get('tpot_ms_overlapping'))} decoded beside one; "
        f"{fmt_int(n.get('control'))} control successes. A positive delta is the penalty of "
        "the long prefill; 'shown' when its interval lies above 0. Method: "
        f"{h.get('method', '?')}."
    )
    s.notes.extend(str(x) for x in h.get("notes") or [])
    rows: list[tuple[str, ...]] = []
    classes: list[str] = []
    level = float((((rv.verdict or {}).get("methods") or {}).get("confidence_level")) or 0.95)
    for c in h.get("comparisons") or []:
        rows.append(_row(c, level))
        classes.append({"shown": "fail", "none shown": "pass"}.get(str(c.get("penalty")), ""))
    s.tables.append(
        table(
            (
                "comparison",
                "metric",
                "statistic",
                "n ref",
                "n overlapping",
                "reference",
                "overlapping",
                "penalty ms [CI]",
                "penalty % [CI]",
                "penalty",
            ),
            rows,
            name="head-of-line",
            caption="the short requests' TTFT/TPOT overlapping a long prefill vs the "
            "reference (the control cells', or the same cell's that overlapped none)",
            numeric=(False, False, False, True, True, True, True, True, True, False),
            row_class=classes,
        )
    )
    return s


def _row(c: dict[str, Any], level: float) -> tuple[str, ...]:
    lo, hi = c.get("ci_abs") or (None, None)
    plo, phi = c.get("ci_pct") or (None, None)
    why = comparison_why(
        str(c.get("statistic")), int(c.get("n_baseline") or 0), int(c.get("n_candidate") or 0),
        level,
    )  # fmt: skip
    return (
        str(c.get("cell")),
        str(c.get("metric")),
        str(c.get("statistic")),
        fmt_int(c.get("n_baseline")),
        fmt_int(c.get("n_candidate")),
        fmt_ms(c.get("baseline")),
        fmt_ms(c.get("candidate")),
        f"{fmt_ms(c.get('delta_abs'))} {fmt_ci(lo, hi, why=why)}",
        f"{fmt_pct(c.get('delta_pct'), signed=True)} {fmt_ci(plo, phi, '%', why)}",
        str(c.get("penalty")),
    )
