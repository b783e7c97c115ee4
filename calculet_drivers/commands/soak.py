"""`calculet-load soak`: the §13 stage driver (calculet_drivers.soak) with the analysis."""

from __future__ import annotations

import argparse

from calculet_drivers.commands.door import analysis_door
from calculet_drivers.soak.run import add_arguments
from calculet_drivers.soak.run import run as run_soak

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    return run_soak(args, analysis_door())
