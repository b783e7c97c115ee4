"""`calculet-load soak`: the §13 stage driver (calculet_drivers.soak)."""

from __future__ import annotations

import argparse
import sys

from calculet_load.errors import EXIT_INVALID, RunStop
from calculet_load.ranges import POSITIVE_RATE, SCALE, SEED

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stage",
        required=True,
        help="stage name (configs/soak/NAME.yaml: smoke, dev, candidate, release, "
        "endurance) or a stage file",
    )
    p.add_argument("--manifest", required=True, help="run manifest YAML")
    p.add_argument("--url", help="target URL (default: the manifest's target.url)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run_id>-soak-<stage>)")
    p.add_argument("--golden", help="golden set YAML (before and after the stage)")
    p.add_argument(
        "--target-rate",
        type=POSITIVE_RATE,
        help="the target load in requests per target second (default: the stage's)",
    )
    p.add_argument(
        "--time-scale-hint",
        type=SCALE,
        help="real seconds per target second (default: /admin/state time_scale, else 1)",
    )
    p.add_argument(
        "--duration-scale",
        type=SCALE,
        help="shorten (< 1) the stage for a rehearsal; recorded in soak.json (default 1)",
    )
    p.add_argument(
        "--rules", help="acceptance rules for the analysis (default: the stage's, else the default)"
    )
    p.add_argument("--seed", type=SEED, help="seed of the arrival schedule (default 0)")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the unfinished soak of RUN_DIR (soak/state.json) to its planned end, "
        "under a new worker name; the gap is recorded",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    """`calculet-load soak`."""
    from calculet_drivers.soak.run import Soak
    from calculet_drivers.soak.stage import StageError
    from calculet_load.schema.manifest import ManifestError
    from calculet_load.workload.matrix import MatrixError
    from calculet_load.workload.mixes import MixError

    if args.duration_scale is not None and not 0 < args.duration_scale <= 1:
        print("soak: --duration-scale must be within (0, 1]", file=sys.stderr)
        return EXIT_INVALID
    try:
        soak = Soak(args)
    except (StageError, ManifestError, MatrixError, MixError) as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except RunStop as stop:
        print(f"soak: {stop}", file=sys.stderr)
        return stop.code
    code = soak.run()
    print(f"soak: exit {code}; {soak.run_dir / 'soak.json'}")
    return code
