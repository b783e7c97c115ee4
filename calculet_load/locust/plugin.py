# size: the wiring of every Locust event and option in one place (DESIGN: locust layer)
"""Locust integration: users, open-loop dispatch, bursts, live stats, the web UI tab.

Import this module from a locustfile (`locustfiles/calculet.py` does); importing it
registers the command-line options and the event listeners. Only the `locust_*` modules
and the locustfiles import Locust: Locust monkey-patches the standard library on import,
and the rest of calculet_load must stay importable without that. This module is the
wiring; a process's share of the run is `locust_worker.Worker`, the master's side
`locust_coordinator.Coordinator`, and a distributed `accept` is `locust_cells`.

How a run is organised:

* **The master (or a single local process) owns the plan.** At `test_start`, before
  Locust sends its first spawn message, it fixes the run id, the run folder, the
  schedule origin (a wall time a moment ahead) and the list of worker processes, and
  puts them into `parsed_options.calculet_plan`; Locust forwards custom options to the
  workers with the spawn message. Every second it re-broadcasts the current target
  (users, rate) for labels and late joiners, trims Locust's history, and writes
  `client/index.json`.
* **Each worker process is one dispatcher slot.** Open loop (`--arrival poisson |
  constant | gamma | replay`): one greenlet per process computes the one global
  schedule (calculet_load.workload.arrivals) and fires the arrivals of its slot at their
  intended time, whatever the server does; an arrival that finds `--max-in-flight`
  requests running is recorded as dropped. Locust's users are idle placeholders
  then: their number does not change the load. Closed loop (`--arrival closed`):
  each Locust user sends its next request when the last one ends.
* **Bursts** (`--arrival burst`): the master sends a fire-at wall time ahead; each
  worker opens its connections in advance, waits on its monotonic clock and fires its
  share at once. Every request of a burst carries the burst id.
* **Clocks** (calculet_load.locust.clocksync): the master measures each worker's
  wall-clock offset to itself over Locust's message channel (NTP-style) when it
  connects, before each run and every `--clock-sync-every` s; workers move the
  master's wall instants (schedule origin, fire-at) onto their own clock with it. Each
  worker also measures RTT and jitter to the target (calculet_load.target.netprobe).
* **Server traces**: when the run stops (each stop of a web-UI run), the master copies
  the target's `/traces/{kind}` rows of this run into `server/` and records what it
  got, or `not_available` and why, as `server_traces` in `client/index.json`
  (calculet_load.target.traces).
* **Records** go to the worker's own Parquet parts in the run folder; Locust's
  `request` event fires once per request (its cell, E2E, failure), and the token-level
  figures go to the LLM tab, CSV and HTML section (calculet_load.locust.llmstats, .locust_llm).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import gevent
import gevent.event
import gevent.pool
from locust import events, task
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner

from calculet_load.errors import ExitCode
from calculet_load.locust.accuracy import self_check
from calculet_load.locust.coordinator import Coordinator
from calculet_load.locust.livestats import LiveStats
from calculet_load.locust.llmstats import LLMTable, nothing_answered
from calculet_load.locust.llmuser import LLMUser, ProgrammedTasks, programmed
from calculet_load.locust.options import convert, register
from calculet_load.locust.startcheck import Refused, check_target
from calculet_load.locust.state import STATE as STATE
from calculet_load.locust.worker import OPEN_LOOP, Plan, Worker, _mix, options
from calculet_load.measure import native
from calculet_load.measure.prompts import WorkloadError
from calculet_load.measure.sink import sink_status
from calculet_load.schema.access import AccessError, access_from
from calculet_load.schema.manifest import ManifestError, load_manifest
from calculet_load.workload.arrivals import ArrivalError, load_replay, unit_gaps
from calculet_load.workload.mixes import MixError

log = logging.getLogger("calculet_load")

UI_OPTIONS: set[str] = set()  # our options in the web UI's start form (their dest names)


# ------------------------------------------------------------------ options
@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    register(parser.add_argument, UI_OPTIONS)  # calculet_load.locust.options declares them


# ------------------------------------------------------------------ Locust wiring
@events.init.add_listener
def _on_init(environment: Environment, **_kw: Any) -> None:
    if environment.parsed_options is None:
        return
    _resolve_arrival(environment)
    _validate(environment.parsed_options)
    # The sink's writer thread converts rows to Arrow while holding the GIL; with the
    # default 5 ms switch interval the event loop could wait that long for the GIL, and
    # every timestamp with it. 0.5 ms bounds that wait at a small cost in throughput.
    sys.setswitchinterval(0.0005)
    # gevent records each new greenlet's spawner and up to 10 of its stack's frames,
    # for debugging tools this process does not run: a greenlet per request, 10-11 µs to
    # spawn and run without it against 18-21 with it, and five fewer tracked objects
    # each for the collector to scan while it is in flight (measure.heap).
    gevent.config.track_greenlet_tree = False
    runner = environment.runner
    # which code reads the responses, and so what a request costs this process's CPU
    # (docs/measurement.md, "Compiled modules on a token event's path"): in every log
    (log.info if native.STATE.startswith("on") else log.warning)(
        "calculet-load's compiled modules: %s", native.STATE
    )
    if not isinstance(runner, WorkerRunner):
        STATE.master = Coordinator(environment, lambda: STATE.worker)
    if isinstance(runner, WorkerRunner):
        runner.register_message("calculet_rate", _on_rate_msg)
        runner.register_message("calculet_burst", _on_burst_msg)
        runner.register_message("calculet_target", _on_target_msg)
        runner.register_message("calculet_stop", _on_stop_msg)
        from calculet_load.locust import clocksync as locust_clocksync

        locust_clocksync.install_worker(runner)  # answer the master's clock pings
        from calculet_load.locust import cells as locust_cells

        locust_cells.install_worker(runner)  # the shares of a distributed `accept`
    if isinstance(runner, MasterRunner):
        runner.register_message("calculet_parts", _on_parts_msg)
        from calculet_load.locust.clocksync import ClockSync

        assert STATE.master is not None
        sync = STATE.master.clock_sync = ClockSync(runner)  # each worker's clock offset
        sync.start(lambda: float(options(environment).clock_sync_every))
    if environment.web_ui is not None:
        from calculet_load.locust import webui as locust_webui

        locust_webui.install(
            environment,
            lambda: STATE.master,
            live_stats,
            llm_table,
            lambda trial: option_problems(trial),
            UI_OPTIONS,
        )
    if not isinstance(runner, WorkerRunner):
        from calculet_load.locust import console

        console.install(environment, llm_table, lambda: _master().reports.values())
    from calculet_load.locust import llm as locust_llm

    locust_llm.install(environment, llm_table, _reset_llm)  # CSV, HTML, resets
    if int(environment.parsed_options.metrics_port) > 0:  # the Prometheus exposition
        from calculet_load.locust import prom

        prom.install(environment, live_stats, lambda: STATE.plan)
    _refresh_loop_clock()


def _refresh_loop_clock() -> None:
    """Bring the event loop's cached time to now before Locust arms `--run-time`.

    libev reads the clock once per loop turn and times a new timer from that reading.
    The hub exists from Locust's first imports, and nothing turns the loop while the
    locustfile and this plugin import and the init listeners run (about 2 s on a busy
    machine): `--run-time 6s` then stopped the run about 2 s early, as the gap between
    "Run time limit set" and "limit reached" in Locust's log showed.
    """
    gevent.get_hub().loop.update_now()


def _resolve_arrival(environment: Environment) -> None:
    """`--arrival` and `--rate` when the command line leaves them out: what the user
    classes declare (`LLMUser.arrival`, `.rate`), else closed at 1/s. Users of other
    kinds are named: calculet-load does not measure them."""
    opts = options(environment)
    classes = list(environment.user_classes or [])
    for c in classes:
        if not issubclass(c, LLMUser):
            log.warning(
                "user class %s is not measured by calculet-load: Locust times its requests "
                "itself (an HttpUser to the response headers) and no record is written; "
                "subclass calculet_load.locust.LLMUser and call self.llm (docs/locust.md)",
                c.__name__,
            )
    declared = {c.arrival for c in classes if issubclass(c, LLMUser) and c.arrival}
    if opts.arrival is None:
        if len(declared) > 1:
            print(
                "calculet-load: the user classes declare different arrivals "
                f"({', '.join(sorted(declared))}): give --arrival",
                file=sys.stderr,
            )
            raise SystemExit(int(ExitCode.INVALID_ARTIFACT))
        opts.arrival = declared.pop() if declared else "closed"
    if opts.rate is None:
        rates = {c.rate for c in classes if issubclass(c, LLMUser) and c.rate is not None}
        opts.rate = float(rates.pop()) if len(rates) == 1 else 1.0


def _validate(opts: Any) -> None:
    """Bad options fail at start with one line naming the option, exit 2 (invalid input,
    as a bad manifest is everywhere in calculet-load)."""
    problems = option_problems(opts)
    if problems:
        print("calculet-load: " + "; ".join(problems), file=sys.stderr)
        raise SystemExit(int(ExitCode.INVALID_ARTIFACT))


def option_problems(opts: Any) -> list[str]:
    """What is wrong with these options, one phrase naming the option each (none: []);
    the numbers made numbers in place (calculet_load.locust.options)."""
    problems = convert(opts)
    if problems:
        return problems  # the rest reads numbers
    if opts.arrival == "replay" and not opts.replay_file:
        problems.append("--replay-file is required with --arrival replay")
    elif opts.arrival == "replay":
        try:
            next(unit_gaps("replay", 0, replay=load_replay(opts.replay_file)))
        except (ArrivalError, OSError) as exc:
            problems.append(f"--replay-file: {exc}")
    try:
        _mix(opts)
        if opts.manifest:
            manifest = load_manifest(opts.manifest)
            if manifest.environment.vpn_in_path and opts.rtt_samples < 2:  # spec §5
                problems.append(
                    "environment.vpn_in_path is true: RTT and jitter must be measured "
                    f"(--rtt-samples >= 2, got {opts.rtt_samples})"
                )
        if getattr(opts, "host", None):  # the access is usable (files, variables, headers)
            access_from(opts, opts.host, manifest.target if opts.manifest else None)
    except (MixError, ManifestError, AccessError) as exc:
        problems.append(str(exc))
    return problems


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_kw: Any) -> None:
    runner = environment.runner
    opts = options(environment)
    if not isinstance(runner, WorkerRunner):  # the master, or the one local process
        users = environment.user_classes or []
        sized = any(getattr(c, "builtin", False) for c in users)  # CalculetUser's load
        refused = check_target(opts, environment.host or "", sized=sized)
        if refused is not None:
            _refuse(environment, refused)
            return
    if isinstance(runner, MasterRunner):
        assert STATE.master is not None
        STATE.plan = STATE.master.start()
        return
    if isinstance(runner, WorkerRunner):
        plan = Plan.from_json(opts.calculet_plan)
        index = runner.worker_index
    else:  # one local process: it is its own master
        assert STATE.master is not None
        plan = STATE.master.start()
        index = 0
    if STATE.worker is not None:
        STATE.worker.stop(timeout_s=1.0)
    STATE.plan = plan
    STATE.worker = Worker(environment, plan, index)
    classes = programmed(list(environment.user_classes or []))
    if classes and plan.arrival != "closed":  # the dispatcher runs the users' tasks
        STATE.worker.tasks = ProgrammedTasks(environment, classes, plan.seed)
    if plan.arrival in OPEN_LOOP:
        STATE.worker.start_dispatcher()


def _refuse(environment: Environment, refused: Refused) -> None:
    """The run does not start: its one line, its exit code, and Locust stopped (a
    headless run quits; the web UI's run stops, the line in its log and the LLM tab)."""
    print(refused.line, file=sys.stderr, flush=True)
    environment.process_exit_code = int(refused.code)
    if STATE.master is not None:
        STATE.master.refused = refused.line
    runner = environment.runner
    if runner is not None:
        headless = environment.web_ui is None
        gevent.spawn_later(0, runner.quit if headless else runner.stop)


@events.test_stopping.add_listener
def _on_test_stopping(environment: Environment, **_kw: Any) -> None:
    if STATE.worker is not None:
        STATE.worker.stopping = True  # no new arrivals; in-flight requests finish
        STATE.worker.plan_changed.set()


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_kw: Any) -> None:
    runner = environment.runner
    w = STATE.worker
    if w is not None:
        STATE.worker = None
        if not isinstance(runner, WorkerRunner) and STATE.master is not None:
            STATE.master.adopt(w)  # a local run's figures stay on view while it stops
        w.stop(timeout_s=max(environment.stop_timeout or 0.0, 10.0))
        report = w.report()
        report["llm"] = w.take_llm_pending()  # the figures since its last stats report
        problem = sink_status(report.get("sink"))
        if problem is not None:
            log.error("calculet worker %s: not every record is in its parts: %s", w.name, problem)
            environment.process_exit_code = int(ExitCode.INFRASTRUCTURE)
        if isinstance(runner, WorkerRunner):
            runner.send_message("calculet_parts", report)
        elif STATE.master is not None:
            STATE.master.on_parts(report)
    master = STATE.master
    if master is None or master.plan is None or master.ended_wall_ns is not None:
        return
    master.stop()
    if isinstance(runner, MasterRunner):
        # Locust's own quit (--run-time, Ctrl-C) does not wait for workers to stop:
        # ask them to stop now and wait for their part lists before the index closes.
        runner.send_message("calculet_stop", None)
        deadline = time.monotonic() + (environment.stop_timeout or 0.0) + 20.0
        expected = master.expected_workers()
        while time.monotonic() < deadline and not expected <= set(master.reports):
            gevent.sleep(0.2)
    # every request has ended: the target's traces of the run into server/ (the analysis
    # joins them); a target without traces, or a failed fetch, leaves the records as is
    master.fetch_traces()
    index = master.write_index("complete")
    self_check(environment, master.reports.values(), master.plan.run_id)
    unanswered = nothing_answered(master.llm)
    if unanswered is not None:
        log.error("calculet run %s measured nothing: %s", master.plan.run_id, unanswered)
        environment.process_exit_code = int(ExitCode.INFRASTRUCTURE)
    if index is not None and index["status"] != "complete":
        problems = [
            f"{w['worker']}: {w.get('sink_problem') or w.get('status')}"
            for w in index["workers"]
            if w.get("status") != "reported"
        ]
        log.error(
            "calculet run %s is INCOMPLETE (%s): see %s/client/index.json",
            master.plan.run_id,
            "; ".join(problems) or index["status"],
            master.plan.run_dir,
        )
        # Exit 3, infrastructure invalid: records are missing from the parts, so no
        # figure of this run can be trusted as is (Locust's own code would say 0 or 1).
        environment.process_exit_code = int(ExitCode.INFRASTRUCTURE)


