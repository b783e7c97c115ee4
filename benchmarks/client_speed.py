"""Speed per worker core: calculet-load's Locust user against a reference client, on a
server whose true timings are known exactly.

The server (benchmarks/exact_server.py: OpenAI /v1/completions SSE, TTFT 50 ms, a token
every 10 ms, 64 one-word tokens, 128-token prompts, keep-alive) runs pinned to core 1 and
records its own send times. Each client runs alone, pinned to core 0:

- `calculet`: one Locust process as a user runs it, `locust -f locustfiles/calculet.py
  --headless --arrival poisson --rate R --protocol openai-completions ...` (closed loop:
  `--arrival closed -u C`), its figures read from its run folder; then
  `calculet-load analyze` on that folder: its own verdict (exit 3 = the client says the
  point is beyond its capacity). It runs on the default I/O engine (`thread`); with
  `--io-engine gevent,thread` once per engine, side by side. The client's name says which
  (`calculet:thread`, `calculet:gevent`).
- `llmuser` (when asked: `--clients calculet,llmuser`): the same requests sent by a user
  you program (benchmarks/llmuser_locustfile.py: `self.llm.complete(prompt_tokens=128,
  max_tokens=64)` from a task), through the same Locust process: what a programmed call
  costs against the built-in workload's, as a ratio to the reference's CPU.
- `reference`: benchmarks/ref_client.py (asyncio + uvloop when installed, stamps at the
  byte's arrival, nothing else).
- `floor` (when asked: `--clients reference,floor,calculet`): the same client reading in
  Python with the kernel's stamp of each read (`ref_client.py --python-reads`), as
  calculet-load reads: the CPU any Python read loop with kernel stamps pays before it
  parses a byte, as a multiple of the reference's in the same run.
- `--peers`: vLLM 0.7.3's `benchmark_serving.py` (`vllm-bench`) and inference-perf
  0.7.0, each in its own venv (installed on first use under `--peers-dir`: benchmarks/
  peers.py), when they install; inference-perf needs `--peers-python` (>= 3.12).

Per point it prints: TTFT, per-chunk ITL and TPOT error at p50/p99 (the client's figure
minus the server's truth at the same percentile, ms), the rate the server counted, the
client's CPU (% of its core and µs per request, over the steady middle of the point),
CPU per request as a ratio to the reference's at the same point of this run, and the
verdict. Truth: TTFT = first token's write − request read; ITL = gap between writes;
TPOT = (last − first write)/(n − 1), all on the server's monotonic clock. At the end,
per calculet-load client, the client's speed targets judged on this run's points
(`target_lines`).

Usage:
  .venv/bin/python benchmarks/client_speed.py                   # the full sweep (~10 min)
  .venv/bin/python benchmarks/client_speed.py --quick           # 2 rates, 1 level, 8 s
  .venv/bin/python benchmarks/client_speed.py --rates 20,80,320 --concurrency 16 \
      --seconds 20 --clients calculet,reference --json out.json
  .venv/bin/python benchmarks/client_speed.py --rates 20,80,160,320 --concurrency 64,256 \
      --io-engine gevent,thread                                 # both engines, the reference
  .venv/bin/python benchmarks/client_speed.py --clients reference,floor,calculet \
      --rates 20,80,320 --concurrency 256                       # with the Python read floor
  .venv/bin/python benchmarks/client_speed.py --rates 20,80,320 --concurrency 64 --burst 2
                                      # a server writing two tokens at a time (the verdict)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from peers import (
    INFERENCE_PERF,
    VLLM_BENCH_PACKAGES,
    peer_python,
    run_inference_perf,
    run_vllm_bench,
    tokenizer_dir,
    vllm_bench_script,
)
from speedkit import CpuWindow, ExactServer, Point, errors, quantiles, taskset, truth_figures

from calculet_load.measure import native
from calculet_load.measure.io_engines import DEFAULT_IO_ENGINE
from calculet_load.measure.thread_loop import (
    NATIVE_READS_ENV,
    READ_COALESCE_ENV,
    READ_COALESCE_US,
    reads_natively,
)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
REFERENCE = REPO / "benchmarks" / "ref_client.py"
LLMUSER = REPO / "benchmarks" / "llmuser_locustfile.py"
RATES = [20, 40, 80, 160, 320, 640]
CONCURRENCY = [16, 64, 256]
BUDGET_MS = 10.0  # the speed target: TTFT p99 error within 10 ms


# ------------------------------------------------------------------ clients
def run_calculet(
    server: ExactServer,
    p: Point,
    seconds: float,
    tmp: Path,
    core: int | None,
    tree: Path = REPO,
    engine: str = DEFAULT_IO_ENGINE,
    locustfile: Path | None = None,
) -> None:
    """calculet-load's Locust user, from this checkout or another one (`tree`: a
    baseline, e.g. `git archive COMMIT | tar -x -C DIR`), as a user runs it, on the I/O
    engine `engine` (--io-engine; a baseline tree is run without the option); or the
    user of `locustfile` (a programmed one)."""
    run_dir = tmp / f"{p.client.replace(':', '-')}-{p.mode}-{p.level:g}"
    env = dict(os.environ)
    env.pop("LOCUST_ACCURACY_MS", None)  # its own verdict at the default budget (10 ms)
    if tree != REPO:
        env["PYTHONPATH"] = str(tree)  # ahead of this checkout's editable install
    cmd = [
        *taskset(core), str(BIN / "locust"), "-f",
        str(locustfile or tree / "locustfiles" / "calculet.py"),
        "--headless",
        "-H", server.url, "--protocol", "openai-completions", "--prompt-tokens", "128",
        "--max-tokens", "64", "--run-dir", str(run_dir), "--only-summary",
        "--max-in-flight", "4096", "-t", f"{seconds + 3:g}s", "--stop-timeout", "5",
    ]  # fmt: skip
    if tree == REPO:
        cmd += ["--io-engine", engine]
    if p.mode == "poisson":
        cmd += ["--arrival", "poisson", "--rate", str(p.level), "-u", "1", "-r", "1"]
    else:
        cmd += ["--arrival", "closed", "-u", str(int(p.level)), "-r", str(int(p.level))]
    window = CpuWindow(server)
    proc = subprocess.Popen(
        cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    window.watch(proc, seconds)
    _, err = proc.communicate(timeout=seconds + 120)
    p.rate, p.cpu_percent, p.cpu_us_per_request = window.figures()
    p.threads = window.thread_figures()
    reported = read_calculet(run_dir, p)
    truth = server.truth()
    p.requests = len(truth)
    p.err = errors(reported, truth_figures(truth))
    code = proc.returncode
    verdict = subprocess.run(
        [str(BIN / "calculet-load"), "analyze", str(run_dir), "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = (verdict.stdout.strip().splitlines() or [""])[-1]
    p.verdict = f"locust exit {code}, analyze exit {verdict.returncode}"
    if code == 3 or verdict.returncode == 3:
        p.verdict += " FLAGGED"
    p.note = said[:160]
    doc = verdict_doc(run_dir)  # read once: what failed, or what the self-watch saw
    failed = failed_rules(doc)
    if failed:  # which of analyze's rules, and by how much (its verdict.json)
        p.note += " | analyze failed: " + "; ".join(failed)[:300]
    elif saw := self_watch_note(doc):  # a pass the self-watch's samples did not decide
        p.note += " | " + saw[:300]
    stderr = err.decode(errors="replace")
    kept_up = [x for x in stderr.splitlines() if "did not keep up" in x]
    if kept_up:  # the self-check's own line: which cells, which figure, how far
        p.note += " | self-check: " + kept_up[-1].split("in ", 1)[-1][:300]
    if code not in (0, 3) or not p.requests:  # an exit 0 that sent nothing says why
        p.note += f" | locust stderr: {stderr[-600:]}"


def compare_lines(points: list[Point], client: str, other: str, what: str) -> list[str]:
    """Per point run by both: `client`'s CPU per request as a multiple of `other`'s, and
    both's TTFT p99 error (ms): a change's cost, measured in one run."""

    def of(name: str) -> dict[tuple[str, float], Point]:
        return {(p.mode, p.level): p for p in points if p.client.partition(":")[0] == name}

    mine, theirs = of(client), of(other)
    out = []
    for key in sorted(mine.keys() & theirs.keys()):
        a, b = mine[key], theirs[key]
        if not (a.cpu_us_per_request and b.cpu_us_per_request):
            continue
        ea, eb = (x.err.get("ttft_p99", math.nan) for x in (a, b))
        out.append(
            f"  {what} ({client}) against {other}, {key[0]} {key[1]:g}: CPU per request "
            f"{a.cpu_us_per_request:.0f} against {b.cpu_us_per_request:.0f} µs "
            f"({a.cpu_us_per_request / b.cpu_us_per_request:.2f}x); TTFT p99 error "
            f"{ea:+.3f} against {eb:+.3f} ms"
        )
    return out


def verdict_doc(run_dir: Path) -> dict[str, Any]:
    """`calculet-load analyze`'s verdict.json in `run_dir` ({} when it is missing or
    unreadable)."""
    try:
        doc = json.loads((run_dir / "verdict.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def failed_rules(doc: dict[str, Any]) -> list[str]:
    """The rules a verdict.json (`verdict_doc`) failed, each with what it observed
    against its threshold, and for client_saturation the worst self-watch samples it
    kept (none when it has no verdicts)."""
    verdicts = doc.get("verdicts")
    return [
        f"{v.get('rule')} {_figure(v.get('observed'))} > {_figure(v.get('threshold'))}"
        + (_self_watch_saw(doc) if v.get("rule") == "client_saturation" else "")
        for v in (verdicts if isinstance(verdicts, list) else [])
        if isinstance(v, dict) and v.get("status") == "fail"
    ]


def self_watch_note(doc: dict[str, Any]) -> str:
    """What the self-watch saw in a point analyze passed, from its verdict.json
    (`verdict_doc`): the saturated samples, the kernel-stamped records it judged by their
    own bounds instead of their loop lag, and the most held closed-loop cell's hold of
    its users (analysis.tables.saturation); '' when none."""
    q = doc.get("quality") or {}
    parts = []
    if saw := _self_watch_saw(doc):
        parts.append("self-watch" + saw)
    if spared := q.get("lag_judged_by_own_bounds"):
        parts.append(f"{spared} kernel-stamped records under loop lag judged by their own bounds")
    if own := q.get("saturated_by_own_bounds"):
        parts.append(f"{own} records flagged by their own bounds or their cell's hold")
    if most := ((q.get("closed_loop_holds") or {}).get("most_held") or [])[:1]:
        h = most[0]
        parts.append(
            f"closed loop: users held {h['mean_hold_ms']:.1f} ms a request, "
            f"{h['held_share']:.1%} of their time ({'held' if h['held'] else 'within limits'})"
        )
    return "; ".join(parts)


def _self_watch_saw(doc: dict[str, Any]) -> str:
    """The saturated self-watch samples verdict.json keeps (`quality.saturated_samples`):
    how many, and the worst three's loop lag and CPU; '' when it has none."""
    kept = (doc.get("quality") or {}).get("saturated_samples") or {}
    worst = kept.get("worst") or []
    if not worst:
        return ""
    named = ", ".join(
        f"{x['worker']} {x['loop_lag_ms']:.1f} ms at {x['cpu_percent']:.0f} % CPU"
        for x in worst[:3]
    )
    return f" ({kept.get('count', len(worst))} saturated self-watch samples: {named})"


