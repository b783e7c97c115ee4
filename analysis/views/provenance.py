# size: the report's provenance section (plan, software, clocks, network) reads top to bottom as one
"""Report sections about the run as a whole: the verdict banner and the rules, the
manifest and provenance (versions, hashes, hosts, clock offsets), the executed plan and
the pipeline's steps (golden before/after included) and the signed bundle (the §17
vendor data: analysis.views.vendor)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from analysis.judge.verdict import is_too_short, too_short_lines
from analysis.tables.join import coalesced_note
from analysis.tables.runfiles import redact
from analysis.views.model import (
    Banner,
    RunView,
    Section,
    cap_rows,
    fmt_int,
    fmt_num,
    fmt_rel,
    fmt_wall,
    table,
)
from analysis.views.network import (
    burst_spreads,
    bursts_table,
    master_offsets,
    network_table,
    rtt_measured,
)
from calculet_load.schema.manifest import REHEARSAL_BANNER, is_rehearsal

__all__ = [
    "BANNER_RULES",
    "EXIT_MEANINGS",
    "banner",
    "plan_section",
    "provenance_section",
    "signature_section",
    "verdicts_section",
]

EXIT_MEANINGS: dict[int, tuple[str, str, str]] = {
    0: ("PASS", "pass: no rule failed", "pass"),
    1: (
        "FAIL",
        "correctness / reliability fail: a hard gate failed (golden, NaN/Inf, "
        "token counts, errors)",
        "fail",
    ),
    2: (
        "INVALID",
        "artifact or configuration invalid: a file or the config could not be "
        "used; nothing was judged",
        "invalid",
    ),
    3: (
        "INVALID MEASUREMENT",
        "infrastructure invalid: the measurement itself is not "
        "sound (client saturated, stamps incomplete, network break): neither a product "
        "pass nor a fail; rerun",
        "invalid",
    ),
    4: (
        "REGRESSION",
        "performance regression: a performance rule failed (a regression "
        "beyond its allowance, a missed target, an SLA)",
        "fail",
    ),
}
"""Spec §15 exit codes: (headline, meaning, css class)."""

_MAX_EVENT_ROWS = 500
_DETAIL_CHARS = 300


def _pipeline_codes(rv: RunView) -> tuple[int | None, str | None]:
    """The pipeline's own exit code (a run-level stop or end in events.jsonl)."""
    code: int | None = None
    reason = None
    for e in rv.events or []:
        if e.get("step") == "run" and e.get("status") in ("stopped", "end"):
            if isinstance(e.get("code"), int):
                code = int(e["code"])
            if e.get("status") == "stopped":
                reason = str(e.get("reason") or "")
    return code, reason


def _endpoint_facts(rv: RunView) -> list[tuple[str, str]]:
    """Warnings about how the target was reached and what that did to the timings:
    certificate verification off (--insecure), and events a proxy delivered coalesced."""
    facts: list[tuple[str, str]] = []

    def at(doc: Any, *keys: str) -> Any:
        """doc[k1][k2]...; None where a level is missing or not a mapping (a plan's
        `target` is its URL in some runs, a mapping in others)."""
        for key in keys:
            doc = doc.get(key) if isinstance(doc, dict) else None
        return doc

    accesses = [
        at(rv.manifest, "target"),
        at(rv.index, "options", "target_access"),
        at(rv.plan, "target", "access"),
    ]
    insecure = [a for a in accesses if isinstance(a, dict) and a.get("insecure") is True]
    if insecure:
        url = next((str(a["url"]) for a in insecure if a.get("url")), "the target")
        facts.append(("TLS", f"INSECURE: certificate verification was OFF for {url} (--insecure)"))
    if rv.table is not None:
        note = coalesced_note(rv.table)
        if note is not None:
            facts.append(("stream events COALESCED", note))
    return facts


