"""Network breaks detected from the run's own evidence (spec §9: "a clear network break"
is a pre-registered reason to exclude requests; §15: it makes the run infrastructure
invalid, exit 3).

A network break is what the network does: packets that get no answer. A server that
crashes or restarts does something else on the wire: its port refuses (an RST answers the
SYN) and its open connections are reset. Those are the target's failures, judged on
reliability (exit 1), and are never a sign here (calculet_load.schema.netsigns). Two
signs, each read from files every run writes:

    probe      a round of the RTT/health probe (client/index.json workers[].target_rtt
               .rounds, calculet_load.target.netprobe) in which at least half of the
               samples' TCP connects timed out or had no route (the round's `failures`;
               a refusal, a reset, or a connection whose /health never answers, is the
               target's; a round without `failures` tells no kinds and is no sign)
    connect    a burst of network failures in the request records: at least BURST_MIN
               records of class connect_timeout or unreachable, each within
               BURST_GAP_NS of the previous one

Each sign is an interval on the reference clock (the worker's wall clock plus its NTP
offset, calculet_load.schema.clocks, as declared breaks are compared:
analysis.tables.quality); overlapping or adjacent intervals merge into one interval.

The server's own evidence then has its say: an interval during which, or up to
RESTART_AFTER_NS after which, the server's trace shows it restarting
(server_events.jsonl: a state_change from "starting", or one whose reason names a
restart, after the run's first request: its first start is none) is the server going
away, not the network: it is set aside (`SetAside`, its evidence saying why), its
records stay in and count against reliability. The others become `NetworkBreak`s
(source "detected") whose `evidence` lists what was seen. A declared break
(network_breaks.json) is kept as it is, beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.compute as pc

from analysis.tables.load import NetworkBreak, RunData
from analysis.tables.runfiles import RunFiles
from calculet_load.schema.clocks import to_reference_ns
from calculet_load.schema.netsigns import NETWORK_ERROR_CLASSES, NETWORK_PROBE_KINDS

__all__ = [
    "BURST_GAP_NS",
    "BURST_MIN",
    "NETWORK_ERROR_CLASSES",
    "RESTART_AFTER_NS",
    "Detection",
    "SetAside",
    "detect_breaks",
]

BURST_MIN = 3  # network failures that make a burst
BURST_GAP_NS = 2_000_000_000  # at most this between two failures of one burst
_MERGE_NS = BURST_GAP_NS  # signs this close are one break
# A server start this long after an interval still explains it: a request's or a probe's
# connect is stamped when it began, and it failed up to its connect timeout later.
RESTART_AFTER_NS = 10_000_000_000
_RESTART_SCAN_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class SetAside:
    """An interval with network signs that the server's own trace explains (it
    restarted): not a network break, its records are judged as any other."""

    start_wall_ns: int
    end_wall_ns: int
    reason: str
    evidence: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "source": "server_restart",
            "start_wall_ns": self.start_wall_ns,
            "end_wall_ns": self.end_wall_ns,
            "reason": self.reason,
            "evidence": list(self.evidence),
            "records": 0,  # nothing excluded
        }


@dataclass(frozen=True, slots=True)
class Detection:
    breaks: list[NetworkBreak] = field(default_factory=list)
    set_aside: list[SetAside] = field(default_factory=list)


def _probe_signs(run: RunData) -> list[tuple[int, int, str]]:
    out = []
    for w in (run.index or {}).get("workers") or []:
        if not isinstance(w, dict):
            continue
        worker = str(w.get("worker"))
        off = run.client_offsets_ns.get(worker, 0)
        rounds = (w.get("target_rtt") or {}).get("rounds") or []
        for r in rounds:
            if not isinstance(r, dict) or not isinstance(r.get("wall_ns"), int):
                continue
            failures = r.get("failures")
            if not isinstance(failures, dict):
                continue  # written before failures were told apart: no sign
            samples = int(r.get("samples") or 0)
            lost = sum(int(failures.get(k) or 0) for k in NETWORK_PROBE_KINDS)
            if samples == 0 or 2 * lost < samples:
                continue
            start = to_reference_ns(int(r["wall_ns"]), off)
            end = to_reference_ns(int(r.get("end_wall_ns") or r["wall_ns"]), off)
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(failures.items()))
            why = f"worker {worker}: RTT probe round: {lost} of {samples} connects lost ({kinds})"
            if r.get("last_error"):
                why += f"; last: {r['last_error']}"
            out.append((start, end, why))
    return out


def _column(t: Any, name: str, fill: Any) -> Any:
    return np.asarray(pc.fill_null(t.column(name), fill).to_numpy(zero_copy_only=False))


def _connect_signs(run: RunData) -> list[tuple[int, int, str]]:
    t = run.requests
    if t.num_rows == 0:
        return []
    cls = _column(t, "ext.error_class", "")
    hit = np.isin(cls, NETWORK_ERROR_CLASSES)
    anchor = _column(t, "ext.wall_anchor_ns", 0).astype(np.int64)
    hit &= anchor > 0
    if not hit.any():
        return []
    workers = _column(t, "ext.worker", "").astype(str)
    off = np.array([run.client_offsets_ns.get(w, 0) for w in workers], dtype=np.int64)
    at = to_reference_ns(anchor, off)[hit]
    kinds, ids = cls[hit], _column(t, "request_id", "")[hit]
    order = np.argsort(at, kind="stable")
    at, kinds, ids = at[order], kinds[order], ids[order]
    out = []
    first = 0
    for i in range(1, len(at) + 1):
        if i < len(at) and at[i] - at[i - 1] <= BURST_GAP_NS:
            continue
        n = i - first
        if n >= BURST_MIN:
            counts = {
                str(k): int(c)
                for k, c in zip(*np.unique(kinds[first:i], return_counts=True), strict=True)
            }
            what = ", ".join(f"{c} {k}" for k, c in sorted(counts.items()))
            out.append(
                (int(at[first]), int(at[i - 1]),
                 f"{n} requests could not reach the target within {BURST_GAP_NS / 1e9:g} s "
                 f"of one another ({what}; first {ids[first]}, last {ids[i - 1]})")
            )  # fmt: skip
        first = i
    return out


def _first_request_ns(run: RunData) -> int | None:
    """The reference wall time the run sent its first request: a server start before it
    is the server's first start, not a restart."""
    t = run.requests
    if t.num_rows == 0:
        return None
    anchor = _column(t, "ext.wall_anchor_ns", 0).astype(np.int64)
    sent = anchor > 0
    if not sent.any():
        return None
    workers = _column(t, "ext.worker", "").astype(str)
    off = np.array([run.client_offsets_ns.get(w, 0) for w in workers], dtype=np.int64)
    return int(to_reference_ns(anchor, off)[sent].min())


