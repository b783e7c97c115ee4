"""`calculet-load demo`: a smoke acceptance rehearsal against the embedded simulator.

It starts `calculet-sim` on loopback (time-scaled, with its traces in the run folder and
an admin token that lives only in this process's memory), writes a manifest for it, and
runs the acceptance pipeline (`calculet-load accept`) as a rehearsal (its manifest's
purpose says so: fewer repetitions than spec §8 asks, and the verdict and report say
"rehearsal: not an acceptance") with the small matrix `configs/matrices/smoke.yaml` and
the golden set `configs/golden/sim.yaml`: release check, idle sampling, golden before,
warmup, one cell of each load shape, golden after, resources, traces, analysis, the HTML
report and the signed bundle. It ends by printing the report's path and exits with the
run's exit code.

`--broken nan` (or `crosstalk`, `leak`) starts the simulator with that behaviour broken:
the run then ends in exit 1 and the report shows the counter-examples.
"""

from __future__ import annotations

import argparse
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from calculet_load.ranges import REPETITIONS, SCALE

REPO = Path(__file__).resolve().parents[1]
_SIGNING_ENV = ("CALCULET_SIGNING_KEY", "CALCULET_SIGNING_KEY_FILE")  # analysis.sign reads
# The demo's simulator, client and analysis share the machine: at the default scale they
# need about 1.8 cores. With less free, the simulated device runs slower so the same matrix
# asks less CPU per second, and the client's self-check still holds (it is not loosened).
TIME_SCALE = 0.05
CORES_NEEDED = 1.8
MAX_TIME_SCALE = 0.2
BROKEN = {
    "nan": ["--set", "knobs.nan_probability=0.05"],
    "crosstalk": ["--set", "knobs.crosstalk_probability=0.02"],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where the run folder goes")
    p.add_argument(
        "--time-scale", type=SCALE, default=None,
        help="the simulator's real seconds per simulated second, as calculet-sim's "
        f"--time-scale (default {TIME_SCALE}: its device runs 20x faster than real time; "
        "larger when other processes leave the demo less than 1.8 cores)",
    )  # fmt: skip
    p.add_argument("--profile", default="b4", help="simulator profile (default b4)")
    p.add_argument(
        "--repetitions", type=REPETITIONS, default=30,
        help="requests per cell (a rehearsal: spec §8 asks 30, 100 for short cases)",
    )  # fmt: skip
    p.add_argument("--broken", choices=sorted(BROKEN), help="break one simulator behaviour")
    p.add_argument(
        "--key",
        type=Path,
        default=None,
        help="signing key (default: runs/demo-signing-key.pem, created on first use)",
    )


def _start_sim(args: argparse.Namespace, trace_dir: Path, calbin: str, token: str) -> Any:
    cmd = [sys.executable, "-m", "calculet_sim.cli", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--trace-dir", str(trace_dir), "--time-scale", str(args.time_scale)]
    cmd += ["--profile", args.profile, "--enable-faults"]
    cmd += ["--set", f"versions.calbin_sha256={calbin}"]
    cmd += BROKEN.get(args.broken or "", [])
    env = dict(os.environ, CALCULET_SIM_ADMIN_TOKEN=token)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline().decode() if ready else ""
    if "listening on http://" not in line:
        proc.kill()
        raise SystemExit("calculet-load demo: the simulator did not start")
    return proc, line.strip().rsplit(" ", 1)[1]


def size_time_scale(free_cores: float) -> float:
    """The time scale that leaves the demo's processes `CORES_NEEDED` worth of CPU."""
    wanted = TIME_SCALE * CORES_NEEDED / max(free_cores, 0.1)
    return round(min(MAX_TIME_SCALE, max(TIME_SCALE, wanted)), 3)


def _free_cores(window_s: float = 1.0) -> float:
    """Cores other processes leave idle, sampled over `window_s` before the demo starts."""
    import psutil

    busy = psutil.cpu_percent(interval=window_s) / 100.0
    return (psutil.cpu_count() or 1) * (1.0 - busy)


def run(args: argparse.Namespace) -> int:
    from calculet_drivers.accept.acceptrun import Options
    from calculet_drivers.accept.pipeline import Pipeline
    from calculet_load.errors import RunStop

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_id = f"demo-{stamp}" + (f"-broken-{args.broken}" if args.broken else "")
    run_dir = args.runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = yaml.safe_load((REPO / "configs" / "manifest.sim.yaml").read_text())
    token = secrets.token_hex(16)  # never written anywhere
    if args.time_scale is None:
        free = _free_cores()
        args.time_scale = size_time_scale(free)
        if args.time_scale > TIME_SCALE:
            print(
                f"load: {free:.1f} cores free of the {CORES_NEEDED} the demo needs at time "
                f"scale {TIME_SCALE}; the simulator runs at {args.time_scale} instead"
            )
    # The simulator's own trace folder; the pipeline copies the traces into the run
    # folder's server/ through the target's /traces API, as it would from a remote host.
    sim_traces = args.runs_dir / f".{run_id}.sim-traces"
    proc, url = _start_sim(args, sim_traces, manifest["model"]["calbin_sha256"], token)
    print(f"simulator: {url} (profile {args.profile}, time scale {args.time_scale})")
    # a rehearsal (spec §8: the smoke matrix has 30 repetitions where a short case needs
    # 100): the verdict and the report say "rehearsal: not an acceptance"
    manifest.update(run_id=run_id, purpose="calculet-load demo: smoke rehearsal")
    manifest["matrix"] = str(REPO / "configs" / "matrices" / "smoke.yaml")
    manifest["target"] = {"url": url, "protocol": "llama"}
    manifest_path = args.runs_dir / f".{run_id}.manifest.yaml"
    manifest_path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    key = args.key or args.runs_dir / "demo-signing-key.pem"
    if not key.exists():
        from analysis.sign import generate_keypair

        generate_keypair(str(key))
        print(f"signing key: created {key} (public key {key}.pub)")
    # Sign with the key named above (and in the verify line below), whatever key the
    # environment names; the caller's environment is restored at the end.
    saved_env = {k: os.environ.pop(k, None) for k in _SIGNING_ENV}
    os.environ["CALCULET_SIGNING_KEY_FILE"] = str(key)
    opts = Options(
        manifest=str(manifest_path),
        matrix=manifest["matrix"],
        golden=str(REPO / "configs" / "golden" / "sim.yaml"),
        run_dir=str(run_dir),
        admin_token=token,
        idle_window_s=3.0,
        idle_timeout_s=120.0,
        idle_gap_s=0.5,
        min_repetitions=args.repetitions,
        # a sample every 0.25 s: the leak rules' 20 bins in a run of a minute
        resource_interval_s=0.25,
    )
    try:
        pipeline = Pipeline(opts)
        code = pipeline.run()
    except RunStop as stop:
        print(f"demo: {stop}", file=sys.stderr)
        code = stop.code
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        manifest_path.unlink(missing_ok=True)
        shutil.rmtree(sim_traces, ignore_errors=True)
        for name, value in saved_env.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    for note in getattr(locals().get("pipeline"), "notes", []):
        print(f"note: {note}")
    report = run_dir / "report.html"
    meaning = {0: "pass", 1: "correctness/reliability fail", 2: "artifact/config invalid",
               3: "infrastructure invalid", 4: "performance regression"}  # fmt: skip
    print(f"\nrun folder: {run_dir}")
    if report.exists():
        print(f"report:     {report.resolve()}")
    print(f"verify:     .venv/bin/calculet-load verify {run_dir} --pubkey {key}.pub")
    print(f"exit {code}: {meaning.get(code, 'unknown')}")
    return code
