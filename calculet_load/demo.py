"""`calculet-load demo`: start the embedded simulator and stream one request from it,
printing each SSE event with the client's arrival time.

This is the smallest end-to-end run: a real `calculet-sim` process on loopback, a real
streaming request, the server's own trace files beside it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import select
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from calculet_load.sse import SSEParser


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where the run folder goes")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--time-scale", type=float, default=1.0)


def _start_sim(trace_dir: Path, time_scale: float) -> tuple[subprocess.Popen[bytes], str, int]:
    cmd = [sys.executable, "-m", "calculet_sim.cli", "--port", "0"]
    cmd += ["--trace-dir", str(trace_dir), "--time-scale", str(time_scale)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline().decode() if ready else ""
    if "listening on http://" not in line:
        proc.kill()
        raise SystemExit("calculet-load demo: the simulator did not start")
    host, port = line.strip().rsplit("http://", 1)[1].rsplit(":", 1)
    return proc, host, int(port)


def run(args: argparse.Namespace) -> int:
    run_id = datetime.now(UTC).strftime("demo-%Y%m%dT%H%M%SZ")
    run_dir = args.runs_dir / run_id
    trace_dir = run_dir / "server"
    proc, host, port = _start_sim(trace_dir, args.time_scale)
    print(f"simulator: http://{host}:{port} (traces in {trace_dir})")
    try:
        body = {
            "prompt": list(range(300, 300 + args.prompt_tokens)),
            "n_predict": args.output_tokens,
            "stream": True,
            "ignore_eos": True,
            "cache_prompt": False,
        }
        conn = http.client.HTTPConnection(host, port, timeout=60)
        t0 = time.monotonic_ns()
        conn.request(
            "POST",
            "/completion",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Request-Id": f"{run_id}-0001"},
        )
        resp = conn.getresponse()
        t_headers = time.monotonic_ns()
        print(f"HTTP {resp.status}, headers after {(t_headers - t0) / 1e6:.2f} ms")
        parser = SSEParser()
        t_first = None
        tokens = 0
        while chunk := resp.read1(65536):
            t = time.monotonic_ns()
            for ev in parser.feed(chunk):
                obj = json.loads(ev.data)
                new = obj.get("tokens_predicted", tokens) - tokens
                tokens += new
                if new and t_first is None:
                    t_first = t
                shown = {k: obj[k] for k in ("tokens", "tokens_predicted", "stop") if k in obj}
                print(f"  +{(t - t0) / 1e6:8.2f} ms  {shown}")
        conn.close()
        t_end = time.monotonic_ns()
        ttft = f"{(t_first - t0) / 1e6:.2f} ms" if t_first else "n/a"
        print(f"TTFT {ttft}, {tokens} tokens, E2E {(t_end - t0) / 1e6:.2f} ms")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    files = sorted(p.name for p in trace_dir.glob("*.jsonl"))
    print(f"server traces: {', '.join(files)}")
    return 0
