"""`calculet-load`: the command-line entry point.

Subcommands are declared in one table; each imports its module only when run, so the
CLI starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

from calculet_load.ranges import OneLineParser

# name -> (module, help, add-arguments function, run function); the functions default to
# the module's `add_arguments(parser)` and `run(args) -> int` (the exit code).
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "demo": (
        "calculet_drivers.demo",
        "a smoke acceptance rehearsal against the embedded simulator, ending in a signed "
        "report and an exit code",
        "add_arguments",
        "run",
    ),
    "probe": (
        "calculet_drivers.commands.probe",
        "send one request, print its t0..t6 timeline and write its record",
        "add_arguments",
        "run",
    ),
    "check-manifest": (
        "calculet_drivers.commands.tools",
        "validate a run manifest (exit 2 with the field path when invalid)",
        "add_check_manifest",
        "check_manifest",
    ),
    "schema": ("calculet_drivers.commands.tools", "print a JSON Schema", "add_schema", "schema"),
    "export": (
        "calculet_drivers.commands.tools",
        "write a run's request records as §3 JSON lines",
        "add_export",
        "export",
    ),
    "accept": (
        "calculet_drivers.commands.accept",
        "the acceptance run of §15 in the order of §8: release, idle, golden, warmup, "
        "matrix, golden, resources, traces, analysis, report, signature",
        "add_arguments",
        "run",
    ),
    "faults": (
        "calculet_drivers.commands.faults",
        "run the fault matrix of §12 (scenarios as data) against a target: faults.json, "
        "a verdict with evidence per scenario",
        "add_arguments",
        "run",
    ),
    "soak": (
        "calculet_drivers.commands.soak",
        "run a stability stage of §13 (configs/soak: smoke, dev, candidate, release, "
        "endurance) with resources and traces sampled during the run; leak/hang/abort verdict",
        "add_arguments",
        "run",
    ),
    "capacity": (
        "calculet_drivers.commands.capacity",
        "find the stable max QPS of §14.3: open-loop rate doubling then bisection, each "
        "window judged on backlog growth, rejects and P99 latency/queue against the SLA",
        "add_arguments",
        "run",
    ),
    "analyze": (
        "analysis.cli",
        "judge a run folder (and compare it with a baseline): verdict.json, summary, exit code",
        "add_arguments",
        "run",
    ),
    "report": (
        "analysis.report",
        "render a run folder's HTML acceptance report (one self-contained file) from its files",
        "add_arguments",
        "run",
    ),
    "sign": (
        "analysis.signcli",
        "hash every file of a run folder into a signed bundle (bundle.intoto.json)",
        "add_sign",
        "run_sign",
    ),
    "verify": (
        "analysis.signcli",
        "check a run folder against its signed bundle: what changed, and the signature",
        "add_verify",
        "run_verify",
    ),
    "keygen": (
        "analysis.signcli",
        "write a new Ed25519 signing key (FILE, mode 0600) and its public key (FILE.pub)",
        "add_keygen",
        "run_keygen",
    ),
    "import-legacy": (
        "analysis.cli",
        "import the old benchmark CSV as a trend-only, non-authoritative series (never a baseline)",
        "add_import_legacy",
        "run_import_legacy",
    ),
}


def _distributed_accept(argv: list[str]) -> bool:
    """`accept --workers N` or `--master`: the run is a Locust master."""
    flags = ("--workers", "--master")
    return argv[:1] == ["accept"] and any(a.split("=")[0] in flags for a in argv)


def build_parser() -> tuple[
    argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]]
]:
    """The command line's parser and each subcommand's run function. A bad value or a
    missing argument is one line (the command, the option, its range) and exit 2, on every
    subcommand (OneLineParser)."""
    parser = OneLineParser(
        prog="calculet-load", description="Load generator and acceptance harness for Calculet"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    runners: dict[str, Callable[[argparse.Namespace], int]] = {}
    for name, (module_name, help_text, add_fn, run_fn) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        getattr(module, add_fn)(p)
        runners[name] = getattr(module, run_fn)
    return parser, runners


def main(argv: list[str] | None = None) -> int:
    if _distributed_accept(sys.argv[1:] if argv is None else argv):
        # Locust monkey-patches the standard library when imported: before anything else
        import locust  # noqa: F401

    parser, runners = build_parser()
    args = parser.parse_args(argv)
    try:
        return runners[args.command](args)
    except BrokenPipeError:  # the reader went away (`... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
