"""`calculet-load`: the command-line entry point.

Subcommands are declared in one table; each imports its module only when run, so the
CLI starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# name -> (module, help); the module provides `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("calculet_load.demo", "start the embedded simulator and stream one request"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="calculet-load", description="Load generator and acceptance harness for Calculet"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    runners: dict[str, Callable[[argparse.Namespace], int]] = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(p)
        runners[name] = module.run
    args = parser.parse_args(argv)
    return runners[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
