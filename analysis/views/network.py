"""The report's clocks-and-network tables, from `client/index.json`.

Per worker: the master's measurement of its wall-clock offset (master − worker, the
convention of calculet_load.schema.clocks) and of the message round trip, and the round
trips to the target (spec §5: TCP connect and `GET /health`) before the run and during
it, with their jitter (standard deviation). Per burst: its spread across workers, the
last actual send minus the first on the master's clock. Nothing here is computed beyond
picking the figures the run recorded and formatting them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from analysis.views.model import DASH, Table, fmt_num, table
from calculet_load.schema.clocks import rtt_measured, to_reference_ns

__all__ = ["burst_spreads", "bursts_table", "master_offsets", "network_table", "rtt_measured"]


def _ms_ns(v: Any) -> str:
    return DASH if not isinstance(v, int) else f"{v / 1e6:+.3f} ms"


def _rtt(summary: Any, key: str) -> str:
    if not isinstance(summary, dict) or not summary.get("n"):
        return DASH
    return f"{fmt_num(summary.get(key), 4)} ms"


def _workers(index: dict[str, Any] | None) -> list[dict[str, Any]]:
    return [w for w in (index or {}).get("workers") or [] if isinstance(w, dict)]


def network_table(index: dict[str, Any] | None) -> Table | None:
    """One row per worker; None when the run recorded neither offsets nor round trips."""
    rows = []
    for w in _workers(index):
        sync = w.get("master_clock_sync") or {}
        rtt = w.get("target_rtt") or {}
        before = rtt.get("before") or {}
        during = rtt.get("during_medians") or {}
        if not sync and not rtt:
            continue
        rows.append(
            (
                str(w.get("worker", DASH)),
                _ms_ns(sync.get("master_offset_ns")),
                _ms_ns(sync.get("master_rtt_ns")).lstrip("+"),
                _rtt(before.get("connect"), "p50_ms"),
                _rtt(before.get("health"), "mean_ms"),
                _rtt(before.get("health"), "jitter_ms"),
                _rtt(during.get("health"), "p50_ms"),
                str((before.get("health") or {}).get("n", 0)),
            )
        )
    if not rows:
        return None
    return table(
        (
            "worker",
            "offset to master",
            "master RTT",
            "connect RTT p50",
            "/health RTT mean",
            "/health jitter",
            "/health RTT during (median of rounds)",
            "samples",
        ),
        rows,
        name="network",
        caption="clocks and network per worker: the master's offset measurement "
        "(master − worker; its error is at most half the master RTT) and round trips to "
        "the target before the run (spec §5; jitter = standard deviation) and during it",
        numeric=(False, True, True, True, True, True, True, True),
    )


def master_offsets(index: dict[str, Any] | None) -> dict[str, int]:
    """Each worker's measured offset to the master (master − worker, ns), where recorded."""
    out: dict[str, int] = {}
    for w in _workers(index):
        off = (w.get("master_clock_sync") or {}).get("master_offset_ns")
        if isinstance(off, int):
            out[str(w.get("worker"))] = off
    return out


def burst_spreads(
    burst_ids: Sequence[str],
    workers: Sequence[str],
    anchors_ns: npt.NDArray[np.int64],
    offsets_ns: dict[str, int],
) -> list[tuple[str, int, int, float]]:
    """Per burst, from its records: (id, requests, workers, spread ms). A request's send
    instant is its wall anchor (read with t0) put on the master's clock with its worker's
    measured offset (0 where none was measured: the master's own process)."""
    ids = np.asarray(burst_ids, dtype=object)
    who = np.asarray(workers, dtype=object)
    off = np.array([offsets_ns.get(str(w), 0) for w in who], dtype=np.int64)
    sent = to_reference_ns(np.asarray(anchors_ns, dtype=np.int64), off)
    out = []
    for b in sorted({str(x) for x in ids if x}):
        m = ids == b
        spread = int(sent[m].max() - sent[m].min())
        out.append((b, int(m.sum()), len(set(who[m].tolist())), spread / 1e6))
    return out


def bursts_table(
    index: dict[str, Any] | None, records: list[tuple[str, int, int, float]] | None = None
) -> Table | None:
    """One row per burst that sent: as the Locust master recorded it in the index, else
    from the records (`burst_spreads`, e.g. an accept run); None when the run had none."""
    rows = [
        (
            str(b.get("id", DASH)),
            str(b.get("size", DASH)),
            str(b.get("workers_sent", 0)),
            DASH if b.get("spread_ms") is None else f"{fmt_num(b['spread_ms'], 4)} ms",
        )
        for b in (index or {}).get("bursts") or []
        if isinstance(b, dict) and b.get("workers_sent")
    ]
    if not rows and records:
        rows = [(b, str(n), str(w), f"{fmt_num(ms, 4)} ms") for b, n, w, ms in records]
    if not rows:
        return None
    return table(
        ("burst", "size", "workers", "spread"),
        rows,
        name="bursts",
        caption="each burst's spread across workers: last actual send − first, on the "
        "master's clock (each worker's sends converted with its measured offset)",
        numeric=(False, True, True, True),
    )