def _figure(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, int | float) else str(x)


def read_calculet(run_dir: Path, p: Point) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(kind: str) -> pa.Table | None:
        parts = sorted((run_dir / "client").glob(f"*/part-*.{kind}.parquet"))
        return pa.concat_tables(pq.read_table(x) for x in parts) if parts else None

    req = table("requests")
    tok = table("tokens")
    if req is None:
        p.note = "no records"
        return {}
    errs = req.column("ext.error_class").to_pylist()
    cut = req.column("ext.cancelled_at").to_pylist()
    ok = [e is None for e in errs]
    p.failed = sum(1 for e, c in zip(errs, cut, strict=True) if e and c != "run_stop")
    ttft = [v for v, k in zip(req.column("durations_ms.ttft").to_pylist(), ok, strict=True) if k]
    tpot = [v for v, k in zip(req.column("durations_ms.tpot").to_pylist(), ok, strict=True) if k]
    itl: list[float] = []
    if tok is not None:
        good = {r for r, k in zip(req.column("request_id").to_pylist(), ok, strict=True) if k}
        rid = np.asarray(tok.column("request_id").to_pylist())
        arr = tok.column("arrival_ns").to_numpy()
        idx = tok.column("event_index").to_numpy()
        order = np.lexsort((idx, rid))
        rid, arr = rid[order], arr[order]
        same = rid[1:] == rid[:-1]
        keep = same & np.isin(rid[1:], list(good))
        itl = list(np.diff(arr)[keep] / 1e6)
    if p.mode == "closed" and "ext.turnaround_ms" in req.column_names:
        held = [v for v in req.column("ext.turnaround_ms").to_pylist() if v is not None]
        if held:
            p50, p99 = quantiles(held)
            p.turnaround = (p50, p99, float(np.mean(held)))
    return {"ttft": ttft, "tpot": tpot, "itl": itl}