def banner(rv: RunView) -> Banner:
    v = rv.verdict
    stop_code, stop_reason = _pipeline_codes(rv)
    facts: list[tuple[str, str]] = []
    run_id = str(((v or {}).get("run") or {}).get("run_id") or "")
    if not run_id:
        run_id = str((rv.manifest or {}).get("run_id") or rv.files.uri.rstrip("/").split("/")[-1])
    purpose = str(
        ((v or {}).get("run") or {}).get("purpose") or (rv.manifest or {}).get("purpose") or ""
    )
    # spec §8: a rehearsal says so in the banner (verdict.json's, else the manifest's purpose)
    rehearsal = (v or {}).get("banner") or (REHEARSAL_BANNER if is_rehearsal(purpose) else None)
    failing: list[tuple[str, str, str]] = []
    too_short: tuple[str, ...] = ()
    if v is None:
        code = stop_code
        headline = "NO VERDICT"
        meaning = "verdict.json is missing: the analysis did not complete"
        if rv.load_error:
            meaning += f" ({rv.load_error})"
        css = "invalid"
        if code is not None:
            head, text, css = EXIT_MEANINGS.get(code, ("?", "unknown exit code", "invalid"))
            headline, meaning = head, f"{text}; {meaning}"
    else:
        code = int(v["exit_code"])
        facts.append(("verdict.json exit code", str(code)))
        # the pipeline's stop for correctness wins over the analysis (pipeline._finish)
        if stop_code == 1 and code != 1:
            code = 1
        headline, meaning, css = EXIT_MEANINGS.get(code, ("?", "unknown exit code", "invalid"))
        counts = v.get("counts") or {}
        facts.append(
            (
                "rules",
                ", ".join(
                    f"{fmt_int(counts.get(k, 0))} {k.replace('_', ' ')}"
                    for k in ("pass", "fail", "inconclusive", "not_evaluated")
                ),
            )
        )
        verdicts = v.get("verdicts") or []
        # failures first; a rule the run was too short to decide is counted in one line
        for status in ("fail", "inconclusive"):
            for r in verdicts:
                if r.get("status") == status and not is_too_short(r):
                    failing.append((str(r.get("rule")), status, _short(str(r.get("reason")))))
        too_short = tuple(too_short_lines(verdicts))
    faults = rv.files.read_json("faults.json")
    if isinstance(faults, dict) and isinstance(faults.get("exit_code"), int):
        fcode = int(faults["exit_code"])
        summary = faults.get("summary") or {}
        facts.append(
            (
                "fault matrix (faults.json)",
                f"exit code {fcode}; " + ", ".join(f"{fmt_int(n)} {k}" for k, n in summary.items()),
            )
        )
        for sc in faults.get("scenarios") or []:
            verdict = str(sc.get("verdict")).upper() if isinstance(sc, dict) else ""
            if isinstance(sc, dict) and verdict in ("FAIL", "ERROR", "NOT_RUN"):
                failing.append(
                    (
                        f"fault scenario {sc.get('name')}",
                        str(sc.get("verdict")).lower(),
                        "; ".join(str(e.get("check")) for e in sc.get("evidence") or [])[:300]
                        or str(sc.get("reason") or ""),
                    )
                )
        if v is None:
            run_id = str(faults.get("run_id") or run_id)
        # a failed fault matrix fails the folder, as a pipeline stopped for correctness
        # does (its 1 wins over the analysis' code); its 2 or 3 only replaces a pass
        if fcode != 0 and (v is None or code in (None, 0) or (fcode == 1 and code != 1)):
            code = fcode
            headline, text, css = EXIT_MEANINGS.get(code, ("?", "unknown exit code", "invalid"))
            meaning = f"{text}; the fault matrix (faults.json) exited {fcode}" + (
                "; this folder has no verdict.json (no performance records were analysed)"
                if v is None
                else ""
            )
        elif v is None and code is None:
            code = fcode
            headline, text, css = EXIT_MEANINGS.get(code, ("?", "unknown exit code", "invalid"))
            meaning = f"{text}; the fault matrix (faults.json) exited {fcode}; no verdict.json"
    facts += _endpoint_facts(rv)
    if stop_reason:
        facts.append(("pipeline stopped", stop_reason))
    if stop_code is not None:
        facts.append(("pipeline exit code", str(stop_code)))
    return Banner(
        exit_code=code,
        status=headline,
        meaning=meaning,
        css=css,
        run_id=run_id,
        purpose=purpose,
        facts=tuple(facts),
        failing=tuple(failing[:BANNER_RULES]),
        rehearsal=rehearsal,
        more_failing=max(0, len(failing) - BANNER_RULES),
        too_short=too_short,
    )


