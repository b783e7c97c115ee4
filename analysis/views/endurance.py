"""The report's §13 endurance section: each chip's temperature drift over the run and the
long-run KV fragmentation signals where the target reports them, as verdict.json's
`endurance` section computed them (analysis.judge.stability.endurance_section)."""

from __future__ import annotations

from typing import Any

from analysis.views.model import RunView, Section, fmt_int, fmt_num, table

__all__ = ["endurance_section"]

_COLUMNS = ("first", "last", "change", "min", "max", "slope per h", "slope interval", "trend")


def _row(head: tuple[str, ...], t: dict[str, Any]) -> tuple[str, ...]:
    return (
        *head,
        fmt_int(t["samples"]),
        *(fmt_num(t[k]) for k in ("first", "last", "change", "min", "max", "slope")),
        f"[{fmt_num(t['slope_lo'])}, {fmt_num(t['slope_hi'])}]",
        str(t["trend"]),
    )


def endurance_section(rv: RunView) -> Section:
    s = Section("endurance", "Endurance: temperature drift and KV fragmentation (spec §13)")
    doc = (rv.verdict or {}).get("endurance")
    if not isinstance(doc, dict):
        return s.empty("verdict.json has no endurance section (run calculet-load analyze)")
    s.intro.append(
        "Spec §13's endurance stage watches heat and long-term fragmentation. Each series: "
        "its first and last tenth (after a tenth of warmup), its range, and its Theil–Sen "
        "slope per hour of server time with Sen's 95% interval: rising or falling when the "
        f"interval excludes 0 (time scale {fmt_num(doc.get('time_scale'))})."
    )
    temp = doc.get("temperature") or {}
    if temp.get("chips"):
        s.tables.append(
            table(
                ("chip", "samples", *(f"{c} °C" if c != "trend" else c for c in _COLUMNS)),
                [_row((str(c["chip"]),), c) for c in temp["chips"]],
                name="endurance_temperature",
                caption="temperature per chip (°C; slope in °C per hour)",
                numeric=(True, True, *([True] * 7), False, False),
            )
        )
    elif temp.get("note"):
        s.notes.append(str(temp["note"]))
    frag = doc.get("fragmentation") or {}
    series = frag.get("series") or {}
    if series:
        s.tables.append(
            table(
                ("series", "unit", "samples", *_COLUMNS),
                [_row((name, str(t["unit"])), t) for name, t in series.items()],
                name="endurance_fragmentation",
                caption="KV fragmentation signals the target reports (falling: fragmenting)",
                numeric=(False, False, True, *([True] * 6), False, False),
            )
        )
    elif frag.get("note"):
        s.notes.append(f"fragmentation: {frag['note']}")
    return s