def run_reference(
    server: ExactServer, p: Point, seconds: float, tmp: Path, core: int | None,
    python_reads: bool = False,
) -> None:  # fmt: skip
    out = tmp / f"{p.client}-{p.mode}-{p.level:g}.jsonl"
    cmd = [*taskset(core), sys.executable, str(REFERENCE), "--url", server.url]
    cmd += ["--seconds", str(seconds), "--out", str(out)]
    cmd += ["--python-reads"] if python_reads else []
    cmd += ["--rate", str(p.level)] if p.mode == "poisson" else ["--concurrency", str(int(p.level))]
    window = CpuWindow(server)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    window.watch(proc, seconds)
    _, err = proc.communicate(timeout=seconds + 120)
    p.rate, p.cpu_percent, p.cpu_us_per_request = window.figures()
    if proc.returncode != 0:
        p.note = err.decode(errors="replace")[-300:]
    ttft, itl, tpot = [], [], []
    rows = [json.loads(line) for line in (out.read_text().splitlines() if out.exists() else [])]
    if p.mode == "closed":
        p.turnaround = user_turnaround(rows)
    for _rid, t0, stamps, ok, _user in rows:
        if not ok or not stamps:
            p.failed += 0 if ok else 1
            continue
        ttft.append((stamps[0] - t0) / 1e6)
        itl.extend(np.diff(np.asarray(stamps, dtype=np.int64)) / 1e6)
        if len(stamps) > 1:
            tpot.append((stamps[-1] - stamps[0]) / 1e6 / (len(stamps) - 1))
    truth = server.truth()
    p.requests = len(truth)
    p.err = errors({"ttft": ttft, "itl": itl, "tpot": tpot}, truth_figures(truth))


