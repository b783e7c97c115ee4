"""How long the HTML report takes, and how big it gets, for a 24-hour-sized run folder.

Writes a synthetic run folder (columnar, straight from numpy: no per-record objects):
N request records over H hours in 16 cells (closed loop c1..c8, open-loop Poisson and
bursts; 0.2% failures), one self-watch sample and one device row per second, and a
server trace holding only lifecycle and runtime events (a reset every 2 h, runtime
errors on 0.2% of requests) — per-request chains are left out, they would only make
`analyze` slower, not the report. Then times `calculet-load analyze` and the report
(`analysis.report.write_report`) and prints the report's size, its figures and tables.

Usage: .venv/bin/python benchmarks/report_scale.py [--records 1000000] [--hours 24]
       [--out DIR] [--keep] | [--run RUN]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calculet_load.schema.arrow import request_schema, selfwatch_schema

WALL0 = 1_800_000_000_000_000_000
CELLS = [(f"p{p}-o{o}", c, "closed") for p, o in ((128, 32), (2048, 128)) for c in (1, 2, 4, 8)]
CELLS += [(f"poisson{r}-mixed", None, "poisson") for r in (1, 2, 4, 8)]
CELLS += [(f"burst{b}-p128-o32", b, "burst") for b in (2, 4, 8, 16)]


def _records(n: int, hours: float, rng: np.random.Generator) -> pa.Table:
    span = int(hours * 3600e9)
    t0 = np.sort(rng.integers(0, span, n))
    cell = rng.integers(0, len(CELLS), n)
    prompt = np.where(cell % 2 == 0, 128, 2048)
    prompt[rng.random(n) < 0.05] = 16384
    out = np.where(prompt == 128, 32, 128)
    ttft = rng.lognormal(np.log(20 + prompt / 100), 0.3)
    tpot = rng.lognormal(np.log(2.0 + prompt / 20000), 0.2)
    failed = rng.random(n) < 0.002
    e2e = ttft + tpot * (out - 1) + rng.exponential(0.5, n)
    ns = lambda ms: (ms * 1e6).astype(np.int64)  # noqa: E731
    conc = np.array([c[1] if c[1] is not None else -1 for c in CELLS])[cell]
    arrival = np.array([c[2] for c in CELLS], dtype=object)[cell]
    queue = rng.exponential(1.0, n)
    prefill = ttft * 0.6
    decode = tpot * (out - 2)
    cols = {
        "run_id": pa.array(np.full(n, "scale-24h", dtype=object)),
        "request_id": pa.array(np.char.add("scale-24h.w00.", np.arange(n).astype(str))),
        "model_alias": pa.array(np.full(n, "qwen3-sim", dtype=object)),
        "workload.prompt_tokens": pa.array(prompt),
        "workload.requested_output_tokens": pa.array(out),
        "workload.actual_output_tokens": pa.array(out),
        "workload.concurrency": pa.array(conc, mask=conc < 0),
        "workload.stream": pa.array(np.ones(n, dtype=bool)),
        "client_ns.request_start": pa.array(t0),
        "client_ns.headers_sent": pa.array(t0 + 100_000),
        "client_ns.response_headers": pa.array(t0 + 200_000),
        "client_ns.first_event": pa.array(t0 + ns(ttft)),
        "client_ns.first_token": pa.array(t0 + ns(ttft)),
        "client_ns.last_token": pa.array(t0 + ns(e2e) - 100_000),
        "client_ns.response_end": pa.array(t0 + ns(e2e)),
        "durations_ms.ttft": pa.array(ttft),
        "durations_ms.tpot": pa.array(tpot, mask=failed),
        "durations_ms.e2e": pa.array(e2e, mask=failed),
        "server_ms.queue": pa.array(queue),
        "server_ms.prefill": pa.array(prefill),
        "server_ms.decode_total": pa.array(decode),
        "server_ms.postprocess": pa.array(np.full(n, 0.3)),
        "runtime_ms.infer_prefill": pa.array(prefill * 0.8),
        "runtime_ms.infer_decode": pa.array(decode * 0.7),
        "result.http_status": pa.array(np.where(failed, 503, 200)),
        "result.token_hash": pa.array(np.full(n, "h", dtype=object)),
        "quality.clock_complete": pa.array(~failed),
        "quality.server_trace_joined": pa.array(np.ones(n, dtype=bool)),
        "quality.warmup": pa.array(np.zeros(n, dtype=bool)),
        "quality.throttled": pa.array(np.zeros(n, dtype=bool)),
        "ext.wall_anchor_ns": pa.array(WALL0 + t0),
        "ext.worker": pa.array(np.full(n, "w00", dtype=object)),
        "ext.host": pa.array(np.full(n, "loadgen-1", dtype=object)),
        "ext.cell": pa.array(np.array([c[0] for c in CELLS], dtype=object)[cell]),
        "ext.arrival": pa.array(arrival),
        "ext.intended_start_ns": pa.array(t0, mask=arrival != "poisson"),
        "ext.send_lag_ms": pa.array(rng.exponential(0.1, n), mask=arrival != "poisson"),
        "ext.error_class": pa.array(np.where(failed, "http_5xx", None), type=pa.string()),
        "ext.client_output_tokens": pa.array(out),
        "ext.server_output_tokens": pa.array(out),
        "ext.corpus_sample_id": pa.array(np.full(n, "synthetic:0:1", dtype=object)),
        "schema": pa.array(np.full(n, "calculet-perf-request/v1", dtype=object)),
    }
    schema = request_schema()
    arrays = [
        cols[f.name].cast(f.type) if f.name in cols else pa.nulls(n, type=f.type) for f in schema
    ]
    for name in ("quality.clock_complete", "quality.warmup", "quality.throttled"):
        i = schema.get_field_index(name)
        arrays[i] = cols[name]
    for i, f in enumerate(schema):
        if pa.types.is_boolean(f.type) and arrays[i].null_count == n:
            arrays[i] = pa.array(np.zeros(n, dtype=bool))
    return pa.Table.from_arrays(arrays, schema=schema)


def _write(root: Path, n: int, hours: float) -> None:
    rng = np.random.default_rng(1)
    (root / "client" / "w00").mkdir(parents=True)
    t = _records(n, hours, rng)
    step = 200_000
    for k, i in enumerate(range(0, n, step), 1):
        pq.write_table(t.slice(i, step), root / "client" / "w00" / f"part-{k:05d}.requests.parquet")
    secs = int(hours * 3600)
    mono = np.arange(secs, dtype=np.int64) * 1_000_000_000
    sw = pa.table(
        {
            "worker": pa.array(np.full(secs, "w00", dtype=object)),
            "mono_ns": pa.array(mono),
            "wall_ns": pa.array(WALL0 + mono),
            "loop_lag_ms": pa.array(rng.exponential(0.3, secs)),
            "cpu_percent": pa.array(rng.uniform(20, 60, secs)),
            "rss_bytes": pa.array((200e6 + mono / 1e9 * 50).astype(np.int64)),
            "in_flight": pa.array(rng.integers(0, 16, secs)),
            "token_events_per_s": pa.array(rng.uniform(100, 5000, secs)),
            "warmup": pa.array(np.zeros(secs, dtype=bool)),
        },
        schema=selfwatch_schema(),
    )
    pq.write_table(sw, root / "client" / "w00" / "part-00001.selfwatch.parquet")
    server = root / "server"
    server.mkdir()
    with (server / "device.jsonl").open("w") as f:
        temp = 45 + 15 * np.sin(np.arange(secs) / 3600) + rng.normal(0, 0.5, secs)
        for s in range(secs):
            chips = [
                {
                    "chip": c,
                    "temperature_c": round(float(temp[s]) + c, 2),
                    "power_w": 60.0,
                    "frequency_mhz": 1200.0,
                    "memory_used_mib": 6200.0 + s / 100,
                    "memory_total_mib": 16384.0,
                    "throttled": bool(temp[s] > 59.5),
                }
                for c in range(2)
            ]
            f.write(
                json.dumps(
                    {
                        "wall_ns": WALL0 + s * 10**9,
                        "mono_ns": s * 10**9,
                        "chips": chips,
                        "pending_jobs": 1,
                        "reset_count": 0,
                    }
                )
                + "\n"
            )
    with (server / "server_events.jsonl").open("w") as f:
        for r in rng.choice(n, max(1, n // 500), replace=False):
            wall = int(t.column("ext.wall_anchor_ns")[int(r)].as_py())
            f.write(
                json.dumps(
                    {
                        "wall_ns": wall,
                        "mono_ns": wall - WALL0,
                        "event": "runtime_error",
                        "request_id": f"scale-24h.w00.{r}",
                        "generation": 1,
                        "detail": {"rc": 17, "where": "submit", "attempt": 0},
                    }
                )
                + "\n"
            )
        for h in range(0, int(hours), 2):
            wall = WALL0 + h * 3600 * 10**9
            f.write(
                json.dumps(
                    {
                        "wall_ns": wall,
                        "mono_ns": wall - WALL0,
                        "event": "reset",
                        "request_id": None,
                        "generation": h + 2,
                        "detail": {"why": "wait_timeout", "ok": True, "recovery_ms": 12.5},
                    }
                )
                + "\n"
            )
    (root / "events.jsonl").write_text(
        json.dumps({"wall_ns": WALL0, "step": "run", "status": "start", "run_id": "scale-24h"})
        + "\n"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--out", help="run folder to write (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument(
        "--run",
        help="render this existing run folder instead (e.g. one kept by "
        "benchmarks/analysis_scale.py --keep); analysed first if it has no verdict.json",
    )
    args = ap.parse_args()
    root = Path(args.run) if args.run else Path(args.out or tempfile.mkdtemp(prefix="rs-")) / "run"

    from analysis.cli import analyze_run
    from analysis.report import write_report

    if args.run is None or not (root / "verdict.json").exists():
        if args.run is None and root.exists():
            shutil.rmtree(root)
        if args.run is None:
            t = time.perf_counter()
            _write(root, args.records, args.hours)
            took = time.perf_counter() - t
            print(f"wrote {args.records:,} records over {args.hours:g} h in {took:.1f} s")
        t = time.perf_counter()
        code = analyze_run(str(root), quiet=True)
        print(f"analyze: exit {code} in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    path = write_report(str(root))
    took = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # analyze's too
    html = Path(path).read_text()
    largest = max((len(s) for s in re.findall("<svg .*?</svg>", html, re.S)), default=0)
    print(f"report: {took:.1f} s; peak RSS of the process {peak / 2**20:.0f} MiB")
    print(
        f"  {path}: {len(html.encode()):,} bytes; {html.count('<svg ')} figures, "
        f"{html.count('<table ')} tables, {len(re.findall('<tr', html)):,} table rows; "
        f"largest figure {largest:,} bytes"
    )
    if not args.run and not args.out and not args.keep:
        shutil.rmtree(root.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