BANNER_RULES = 5
"""Failed or inconclusive rules the banner lists; the rest are counted (all are in "Rules
and verdicts"), so the first screen keeps the headline table in view."""
_REASON_CHARS = 220


def _short(reason: str) -> str:
    return reason if len(reason) <= _REASON_CHARS else reason[: _REASON_CHARS - 1] + "…"


def _value(x: Any) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.6g}"
    if x is None:
        return "–"
    if isinstance(x, dict | list):
        return json.dumps(redact(x), sort_keys=True, default=str)
    return str(x)


def verdicts_section(rv: RunView) -> Section:
    s = Section("verdicts", "Rules and verdicts")
    v = rv.verdict
    if v is None:
        return s.empty("verdict.json is missing (run `calculet-load analyze RUN`)")
    rules = v.get("rules") or {}
    s.intro.append(
        f"Rules file {rules.get('file')} (sha256 {rules.get('sha256')}); "
        f"fail_on_inconclusive: {rules.get('fail_on_inconclusive')}. An inconclusive or "
        "not-evaluated rule is never a pass. Exit code precedence: 2, then 3, then 1, then 4."
    )
    order = {"fail": 0, "inconclusive": 1, "pass": 2, "not_evaluated": 3}
    rows = sorted(v.get("verdicts") or [], key=lambda r: order.get(str(r.get("status")), 9))
    s.tables.append(
        table(
            ("rule", "class", "status", "observed", "threshold", "n", "reason"),
            [
                (
                    str(r.get("rule")),
                    str(r.get("class")),
                    str(r.get("status")).replace("_", " "),
                    _value(r.get("observed")),
                    _value(r.get("threshold")),
                    fmt_int(r.get("n")),
                    str(r.get("reason")),
                )
                for r in rows
            ],
            name="verdicts",
            numeric=(False, False, False, True, False, True, False),
            row_class=[str(r.get("status")) for r in rows],
        )
    )
    return s


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if isinstance(d, dict):
        for k, val in d.items():
            out += _flatten(val, f"{prefix}{k}.")
        return out
    return [(prefix.rstrip("."), _value(d))]


def provenance_section(rv: RunView, base: RunView | None) -> Section:
    s = Section("provenance", "Manifest and provenance")
    man = rv.manifest
    if man is None:
        s.notes.append(f"manifest.yaml: {NO_MANIFEST}")
    else:
        rows = _flatten(man)
        bman = dict(_flatten(base.manifest)) if base is not None and base.manifest else None
        if bman is None:
            s.tables.append(
                table(
                    ("field", "value"),
                    rows,
                    name="manifest",
                    caption="manifest.yaml (the run's declaration, spec §5)",
                )
            )
        else:
            keys = [k for k, _ in rows] + [k for k in bman if k not in dict(rows)]
            cand = dict(rows)
            s.tables.append(
                table(
                    ("field", "candidate", "baseline"),
                    [(k, cand.get(k, "–"), bman.get(k, "–")) for k in keys],
                    name="manifest",
                    caption="manifest.yaml of both runs; rows that differ are marked",
                    row_class=["warn" if cand.get(k) != bman.get(k) else "" for k in keys],
                )
            )
    if rv.table is not None:
        s.tables.append(_versions(rv))
        s.tables.append(_hosts(rv))
    for extra in (network_table(rv.index), bursts_table(rv.index, _bursts(rv))):
        if extra is not None:
            s.tables.append(extra)
    s.intro.append(_clocks(rv))
    return s