def user_turnaround(rows: list[list[Any]]) -> tuple[float, float, float] | None:
    """The reference's closed-loop turnaround (ms: p50, p99, mean): for each user, from a
    response's last token to that user's next send (its rows: [id, t0, stamps, ok,
    user]). calculet-load's `ext.turnaround_ms` leaves out the driver's own steps between
    two sends, so it is the smaller of the two for the same client."""
    by_user: dict[int, list[tuple[int, list[int]]]] = {}
    for _rid, t0, stamps, _ok, user in rows:
        if user is not None:
            by_user.setdefault(user, []).append((t0, stamps))
    gaps = [
        (nxt[0] - prev[1][-1]) / 1e6
        for sent in by_user.values()
        for prev, nxt in zip(sorted(sent)[:-1], sorted(sent)[1:], strict=True)
        if prev[1]
    ]
    if not gaps:
        return None
    p50, p99 = quantiles(gaps)
    return p50, p99, float(np.mean(gaps))


# ------------------------------------------------------------------ report
def row(p: Point) -> str:
    e = p.err

    def f(k: str) -> str:
        v = e.get(k, float("nan"))
        return f"{v:+8.2f}" if np.isfinite(v) else f"{'-':>8}"

    ratio = f"{p.cpu_ratio:5.2f}x" if np.isfinite(p.cpu_ratio) else f"{'-':>6}"
    return (
        f"  {p.client:<15} {p.label:>8} {p.requests:>6} {p.failed:>4} {p.rate:>7.1f} "
        f"{f('ttft_p50')} {f('ttft_p99')} {f('itl_p50')} {f('itl_p99')} {f('tpot_p50')} "
        f"{f('tpot_p99')} {p.cpu_percent:>5.0f} {p.cpu_us_per_request:>7.0f} {ratio} "
        f"{p.load:>5.2f}  {p.verdict}"
    )


