"""The soak's own verdict in the report: `soak.json` of `calculet-load soak` (spec §13),
with its gaps first. A gap is a stretch of the stage with no client: the soak process
died (SIGKILL, OOM, host reboot) or was stopped, and a new process resumed the run
(`--resume`). Nothing was sent and nothing was sampled in a gap; the records of a killed
process' open Parquet part are lost, their number unknown. The report shows each gap
with its bounds and reason, and the conditions as the soak judged them (the target's
from its own samples; `client continuity` fails for any gap)."""

from __future__ import annotations

from typing import Any

from analysis.views.model import DASH, RunView, Section, fmt_num, table

__all__ = ["gap_notes", "soak_verdict_section"]


def _soak(rv: RunView) -> dict[str, Any] | None:
    doc = rv.files.read_json("soak.json") if rv.files.exists("soak.json") else None
    return doc if isinstance(doc, dict) and "conditions" in doc else None


def gap_notes(rv: RunView) -> list[str]:
    """One line per gap, for the notes at the top of the report."""
    doc = _soak(rv)
    if doc is None:
        return []
    return [
        f"soak gap {g.get('index')}: no client from {g.get('start')} to {g.get('end')} "
        f"({fmt_num(g.get('duration_s'))} s real): {g.get('reason')}; nothing was sent or "
        "sampled in it"
        + ("; the killed process' open part was lost" if g.get("open_part_lost") else "")
        for g in doc.get("gaps") or []
    ]


def soak_verdict_section(rv: RunView) -> Section:
    s = Section("soak-verdict", "Soak stage: verdict, gaps and conditions (spec §13)")
    doc = _soak(rv)
    if doc is None:
        return s.empty("no soak.json: not a `calculet-load soak` run")
    gaps = doc.get("gaps") or []
    s.intro.append(
        f"Stage {doc.get('stage')} ({doc.get('title')}): {doc.get('verdict')} "
        f"(exit {doc.get('exit_code')}). Planned {fmt_num(doc.get('run_duration_real_s'))} s "
        f"of real time at time scale {fmt_num(doc.get('time_scale'))}; "
        f"{len(doc.get('attempts') or [])} client process(es); {len(gaps)} gap(s)."
    )
    if gaps:
        s.intro.append(
            "In a gap the client was not running: no load, no sample of the target. The "
            "target's conditions are judged from its own samples on either side (the leak "
            "rule per segment, and over the joined series); the run is not a clean pass."
        )
        s.tables.append(
            table(
                ("gap", "from", "to", "real s", "target s", "reason", "before", "after",
                 "requests lost"),
                [
                    (
                        str(g.get("index")),
                        str(g.get("start")),
                        str(g.get("end")),
                        fmt_num(g.get("duration_s")),
                        fmt_num(g.get("duration_target_s")),
                        str(g.get("reason")),
                        str(g.get("before_worker")),
                        str(g.get("after_worker")),
                        (f"unknown (≥ {g.get('lost_requests_at_least')})"
                         if g.get("open_part_lost") else "none (flushed)"),
                    )
                    for g in gaps
                ],
                name="soak-gaps",
                row_class=["fail"] * len(gaps),
            )
        )  # fmt: skip
    rows, classes = [], []
    for c in doc.get("conditions") or []:
        ok = c.get("ok")
        rows.append(
            (
                str(c.get("condition")),
                str(c.get("class", DASH)),
                {True: "pass", False: "FAIL", None: "n/a"}.get(ok, str(ok)),
                str(c.get("expected")),
            )
        )
        classes.append("fail" if ok is False else "")
    s.tables.append(
        table(("condition", "class", "result", "expected"), rows, name="soak-conditions",
              row_class=classes)
    )  # fmt: skip
    return s
