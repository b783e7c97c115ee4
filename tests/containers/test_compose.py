"""docker-compose.yml and the Dockerfile, checked without a Docker engine (the `accept`
profile here too; `metrics` in tests/containers/test_compose_metrics.py).

The file is read as data and held to what the containers need (one image, the shared
`runs` volume, service names used as host names, published ports). Every option its
commands use must appear in the same program's `--help`, and the same three commands —
simulator, master, one worker — are then run on loopback, with only addresses and ports
changed and `--headless -t` added, and must leave a run folder with the worker's parts.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from calculet_load.measure import native
from calculet_load.schema.runfolder import read_records
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
# the three calculet services; profile services (Prometheus, Grafana: `metrics`) are
# checked in tests/containers/test_compose_metrics.py
SERVICES: dict[str, dict[str, Any]] = {
    n: s for n, s in COMPOSE["services"].items() if "profiles" not in s
}
APP = "/app"  # the image's WORKDIR: compose paths under it are repo paths

pytestmark = pytest.mark.timeout(300)


def _dockerfile() -> list[tuple[str, list[str]]]:
    """(INSTRUCTION, args) per instruction; continuation lines joined, comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    lines = [x for x in text.splitlines() if x.strip() and not x.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.split()))
    return out


def _value(cmd: list[str], flag: str) -> str:
    assert flag in cmd, (flag, cmd)
    return cmd[cmd.index(flag) + 1]


def _flags(cmd: list[str]) -> list[str]:
    return [t for t in cmd[1:] if t.startswith("-")]


# ------------------------------------------------------------------ the file as data
def test_three_services_from_one_image_built_here() -> None:
    assert set(SERVICES) == {"sim", "master", "worker"}
    images = {s["image"] for s in SERVICES.values()}
    assert len(images) == 1, images
    for name, s in SERVICES.items():
        context = s["build"] if isinstance(s["build"], str) else s["build"]["context"]
        assert (REPO / context / "Dockerfile").is_file(), name
        assert s.get("working_dir", APP) == APP, name
        assert isinstance(s["command"], list), f"{name}: exec form, no shell"
    assert SERVICES["sim"]["command"][0] == "calculet-sim"
    assert SERVICES["master"]["command"][0] == SERVICES["worker"]["command"][0] == "locust"


def test_commands_wire_the_services_together() -> None:
    sim, master, worker = (SERVICES[n]["command"] for n in ("sim", "master", "worker"))
    assert _value(sim, "--host") == "0.0.0.0"
    sim_port = _value(sim, "--port")
    assert _value(master, "-H") == f"http://sim:{sim_port}"
    assert "--master" in master and "--worker" in worker
    assert _value(worker, "--master-host") == "master"
    for cmd in (master, worker):
        locustfile = _value(cmd, "-f")
        assert not locustfile.startswith("/") and (REPO / locustfile).is_file(), locustfile
    assert _value(master, "-f") == _value(worker, "-f")
    # the simulator's traces go to the run volume
    assert _value(sim, "--trace-dir").startswith(f"{APP}/runs/")


def test_ports_volumes_and_start_order() -> None:
    sim, master, worker = (SERVICES[n] for n in ("sim", "master", "worker"))
    web_port = _value(master["command"], "--web-port")
    assert master["ports"] == [f"{web_port}:{web_port}"] and web_port == "8089"
    sim_port = _value(sim["command"], "--port")
    assert sim["ports"] == [f"{sim_port}:{sim_port}"] and sim_port == "8000"
    assert "ports" not in worker, "a published port would stop --scale worker=N"
    assert "runs" in COMPOSE["volumes"]
    for name, s in SERVICES.items():
        assert f"runs:{APP}/runs" in s["volumes"], name
    assert "sim" in master["depends_on"] and "master" in worker["depends_on"]
    if isinstance(master["depends_on"], dict):
        condition = master["depends_on"]["sim"].get("condition", "service_started")
        assert condition != "service_healthy" or "healthcheck" in sim