def thread_line(p: Point) -> str:
    """calculet-load's CPU per request by thread, engine first."""
    order = ("engine", "reader", "main", "sink", "other")
    parts = [f"{k} {p.threads[k]:,.0f}" for k in order if k in p.threads]
    line = "threads (µs/req): " + ", ".join(parts)
    return line + ("; " + turnaround_text(p) if p.turnaround is not None else "")


def turnaround_text(p: Point) -> str:
    assert p.turnaround is not None
    p50, p99, mean = p.turnaround
    return f"turnaround (ms): p50 {p50:.2f}, p99 {p99:.2f}, mean {mean:.2f}"


HEADER = (
    f"  {'client':<15} {'point':>8} {'reqs':>6} {'fail':>4} {'req/s':>7} "
    f"{'TTFT p50':>8} {'TTFT p99':>8} {'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>8} "
    f"{'TPOT p99':>8} {'cpu%':>5} {'µs/req':>7} {'×ref':>6} {'load':>5}  verdict"
)

MEANING = """\
  Errors are the client's figure minus the server's truth at the same percentile, in ms
  (positive: the client reports later/longer than what happened). req/s is what the
  server received in the steady middle of the point; cpu% and µs/req are the client
  process's own CPU over that window (one core = 100); ×ref is µs/req over the
  reference client's at the same point of this run; load is the 1-minute load average
  when the point started (the machine's other work and the previous point). verdict:
  calculet-load's own exit codes (Locust run, then `calculet-load analyze`); FLAGGED = it
  said the point is not to be trusted (exit 3). threads: calculet-load's µs/req split by
  thread over the same window (engine: the I/O engine's loop; reader: its native thread
  that reads and stamps plain sockets' bytes; main: the greenlets, i.e.
  Locust's users, the dispatcher, the records and live statistics; sink: the Parquet
  writer). turnaround (closed loop): the client's own time around each request, from
  the user's send to the start stamp and from the response's last bytes to the outcome
  back in the user's hands (ext.turnaround_ms); the user's next request waits for it, so
  the server has fewer streams than asked for by its share of each cycle. The
  reference's: from a response's last token to the same user's next send. A busy
  machine makes every client look worse: compare clients within one run."""


def engine_client(engine: str) -> str:
    """The client name of calculet-load on one I/O engine."""
    return f"calculet:{engine}"


