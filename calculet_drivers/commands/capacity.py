"""`calculet-load capacity`: the §14.3 search (calculet_drivers.capacity)."""

from __future__ import annotations

import argparse

from calculet_drivers.capacity.sla import SPEC_WINDOW_S
from calculet_load.ranges import (
    COUNT,
    FRACTION,
    MILLISECONDS,
    OUTPUT_TOKENS,
    POSITIVE_FRACTION,
    POSITIVE_RATE,
    POSITIVE_SECONDS,
    PROMPT_TOKENS,
    SCALE,
    SEED,
    Number,
)

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", required=True, help="run manifest YAML")
    p.add_argument("--url", help="target URL (default: the manifest's target.url)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run_id>-capacity)")
    p.add_argument(
        "--start-rate", type=POSITIVE_RATE, default=0.5, help="first rate, req/s (target)"
    )
    p.add_argument("--max-rate", type=POSITIVE_RATE, default=64.0, help="highest rate tried")
    p.add_argument(
        "--window-s",
        type=POSITIVE_SECONDS,
        default=SPEC_WINDOW_S,
        help="target seconds per rate (spec §14.3: 1800; shorter is a rehearsal)",
    )
    p.add_argument(
        "--warmup-fraction",
        type=Number(float, 0, 0.9),
        default=0.2,
        help="share of each window not measured",
    )
    p.add_argument(
        "--tolerance",
        type=POSITIVE_FRACTION,
        default=0.05,
        help="bisect until (unstable - stable) / stable <= this",
    )
    p.add_argument("--max-bisections", type=Number(int, 0, 64), default=8)
    p.add_argument("--arrival", choices=("poisson", "constant", "gamma"), default="poisson")
    p.add_argument("--prompt-tokens", type=PROMPT_TOKENS, default=128)
    p.add_argument("--max-tokens", type=OUTPUT_TOKENS, default=32)
    p.add_argument("--mix", help="a workload mix (configs/mixes) instead of one shape")
    p.add_argument("--max-in-flight", type=COUNT, default=512, help="client in-flight cap")
    p.add_argument("--sla", help="SLA YAML (keys of calculet_drivers.capacity.sla.SLA)")
    p.add_argument("--max-reject-rate", type=FRACTION)
    p.add_argument("--max-queue-p99-ms", type=MILLISECONDS, help="target ms")
    p.add_argument("--max-ttft-p99-ms", type=MILLISECONDS, help="target ms")
    p.add_argument("--max-e2e-p99-ms", type=MILLISECONDS, help="target ms")
    p.add_argument(
        "--time-scale-hint",
        type=SCALE,
        help="real seconds per target second (default: /admin/state time_scale)",
    )
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace) -> int:
    from calculet_drivers.capacity.search import run as run_capacity

    return run_capacity(args)
