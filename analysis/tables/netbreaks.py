"""Network breaks detected from the run's own evidence (spec §9: "a clear network break"
is a pre-registered reason to exclude requests; §15: it makes the run infrastructure
invalid, exit 3).

Two signs, each read from files every run writes:

    probe      a round of the RTT/health probe (client/index.json workers[].target_rtt
               .rounds, calculet_load.target.netprobe) in which at least half of the
               samples failed: the target's port did not answer a fresh connection
    connect    a burst of connection failures in the request records: at least
               BURST_MIN records of class connect_refused, connect_timeout or
               connection_reset, each within BURST_GAP_NS of the previous one

Each sign is an interval of wall time (the worker's wall clock less its NTP offset, as
declared breaks are compared: analysis.tables.quality); overlapping or adjacent
intervals merge into one `NetworkBreak` (source "detected") whose `evidence` lists what
was seen. A declared break (network_breaks.json) is kept as it is, beside them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.compute as pc

from analysis.tables.load import NetworkBreak, RunData

__all__ = ["BURST_GAP_NS", "BURST_MIN", "CONNECT_CLASSES", "detect_breaks"]

CONNECT_CLASSES = ("connect_refused", "connect_timeout", "connection_reset")
BURST_MIN = 3  # connection failures that make a burst
BURST_GAP_NS = 2_000_000_000  # at most this between two failures of one burst
_MERGE_NS = BURST_GAP_NS  # signs this close are one break


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
            samples, errors = int(r.get("samples") or 0), int(r.get("errors") or 0)
            if samples == 0 or 2 * errors < samples:
                continue
            start = int(r["wall_ns"]) - off
            end = int(r.get("end_wall_ns") or r["wall_ns"]) - off
            why = f"worker {worker}: RTT probe round {errors} of {samples} samples failed"
            if r.get("last_error"):
                why += f" ({r['last_error']})"
            out.append((start, end, why))
    return out


def _column(t: Any, name: str, fill: Any) -> Any:
    return np.asarray(pc.fill_null(t.column(name), fill).to_numpy(zero_copy_only=False))


def _connect_signs(run: RunData) -> list[tuple[int, int, str]]:
    t = run.requests
    if t.num_rows == 0:
        return []
    cls = _column(t, "ext.error_class", "")
    hit = np.isin(cls, CONNECT_CLASSES)
    anchor = _column(t, "ext.wall_anchor_ns", 0).astype(np.int64)
    hit &= anchor > 0
    if not hit.any():
        return []
    workers = _column(t, "ext.worker", "").astype(str)
    off = np.array([run.client_offsets_ns.get(w, 0) for w in workers], dtype=np.int64)
    at = (anchor - off)[hit]
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
                 f"{n} requests failed to connect within {BURST_GAP_NS / 1e9:g} s of one "
                 f"another ({what}; first {ids[first]}, last {ids[i - 1]})")
            )  # fmt: skip
        first = i
    return out


def detect_breaks(run: RunData) -> list[NetworkBreak]:
    """The network breaks the run's probe rounds and request records show (merged)."""
    signs = sorted(_probe_signs(run) + _connect_signs(run))
    merged: list[tuple[int, int, list[str]]] = []
    for start, end, why in signs:
        if merged and start <= merged[-1][1] + _MERGE_NS:
            s, e, whys = merged[-1]
            merged[-1] = (s, max(e, end), [*whys, why])
        else:
            merged.append((start, end, [why]))
    return [
        NetworkBreak(
            start_wall_ns=s,
            end_wall_ns=e,
            reason=f"detected: {len(whys)} sign(s) of a network break",
            source="detected",
            evidence=tuple(whys),
        )
        for s, e, whys in merged
    ]