_LOCUST_HELP = (
    "import runpy, sys; runpy.run_path(sys.argv[1]); "
    "from locust.argument_parser import get_parser; get_parser().print_help()"
)


def test_every_option_appears_in_its_programs_help() -> None:
    for name, s in SERVICES.items():
        cmd = s["command"]
        help_cmd = [str(BIN / cmd[0])]
        if cmd[0] == "locust":  # Locust prints --help before it loads the locustfile, so
            # its help lacks calculet's options: load the locustfile, then print the help
            help_cmd = [sys.executable, "-c", _LOCUST_HELP, _value(cmd, "-f")]
        out = subprocess.run(
            [*help_cmd, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        for flag in _flags(cmd):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out.stdout), (name, flag)


def test_the_headless_override_runs_the_same_services_headless() -> None:
    """deploy/containers/compose.headless.yml (scripts/containers' compose run) changes
    only two commands: the simulator time-scaled, the master headless with 2 workers."""
    path = REPO / "deploy" / "containers" / "compose.headless.yml"
    over = yaml.safe_load(path.read_text())["services"]
    assert set(over) == {"sim", "master"}
    assert all(set(s) == {"command"} for s in over.values()), over
    sim = over["sim"]["command"]
    scale = _value(sim, "--time-scale")
    assert 0 < float(scale) < 1
    assert [t for t in sim if t not in ("--time-scale", scale)] == SERVICES["sim"]["command"]
    master, base = over["master"]["command"], SERVICES["master"]["command"]
    assert master[:4] == base[:4] == ["locust", "-f", "locustfiles/calculet.py", "--master"]
    assert "--headless" in master and _value(master, "--expect-workers") == "2"
    assert _value(master, "-H") == _value(base, "-H")
    assert _value(master, "--run-dir").startswith("runs/")  # on the volume
    for cmd, help_cmd in (
        (sim, [str(BIN / "calculet-sim"), "--help"]),
        (master, [sys.executable, "-c", _LOCUST_HELP, _value(master, "-f"), "--help"]),
    ):
        out = subprocess.run(help_cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
        for flag in _flags(cmd):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out.stdout), flag


def test_dockerfile_builds_what_compose_runs() -> None:
    steps = _dockerfile()
    known = {"FROM", "ENV", "WORKDIR", "COPY", "RUN", "EXPOSE", "CMD", "ARG", "LABEL", "USER"}
    assert {w for w, _ in steps} <= known, steps
    # the base is a build argument, the registry's image by default (scripts/containers
    # passes its own with --base)
    assert steps[0] == ("ARG", ["PYTHON_IMAGE=python:3.11-slim"])
    assert steps[1] == ("FROM", ["${PYTHON_IMAGE}"])
    assert ("WORKDIR", [APP]) in steps
    copied: list[str] = []
    for word, args in steps:
        if word == "COPY":
            *sources, _dest = [a for a in args if not a.startswith("--")]
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: not in the repo"
                copied.append(src.rstrip("/"))
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert not ignored & set(copied), ignored & set(copied)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    # the dependencies are installed from pyproject.toml alone (the readme it names is a
    # placeholder there), so a change to the sources or the readme reinstalls none of
    # them; the project itself after its sources
    deps = next(i for i, (w, a) in enumerate(steps) if w == "RUN" and '".[native]"' in a)
    before = {src for w, a in steps[:deps] if w == "COPY" for src in a[:-1]}
    assert before == {"pyproject.toml"}, before
    assert f"touch {project['project']['readme']} &&" in " ".join(steps[deps][1])
    install = next(i for i, (w, a) in enumerate(steps) if w == "RUN" and "-e" in a)
    before = {src for w, a in steps[:install] if w == "COPY" for src in a[:-1]}
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = {p.rstrip("*") for p in packages} | {project["project"]["readme"]}
    assert needed <= before, needed - before
    # both installs take the wheelhouse when the build is given one, and only then
    wheels = "${WHEELS:+--no-index --find-links $WHEELS}"
    for i in (deps, install):
        assert wheels in " ".join(steps[i][1]), steps[i]
    assert ("ARG", ["WHEELS="]) in steps[: steps.index(("WORKDIR", [APP]))]
    # what the compose commands read at run time is in the image
    for s in SERVICES.values():
        if "-f" in s["command"]:
            assert _value(s["command"], "-f").split("/")[0] in copied
    assert "configs" in copied  # named mixes


def test_the_image_compiles_the_modules_a_response_is_read_with() -> None:
    """The image builds what scripts/setup builds (measure.native), with the same command,
    from sources already copied in, with the extra that holds mypyc; the compiler comes
    and goes within the one step, and a failed build fails the image (`&&` throughout)."""
    steps = _dockerfile()
    install = next(i for i, (w, a) in enumerate(steps) if w == "RUN" and "-e" in a)
    run = " ".join(steps[install][1])
    setup = (REPO / "scripts" / "setup").read_text()
    build = re.search(r"python (-c '[^']*native\.build\(\)[^']*')", setup)
    assert build is not None, "scripts/setup's build command"
    parts = [p.strip() for p in run.split("&&")]
    assert parts == [
        "apt-get update",
        "apt-get install -y --no-install-recommends gcc libc6-dev",
        "pip install --no-deps ${WHEELS:+--no-index --find-links $WHEELS} -e .",
        f"python {build[1]}",
        "apt-get purge -y --auto-remove gcc libc6-dev",
        "rm -rf /var/lib/apt/lists/*",
    ], parts
    # the extra (mypyc's mypy, setuptools) is installed with the dependencies before it
    deps = next(i for i, (w, a) in enumerate(steps) if w == "RUN" and '".[native]"' in a)
    assert deps < install
    # what native.build compiles is in the image before that step
    copied = {src.rstrip("/") for w, a in steps[:install] if w == "COPY" for src in a[:-1]}
    for rel in native.sources():
        assert rel.split("/")[0] in copied, rel
    # the extra holds what native.buildable() asks for (mypyc is mypy's)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    extra = {
        re.split(r"[<>=\[ ]", r)[0] for r in project["project"]["optional-dependencies"]["native"]
    }
    assert extra == {"mypy", "setuptools"}, extra
    assert extra <= {
        re.split(r"[<>=\[ ]", r)[0] for r in project["project"]["optional-dependencies"]["dev"]
    }