def _on_stop_msg(environment: Environment, msg: Any, **_kw: Any) -> None:
    """The master is stopping the run: stop this worker's users, then report (test_stop)."""
    runner = environment.runner
    if STATE.worker is not None and runner is not None:
        runner.stop()


@events.report_to_master.add_listener
def _on_report_to_master(client_id: str, data: dict[str, Any], **_kw: Any) -> None:
    w = STATE.worker
    if w is None:
        return
    wire = w.wire_pending.to_wire()
    wire["worker"] = w.name
    wire["in_flight"] = w.session.in_flight
    wire["cpu_percent"] = w.cpu_percent
    wire["llm"] = w.take_llm_pending()
    w.wire_pending = LiveStats()
    data["calculet"] = wire


@events.worker_report.add_listener
def _on_worker_report(client_id: str, data: dict[str, Any], **_kw: Any) -> None:
    if STATE.master is not None:
        STATE.master.on_worker_stats(client_id, data)


def _on_rate_msg(environment: Environment, msg: Any, **_kw: Any) -> None:
    if STATE.worker is not None:
        STATE.worker.change_rate(int(msg.data["at_ns"]), float(msg.data["rate"]))


def _on_burst_msg(environment: Environment, msg: Any, **_kw: Any) -> None:
    w = STATE.worker
    if w is None:
        return
    me = str(w.index)
    n = int(msg.data["counts"].get(me, 0))
    if n:
        gevent.spawn(
            w.burst,
            msg.data["id"],
            int(msg.data["fire_at_wall_ns"]),
            n,
            int(msg.data["first_k"][me]),
        )


