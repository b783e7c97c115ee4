"""`calculet-load analyze` at scale: 1 M request records, 50 M token events, 10 M step rows.

Generates a run folder the way a large run leaves it — two workers' rotated Parquet parts
written with the schema module's Arrow schemas (zstd, as the sink writes them), the
server's `steps.jsonl` and `device.jsonl` as JSON lines, a complete `client/index.json`
— with numpy and pyarrow only (no per-record Python), then runs `calculet-load analyze`
on it in a subprocess and reports its wall time, CPU time and peak memory (the child's
max RSS).

The synthetic run: 16 closed-loop cells (concurrency 1/2/4/8 × prompts 128…8192), every
request streaming 50 tokens (one token per event), TTFT and TPOT lognormal around
plausible values; every 5th request traced by the server: 50 steps each (a prefill, 49
decodes) in a compiled batch of 4, lanes shared by consecutive traced requests of a
cell. The target: ≤ 60 s and ≤ 4 GB on 2 cores. The measured figures, with the command
that reproduces them, are in docs/performance.md; what the analysis does at this size,
in docs/analysis.md "At scale".

Usage: .venv/bin/python benchmarks/analysis_scale.py [--requests N] [--keep DIR]
       [--reuse DIR] [--steps-jsonl]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from calculet_load.schema import StepRow  # noqa: E402
from calculet_load.schema.arrow import request_schema, token_event_schema  # noqa: E402

WALL0 = 1_790_000_000_000_000_000
MS = 1_000_000
RUN_ID = "scale"
WORKERS = ("w00", "w01")
PARTS_PER_WORKER = 5
TOKENS = 50  # per request: 50 M token events for 1 M requests
TRACE_EVERY = 5  # every 5th request traced: 50 steps each → 10 M step rows
B = 4
CONCURRENCY = (1, 2, 4, 8)
PROMPTS = (128, 512, 2048, 8192)


def _strings(prefix: str, ids: np.ndarray) -> pa.Array:
    """prefix + 8-digit zero-padded id, vectorised (pyarrow string kernels)."""
    digits = pc.utf8_lpad(pc.cast(pa.array(ids), pa.string()), 8, "0")
    return pc.binary_join_element_wise(pa.scalar(prefix), digits, "")


def _requests(
    worker: str, first: int, n: int, n_local: int, rng: np.random.Generator
) -> dict[str, Any]:
    """Columns of n records of one worker (local sequence numbers first … first+n−1);
    the worker's n_local requests run the 16 cells one after another."""
    seq = np.arange(first, first + n, dtype=np.int64)
    cell_idx = (seq * 16) // n_local
    conc = np.asarray(CONCURRENCY)[cell_idx % 4]
    prompt = np.asarray(PROMPTS)[cell_idx // 4]
    t0 = seq * 20 * MS + (0 if worker == "w00" else 7 * MS)
    ttft = ((8 + 0.05 * prompt) * rng.lognormal(0, 0.1, n) * MS).astype(np.int64)
    tpot = (12 * (1 + 0.12 * (np.minimum(conc, B) - 1)) * rng.lognormal(0, 0.05, n) * MS).astype(
        np.int64
    )
    t4 = t0 + ttft
    t5 = t4 + (TOKENS - 1) * tpot
    t6 = t5 + 100_000
    names = pc.binary_join_element_wise(
        pa.scalar("c"),
        pc.cast(pa.array(conc), pa.string()),
        pa.scalar("-p"),
        pc.cast(pa.array(prompt), pa.string()),
        pa.scalar("-o50"),
        "",
    )
    return {
        "run_id": pa.array(np.full(n, RUN_ID)),
        "request_id": _strings(f"{RUN_ID}.{worker}.", seq),
        "model_alias": pa.array(np.full(n, "qwen3")),
        "workload.prompt_tokens": prompt,
        "workload.requested_output_tokens": np.full(n, TOKENS),
        "workload.actual_output_tokens": np.full(n, TOKENS),
        "workload.concurrency": conc,
        "workload.stream": np.ones(n, dtype=bool),
        "client_ns.request_start": t0,
        "client_ns.headers_sent": t0 + 100_000,
        "client_ns.response_headers": t0 + 200_000,
        "client_ns.first_event": t4,
        "client_ns.first_token": t4,
        "client_ns.last_token": t5,
        "client_ns.response_end": t6,
        "durations_ms.ttfh": np.full(n, 0.2),
        "durations_ms.ttfe": ttft / 1e6,
        "durations_ms.ttft": ttft / 1e6,
        "durations_ms.tpot": tpot / 1e6,
        "durations_ms.e2e": (t6 - t0) / 1e6,
        "result.http_status": np.full(n, 200),
        "result.finish_reason": pa.array(np.full(n, "length")),
        "result.token_hash": pa.array(np.full(n, "0" * 16)),
        "quality.clock_complete": np.ones(n, dtype=bool),
        "quality.server_trace_joined": np.zeros(n, dtype=bool),
        "quality.warmup": np.zeros(n, dtype=bool),
        "quality.throttled": np.zeros(n, dtype=bool),
        "ext.wall_anchor_ns": WALL0 + t0,
        "ext.worker": pa.array(np.full(n, worker)),
        "ext.cell": names,
        "ext.protocol": pa.array(np.full(n, "llama")),
        "ext.arrival": pa.array(np.full(n, "closed")),
        "ext.late": np.zeros(n, dtype=bool),
        "ext.dropped": np.zeros(n, dtype=bool),
        "ext.events": np.full(n, TOKENS + 1),
        "ext.token_events": np.full(n, TOKENS),
        "ext.client_output_tokens": np.full(n, TOKENS),
        "ext.server_output_tokens": np.full(n, TOKENS),
        "ext.token_count_source": pa.array(np.full(n, "tokens_predicted")),
        "ext.token_count_mismatch": np.zeros(n, dtype=bool),
        "ext.corpus_sample_id": pa.array(np.full(n, "s0")),
        "ext.sampling": pa.array(np.full(n, "greedy")),
        "ext.nonfinite_field": np.zeros(n, dtype=bool),
        "_t4": t4,
        "_tpot": tpot,
        "_cell": cell_idx,
    }


def _table(cols: dict[str, Any], schema: pa.Schema) -> pa.Table:
    n = len(next(iter(cols.values())))
    arrays = [
        pa.array(cols[f.name], type=f.type) if f.name in cols else pa.nulls(n, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


def _tokens(cols: dict[str, Any]) -> pa.Table:
    n = len(cols["_t4"])
    rid = cols["request_id"]
    idx = np.repeat(np.arange(n, dtype=np.int32), TOKENS)
    k = np.tile(np.arange(TOKENS, dtype=np.int64), n)
    # one dictionary-encoded id column: what the Parquet writer stores for repeated ids
    ids = pa.DictionaryArray.from_arrays(pa.array(idx), rid)
    arrays = {
        "request_id": ids,
        "event_index": k + 1,  # event 0 is the role-only first event
        "arrival_ns": np.repeat(cols["_t4"], TOKENS) + k * np.repeat(cols["_tpot"], TOKENS),
        "tokens": np.ones(n * TOKENS, dtype=np.int64),
        "server_cumulative": k + 1,
    }
    schema = token_event_schema()
    fields = [pa.field("request_id", ids.type)] + [f for f in schema if f.name != "request_id"]
    return pa.Table.from_arrays(
        [arrays[f.name] for f in fields], schema=pa.schema(fields, metadata=schema.metadata)
    )


def _write_strings(f: Any, lines: Any) -> None:
    """Write a string array's bytes as they are (each value ends with a newline)."""
    chunks = lines.chunks if isinstance(lines, pa.ChunkedArray) else [lines]
    for chunk in chunks:
        chunk = pa.concat_arrays([chunk]).cast(pa.large_string())  # offset 0, int64 offsets
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int64)[: len(chunk) + 1]
        data = chunk.buffers()[2]
        f.write(memoryview(data)[offsets[0] : offsets[-1]])


def _jsonl(columns: list[tuple[str, pa.Array]]) -> pa.Array:
    """JSON objects as strings, joined column-wise by pyarrow string kernels."""
    pieces: list[Any] = []
    for i, (name, arr) in enumerate(columns):
        pieces.append(pa.scalar(("{" if i == 0 else ",") + json.dumps(name) + ":"))
        if pa.types.is_string(arr.type):
            pieces += [pa.scalar('"'), arr, pa.scalar('"')]
        else:
            pieces.append(pc.cast(arr, pa.string()))
    pieces.append(pa.scalar("}\n"))
    return pc.binary_join_element_wise(*pieces, "")


def _steps(cols: dict[str, Any], first_job: int) -> tuple[list[tuple[str, pa.Array]], int]:
    """Step rows of the traced requests (every TRACE_EVERY-th): a prefill job each, then
    49 decode steps whose jobs are shared by up to B consecutive traced requests."""
    traced = np.flatnonzero(np.arange(len(cols["_t4"])) % TRACE_EVERY == 0)
    m = traced.size
    lanes = np.minimum(np.asarray(cols["workload.concurrency"])[traced], B)
    cell = np.asarray(cols["_cell"])[traced]
    starts = np.r_[0, np.flatnonzero(np.diff(cell)) + 1]  # first traced row of each cell
    in_cell = np.arange(m) - starts[np.searchsorted(starts, np.arange(m), side="right") - 1]
    group = np.cumsum(in_cell % lanes == 0) - 1  # consecutive requests share a job
    steps = np.tile(np.arange(TOKENS, dtype=np.int64), m)
    req = np.repeat(np.arange(m), TOKENS)
    prefill = steps == 0
    job = np.where(
        prefill,
        first_job + req,
        first_job + m + group[req] * TOKENS + steps,
    )
    t4 = np.asarray(cols["_t4"])[traced][req]
    tpot = np.asarray(cols["_tpot"])[traced][req]
    mono = t4 + steps * tpot
    dev = np.where(prefill, 20.0, 11.0 * (1 + 0.12 * (B - 1)))
    rid = pc.take(cols["request_id"], pa.array(traced[req]))
    kv = 1024 + steps
    columns = [
        ("wall_ns", pa.array(WALL0 + mono)),
        ("mono_ns", pa.array(mono)),
        ("request_id", rid),
        ("job_id", pa.array(job)),
        ("seq_id", pa.array(first_job + req)),
        ("kind", pa.array(np.where(prefill, "prefill", "decode"))),
        ("step", pa.array(steps)),
        ("queue_ms", pa.array(np.round(np.where(prefill, 1.5, 0.25), 3))),
        ("prepare_ms", pa.array(np.full(req.size, 0.15))),
        ("h2d_ms", pa.array(np.full(req.size, 0.05))),
        ("device_wait_ms", pa.array(np.round(dev, 3))),
        ("d2h_ms", pa.array(np.full(req.size, 0.2))),
        ("bf16_ms", pa.array(np.full(req.size, 0.1))),
        ("sampling_ms", pa.array(np.full(req.size, 0.05))),
        ("engine", pa.array(np.full(req.size, "sync"))),
        ("kv_before", pa.array(np.where(prefill, 0, kv - 1))),
        ("kv_after", pa.array(kv)),
        ("output_status", pa.array(np.full(req.size, "done"))),
    ]
    return columns, int(job.max()) + 1


def _step_schema() -> pa.Schema:
    """StepRow's fields in their declared order (int → int64, float → float64, others
    string), as a collector converting steps.jsonl to Parquet writes them."""
    kinds = {"int": pa.int64(), "float": pa.float64()}
    return pa.schema(
        [pa.field(f.name, kinds.get(str(f.type), pa.string())) for f in fields(StepRow)]
    )


def generate(root: Path, n_requests: int, *, steps_jsonl: bool = False) -> dict[str, Any]:
    n_local = n_requests // len(WORKERS)
    rng = np.random.default_rng(5)
    schema = request_schema()
    per_part = -(-n_local // PARTS_PER_WORKER)
    steps_path = root / "server" / ("steps.jsonl" if steps_jsonl else "steps.parquet")
    steps_path.parent.mkdir(parents=True)
    index_workers = []
    job = 1
    rows = {"requests": 0, "tokens": 0, "steps": 0}
    step_schema = _step_schema()
    with ExitStack() as stack:
        if steps_jsonl:
            steps_file = stack.enter_context(steps_path.open("wb"))
        else:
            writer = stack.enter_context(
                pq.ParquetWriter(steps_path, step_schema, compression="zstd")
            )
        for w in WORKERS:
            folder = root / "client" / w
            folder.mkdir(parents=True)
            parts = []
            for p in range(PARTS_PER_WORKER):
                first = p * per_part
                n = min(per_part, n_local - first)
                cols = _requests(w, first, n, n_local, rng)
                name = f"part-{p + 1:05d}"
                pq.write_table(
                    _table(cols, schema), folder / f"{name}.requests.parquet", compression="zstd"
                )
                # tokens in row groups of 1 M: the reader never holds a part's text at once
                pq.write_table(
                    _tokens(cols),
                    folder / f"{name}.tokens.parquet",
                    compression="zstd",
                    row_group_size=1_000_000,
                )
                step_cols, job = _steps(cols, job)
                if steps_jsonl:
                    _write_strings(steps_file, _jsonl(step_cols))
                else:
                    writer.write_table(
                        pa.Table.from_arrays([a for _, a in step_cols], schema=step_schema),
                        row_group_size=1_000_000,
                    )
                parts += [f"{name}.requests.parquet", f"{name}.tokens.parquet"]
                rows["requests"] += n
                rows["tokens"] += n * TOKENS
                rows["steps"] += len(step_cols[0][1])
            index_workers.append({"worker": w, "status": "reported", "parts": parts})
    seconds = int(n_local * 20 / 1000) + 10
    chip = ('{"chip":%d,"temperature_c":55.0,"power_w":40.0,"frequency_mhz":1200.0,'
            '"memory_used_mib":7000.0,"memory_total_mib":16384.0,"throttled":false}')  # fmt: skip
    chips = '"chips":[' + chip % 0 + "," + chip % 1 + "],"
    with (root / "server" / "device.jsonl").open("w") as f:
        tail = '"pending_jobs":0,"finished_jobs":0,"left_jobs":0,"reset_count":0}\n'
        for s in range(seconds):
            f.write(f'{{"wall_ns":{WALL0 + s * 1000 * MS},"mono_ns":{s * 1000 * MS},{chips}' + tail)
    index = {"schema": "calculet-client-index/v1", "run_id": RUN_ID, "status": "complete",
             "workers": index_workers}  # fmt: skip
    (root / "client" / "index.json").write_text(json.dumps(index))
    return rows


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, help="generate into (and keep) this folder")
    ap.add_argument("--reuse", type=Path, help="analyze an already generated folder")
    ap.add_argument(
        "--steps-jsonl",
        action="store_true",
        help="write steps as server/steps.jsonl (as the server does) instead of steps.parquet",
    )
    args = ap.parse_args()
    tmp = None
    if args.reuse:
        root = args.reuse
        print(f"reusing {root} ({_size(root) / 1e9:.2f} GB)")
    else:
        root = args.keep or Path(tempfile.mkdtemp(prefix="analysis-scale-")) / "run"
        tmp = None if args.keep else root.parent
        t = time.perf_counter()
        rows = generate(root, args.requests, steps_jsonl=args.steps_jsonl)
        print(
            f"generated {rows['requests']:,} records, {rows['tokens']:,} token events, "
            f"{rows['steps']:,} step rows in {time.perf_counter() - t:.1f} s "
            f"({_size(root) / 1e9:.2f} GB on disk) → {root}"
        )
    out = Path(tempfile.mkdtemp(prefix="analysis-scale-out-"))
    cmd = [sys.executable, "-m", "calculet_drivers.cli", "analyze", str(root), "--out", str(out)]
    cmd.append("--progress")
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_gb = usage.ru_maxrss * 1024 / 1e9
    print(proc.stderr[-3000:], end="")
    print(proc.stdout.splitlines()[-1] if proc.stdout else "(no output)")
    verdict = json.loads((out / "verdict.json").read_text()) if proc.returncode != 2 else {}
    cpu = usage.ru_utime + usage.ru_stime
    print(
        f"\nanalyze: exit {proc.returncode}, {wall:.1f} s wall ({cpu:.1f} s CPU), "
        f"peak RSS {peak_gb:.2f} GB"
    )
    if verdict:
        batch = verdict.get("batch") or {}
        print(
            f"  records {verdict['run']['records']:,}, cells {len(verdict['cells'])}, "
            f"batch: {batch.get('decode_steps', 0):,} decode steps, fill "
            f"{(batch.get('fill_ratio') or 0):.3f}, lane waste {(batch.get('lane_waste') or 0):.3f}"
        )
    ok = wall <= 60 and peak_gb <= 4
    print(
        "\nWhat the figures mean: the wall time is the whole `calculet-load analyze` process "
        "(interpreter start, reading every part and trace file, joining, quality, per-cell "
        "statistics with their intervals, batch/capacity/leak sections, rules, writing "
        "verdict.json and summary.*); CPU is its user + system time (on a shared machine "
        "the steadier figure); peak RSS is the child process's maximum resident "
        f"memory. Target ≤ 60 s and ≤ 4 GB on 2 cores: {'met' if ok else 'MISSED'}."
    )
    shutil.rmtree(out, ignore_errors=True)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