def _unflagged(points: list[Point]) -> tuple[list[Point], list[str]]:
    """The points past the budget (TTFT p99 error, or none measured), and the labels of
    those calculet-load's own verdict did not flag."""
    beyond = [p for p in points if not p.err.get("ttft_p99", float("inf")) <= BUDGET_MS]
    return beyond, [p.label for p in beyond if "FLAGGED" not in p.verdict]


def summary(name: str, points: list[Point]) -> None:
    """The highest rate within the budget, and the points beyond it the verdict missed."""
    ours = [p for p in points if p.mode == "poisson"]
    ok = [p.level for p in ours if p.err.get("ttft_p99", float("inf")) <= BUDGET_MS]
    if ours:
        print(
            f"  {name}: highest Poisson rate with TTFT p99 error <= {BUDGET_MS:g} ms: "
            f"{max(ok):g} req/s"
            if ok
            else f"  {name}: no rate within the budget"
        )
    beyond, silent = _unflagged(points)
    print(
        f"  {name}: points beyond {BUDGET_MS:g} ms TTFT p99 error: "
        f"{', '.join(p.label for p in beyond) or 'none'}; not flagged by its own "
        f"verdict: {', '.join(silent) or 'none'}"
    )


def _figures(points: list[Point], key: str) -> str:
    return ", ".join(f"{p.label} {p.err.get(key, float('nan')):+.2f}" for p in points)


def _check(points: list[Point], key: str, limit: float, what: str, upto: float) -> str:
    """One target over the points of one mode up to `upto`: met, not met, or not run."""
    if not points:
        return f"{what}: not run (no such point in this run)"
    bad = [p for p in points if not p.err.get(key, float("inf")) <= limit]
    top = max(p.level for p in points)
    scope = "" if top >= upto else f" (run only up to {top:g})"
    verdict = "NOT met" if bad else "met"
    return f"{what}: {verdict}{scope} ({_figures(points, key)})"