# ------------------------------------------------------------------ the same commands, run
def _local(cmd: list[str], app: Path, values: dict[str, str], extra: list[str]) -> list[str]:
    """The container's command on this machine: same options, loopback addresses."""
    out = [str(BIN / cmd[0])]
    it = iter(cmd[1:])
    for token in it:
        out.append(token)
        if token in values:
            next(it)
            out.append(values[token])
    out = [t.replace(f"{APP}/", f"{app}/") if t.startswith(f"{APP}/") else t for t in out]
    return out + extra


class Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, cmd: list[str], cwd: Path, **kw: Any) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        stdout = kw.pop("stdout", log)
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=log, **kw)
        log.close()
        self.procs[name] = p
        return p

    def logs(self) -> str:
        return "\n".join(
            f"--- {n}\n{(self.tmp / f'{n}.log').read_text(errors='replace')[-3000:]}"
            for n in self.procs
        )

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    yield ps
    ps.stop()


def _app(tmp: Path) -> Path:
    """/app as the image lays it out: the repo's files, and an empty runs/ (the volume)."""
    app = tmp / "app"
    app.mkdir()
    for name in ("locustfiles", "configs"):
        (app / name).symlink_to(REPO / name)
    (app / "runs").mkdir()
    return app


def _start_sim(procs: Procs, app: Path, *extra: str) -> tuple[list[str], str]:
    """The sim service's command on loopback (port 0): (the command, its URL)."""
    sim_cmd = _local(SERVICES["sim"]["command"], app, {"--host": "127.0.0.1", "--port": "0"}, [])
    sim = procs.start("sim", [*sim_cmd, *extra], app, stdout=subprocess.PIPE)
    assert sim.stdout is not None
    ready, _, _ = select.select([sim.stdout], [], [], 30)
    line = sim.stdout.readline().decode() if ready else ""
    assert "listening on http://" in line, f"{line!r}\n{procs.logs()}"
    return sim_cmd, line.split()[-1]


