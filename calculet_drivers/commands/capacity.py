"""`calculet-load capacity`: the §14.3 search (calculet_drivers.capacity.search), its
windows' backlog slope through the analysis door."""

from __future__ import annotations

import argparse

from calculet_drivers.capacity.search import add_arguments
from calculet_drivers.capacity.search import run as run_capacity
from calculet_drivers.commands.door import analysis_door

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    return run_capacity(args, analysis_door())