def _server_starts(run: RunData) -> list[tuple[int, str]]:
    """(reference wall ns, what) of every server restart in server_events.jsonl: a
    state_change from "starting" (the process came up) or one whose reason names a
    restart (a supervisor restart), after the run's first request (the server's first
    start, before the load, is none)."""
    began = _first_request_ns(run)
    scan = RunFiles(run.uri).scan_server_events(("state_change",), _RESTART_SCAN_LIMIT)
    out = []
    for r in scan.rows if scan is not None else []:
        detail: dict[str, Any] = r["detail"] if isinstance(r.get("detail"), dict) else {}
        why = str(detail.get("why") or "")
        wall = r.get("wall_ns")
        if not isinstance(wall, int) or not (
            detail.get("from") == "starting" or "restart" in why.lower()
        ):
            continue
        at = to_reference_ns(wall, run.server_offset_ns)
        if began is not None and at < began:
            continue
        what = f"state_change {detail.get('from')} -> {detail.get('to')}"
        out.append((at, what + (f" ({why})" if why else "")))
    return sorted(out)


def detect_breaks(run: RunData) -> Detection:
    """The network breaks the run's probe rounds and request records show (merged), and
    the intervals set aside because the server restarted in them."""
    signs = sorted(_probe_signs(run) + _connect_signs(run))
    merged: list[tuple[int, int, list[str]]] = []
    for start, end, why in signs:
        if merged and start <= merged[-1][1] + _MERGE_NS:
            s, e, whys = merged[-1]
            merged[-1] = (s, max(e, end), [*whys, why])
        else:
            merged.append((start, end, [why]))
    starts = _server_starts(run) if merged else []
    out = Detection()
    for s, e, whys in merged:
        restarts = [(t, what) for t, what in starts if s - _MERGE_NS <= t <= e + RESTART_AFTER_NS]
        if restarts:
            t, what = restarts[0]
            seen = (
                f"the server restarted at {(t - s) / 1e9:+.3f} s from the interval's start "
                f"(server_events.jsonl: {what}): a server restart, not a network break"
            )
            out.set_aside.append(
                SetAside(s, e, f"not a network break: the server restarted ({what})",
                         (*whys, seen))
            )  # fmt: skip
            continue
        out.breaks.append(
            NetworkBreak(
                start_wall_ns=s,
                end_wall_ns=e,
                reason=f"detected: {len(whys)} sign(s) of a network break",
                source="detected",
                evidence=tuple(whys),
            )
        )
    return out