def test_the_compose_commands_run_a_distributed_run(tmp_path: Path, procs: Procs) -> None:
    app = _app(tmp_path)
    sim_cmd, sim_url = _start_sim(procs, app)
    sim = procs.procs["sim"]

    # the compose healthcheck, pointed at this simulator
    health = SERVICES["sim"]["healthcheck"]["test"]
    assert health[:2] == ["CMD", "python"]
    assert "127.0.0.1:8000" in health[3], health
    code = health[3].replace("127.0.0.1:8000", sim_url.removeprefix("http://"))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=10)

    master_port = str(free_port())
    master_cmd = _local(
        SERVICES["master"]["command"],
        app,
        {
            "--web-host": "127.0.0.1",
            "--web-port": str(free_port()),
            "-H": sim_url,
            "--metrics-port": str(free_port()),
        },
        [
            *("--master-bind-host", "127.0.0.1", "--master-bind-port", master_port),
            *("--metrics-host", "127.0.0.1"),
            *("--expect-workers", "1", "--headless", "-u", "2", "-r", "2", "-t", "6s"),
        ],
    )
    worker_cmd = _local(
        SERVICES["worker"]["command"],
        app,
        {"--master-host": "127.0.0.1"},
        ["--master-port", master_port],
    )
    master = procs.start("master", master_cmd, app)
    worker = procs.start("worker", worker_cmd, app)
    try:
        assert master.wait(60) == 0, procs.logs()
        worker.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run did not end in time\n{procs.logs()}")

    (index_path,) = (app / "runs").glob("*/client/index.json")
    index = json.loads(index_path.read_text())
    assert index["status"] == "complete", index
    assert index["target"] == sim_url
    (w,) = index["workers"]
    assert w["worker"] == "w00" and w["status"] == "reported", w
    assert w["requests"] > 0 and w["parts"], w
    run_dir = index_path.parent.parent
    on_disk = sorted(p.name for p in (run_dir / "client" / "w00").glob("part-*.parquet"))
    assert on_disk == sorted(w["parts"]), (on_disk, w["parts"])
    records = read_records(str(run_dir))
    assert len(records) == w["requests"] + w["dropped"]
    assert {r.ext.worker for r in records} == {"w00"}

    # the simulator's traces are on the run volume once it stops
    sim.send_signal(signal.SIGTERM)
    sim.wait(15)
    trace_dir = Path(_value(sim_cmd, "--trace-dir"))
    assert trace_dir.is_relative_to(app / "runs")
    assert any(p.stat().st_size > 0 for p in trace_dir.glob("*.jsonl")), list(trace_dir.iterdir())


# ------------------------------------------------------------------ profile `accept`
ACCEPT = {n: s for n, s in COMPOSE["services"].items() if s.get("profiles") == ["accept"]}


