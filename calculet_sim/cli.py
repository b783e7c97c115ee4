"""`calculet-sim`: run the simulated Calculet NPU service.

Prints `calculet-sim listening on http://HOST:PORT` once it accepts connections
(with `--port 0` the port is the one the OS chose).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from calculet_sim.profile import ProfileError, load_profile
from calculet_sim.server import build_app

TOKEN_ENV = "CALCULET_SIM_ADMIN_TOKEN"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="calculet-sim", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--profile",
        help="profile YAML path or bundled name "
        "(default, b4, b8, b16, pingpong, slow, firehose, qwen3)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a profile field, e.g. --set scheduling.slots=4",
    )
    p.add_argument("--time-scale", type=float, help="real seconds per simulated second")
    p.add_argument("--firehose", action="store_true", help="no delays, many tokens per write")
    p.add_argument("--seed", type=int)
    p.add_argument("--trace-dir", type=Path, help="where server_events/steps/device/audit go")
    p.add_argument(
        "--enable-faults",
        action="store_true",
        help="serve the admin fault API (needs an admin token)",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        help=f"file holding the admin bearer token (or set {TOKEN_ENV})",
    )
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = list(args.set)
    if args.time_scale is not None:
        overrides.append(f"time_scale={args.time_scale}")
    if args.firehose:
        overrides.append("firehose=true")
    if args.seed is not None:
        overrides.append(f"seed={args.seed}")
    try:
        profile = load_profile(args.profile, overrides)
    except ProfileError as exc:
        print(f"calculet-sim: {exc}", file=sys.stderr)
        return 2
    token = None
    if args.enable_faults:
        if args.admin_token_file is not None:
            try:
                token = args.admin_token_file.read_text(encoding="utf-8").strip()
            except OSError as exc:
                print(f"calculet-sim: --admin-token-file: {exc.strerror}", file=sys.stderr)
                return 2
        else:
            token = os.environ.get(TOKEN_ENV, "").strip()
        if len(token) < 16:
            print(
                f"calculet-sim: --enable-faults needs an admin token of at least 16 characters "
                f"(--admin-token-file or {TOKEN_ENV})",
                file=sys.stderr,
            )
            return 2
    app = build_app(profile, args.trace_dir, faults_enabled=args.enable_faults, admin_token=token)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(app, args.host, args.port))
    return 0


async def _serve(app: web.Application, host: str, port: int) -> None:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    addr = runner.addresses[0]
    shown = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
    print(f"calculet-sim listening on http://{shown}:{addr[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
