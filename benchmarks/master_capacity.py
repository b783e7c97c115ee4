"""How many workers one Locust master holds: its CPU, memory and message rate with N
workers, the cost per worker fitted, and the ceiling that follows.

Real processes on loopback: a time-scaled simulator, one headless master (with
benchmarks/master_probe.py loaded beside locustfiles/calculet.py: it counts the messages
and bytes the workers send, by type, and samples the master's CPU and RSS each second),
and N workers. Three sweeps, each point a run of its own:

1. workers: N = 1, 2, 4, 8, 12, 16 light workers, each at `--per-worker` req/s (Poisson,
   32-token prompts, 8 output tokens): the master's CPU (% of one core) and RSS against
   N, fitted by least squares as a + b·N: b is the cost of one worker.
2. rate: 1 worker at rising rates, up to 300 req/s: what a worker's report weighs as its
   request rate grows (Locust's own statistics and calculet-load's histograms cross the
   wire aggregated, every 3 s), and the master's CPU per request.
3. stand-ins: N = 25, 50, 100 workers of benchmarks/replay_workers.py, each sending the
   report recorded from the real worker at the highest rate of sweep 2, at a worker's
   pace: the master at the scale of 100 workers x 300 req/s, which this machine could
   not drive with real workers.

The master's CPU is measured over the steady middle of each run: while Locust's runner
is `running` with every worker, less its first 5 s (the workers' start-up) and last 1 s.
The ceiling: the workers a master holds at 50 % of its core (a master beyond it is late
with heartbeats and reports; Locust marks a worker missing after 60 s without one) at a
given rate per worker, from the fit.

Usage: .venv/bin/python benchmarks/master_capacity.py [--quick] [--json out.json]
       .venv/bin/python benchmarks/master_capacity.py --sweeps replayed --rates 300
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.locustproc import LOCUSTFILE, free_port  # noqa: E402
from tests.support.simproc import SimProcess  # noqa: E402

PROBE = str(REPO / "benchmarks" / "master_probe.py")
REPLAY = REPO / "benchmarks" / "replay_workers.py"
MASTER_BUDGET = 0.5  # of one core: what the master may spend on its workers
TARGET_WORKERS, TARGET_RATE = 100, 300.0  # the scale asked about: 100 workers x 300 req/s


def run_point(
    tmp: Path, sim_url: str, workers: int, rate_each: float, run_s: int,
    replay: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One headless run: the master's figures over its steady middle. With `replay` (a
    recorded report), the workers are benchmarks/replay_workers.py's stand-ins."""
    port = free_port()
    probe = tmp / f"probe-{time.monotonic_ns()}.json"
    base = [sys.executable, "-m", "locust"]
    master = [
        *base, "-f", f"{LOCUSTFILE},{PROBE}", "--master", "--headless",
        "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
        "--expect-workers", str(workers), "-H", sim_url, "-u", str(workers),
        "-r", str(workers), "-t", f"{run_s}s", "--run-dir", str(tmp / f"run-{port}"),
        "--only-summary", "--arrival", "poisson", "--rate", str(rate_each * workers),
        "--prompt-tokens", "32", "--max-tokens", "8", "--max-in-flight", "1024",
        "--accuracy-ms", "1000",
    ]  # fmt: skip
    env = dict(os.environ, CALCULET_MASTER_PROBE=str(probe))
    quiet: Any = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    with open(tmp / f"master-{port}.log", "wb") as log:  # kept for a point that failed
        procs = [subprocess.Popen(master, cwd=REPO, env=env, stdout=log, stderr=log)]
    if replay is None:
        worker = [*base, "-f", LOCUSTFILE, "--worker", "--master-port", str(port)]
        procs += [subprocess.Popen(worker, cwd=REPO, **quiet) for _ in range(workers)]
    else:
        stand_ins = [sys.executable, str(REPLAY), str(port), str(workers), str(replay)]
        procs.append(subprocess.Popen([*stand_ins, str(run_s + 60)], cwd=REPO, **quiet))
    for p in procs:
        try:
            p.wait(run_s + 120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    samples: list[dict[str, Any]] = json.loads(probe.read_text()) if probe.exists() else []
    report = Path(f"{probe}.stats")
    index = tmp / f"run-{port}" / "client" / "index.json"
    sent = (
        sum(w.get("requests", 0) for w in json.loads(index.read_text())["workers"])
        if index.exists()
        else 0
    )
    running = [s for s in samples if s["workers"] >= workers and s["state"] == "running"]
    if len(running) < 10:
        return {"workers": workers, "rate_each": rate_each, "error": "too few samples"}
    start = running[0]["mono"] + 5
    steady = [s for s in running if start <= s["mono"] <= running[-1]["mono"] - 1]
    a, b = steady[0], steady[-1]
    span = b["mono"] - a["mono"]
    messages = {k: (b["messages"].get(k, 0) - a["messages"].get(k, 0)) / span
                for k in b["messages"]}  # fmt: skip
    nbytes = {k: (b["bytes"].get(k, 0) - a["bytes"].get(k, 0)) / span for k in b["bytes"]}
    stats_n = b["messages"].get("stats", 0) - a["messages"].get("stats", 0)
    stats_b = b["bytes"].get("stats", 0) - a["bytes"].get("stats", 0)
    return {
        "workers": workers,
        "rate_each": rate_each,
        "span_s": span,
        "sent_s": sent / run_s,  # the workers' requests over the run (0 for stand-ins)
        "cpu_pct": 100 * (b["cpu_s"] - a["cpu_s"]) / span,
        "rss_mb": float(np.median([s["rss"] for s in steady])) / 2**20,
        "messages_s": sum(messages.values()),
        "bytes_s": sum(nbytes.values()),
        "by_type": {k: round(v, 2) for k, v in sorted(messages.items())},
        "stats_bytes": stats_b / stats_n if stats_n else float("nan"),
        "report": str(report) if report.exists() else None,
    }


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·x: (a, b)."""
    b, a = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(a), float(b)


def line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"    {r['workers']:3d} {r['rate_each']:7.1f}  {r['error']}"
    return (
        f"    {r['workers']:3d} {r['rate_each']:7.1f} {r['sent_s']:7.1f} {r['cpu_pct']:7.2f}"
        f" {r['rss_mb']:8.1f}"
        f" {r['messages_s']:8.2f} {r['bytes_s'] / 1024:9.1f} {r['stats_bytes'] / 1024:9.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter points (~5 min)")
    ap.add_argument("--per-worker", type=float, default=1.0, help="sweep 1: req/s per worker")
    ap.add_argument("--json", type=Path, help="write the points here")
    ap.add_argument(
        "--sweeps",
        default="workers,rate,replayed",
        help="which sweeps (the stand-ins replay the rate sweep's last report)",
    )
    ap.add_argument("--rates", help="sweep 2's rates per worker, e.g. 1,300")  # fmt: skip
    args = ap.parse_args()
    run_s = 25 if args.quick else 40
    counts = [1, 4, 8] if args.quick else [1, 2, 4, 8, 12, 16]
    rates = [1.0, TARGET_RATE] if args.quick else [1.0, 50.0, 100.0, 200.0, TARGET_RATE]
    if args.rates:
        rates = [float(r) for r in args.rates.split(",")]
    wanted = set(args.sweeps.split(","))
    counts = counts if "workers" in wanted else []
    rates = rates if wanted & {"rate", "replayed"} else []
    stand_ins = [25, TARGET_WORKERS] if args.quick else [25, 50, TARGET_WORKERS]
    load = os.getloadavg()[0]
    print(f"master_capacity: {os.cpu_count()} cores, load average {load:.2f} at the start")
    header = "    N   rate/w  sent/s    cpu%   rss MB   msgs/s     KiB/s  stats KiB"
    tmp = Path(tempfile.mkdtemp(prefix="master-capacity-"))
    sim = SimProcess(tmp, "--profile", "b16", "--time-scale", "0.01")
    sweeps: dict[str, list[dict[str, Any]]] = {"workers": [], "rate": [], "replayed": []}
    try:
        print("  1. N light workers")
        print(header)
        for n in counts:
            sweeps["workers"].append(run_point(tmp, sim.url, n, args.per_worker, run_s))
            print(line(sweeps["workers"][-1]), flush=True)
        print("  2. 1 worker, rising rate")
        print(header)
        for rate in rates:
            sweeps["rate"].append(run_point(tmp, sim.url, 1, rate, run_s))
            print(line(sweeps["rate"][-1]), flush=True)
        recorded = [r for r in sweeps["rate"] if r.get("report")]
        if recorded and "replayed" in wanted:
            source = recorded[-1]
            kib = source["stats_bytes"] / 1024
            print(f"  3. N stand-in workers, each sending the report of the real worker at "
                  f"{source['rate_each']:g} req/s ({kib:.1f} KiB)")  # fmt: skip
            print(header)
            for n in stand_ins:
                point = run_point(
                    tmp, sim.url, n, source["rate_each"], run_s, Path(source["report"])
                )
                sweeps["replayed"].append(point)
                print(line(point), flush=True)
    finally:
        sim.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    summarize(sweeps)
    if args.json:
        for points in sweeps.values():
            for r in points:
                r.pop("report", None)
        args.json.write_text(json.dumps(sweeps, indent=1))


def summarize(sweeps: dict[str, list[dict[str, Any]]]) -> None:
    ok = {k: [r for r in v if "error" not in r] for k, v in sweeps.items()}
    budget = 100 * MASTER_BUDGET
    if len(ok["workers"]) >= 2:
        c0, per_worker = fit([r["workers"] for r in ok["workers"]],
                             [r["cpu_pct"] for r in ok["workers"]])  # fmt: skip
        m0, mem = fit([r["workers"] for r in ok["workers"]], [r["rss_mb"] for r in ok["workers"]])
        print(f"  light workers: master cpu% = {c0:.2f} + {per_worker:.3f}·N, "
              f"RSS MB = {m0:.1f} + {mem:.2f}·N")  # fmt: skip
    if len(ok["rate"]) >= 2:
        r0, per_req = fit([r["rate_each"] for r in ok["rate"]], [r["cpu_pct"] for r in ok["rate"]])
        k0, k1 = fit([r["rate_each"] for r in ok["rate"]],
                     [r["stats_bytes"] / 1024 for r in ok["rate"]])  # fmt: skip
        print(f"  one worker: master cpu% = {r0:.2f} + {per_req:.5f}·(its req/s); "
              f"a report = {k0:.2f} KiB + {k1:.4f} KiB per req/s")  # fmt: skip
    if len(ok["replayed"]) >= 2:
        pts = ok["replayed"]
        a, b = fit([r["workers"] for r in pts], [r["cpu_pct"] for r in pts])
        m0, mem = fit([r["workers"] for r in pts], [r["rss_mb"] for r in pts])
        rate = pts[0]["rate_each"]
        print(f"  stand-ins at {rate:g} req/s each: master cpu% = {a:.2f} + {b:.3f}·N, "
              f"RSS MB = {m0:.1f} + {mem:.2f}·N")  # fmt: skip
        n_max = (budget - a) / b if b > 0 else float("inf")
        print(
            f"  ceiling at {budget:.0f} % of one core: {n_max:.0f} workers at {rate:g} req/s each"
        )
        big = max(pts, key=lambda r: r["workers"])
        print(f"  measured: {big['workers']} workers x {rate:g} req/s: master "
              f"{big['cpu_pct']:.1f} % of one core, {big['rss_mb']:.0f} MB, "
              f"{big['messages_s']:.0f} messages/s, {big['bytes_s'] / 1024:.0f} KiB/s")  # fmt: skip


if __name__ == "__main__":
    main()
