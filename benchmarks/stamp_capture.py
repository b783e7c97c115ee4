"""Each stamp of calculet-load's records against a packet capture of loopback.

tcpdump (nanosecond times, whole packets) captures a Locust run against
`benchmarks/exact_server.py` (OpenAI completions, 64 tokens of 10 ms after a 50-ms TTFT,
as benchmarks/client_speed.py runs it); every request is matched to its packets by its
`X-Request-Id`, and each stamp t1..t6, each token event, TTFH and TTFT is set against the
packet that carried the byte completing it (benchmarks/capturekit.py says which byte,
and what a loopback packet's time is). It prints record − packet, in ms, per stamp and
per the stamp's source (`kernel`: the kernel's transmit or receive time; `user`: the
client's clock when a call returned): n, p50, p99, max.

Needs tcpdump and the privilege to capture (root, or CAP_NET_RAW).

    .venv/bin/python benchmarks/stamp_capture.py                     # 20 req/s, 20 s
    .venv/bin/python benchmarks/stamp_capture.py --io-engine gevent
    CALCULET_NATIVE_READS=0 .venv/bin/python benchmarks/stamp_capture.py   # loop reads
    .venv/bin/python benchmarks/stamp_capture.py --tls               # through nginx
    # before/after a change: another checkout as the client
    base=$(mktemp -d) && git archive COMMIT | tar -x -C "$base"
    (cd "$base" && PYTHONPATH="$base" "$OLDPWD/.venv/bin/python" -c \
        'from calculet_load.measure import native; native.build()')
    .venv/bin/python benchmarks/stamp_capture.py --tree "$base"
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from capturekit import (
    Errors,
    captured,
    compare,
    exchanges,
    read_keylog,
    read_records,
    wall_minus_mono,
)
from speedkit import ExactServer

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_locust(
    url: str, run_dir: Path, rate: float, seconds: float, engine: str | None, tree: Path,
    env: dict[str, str], extra: list[str], nice: int = 0,
) -> int:  # fmt: skip
    """A Poisson Locust run, headless, as a user runs it (from `tree`'s sources), at
    niceness `nice` (every thread of it: set before they start)."""
    cmd = [
        *(["nice", "-n", str(nice)] if nice else []),
        str(BIN / "locust"), "-f", str(tree / "locustfiles" / "calculet.py"), "--headless",
        "-H", url, "--protocol", "openai-completions", "--prompt-tokens", "128",
        "--max-tokens", "64", "--run-dir", str(run_dir), "--only-summary",
        "--arrival", "poisson", "--rate", f"{rate:g}", "-u", "1", "-r", "1",
        "-t", f"{seconds:g}s", "--stop-timeout", "5",
    ]  # fmt: skip
    if engine is not None:
        cmd += ["--io-engine", engine]
    cmd += extra
    if tree != REPO:
        env = dict(env, PYTHONPATH=str(tree))  # ahead of this checkout's editable install
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, timeout=seconds + 120)
    if proc.returncode not in (0, 3):
        sys.stderr.write(proc.stderr.decode()[-3000:])
    return proc.returncode


def capture_run(
    tmp: Path,
    rate: float,
    seconds: float,
    engine: str | None = None,
    tree: Path = REPO,
    tls: bool = False,
    nice: int = 0,
) -> tuple[Errors, int, str]:
    """One Locust run against the exact server (through nginx over TLS with `tls`),
    captured: (its records against the packets, Locust's exit code, tcpdump's counts).
    `nice` below 0 (root): the server and the client run above the machine's other work,
    which would delay the server's tokens into bursts and the client's reads past them.
    Raises when the capture dropped a packet or missed a byte of a connection."""
    env = dict(os.environ)
    env.pop("LOCUST_ACCURACY_MS", None)
    server = ExactServer(None, 50.0, 10.0)
    if nice:
        os.setpriority(os.PRIO_PROCESS, server.proc.pid, nice)  # one thread: its loop
    proxy = None
    keylog = None
    extra: list[str] = []
    try:
        url, port = server.url, server.port
        if tls:
            sys.path.insert(0, str(REPO))
            from tests.support.tlsproxy import Nginx, make_pki

            pki = make_pki(tmp / "pki")
            proxy = Nginx(tmp, f"127.0.0.1:{server.port}", pki, "capture-key").start()
            url, port = proxy.url(), proxy.port
            keylog = tmp / "keys.log"  # the client's TLS keys, to read its records
            env |= {"SSLKEYLOGFILE": str(keylog), "CAPTURE_API_KEY": "capture-key"}
            extra = ["--ca-file", str(pki.ca_file), "--api-key-env", "CAPTURE_API_KEY"]
        pcap = tmp / "capture.pcap"
        run_dir = tmp / "run"
        with captured(pcap, port) as cap:
            code = run_locust(url, run_dir, rate, seconds, engine, tree, env, extra, nice)
        offset = wall_minus_mono()
        found, gaps = exchanges(pcap, port, read_keylog(keylog) if keylog else None)
        if gaps:
            raise RuntimeError(f"the capture missed {gaps} bytes of the client's connections")
        return compare(read_records(run_dir), found, offset), code, " ".join(cap.stats.split())
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rate", type=float, default=20.0, help="Poisson requests/s")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--io-engine", help="thread or gevent (default: Locust's)")
    ap.add_argument("--tree", help="run calculet-load from this source tree (a baseline)")
    ap.add_argument("--tls", action="store_true", help="through nginx over TLS (tests' proxy)")
    ap.add_argument("--keep", help="keep the capture and the run folder under this folder")
    args = ap.parse_args()
    if shutil.which("tcpdump") is None:
        raise SystemExit("stamp_capture: tcpdump not found (Debian: apt-get install tcpdump)")
    tree = Path(args.tree).resolve() if args.tree else REPO
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="stamp-capture-"))
    tmp.mkdir(parents=True, exist_ok=True)
    print(
        f"stamp_capture: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
        f"client {tree}, engine {args.io_engine or 'default'}, "
        f"{'TLS through nginx' if args.tls else 'plain'}, {args.rate:g} req/s, "
        f"{args.seconds:g} s",
        flush=True,
    )
    try:
        errors, code, stats = capture_run(
            tmp, args.rate, args.seconds, args.io_engine, tree, args.tls
        )
        print(f"locust exit {code}; tcpdump: {stats}")
        print(errors.table())
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