NO_MANIFEST = "absent: versions and hashes come from the records only"


def _bursts(rv: RunView) -> list[tuple[str, int, int, float]] | None:
    """Each burst's spread from the records (when the index has none: an accept run)."""
    if rv.table is None:
        return None
    ids = rv.col("ext.burst_id")
    if not any(ids.tolist()):
        return None
    anchors = rv.col("ext.wall_anchor_ns", fill=0, dtype=np.int64)
    return burst_spreads(ids.tolist(), rv.col("ext.worker").tolist(), anchors,
                         master_offsets(rv.index))  # fmt: skip


def _versions(rv: RunView) -> Any:
    cols = (
        "model_alias",
        "model_generation",
        "software.server_commit",
        "software.image_digest",
        "software.calrt",
        "software.driver",
        "software.firmware",
        "hardware.power_mode",
        "ext.protocol",
    )
    assert rv.table is not None
    t = pa.table({c: rv.table.column(c).cast(pa.string()).fill_null("–") for c in cols})
    counts = t.group_by(list(cols)).aggregate([([], "count_all")])
    combos = sorted(
        ((tuple(str(r[c]) for c in cols), int(r["count_all"])) for r in counts.to_pylist()),
        key=lambda kv: -kv[1],
    )
    return table(
        (
            "model",
            "generation",
            "server commit",
            "image",
            "calrt",
            "driver",
            "firmware",
            "power mode",
            "protocol",
            "records",
        ),
        [(*k, fmt_int(n)) for k, n in combos],
        name="versions",
        caption="versions the records carry (one row per distinct combination); more than "
        "one row means the versions changed during the run",
        row_class=["warn" if len(combos) > 1 else ""] * len(combos),
    )


def _hosts(rv: RunView) -> Any:
    worker = rv.col("ext.worker")
    host = rv.col("ext.host")
    anchor = rv.col("ext.wall_anchor_ns")
    rows = []
    for w in sorted(set(worker.tolist())):
        m = worker == w
        hosts = sorted({h for h in host[m].tolist() if h}) or ["–"]
        off = rv.client_offsets_ns.get(str(w))
        rows.append(
            (
                str(w) or "–",
                ", ".join(hosts),
                fmt_int(int(m.sum())),
                fmt_wall(np.nanmin(anchor[m])),
                fmt_wall(np.nanmax(anchor[m])),
                "not recorded" if off is None else f"{off / 1e6:+.3f} ms",
            )
        )
    return table(
        ("worker", "host", "records", "first request", "last request", "NTP offset"),
        rows,
        name="hosts",
        caption="client workers and hosts (wall clock of each host; durations never mix clocks)",
        numeric=(False, False, True, False, False, True),
    )


def _clocks(rv: RunView) -> str:
    server = (
        f"server clock offset {rv.server_offset_ns / 1e6:+.3f} ms (server/clock.json)"
        if rv.files.exists("server/clock.json")
        else "server clock offset: not recorded (no server/clock.json)"
    )
    net = (
        "network RTT/jitter to the target: measured by each worker (table 'network')"
        if rtt_measured(rv.index)
        else "network RTT/jitter: not recorded by this run; time no trace explains is shown "
        "as 'unattributed' (client + network) in the breakdowns"
    )
    return f"{server}; {net}."