def _on_target_msg(environment: Environment, msg: Any, **_kw: Any) -> None:
    if STATE.worker is not None:
        STATE.worker.target_users = int(msg.data["users"])


def _on_parts_msg(environment: Environment, msg: Any, **_kw: Any) -> None:
    if STATE.master is not None:
        STATE.master.on_parts(msg.data)


def _master() -> Coordinator:
    assert STATE.master is not None
    return STATE.master


def worker_slots() -> list[int]:
    """Worker indexes that take part (this process alone when not distributed)."""
    return STATE.master.workers() if STATE.master is not None else [0]


def live_stats() -> LiveStats | None:
    """The live figures of this process: merged (master), or its own (local run)."""
    if STATE.master is not None:
        return STATE.master.current()[0]
    return STATE.worker.stats if STATE.worker is not None else None


def llm_table() -> LLMTable | None:
    """The LLM tab's figures: merged (master), or this process's own (local run)."""
    if STATE.master is not None:
        return STATE.master.current()[1]
    return STATE.worker.llm if STATE.worker is not None else None


def _reset_llm() -> None:
    """Locust's "Reset stats" on this process (the master also tells its workers)."""
    if STATE.worker is not None:
        STATE.worker.reset_llm()
    if STATE.master is not None:
        STATE.master.llm.reset()


# ------------------------------------------------------------------ the user
class CalculetUser(LLMUser):
    """The built-in workload. Closed loop: send the run's next request (its mix entry, or
    `--prompt-tokens`/`--max-tokens`), wait for the whole response, send again. Open loop
    and bursts: an idle placeholder (the process's dispatcher sends; users do not add
    load). A subclass with tasks of its own is a programmed user: its tasks replace this
    one, and `self.llm` is there for them."""

    abstract = False
    builtin = True

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        own = [t for t in cls.tasks if t is not CalculetUser.work]
        if own:  # Locust hands a subclass its bases' tasks too: not the built-in one
            cls.tasks = own
            cls.builtin = False
            # and Locust would run the base class too, imported into the locustfile
            CalculetUser.abstract = True

    @task
    def work(self) -> None:
        w = STATE.worker
        if w is None or w.plan.arrival != "closed" or w.stopping:
            gevent.sleep(0.5)
            return
        if not w.wait_ready(1.0):  # prompts and connections first: start-up is not load
            return
        try:
            w.closed_request(self.llm.pause)
        except (WorkloadError, OSError) as exc:
            log.error("%s: cannot build the request: %s", w.name, exc)
            gevent.sleep(1.0)
