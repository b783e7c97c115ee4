"""Tiny hand-written run folders for the analysis tests (integer ns everywhere).

`request(...)` builds one record whose stamps follow from a few integers:

    t1 = t0 + 100 µs, t2 = t0 + 200 µs, t3 = t4 = t0 + ttft, t5 = t4 + (n − 1)·tpot,
    t6 = t5 + 100 µs

and `tokens_for(...)` its token events (one per token, at t4 + i·tpot). `RunBuilder`
writes them with the project's own writers (records_table + pq.write_table) and the
server traces as JSON lines, exactly where a real run puts them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from calculet_load.measure.durations import durations
from calculet_load.schema.arrow import (
    SelfWatchRow,
    records_table,
    selfwatch_table,
    token_events_table,
)
from calculet_load.schema.records import (
    ClientNs,
    Ext,
    Quality,
    RequestRecord,
    Result,
    TokenEvent,
    Workload,
)

WALL0 = 1_700_000_000_000_000_000  # wall clock at monotonic 0 (client and server)
MS = 1_000_000


def request(
    rid: str,
    *,
    t0: int,
    ttft: int = 50 * MS,
    tpot: int = 10 * MS,
    n: int = 5,
    worker: str = "w00",
    cell: str = "c",
    concurrency: int | None = 1,
    arrival: str = "closed",
    stream: bool = True,
    error: str | None = None,
    quality: dict[str, Any] | None = None,
    ext: dict[str, Any] | None = None,
    token_hash: str | None = "h",
    prompt_tokens: int = 16,
    sample: str = "s0",
    http_status: int | None = None,
) -> RequestRecord:
    t4 = t0 + ttft
    t5 = t4 + (n - 1) * tpot
    ns = ClientNs(t0, t0 + 100_000, t0 + 200_000, t4, t4, t5, t5 + 100_000)
    d = durations(ns, n)
    if error is not None:
        d = dataclasses.replace(d, e2e=None, tpot=None)
    q = {"clock_complete": error is None, **(quality or {})}
    return RequestRecord(
        run_id="run",
        request_id=rid,
        workload=Workload(prompt_tokens, n, n, concurrency, stream, None),
        client_ns=ns,
        durations_ms=d,
        result=Result(http_status or (200 if error is None else 500), "length", token_hash, error),
        quality=Quality(**q),
        ext=Ext(
            wall_anchor_ns=WALL0 + t0,
            worker=worker,
            cell=cell,
            arrival=arrival,
            error_class=error,
            client_output_tokens=n,
            server_output_tokens=n,
            corpus_sample_id=sample,
            sampling="greedy",
            **(ext or {}),
        ),
    )


def tokens_for(rec: RequestRecord, tpot: int = 10 * MS) -> list[TokenEvent]:
    t4 = rec.client_ns.first_token
    n = rec.workload.actual_output_tokens or 0
    assert t4 is not None
    return [TokenEvent(rec.request_id, i, t4 + i * tpot, 1, i + 1) for i in range(n)]


def server_chain(
    rid: str, *, accepted: int, steps: list[tuple[int, int, int]]
) -> list[dict[str, Any]]:
    """server_events rows: accepted, then per step (job_prepared, sampled, token_flushed)
    at the given monotonic ns; step 0 is the prefill."""
    rows = [_event("accepted", rid, accepted)]
    for i, (prepared, sampled, flushed) in enumerate(steps):
        kind = "prefill" if i == 0 else "decode"
        for name, t in (
            ("job_prepared", prepared),
            ("sampled", sampled),
            ("token_flushed", flushed),
        ):
            rows.append(_event(name, rid, t, step_index=i, kind=kind, job_id=i + 1))
    rows.append(_event("finished", rid, steps[-1][2] + 1000))
    return rows


def _event(name: str, rid: str, mono: int, **kw: Any) -> dict[str, Any]:
    return {
        "wall_ns": WALL0 + mono,
        "mono_ns": mono,
        "event": name,
        "request_id": rid,
        "job_id": kw.get("job_id"),
        "seq_id": 1,
        "step_index": kw.get("step_index"),
        "kind": kw.get("kind"),
        "generation": 1,
        "detail": {"note": "ignored by the analysis"},
    }


def step_row(
    rid: str, step: int, *, h2d: float, wait: float, d2h: float, sampling: float
) -> dict[str, Any]:
    return {
        "wall_ns": WALL0,
        "mono_ns": 0,
        "request_id": rid,
        "job_id": step + 1,
        "seq_id": 1,
        "kind": "prefill" if step == 0 else "decode",
        "step": step,
        "queue_ms": 0.0,
        "prepare_ms": 0.0,
        "h2d_ms": h2d,
        "device_wait_ms": wait,
        "d2h_ms": d2h,
        "bf16_ms": 0.0,
        "sampling_ms": sampling,
        "engine": "sync",
        "kv_before": 0,
        "kv_after": 1,
        "output_status": "done",
    }


def device_row(
    mono: int,
    temps: tuple[float | None, ...],
    *,
    throttled: bool = False,
    power: float | None = 20.0,
) -> dict[str, Any]:
    return {
        "wall_ns": WALL0 + mono,
        "mono_ns": mono,
        "chips": [
            {
                "chip": i,
                "temperature_c": t,
                "power_w": power,
                "frequency_mhz": 800.0 if throttled else 1200.0,
                "memory_used_mib": 1.0,
                "memory_total_mib": 2.0,
                "throttled": throttled and i == 0,
            }
            for i, t in enumerate(temps)
        ],
        "pending_jobs": 0,
        "finished_jobs": 0,
        "left_jobs": 0,
        "reset_count": 0,
    }


def selfwatch(worker: str, mono: int, lag_ms: float = 1.0, cpu: float = 10.0) -> SelfWatchRow:
    return SelfWatchRow(worker, mono, WALL0 + mono, lag_ms, cpu, 1, 1, None)


class RunBuilder:
    """Collects records, token events, self-watch rows and traces; `write()` lays them out."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.records: list[RequestRecord] = []
        self.tokens: list[TokenEvent] = []
        self.watch: list[SelfWatchRow] = []
        self.traces: dict[str, list[dict[str, Any]]] = {}
        self.index: dict[str, Any] | None = None

    def add(self, rec: RequestRecord, *, tokens: bool = True, tpot: int = 10 * MS) -> RunBuilder:
        self.records.append(rec)
        if tokens and rec.ext.error_class is None:
            self.tokens += tokens_for(rec, tpot)
        return self

    def trace(self, kind: str, rows: list[dict[str, Any]]) -> RunBuilder:
        self.traces.setdefault(kind, []).extend(rows)
        return self

    def complete_index(self, status: str = "complete") -> RunBuilder:
        workers = sorted({r.ext.worker or "" for r in self.records})
        self.index = {
            "schema": "calculet-client-index/v1",
            "run_id": "run",
            "status": status,
            "workers": [{"worker": w, "status": "reported", "parts": []} for w in workers],
        }
        return self

    def write(self) -> str:
        by_worker: dict[str, list[RequestRecord]] = {}
        for r in self.records:
            by_worker.setdefault(r.ext.worker or "w00", []).append(r)
        for worker, recs in by_worker.items():
            d = self.root / "client" / worker
            d.mkdir(parents=True, exist_ok=True)
            ids = {r.request_id for r in recs}
            # two parts per worker: the reader must join them
            half = max(1, len(recs) // 2)
            for part, chunk in ((1, recs[:half]), (2, recs[half:])):
                if not chunk:
                    continue
                pq.write_table(records_table(chunk), d / f"part-{part:05d}.requests.parquet")
            toks = [t for t in self.tokens if t.request_id in ids]
            if toks:
                pq.write_table(token_events_table(toks), d / "part-00001.tokens.parquet")
            watch = [w for w in self.watch if w.worker == worker]
            if watch:
                pq.write_table(selfwatch_table(watch), d / "part-00001.selfwatch.parquet")
        if self.traces:
            (self.root / "server").mkdir(parents=True, exist_ok=True)
            for kind, rows in self.traces.items():
                text = "".join(json.dumps(r) + "\n" for r in rows)
                (self.root / "server" / f"{kind}.jsonl").write_text(text)
        if self.index is not None:
            (self.root / "client").mkdir(parents=True, exist_ok=True)
            (self.root / "client" / "index.json").write_text(json.dumps(self.index))
        return str(self.root)