def target_lines(points: list[Point]) -> list[str]:
    """The speed targets for one calculet-load client, judged on this run's points."""
    poisson = [p for p in points if p.mode == "poisson"]
    closed = [p for p in points if p.mode == "closed"]
    lines = [
        _check([p for p in poisson if p.level <= 80], "ttft_p99", 1.0,
               "TTFT p99 error <= 1 ms, Poisson up to 80 req/s", 80),
        _check([p for p in poisson if p.level <= 320], "ttft_p99", BUDGET_MS,
               f"TTFT p99 error <= {BUDGET_MS:g} ms, Poisson up to 320 req/s", 320),
        _check([p for p in closed if p.level <= 256], "ttft_p99", BUDGET_MS,
               f"TTFT p99 error <= {BUDGET_MS:g} ms, closed loop up to 256 streams", 256),
        _check([p for p in poisson if p.level == 20], "ttft_p50", 0.3,
               "TTFT p50 error <= 0.3 ms at 20 req/s", 20),
    ]  # fmt: skip
    ratios = [p.cpu_ratio for p in points if p.cpu_ratio == p.cpu_ratio]  # not NaN
    if ratios:
        verdict = "met" if max(ratios) <= 1.5 else "NOT met"
        lines.append(
            f"CPU per request <= 1.5x the reference's: {verdict} "
            f"({min(ratios):.2f}x to {max(ratios):.2f}x)"
        )
    else:
        lines.append("CPU per request <= 1.5x the reference's: not run (no reference)")
    beyond, silent = _unflagged(points)
    lines.append(
        f"every point beyond {BUDGET_MS:g} ms flagged by its own verdict: "
        + (f"NOT met ({', '.join(silent)})" if silent else f"met ({len(beyond)} beyond)")
    )
    lines.append("the sink's cost per token event: benchmarks/client_capacity.py (Part 2)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of load per point")
    ap.add_argument("--rates", default=",".join(map(str, RATES)), help="Poisson rates")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                    help="closed-loop levels ('' for none)")  # fmt: skip
    ap.add_argument("--clients", default="reference,calculet", help="which clients, in order")
    ap.add_argument("--quick", action="store_true", help="rates 20,160, C=16, 8 s (smoke)")
    ap.add_argument(
        "--peers", action="store_true", help="also vllm-bench and inference-perf (own venvs)"
    )
    ap.add_argument("--peers-dir", default=str(Path.home() / ".cache" / "calculet-load-peers"))
    ap.add_argument("--peers-python", help="the interpreter of the peers' venvs (>= 3.12)")
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument(
        "--burst",
        type=int,
        default=1,
        help="tokens the server writes at a time (2: as vLLM's multi-step scheduling); the "
        "first two then share a read, their late bound is the TTFT, their stamps exact",
    )
    ap.add_argument(
        "--baseline-tree",
        help="also run calculet-load from this source tree as client 'baseline' (before/after)",
    )
    ap.add_argument(
        "--io-engine",
        default=DEFAULT_IO_ENGINE,
        help="calculet-load's I/O engines, comma-separated (thread,gevent; default: "
        f"{DEFAULT_IO_ENGINE}, Locust's): each runs as its own client, 'calculet:thread' "
        "and 'calculet:gevent', side by side",
    )
    ap.add_argument("--no-pin", action="store_true", help="do not pin server and client")
    ap.add_argument("--json", help="also write every point as JSON to this file")
    args = ap.parse_args()
    if args.quick:
        args.rates, args.concurrency, args.seconds = "20,160", "16", min(args.seconds, 8.0)
    if args.burst < 1:
        raise SystemExit(f"--burst {args.burst}: expected 1 or more tokens a write")
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    engines = [e.strip() for e in args.io_engine.split(",") if e.strip()]
    if bad := [e for e in engines if e not in ("gevent", "thread")]:
        raise SystemExit(f"--io-engine: unknown engine(s) {', '.join(bad)} (gevent, thread)")
    if "calculet" in clients:
        at = clients.index("calculet")
        clients[at : at + 1] = [engine_client(e) for e in engines]
    if args.peers:
        clients += ["vllm-bench", "inference-perf"]
    if args.baseline_tree:
        ours_at = [i for i, c in enumerate(clients) if c.startswith("calculet")]
        clients.insert(ours_at[0] if ours_at else 0, "baseline")
    pin = not args.no_pin and (os.cpu_count() or 1) > 1
    client_core, server_core = (0, 1) if pin else (None, None)
    if pin:
        os.sched_setaffinity(0, {1})  # this driver mostly sleeps: beside the server
    peers_dir = Path(args.peers_dir)
    vllm_py = vllm_script = ip_py = tokenizer = None
    if "vllm-bench" in clients:
        vllm_py = peer_python(peers_dir, "vllm-bench", VLLM_BENCH_PACKAGES, None)
        vllm_script = vllm_bench_script(peers_dir)
        if vllm_py is None or vllm_script is None:
            clients.remove("vllm-bench")
    if "inference-perf" in clients:
        ip_py = peer_python(peers_dir, "inference-perf", [INFERENCE_PERF], args.peers_python)
        if ip_py is None:
            clients.remove("inference-perf")
    if (peer := vllm_py or ip_py) is not None:
        tokenizer = tokenizer_dir(peers_dir, peer)
    print(
        f"client_speed: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} "
        f"{os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; pinned: "
        f"{'server core 1, client core 0' if pin else 'no'}; {args.seconds:g} s per point; "
        f"truth TTFT {args.ttft_ms:g} ms, a token every {args.itl_ms:g} ms, 64 tokens"
        + (f", {args.burst} a write (--burst)" if args.burst > 1 else "")
    )
    # what calculet-load's processes import from this tree, in this environment
    print(f"calculet-load's compiled modules (calculet_load.measure.native): {native.STATE}")
    reads = "the native reader" if reads_natively() else "its loop"
    line = f"the thread engine reads plain sockets with {reads} ({NATIVE_READS_ENV}=0: its loop)"
    if reads_natively():  # the reader's coalescing window (opt-in), as the workers get it
        window = f"{READ_COALESCE_US} µs" if READ_COALESCE_US else "off"
        line += f"; the reader's coalescing window: {window} ({READ_COALESCE_ENV}, opt-in)"
    print(line)
    print(HEADER, flush=True)
    points: list[Point] = []
    server = ExactServer(server_core, args.ttft_ms, args.itl_ms, args.burst)
    try:
        with tempfile.TemporaryDirectory(prefix="client-speed-") as name:
            tmp = Path(name)
            grid = [("poisson", float(r)) for r in rates] + [("closed", float(c)) for c in levels]
            for mode, level in grid:
                ref: Point | None = None
                for client in clients:
                    p = Point(client, mode, level, load=os.getloadavg()[0])
                    server.truth()  # forget anything left over
                    if client.startswith("calculet"):
                        engine = client.partition(":")[2] or DEFAULT_IO_ENGINE
                        run_calculet(server, p, args.seconds, tmp, client_core, engine=engine)
                    elif client == "llmuser":
                        run_calculet(server, p, args.seconds, tmp, client_core,
                                     locustfile=LLMUSER)  # fmt: skip
                    elif client == "baseline":
                        tree = Path(args.baseline_tree).resolve()
                        run_calculet(server, p, args.seconds, tmp, client_core, tree)
                    elif client == "reference":
                        run_reference(server, p, args.seconds, tmp, client_core)
                    elif client == "floor":
                        run_reference(server, p, args.seconds, tmp, client_core, True)
                    elif client == "vllm-bench" and vllm_py and vllm_script and tokenizer:
                        run_vllm_bench(
                            server, p, args.seconds, tmp, client_core, vllm_py, vllm_script,
                            tokenizer,
                        )  # fmt: skip
                    elif client == "inference-perf" and ip_py is not None and tokenizer:
                        run_inference_perf(
                            server, p, args.seconds, tmp, client_core, ip_py, tokenizer
                        )
                    else:
                        raise SystemExit(f"--clients: unknown client {client!r}")
                    if client == "reference":
                        ref = p
                    if ref is not None and client != "reference" and ref.cpu_us_per_request:
                        p.cpu_ratio = p.cpu_us_per_request / ref.cpu_us_per_request
                    points.append(p)
                    print(row(p), flush=True)
                    if p.note:
                        print(f"  {'':<15} {'':>8} note: {p.note}", flush=True)
                    if "engine" in p.threads:
                        print(f"  {'':<15} {'':>8} {thread_line(p)}", flush=True)
                    elif p.turnaround is not None:  # the reference's, the floor's
                        print(f"  {'':<15} {'':>8} {turnaround_text(p)}", flush=True)
    finally:
        server.stop()
    la = os.getloadavg()
    print(f"  load average at the end: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    for name in dict.fromkeys(p.client for p in points if p.client.startswith("calculet")):
        summary(name, [p for p in points if p.client == name])
    for line in compare_lines(points, "llmuser", "calculet", "a programmed user"):
        print(line)
    for line in compare_lines(points, "calculet", "baseline", "this tree"):
        print(line)
    for name in dict.fromkeys(p.client for p in points if p.client.startswith("calculet")):
        print(f"  {name} against the speed targets, in this run:")
        for line in target_lines([p for p in points if p.client == name]):
            print(f"    {line}")
    floor = [p.cpu_ratio for p in points if p.client == "floor" and math.isfinite(p.cpu_ratio)]
    if floor:
        print(
            f"  floor: a Python read loop with kernel stamps, parsing nothing, took "
            f"{min(floor):.2f}x to {max(floor):.2f}x the reference's CPU per request"
        )
    print(MEANING)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(p) for p in points], indent=1))


if __name__ == "__main__":
    main()