def plan_section(rv: RunView) -> Section:
    s = Section("plan", "Executed plan and pipeline steps")
    plan = rv.plan
    if plan is None:
        s.notes.append("plan.json: absent (not a `calculet-load accept` run)")
    else:
        if plan.get("below_minimum_repetitions"):
            s.intro.append(
                "Rehearsal: some cells have fewer repetitions than spec §8's 30 (100 for short "
                "cases), which only a rehearsal may; intervals are wide and P99 bounds may "
                "not exist."
            )
        s.intro.append(
            f"Seed {plan.get('seed')}, attempts {plan.get('attempts')}; cells in executed "
            "(randomized) order:"
        )
        cells = sorted(plan.get("cells") or [], key=lambda c: c.get("started_wall_ns") or 0)
        rows = [
            (
                str(i),
                str(c.get("name")),
                fmt_int(c.get("repetitions")),
                fmt_int(c.get("requests")),
                str(c.get("status")),
                str(c.get("worker") or "–"),
                fmt_rel(rv.rel_s(c.get("started_wall_ns"))),
                fmt_num(((c.get("ended_wall_ns") or 0) - (c.get("started_wall_ns") or 0)) / 1e9)
                if c.get("ended_wall_ns")
                else "–",
            )
            for i, c in enumerate(cells, 1)
        ]
        shown, note = cap_rows(rows, _MAX_EVENT_ROWS, "cells", "plan.json")
        s.tables.append(
            table(
                ("#", "cell", "repetitions", "requests", "status", "worker", "started", "s"),
                shown,
                name="plan",
                note=note,
                numeric=(True, False, True, True, False, False, False, True),
                row_class=["" if c.get("status") == "done" else "warn" for c in cells],
            )
        )
        excluded = plan.get("excluded") or []
        s.tables.append(
            table(
                ("cell", "worker", "reason"),
                [
                    (str(e.get("cell")), str(e.get("worker")), str(e.get("reason")))
                    for e in excluded
                ],
                name="plan-excluded",
                caption="excluded attempts (a cell cut by a crash is run again; its first "
                "records are excluded)"
                if excluded
                else "excluded attempts: none",
            )
        )
    if rv.events is None:
        s.notes.append("events.jsonl: absent (not a pipeline run): no step log")
        return s
    s.tables.append(_steps(rv))
    return s


def _steps(rv: RunView) -> Any:
    rows = []
    classes = []
    for e in rv.events or []:
        detail = {k: v for k, v in e.items() if k not in ("wall_ns", "step", "status")}
        text = json.dumps(redact(detail), sort_keys=True, default=str) if detail else ""
        if len(text) > _DETAIL_CHARS:
            text = text[:_DETAIL_CHARS] + "…"
        rows.append(
            (fmt_rel(rv.rel_s(e.get("wall_ns"))), str(e.get("step")), str(e.get("status")), text)
        )
        failed = e.get("failures") or e.get("status") == "stopped"
        failed = failed or e.get("back_to_baseline") is False or e.get("stable") is False
        classes.append("fail" if failed else "")
    shown, note = cap_rows(rows, _MAX_EVENT_ROWS, "step events", "events.jsonl")
    return table(
        ("time", "step", "status", "details"),
        shown,
        name="steps",
        caption="the pipeline's step log (events.jsonl): release, idle, golden before, warmup, "
        "matrix, golden after, resources, traces, analysis",
        note=note,
        row_class=classes[: len(shown)],
    )


def signature_section(rv: RunView) -> Section:
    s = Section("signature", "Signed result bundle")
    b = rv.files.bundle()
    if b is None:
        s.intro.append(
            "No bundle.intoto.json yet. The acceptance pipeline signs the run folder after "
            "writing this report, so the bundle covers this file too: check it with "
            "`calculet-load verify RUN`."
        )
        return s
    if b.error:
        s.intro.append(
            f"bundle.intoto.json is {b.error}; `calculet-load verify RUN` names the problem."
        )
        return s
    how = f"signed, key {b.key_id}" if b.signed else "UNSIGNED (written without a key)"
    s.intro.append(
        f"bundle.intoto.json: {how}; created {b.created} by {b.tool}; "
        f"{fmt_int(b.files)} files listed"
        f"{', report.html among them' if b.lists_report else ''}. This is what the bundle "
        "claims, not a check: `calculet-load verify RUN` hashes every file and checks the "
        "signature. A report rendered again into a signed folder changes report.html, which "
        "verify then names: sign the folder again."
    )
    return s
