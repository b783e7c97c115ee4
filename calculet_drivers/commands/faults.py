"""`calculet-load faults`: the fault matrix of §12 (faults.matrix) from the command
line: its arguments, the admin token from the environment, the summary line."""

from __future__ import annotations

import argparse
import os
import sys

from calculet_drivers.faults.matrix import FaultMatrix
from calculet_drivers.faults.scenariorun import (
    ERROR,
    FAIL,
    NOT_AVAILABLE,
    NOT_RUN,
    PASS,
    SKIPPED,
    FaultOptions,
)
from calculet_load.errors import EXIT_INFRA, RunStop
from calculet_load.ranges import SCALE, SECONDS
from calculet_load.schema.manifest import ManifestError, load_manifest
from calculet_load.schema.profiles import profile_named

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", required=True, help="run manifest YAML")
    p.add_argument(
        "--scenarios",
        default="configs/faults",
        help="a scenario file or a folder of them (default configs/faults)",
    )
    p.add_argument("--url", help="target URL (default: the manifest's target.url)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run_id>)")
    p.add_argument("--golden", help="golden set YAML: run after each scenario's recovery")
    p.add_argument("--only", help="comma-separated scenario names to run")
    p.add_argument(
        "--broken",
        help="rehearsal against the simulator: arm these scenarios' faults in their broken "
        "mode (comma-separated names or 'all'); their verdicts must be FAIL",
    )
    p.add_argument(
        "--allow-stop",
        action="store_true",
        help="also run scenarios that stop the target (shutdown), last",
    )
    p.add_argument(
        "--time-scale",
        type=SCALE,
        help="real seconds per target second (default: /admin/state time_scale)",
    )
    p.add_argument(
        "--slack-s",
        type=SECONDS,
        default=0.5,
        help="real seconds allowed on top of every scaled time bound",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _has_admin_api(manifest_path: str) -> bool:
    """Whether the manifest's target has an admin API (its profile; a manifest that does
    not load is judged later, with its own message)."""
    try:
        target = load_manifest(manifest_path).target
    except (ManifestError, OSError):
        return True
    return profile_named(target.profile if target else "calculet").admin_api


def run(args: argparse.Namespace) -> int:
    token = os.environ.get("CALCULET_ADMIN_TOKEN")
    if not token and _has_admin_api(args.manifest):
        print("faults: CALCULET_ADMIN_TOKEN is not set: the admin API needs it", file=sys.stderr)
        return EXIT_INFRA
    opts = FaultOptions(
        manifest=args.manifest,
        scenarios=args.scenarios,
        url=args.url,
        run_dir=args.run_dir,
        golden=args.golden,
        admin_token=token,
        only=[s for s in (args.only or "").split(",") if s] or None,
        broken=[s for s in (args.broken or "").split(",") if s] or None,
        allow_stop=args.allow_stop,
        time_scale=args.time_scale,
        slack_s=args.slack_s,
        progress=not args.quiet,
    )
    try:
        fm = FaultMatrix(opts)
    except RunStop as stop:  # the scenarios or the manifest cannot be run
        print(f"faults: {stop}", file=sys.stderr)
        return stop.code
    code = fm.run()
    doc = fm.document()
    s = doc["summary"]
    print(
        f"faults: {s[PASS]} pass, {s[FAIL]} fail, {s[ERROR]} error, {s[SKIPPED]} skipped, "
        f"{s[NOT_RUN]} NOT RUN (not authorized by the manifest); "
        + (f"{s[NOT_AVAILABLE]} not available on this target; " if s[NOT_AVAILABLE] else "")
        + f"exit {code}; {fm.run_dir / 'faults.json'}"
    )
    return code
