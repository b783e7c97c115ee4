"""A distributed `accept`: the pipeline as the Locust master of client processes.

`calculet-load accept --workers N` starts N local Locust worker processes itself;
`calculet-load accept --master --expect-workers N` waits for N workers started on the
client hosts with

    locust -f locustfiles/calculet.py --worker --master-host MASTER [--master-port 5557]

The pipeline keeps the sequential steps (release, idle, golden, warmup, resources) in
its own process and hands each step of a matrix cell (calculet_load.workload.dispatch.split) to
the workers, over Locust's own message channel:

  master → worker   calculet_share  {task, job, share}   the worker builds its prompts
  worker → master   calculet_ready  {task, worker, error}
  master → workers  calculet_go     {task, start_wall_ns}  the step's instant, a moment
                                                         ahead (open loop: schedule
                                                         time 0; burst: the instant)
  worker → master   calculet_done   {task, worker, sent, parts}
  master → workers  calculet_end    {run_id}             the worker closes its sink
  worker → master   calculet_closed {worker, parts, report}

A worker writes its records to a local spool folder and sends each closed Parquet part
back with the step that closed it, so the client hosts need no shared file system: the
master writes the parts into `client/<worker>/` of the run folder, where the analysis
reads them like any other worker's. Every request a worker sends carries its worker
name (`w01`, `w02`, …; `-rN` on the N-th resumed attempt) and its host.

Importing this module imports Locust, which monkey-patches the standard library: the
CLI imports Locust first when `accept` runs distributed (calculet_drivers/cli.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gevent
import gevent.event
from locust.env import Environment
from locust.event import Events
from locust.runners import STATE_MISSING, MasterRunner, WorkerRunner

from calculet_load.clock import clock_provenance
from calculet_load.locust.clocksync import LOCAL, ClockSync
from calculet_load.measure.outcome import Timeouts
from calculet_load.measure.prompts import Prompt, PromptBook, WorkloadError, target_prompts
from calculet_load.measure.selfwatch import SelfWatch
from calculet_load.measure.session import RunContext, Session
from calculet_load.measure.sink import PartSink
from calculet_load.schema.access import AccessError, access_described
from calculet_load.schema.profiles import profile_named
from calculet_load.schema.records import Hardware, Software
from calculet_load.target.netprobe import RttRounds
from calculet_load.workload.dispatch import CellRunner, FleetError, Share

log = logging.getLogger("calculet_load")

LOCUSTFILE = Path(__file__).resolve().parents[2] / "locustfiles" / "calculet.py"
MISSING_GRACE_S = 30.0  # a worker silent this long during a step is lost (exit 3)


# ------------------------------------------------------------------ the master side
class Fleet:
    """The pipeline's Locust master: waits for its workers and runs steps on them."""

    def __init__(
        self,
        run_dir: Path,
        *,
        expect: int,
        local: int = 0,
        bind_host: str = "*",
        bind_port: int = 5557,
        suffix: str = "",
        say: Any = print,
    ) -> None:
        if expect < 1:
            raise ValueError("a distributed run expects at least one worker")
        self.run_dir = run_dir
        self.expect = expect
        self.local = local
        self.bind_host = bind_host
        self.bind_port = bind_port
        self.suffix = suffix
        self.say = say
        self.env = Environment(events=Events())
        self.runner: MasterRunner | None = None
        self.names: dict[str, str] = {}  # Locust client id -> worker name, in index order
        self.reports: dict[str, dict[str, Any]] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._waiting: dict[tuple[str, str], gevent.event.AsyncResult] = {}
        self._tasks = itertools.count(1)
        self.clock_sync: ClockSync | None = None  # each worker's offset to us

    @property
    def processes(self) -> int:
        return len(self.names)

    # --- start ----------------------------------------------------------------------
    def start(self, timeout_s: float) -> None:
        runner = self.env.create_master_runner(self.bind_host, self.bind_port)
        self.runner = runner
        for kind in ("calculet_ready", "calculet_done", "calculet_closed"):
            runner.register_message(kind, self._on_reply)
        self.clock_sync = ClockSync(runner)
        if self.local:
            logs = self.run_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            for i in range(self.local):
                cmd = [
                    sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker",
                    "--master-host", "127.0.0.1", "--master-port", str(self.bind_port),
                    "--loglevel", "WARNING",
                ]  # fmt: skip
                env = dict(os.environ, CALCULET_SPOOL_DIR=str(logs / "spool"))
                with (logs / f"locust-worker-{i + 1}.log").open("ab") as out:
                    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
                self.procs.append(proc)
            atexit.register(self._kill_local)
        self.say(f"waiting for {self.expect} Locust worker(s) on port {self.bind_port}")
        deadline = time.monotonic() + timeout_s
        while len(runner.clients.ready) < self.expect:
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead:
                raise FleetError(f"a local worker exited at start: see {self.run_dir}/logs")
            if time.monotonic() > deadline:
                raise FleetError(
                    f"{len(runner.clients.ready)} of {self.expect} worker(s) connected "
                    f"within {timeout_s:.0f} s"
                )
            gevent.sleep(0.2)
        index: dict[str, int] = {c.id: runner.get_worker_index(c.id) for c in runner.clients.ready}
        for cid in sorted(index, key=index.__getitem__)[: self.expect]:
            self.names[cid] = f"w{index[cid] + 1:02d}{self.suffix}"
        self.say(f"workers: {', '.join(self.names.values())}")
        self._sync_clocks(max_age_s=0.0)

    # --- one step of a cell -----------------------------------------------------------
    def run_step(
        self, step: list[Share | None], job: dict[str, Any], lead_s: float, run_dir: Path
    ) -> int:
        """Hand each worker its share, wait until all have their prompts, fix the step's
        instant `lead_s` ahead, and wait for every share to end; the workers' parts go to
        `run_dir`. Requests sent."""
        runner = self._runner()
        task = str(next(self._tasks))
        shares = {cid: s for cid, s in zip(self.names, step, strict=True) if s is not None}
        lanes = {cid: i for i, cid in enumerate(self.names)}  # prompts' first tokens differ
        for cid, share in shares.items():
            data = {"task": task, "job": {**job, "worker": self.names[cid],
                                          "lane": [lanes[cid], len(lanes)]},
                    "share": share.to_wire()}  # fmt: skip
            runner.send_message("calculet_share", data, client_id=cid)
        for reply in self._gather("calculet_ready", task, shares, timeout_s=600.0):
            if reply.get("info"):  # the worker's first share of the run: its host and clock
                self._worker_info(run_dir, reply["worker"], reply["info"])
            if reply.get("error"):
                raise FleetError(f"{reply['worker']}: {reply['error']}", infra=reply["infra"])
        self._sync_clocks(max_age_s=30.0)  # each worker turns `start` into its own clock
        start = time.time_ns() + int(lead_s * 1e9)
        for cid in shares:
            runner.send_message("calculet_go", {"task": task, "start_wall_ns": start}, cid)
        sent = 0
        for reply in self._gather("calculet_done", task, shares, timeout_s=None):
            self._write_parts(run_dir, reply["worker"], reply["parts"])
            if reply.get("error"):
                raise FleetError(f"{reply['worker']}: {reply['error']}")
            sent += int(reply["sent"])
        return sent

    def finish(self, run_id: str, run_dir: Path, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """End a run on every worker: their last parts and reports (for the index)."""
        runner = self._runner()
        alive = {cid: cid for cid in self.names if self._state(cid) != STATE_MISSING}
        for cid in alive:
            data = {"run_id": run_id, "worker": self.names[cid]}
            runner.send_message("calculet_end", data, client_id=cid)
        try:
            for reply in self._gather("calculet_closed", run_id, alive, timeout_s=timeout_s):
                self._write_parts(run_dir, reply["worker"], reply["parts"])
                self._worker_info(run_dir, reply["worker"], reply["report"])
        except FleetError as exc:
            log.warning("calculet: %s", exc)
        missing = {"status": "missing"}
        return [self.reports.get(n, {**missing, "worker": n}) for n in self.names.values()]

    def close(self) -> None:
        if self.runner is not None:
            self.runner.quit()
            self.runner = None
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
        self._kill_local()

    # --- helpers ------------------------------------------------------------------------
    def _runner(self) -> MasterRunner:
        if self.runner is None:
            raise FleetError("the fleet is not started")
        return self.runner

    def _state(self, cid: str) -> str | None:
        client = self._runner().clients.get(cid)
        return client.state if client is not None else None

    def _on_reply(self, environment: Environment, msg: Any, **_kw: Any) -> None:
        task = str(msg.data.get("task") or msg.data.get("run_id"))
        waiter = self._waiting.get((msg.type + ":" + task, msg.node_id))
        if waiter is not None:
            waiter.set(msg.data)

    def _gather(
        self, kind: str, task: str, clients: dict[str, Any], *, timeout_s: float | None
    ) -> list[dict[str, Any]]:
        """Each client's reply `kind` to `task`; a worker missing for MISSING_GRACE_S (or
        the timeout passing) is a FleetError."""
        waiters = {cid: gevent.event.AsyncResult() for cid in clients}
        for cid, w in waiters.items():
            self._waiting[(kind + ":" + task, cid)] = w
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        missing_since: dict[str, float] = {}
        try:
            while not all(w.ready() for w in waiters.values()):
                gevent.wait([w for w in waiters.values() if not w.ready()], timeout=1.0, count=1)
                now = time.monotonic()
                dead = [p.returncode for p in self.procs if p.poll() is not None]
                if dead:
                    raise FleetError(f"a local worker process exited (code {dead[0]})")
                for cid, w in waiters.items():
                    if w.ready():
                        continue
                    if self._state(cid) in (STATE_MISSING, None):
                        since = missing_since.setdefault(cid, now)
                        if now - since > MISSING_GRACE_S:
                            raise FleetError(f"worker {self.names[cid]} was lost (no heartbeat)")
                    else:
                        missing_since.pop(cid, None)
                if deadline is not None and now > deadline:
                    late = [self.names[c] for c, w in waiters.items() if not w.ready()]
                    raise FleetError(f"no {kind} from {', '.join(late)} within {timeout_s:.0f} s")
            return [w.get() for w in waiters.values()]
        finally:
            for cid in waiters:
                self._waiting.pop((kind + ":" + task, cid), None)

    def _write_parts(self, run_dir: Path, worker: str, parts: dict[str, bytes]) -> None:
        folder = run_dir / "client" / worker
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in parts.items():
            if "/" in name or not name.startswith(("part-", "quarantine-")):
                raise FleetError(f"{worker} sent a part with a bad name: {name!r}")
            tmp = folder / f".{name}.tmp"
            tmp.write_bytes(data)
            tmp.replace(folder / name)

    def _sync_clocks(self, max_age_s: float) -> None:
        """Measure each worker's wall-clock offset to this master if older than
        `max_age_s` (the worker keeps it and converts the instants we send)."""
        if self.clock_sync is not None:
            alive = [cid for cid in self.names if self._state(cid) != STATE_MISSING]
            self.clock_sync.ensure(alive, max_age_s=max_age_s)

    def _worker_info(self, run_dir: Path, worker: str, info: dict[str, Any]) -> None:
        """What a worker reported of itself (host, pid, clock): kept, and written to
        `client/<worker>/worker.json` for the run's index."""
        cid = next((c for c, n in self.names.items() if n == worker), None)
        if self.clock_sync is not None and cid is not None:
            clock = self.clock_sync.for_client(cid)
            if clock is not None:  # the master's measurement of this worker
                info = {**info, "master_clock_sync": clock}
        self.reports[worker] = info
        _write_json(run_dir / "client" / worker / "worker.json", info)

    def _kill_local(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def _worker_info(name: str) -> dict[str, Any]:
    return {"worker": name, "host": socket.gethostname(), "pid": os.getpid(),
            "status": "reported", **clock_provenance()}  # fmt: skip


# ------------------------------------------------------------------ the worker side
class Agent:
    """One accept run on a Locust worker: a session, a spool sink and its self-watch."""

    def __init__(self, job: dict[str, Any], opts: Any = None) -> None:
        self.run_id = str(job["run_id"])
        self.name = str(job["worker"])
        ctx = job["context"]
        context = RunContext(
            **{**ctx, "worker": self.name, "host": socket.gethostname(),
               "software": Software(**ctx["software"]), "hardware": Hardware(**ctx["hardware"])}
        )  # fmt: skip
        target = job["target"]
        # CALCULET_SPOOL_DIR: where the spool goes (the master sets it for local workers:
        # under the run's logs/, so a killed worker's unsent parts stay with the run)
        spool_root = os.environ.get("CALCULET_SPOOL_DIR") or None
        if spool_root:
            Path(spool_root).mkdir(parents=True, exist_ok=True)
        self.spool = Path(tempfile.mkdtemp(prefix="calculet-spool-", dir=spool_root))
        self.sink = PartSink(str(self.spool), self.name)
        timeout = float(target["timeout_s"])
        # TLS, base path, headers and key rebuilt here: secrets do not travel (the key is
        # read from the same file or variable on this host; `opts`: this worker's options)
        access = access_described(target.get("access") or {"url": target["url"]}, opts)
        self.session = Session(
            context,
            access,
            target["protocol"],
            model=target.get("model"),
            max_in_flight=1024,
            timeouts=Timeouts.within(timeout),
            sink=self.sink,
            prompt_reuse=bool(target.get("prompt_reuse")),
            lane=(int(job["lane"][0]), int(job["lane"][1])),  # its place in the fleet
        )
        self.watch = SelfWatch(self.sink, self.name, in_flight=lambda: self.session.in_flight)
        self.watch.start()
        sizing = SimpleNamespace(profile=target.get("profile"), tokenizer=target.get("tokenizer"))
        self.prompts = PromptBook(lambda protocol: target_prompts(access, protocol, sizing))
        self.protocol = str(target["protocol"])
        self.session.count_text = self.prompts.factory(self.protocol).count_text
        self.cells = CellRunner(self.session, self.prompt, self.prompts)
        self.pending: dict[str, Share] = {}
        self.shipped: set[str] = set()
        # RTT and jitter from this host (§5), on the profile's health path
        self.rtt = RttRounds(
            access,
            path=profile_named(target.get("profile") or "calculet").health_probe_path,
        )

    def prompt(self, tokens: int, sample: int) -> Prompt:
        return self.prompts(self.protocol, tokens, sample)

    def new_parts(self) -> dict[str, bytes]:
        """Closed parts not sent to the master yet, by file name."""
        folder = self.spool / "client" / self.name
        out = {}
        # quarantine files: rows the sink could not put into a part travel with the parts
        files = [*folder.glob("part-*.parquet"), *folder.glob("quarantine-*.jsonl")]
        for path in sorted(files):
            if path.name not in self.shipped:
                out[path.name] = path.read_bytes()
                self.shipped.add(path.name)
        return out

    def close(self) -> dict[str, Any]:
        self.watch.stop()
        self.session.close()
        stats = self.sink.close()
        return {**_worker_info(self.name), "sink": dataclasses.asdict(stats),
                "target_rtt": self.rtt.record()}  # fmt: skip


AGENTS: dict[str, Agent] = {}  # run id -> this worker's agent


def install_worker(runner: WorkerRunner) -> None:
    """Register the worker's handlers (calculet_load.locust.plugin does, on a worker)."""
    runner.register_message("calculet_share", _on_share, concurrent=True)
    runner.register_message("calculet_go", _on_go, concurrent=True)
    runner.register_message("calculet_end", _on_end, concurrent=True)


def _reply(environment: Environment, kind: str, data: dict[str, Any]) -> None:
    runner = environment.runner
    assert isinstance(runner, WorkerRunner)
    runner.send_message(kind, data)


def _on_share(environment: Environment, msg: Any, **_kw: Any) -> None:
    job, task = msg.data["job"], str(msg.data["task"])
    error, infra, info = None, True, None
    try:
        agent = AGENTS.get(job["run_id"])
        if agent is None:
            agent = AGENTS[job["run_id"]] = Agent(job, environment.parsed_options)
            agent.rtt.take("before")
            info = {**_worker_info(agent.name), "target_rtt": agent.rtt.record()}
        share = Share.from_wire(msg.data["share"])
        agent.cells.prepare(share)
        agent.session.pool.prewarm(min(share.count, share.cell.max_in_flight))
        agent.pending[task] = share
    except WorkloadError as exc:
        error, infra = f"cannot build a prompt: {exc}", False
    except AccessError as exc:  # this host lacks the key or a secret header: config, exit 2
        error, infra = f"cannot reach the target from this worker: {exc}", False
    except (OSError, ValueError, KeyError) as exc:
        error, infra = f"cannot prepare the share: {exc}", True
    data = {"task": task, "worker": job["worker"], "error": error, "infra": infra, "info": info}
    _reply(environment, "calculet_ready", data)


def _on_go(environment: Environment, msg: Any, **_kw: Any) -> None:
    task = str(msg.data["task"])
    agent = next((a for a in AGENTS.values() if task in a.pending), None)
    if agent is None:
        log.error("calculet: go for an unknown task %s", task)
        return
    start = LOCAL.to_local_ns(int(msg.data["start_wall_ns"]))  # the master's instant, ours
    share = dataclasses.replace(agent.pending.pop(task), start_wall_ns=start)
    sent, error = 0, None
    try:
        sent = agent.cells.run(share)
    except Exception as exc:  # a bug, not the server's behaviour: reported, the run stops
        log.exception("%s: the share failed inside the client", agent.name)
        error = f"the share failed inside the client: {exc!r}"
    agent.sink.flush_polling(gevent.sleep)  # the step's records are closed parts: it is done
    data = {"task": task, "worker": agent.name, "sent": sent, "parts": agent.new_parts(),
            "error": error}  # fmt: skip
    _reply(environment, "calculet_done", data)
    agent.rtt.take("during")  # after the reply, at most once a minute: never delays a step


def _on_end(environment: Environment, msg: Any, **_kw: Any) -> None:
    agent = AGENTS.pop(str(msg.data["run_id"]), None)
    name = str(msg.data["worker"])
    if agent is None:  # this worker had no share in the run
        data = {"run_id": msg.data["run_id"], "worker": name, "parts": {},
                "report": _worker_info(name)}  # fmt: skip
        _reply(environment, "calculet_closed", data)
        return
    report = agent.close()
    data = {"run_id": agent.run_id, "worker": agent.name, "parts": agent.new_parts(),
            "report": report}  # fmt: skip
    _reply(environment, "calculet_closed", data)
    shutil.rmtree(agent.spool, ignore_errors=True)
