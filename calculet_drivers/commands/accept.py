"""`calculet-load accept`: the §15 acceptance run (calculet_drivers.accept) with the analysis,
alone or interleaved with a baseline target (`--interleave-with`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from calculet_load.errors import EXIT_INVALID, RunStop
from calculet_load.ranges import COUNT, PORT, POSITIVE_SECONDS, REPETITIONS, SECONDS, SEED, Number
from calculet_load.schema.manifest import ManifestError, load_manifest
from calculet_load.workload.mixes import MixError

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", required=True, help="run manifest YAML")
    p.add_argument("--matrix", help="matrix YAML (default: the manifest's `matrix`)")
    p.add_argument("--golden", help="golden set YAML (token hashes of greedy outputs)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run_id>)")
    p.add_argument("--url", help="target URL (default: the manifest's target.url)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the cell order and schedules")
    base = p.add_mutually_exclusive_group()
    base.add_argument("--baseline-run", help="a baseline run folder to compare with")
    base.add_argument(
        "--interleave-with", metavar="TARGET",
        help="the baseline target (its manifest file, or a URL): its cells run between the "
        "candidate's, alternating which goes first; the baseline run is RUN_DIR/baseline",
    )  # fmt: skip
    p.add_argument(
        "--rules", help="acceptance rules YAML (default: configs/acceptance/default.yaml)"
    )
    p.add_argument("--calbin", help="the calbin file: its sha256 must match the manifest")
    p.add_argument(
        "--idle-window-s", type=POSITIVE_SECONDS,
        help="§8.2 idle sampling: the window the device must be stable over, s (default: "
        "the rules file's idle.window_s, 300)",
    )  # fmt: skip
    p.add_argument(
        "--idle-timeout-s", type=POSITIVE_SECONDS,
        help="§8.2: not stable after this long, s: exit 3 naming the series (default: the "
        "rules file's idle.timeout_s, 1800)",
    )  # fmt: skip
    p.add_argument("--idle-gap-s", type=SECONDS, default=2.0, help="pause between cells, s")
    p.add_argument(
        "--min-repetitions", type=REPETITIONS,
        help="cap the repetitions per cell; below §8's 30 (100 for short cases) only when "
        "the manifest's purpose says rehearsal (exit 2 otherwise)",
    )  # fmt: skip
    p.add_argument(
        "--record-golden", action="store_true",
        help="record the golden set's token hashes from this run instead of checking them "
        "against the file's (golden before); golden after and the fault matrix check "
        "against the recorded ones; RUN_DIR/golden.recorded.yaml is the set to pin",
    )  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    p.add_argument("--skip-report", action="store_true", help="no HTML report")
    p.add_argument(  # spec §14.1 cross-talk under concurrency
        "--crosstalk-concurrency", type=COUNT, default=4, metavar="N",
        help="after golden before, send the golden set's greedy cases N at a time and "
        "compare each with the same request sent alone (0: skip; default 4)",
    )  # fmt: skip
    p.add_argument(  # the fault matrix (§12) as a step
        "--faults",
        help="fault scenarios (a file or folder, e.g. configs/faults): run the "
        "fault matrix after the matrix, before golden after (needs CALCULET_ADMIN_TOKEN)",
    )
    dist = p.add_argument_group(
        "distributed (the pipeline as the Locust master of its client processes)"
    )
    dist.add_argument(
        "--workers", type=Number(int, 0, 100_000), default=0,
        help="start N local Locust worker processes and send the matrix from them",
    )  # fmt: skip
    dist.add_argument(
        "--master", action="store_true",
        help="wait for --expect-workers remote workers: `locust -f locustfiles/calculet.py "
        "--worker --master-host THIS_HOST` on each client host",
    )  # fmt: skip
    dist.add_argument("--expect-workers", type=COUNT, default=1, help="with --master")
    dist.add_argument("--master-bind-host", default="*", help="with --master (default: all)")
    dist.add_argument("--master-bind-port", type=PORT, default=5557, help="with --master")
    dist.add_argument(
        "--workers-timeout-s",
        type=POSITIVE_SECONDS,
        default=120.0,
        help="wait this long for the workers",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    if args.workers < 0 or args.expect_workers < 1:
        print("accept: --workers must be >= 0 and --expect-workers >= 1", file=sys.stderr)
        return EXIT_INVALID
    if args.crosstalk_concurrency == 1 or args.crosstalk_concurrency < 0:
        print("accept: --crosstalk-concurrency must be 0 (skip) or >= 2", file=sys.stderr)
        return EXIT_INVALID
    if args.workers and args.master:
        print("accept: --workers (local) and --master (remote) exclude each other", file=sys.stderr)
        return EXIT_INVALID
    if args.record_golden and not args.golden:
        print("accept: --record-golden needs --golden (the set whose hashes to record)",
              file=sys.stderr)  # fmt: skip
        return EXIT_INVALID
    from calculet_drivers.accept.acceptrun import Options
    from calculet_drivers.accept.interleave import Interleaved, interleave_manifest
    from calculet_drivers.accept.pipeline import Pipeline

    matrix = args.matrix
    if matrix is None:
        try:
            matrix = load_manifest(args.manifest).matrix
        except ManifestError as exc:
            print(exc, file=sys.stderr)
            return EXIT_INVALID
    opts = Options(
        manifest=args.manifest,
        matrix=matrix,
        golden=args.golden,
        run_dir=args.run_dir,
        url=args.url,
        seed=args.seed,
        baseline_run=args.baseline_run,
        rules=args.rules,
        calbin=args.calbin,
        admin_token=os.environ.get("CALCULET_ADMIN_TOKEN"),
        idle_window_s=args.idle_window_s,
        idle_timeout_s=args.idle_timeout_s,
        idle_gap_s=args.idle_gap_s,
        min_repetitions=args.min_repetitions,
        record_golden=args.record_golden,
        resume=args.resume,
        skip_report=args.skip_report,
        crosstalk_concurrency=args.crosstalk_concurrency,
        progress=not args.quiet,
        workers=args.workers,
        master=args.master,
        expect_workers=args.expect_workers,
        master_bind_host=args.master_bind_host,
        master_bind_port=args.master_bind_port,
        workers_timeout_s=args.workers_timeout_s,
        faults=args.faults,
    )
    try:
        pipeline = Pipeline(opts)
        runner: Pipeline | Interleaved = pipeline
        if args.interleave_with:
            folder = pipeline.run_dir / "baseline"
            manifest = interleave_manifest(opts.manifest, args.interleave_with, folder)
            base_opts = dataclasses.replace(
                opts, manifest=manifest, url=None, run_dir=str(folder), calbin=None,
                skip_report=True, faults=None,
            )  # fmt: skip
            runner = Interleaved(pipeline, Pipeline(base_opts))
    except RunStop as stop:
        print(f"accept: {stop}", file=sys.stderr)
        return stop.code
    except MixError as exc:
        print(f"accept: {exc}", file=sys.stderr)
        return EXIT_INVALID
    code = runner.run()
    for note in pipeline.notes:
        print(f"note: {note}")
    print(f"accept: exit {code}; run folder {pipeline.run_dir}")
    return code