def test_the_accept_profile_is_the_pipeline_as_master_of_worker_containers() -> None:
    assert set(ACCEPT) == {"accept-sim", "accept", "accept-worker"}
    accept, worker = ACCEPT["accept"]["command"], ACCEPT["accept-worker"]["command"]
    sim = ACCEPT["accept-sim"]["command"]
    assert {s["image"] for s in ACCEPT.values()} == {SERVICES["sim"]["image"]}
    assert accept[:2] == ["calculet-load", "accept"] and "--master" in accept
    assert _value(accept, "--url") == f"http://accept-sim:{_value(sim, '--port')}"
    # its own simulator, time-scaled, serving the model artifact the manifest names
    assert sim[0] == "calculet-sim" and 0 < float(_value(sim, "--time-scale")) < 1
    manifest = yaml.safe_load((REPO / _value(accept, "--manifest")).read_text())
    assert _value(sim, "--set") == f"versions.calbin_sha256={manifest['model']['calbin_sha256']}"
    assert "rehearsal" in manifest["purpose"]  # fewer repetitions than an acceptance
    assert "ports" not in ACCEPT["accept-sim"]
    assert ACCEPT["accept"]["depends_on"]["accept-sim"]["condition"] == "service_healthy"
    assert "healthcheck" in ACCEPT["accept-sim"]
    # the report is signed with the caller's key, passed through; unsigned without one
    assert ACCEPT["accept"]["environment"] == {"CALCULET_SIGNING_KEY": "${CALCULET_SIGNING_KEY:-}"}
    out = subprocess.run(
        [str(BIN / "calculet-sim"), "--help"], capture_output=True, text=True, timeout=60
    )
    for flag in _flags(sim):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out.stdout), flag
    assert _value(accept, "--master-bind-host") == "0.0.0.0"
    # the worker is Locust's own worker command, pointed at the pipeline's port
    assert worker[:4] == ["locust", "-f", "locustfiles/calculet.py", "--worker"]
    assert _value(worker, "--master-host") == "accept"
    assert _value(worker, "--master-port") == _value(accept, "--master-bind-port")
    for flag in ("--manifest", "--matrix", "--golden"):
        assert (REPO / _value(accept, flag)).is_file(), flag
    assert _value(accept, "--run-dir").startswith("runs/")  # on the volume
    assert "ports" not in ACCEPT["accept-worker"], "a published port would stop --scale"
    for name, s in ACCEPT.items():
        assert f"runs:{APP}/runs" in s["volumes"], name
    out = subprocess.run(
        [str(BIN / "calculet-load"), "accept", "--help"], capture_output=True, text=True, timeout=60
    )
    for flag in _flags(accept[1:]):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out.stdout), flag


@pytest.mark.slow  # the same commands as test_accept_distributed's --master test
def test_the_accept_profile_commands_run_a_distributed_acceptance(
    tmp_path: Path, procs: Procs
) -> None:
    app = _app(tmp_path)
    _, sim_url = _start_sim(procs, app, "--time-scale", "0.02")

    rules = yaml.safe_load((REPO / "configs" / "acceptance" / "default.yaml").read_text())
    rules["infrastructure"]["max_saturated_fraction"] = None  # this shared machine's load
    rules["infrastructure"]["max_send_lag_p99_ms"] = None
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    port = str(free_port())
    accept_cmd = _local(
        ACCEPT["accept"]["command"],
        app,
        {"--url": sim_url, "--master-bind-host": "127.0.0.1", "--master-bind-port": port,
         "--idle-window-s": "1"},
        ["--min-repetitions", "3", "--rules", str(tmp_path / "rules.yaml"), "--skip-report"],
    )  # fmt: skip
    accept = procs.start("accept", accept_cmd, app)
    at_pipeline = {"--master-host": "127.0.0.1", "--master-port": port}
    worker_cmd = _local(ACCEPT["accept-worker"]["command"], app, at_pipeline, [])
    workers = [procs.start(f"worker{i}", worker_cmd, app) for i in (1, 2)]
    try:
        assert accept.wait(240) == 0, procs.logs()
        for w in workers:
            assert w.wait(30) == 0, procs.logs()
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run did not end in time\n{procs.logs()}")
    run_dir = app / _value(ACCEPT["accept"]["command"], "--run-dir")
    index = json.loads((run_dir / "client" / "index.json").read_text())
    assert {w["worker"] for w in index["workers"]} == {"w00", "w01", "w02"}
    assert (run_dir / "verdict.json").exists() and (run_dir / "bundle.intoto.json").exists()
