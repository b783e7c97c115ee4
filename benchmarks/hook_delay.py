"""The delay from a token event's arrival stamp to its listener, and what listening costs.

Against benchmarks/exact_server.py (OpenAI completions, TTFT 50 ms, a token every 10 ms,
64 tokens; pinned to core 1), one Locust process (pinned to core 0) runs the built-in
open loop at `--rate` req/s on the default I/O engine, twice:

- `listening`: with a `calculet_load.events.token_event` listener
  (benchmarks/hook_delay_locustfile.py) that notes, for every token event, the monotonic
  time at its call minus the event's arrival stamp: how late a live hook sees a token.
  The engine stamps the event on its thread, then hands it to the request's greenlet.
- `silent`: the same run with no listener.

It prints the delay's p50, p99 and max (µs) over every token event of the listening run,
and both runs' CPU per request (µs, over the steady middle) and its ratio: what having a
listener costs. With no listener a request pays nothing for the hooks (the engine's
reader reports each stream at its end, and no token is handed over).

Usage:
  .venv/bin/python benchmarks/hook_delay.py                  # 80 req/s, 20 s a run
  .venv/bin/python benchmarks/hook_delay.py --rate 320 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from speedkit import CpuWindow, ExactServer, taskset

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LISTENING = REPO / "benchmarks" / "hook_delay_locustfile.py"
SILENT = REPO / "locustfiles" / "calculet.py"


def run(server: ExactServer, locustfile: Path, rate: float, seconds: float, out: Path,
        core: int | None) -> float:  # fmt: skip
    """One Locust run; its CPU µs per request over the steady middle."""
    cmd = [
        *taskset(core), str(BIN / "locust"), "-f", str(locustfile), "--headless",
        "-H", server.url, "--protocol", "openai-completions", "--prompt-tokens", "128",
        "--max-tokens", "64", "--arrival", "poisson", "--rate", str(rate), "-u", "1",
        "-r", "1", "--run-dir", str(out.parent / f"run-{locustfile.stem}"),
        "--only-summary", "-t", f"{seconds + 3:g}s", "--stop-timeout", "5",
    ]  # fmt: skip
    env = dict(os.environ, HOOK_DELAY_OUT=str(out))
    env.pop("LOCUST_ACCURACY_MS", None)
    window = CpuWindow(server)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    window.watch(proc, seconds)
    proc.wait(timeout=seconds + 120)
    server.truth()  # forget this run's requests
    return window.figures()[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rate", type=float, default=80.0, help="Poisson arrivals per second")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of load per run")
    ap.add_argument("--no-pin", action="store_true", help="do not pin server and client")
    args = ap.parse_args()
    pin = not args.no_pin and (os.cpu_count() or 1) > 1
    client_core, server_core = (0, 1) if pin else (None, None)
    server = ExactServer(server_core, 50.0, 10.0)
    try:
        with tempfile.TemporaryDirectory(prefix="hook-delay-") as name:
            tmp = Path(name)
            delays = tmp / "delays.json"
            listening = run(server, LISTENING, args.rate, args.seconds, delays, client_core)
            silent = run(server, SILENT, args.rate, args.seconds, tmp / "none.json", client_core)
            d_us = np.array(json.loads(delays.read_text()), dtype=np.float64) / 1e3
    finally:
        server.stop()
    p50, p99 = np.percentile(d_us, [50, 99])
    print(
        f"hook_delay: {args.rate:g} req/s, {args.seconds:g} s a run, load average "
        f"{os.getloadavg()[0]:.2f}; pinned: {'yes' if pin else 'no'}"
    )
    print(
        f"  token event arrival stamp -> listener call: p50 {p50:.0f} µs, p99 {p99:.0f} µs, "
        f"max {d_us.max():.0f} µs over {d_us.size} token events"
    )
    print(
        f"  CPU per request: {listening:.0f} µs listening, {silent:.0f} µs silent "
        f"({listening / silent:.2f}x): what a listener on every token event costs"
    )


if __name__ == "__main__":
    main()
