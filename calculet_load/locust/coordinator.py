"""The master (or single local process) side of a Locust run: the plan, its broadcasts
(rate changes, bursts, the target user count), merged live stats, the target's traces
fetched at each stop (`server/`) and `client/index.json`.
The wiring is calculet_load.locust.plugin; the workers' side is calculet_load.locust.worker.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import gevent.pool
from locust.env import Environment
from locust.runners import MasterRunner

from calculet_load.locust.clocksync import ClockSync
from calculet_load.locust.livestats import LiveStats
from calculet_load.locust.llmstats import LLMTable
from calculet_load.locust.series import LiveSeries, point_of
from calculet_load.locust.worker import OPEN_LOOP, Plan, Worker, _run_id, options, target_access
from calculet_load.schema.fs import write_file
from calculet_load.schema.liveseries import LiveSeriesPoint
from calculet_load.schema.profiles import profile_named
from calculet_load.schema.runfolder import ClientIndex, IndexWorker
from calculet_load.target.api import TargetAPI
from calculet_load.target.scrape import ServerSampler, sampler_for_run
from calculet_load.target.traces import TraceWindow, collect_traces

log = logging.getLogger("calculet_load")

HISTORY_KEEP = 3600  # Locust appends a history row per second forever: keep an hour


# ------------------------------------------------------------------ the master side
class Coordinator:
    """Master (or local) side: plan, broadcasts, bursts, index, merged live stats."""

    def __init__(self, env: Environment, local_worker: Callable[[], Worker | None]) -> None:
        self.env = env
        # a run without workers: this process's own Worker (None between runs)
        self.local_worker = local_worker
        self.stats = LiveStats()
        self.llm = LLMTable()  # the LLM tab, CSV and HTML section (merged)
        self.reports: dict[str, dict[str, Any]] = {}
        self.worker_state: dict[str, dict[str, Any]] = {}
        self.plan: Plan | None = None
        self.started_wall_ns = 0
        self.ended_wall_ns: int | None = None
        self.bursts: list[dict[str, Any]] = []
        # the burst options an Edit changed while the run went on, in order
        self.option_changes: list[dict[str, Any]] = []
        self.series = LiveSeries()  # the live figures over time (the tab's charts)
        self._loop: gevent.Greenlet[..., Any] | None = None
        self._burster: gevent.Greenlet[..., Any] | None = None
        self._bursts_changed = gevent.event.Event()
        self._burst_seq = 0
        self._sampler: ServerSampler | None = None  # the target's /metrics and process
        # each worker's wall-clock offset to this master (set up on a master)
        self.clock_sync: ClockSync | None = None
        # what fetch_traces did at this run's stop (the index's server_traces)
        self.server_traces: dict[str, Any] | None = None
        self.refused: str | None = None  # why the last start was refused (the start check)

    @property
    def distributed(self) -> bool:
        return isinstance(self.env.runner, MasterRunner)

    def workers(self) -> list[int]:
        runner = self.env.runner
        if isinstance(runner, MasterRunner):
            ids = [c.id for c in runner.clients.values() if c.state != "missing"]
            return sorted(runner.get_worker_index(i) for i in ids)
        return [0]

    def start(self) -> Plan:
        opts = options(self.env)
        run_id = _run_id(opts)
        run_dir = opts.run_dir or str(Path("runs") / run_id)
        indexes = self.workers()
        runner = self.env.runner
        if self.clock_sync is not None and isinstance(runner, MasterRunner):
            # every worker's offset fresh before the plan's wall instants go out
            ids = [c.id for c in runner.clients.values() if c.state != "missing"]
            self.clock_sync.ensure(ids, max_age_s=5.0)
        delay = max(float(opts.start_delay), 0.2)
        self.stats = LiveStats()
        self.llm = LLMTable()
        self.reports = {}
        self.bursts = []
        self.option_changes = []
        self._bursts_changed.clear()
        self.started_wall_ns = time.time_ns()
        self.ended_wall_ns = None
        self.server_traces = None
        self.plan = Plan(
            run_id=run_id,
            run_dir=run_dir,
            arrival=opts.arrival,
            rate=float(opts.rate),
            seed=int(opts.seed),
            origin_wall_ns=time.time_ns() + int(delay * 1e9),
            slots={str(i): slot for slot, i in enumerate(indexes)},
            users=int(getattr(self.env.runner, "target_user_count", 0) or 0),
        )
        opts.calculet_plan = self.plan.to_json()
        self.series.start(run_dir)
        self.write_index("running")
        # the target's /metrics and process into server/ while the run goes on
        if self._sampler is not None:
            self._sampler.stop()
        self._sampler = sampler_for_run(
            run_dir,
            self.env.host,
            interval_s=float(opts.scrape_interval),
            metrics_url=opts.server_metrics_url,
            metrics=profile_named(opts.target_profile or "calculet").metrics,
            server_pid=int(opts.server_pid),
            access=target_access(opts, self.env.host) if self.env.host else None,
        )
        if self._loop is None:
            self._loop = gevent.spawn(self._tick_loop)
        if opts.arrival == "burst":
            self._burster = gevent.spawn(self._burst_loop, delay)
        log.info(
            "calculet run %s: %s arrivals, %d dispatcher(s), run folder %s",
            run_id,
            opts.arrival,
            len(indexes),
            run_dir,
        )
        return self.plan

    def stop(self) -> None:
        if self._burster is not None:
            self._burster.kill()
            self._burster = None
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        self.ended_wall_ns = time.time_ns()

    # --- the target's traces at stop ----------------------------------------------------
    def fetch_traces(self) -> dict[str, Any]:
        """Copy the target's traces of this run into `server/` (calculet_load.target.traces)
        and keep what was done for the index. Never raises: a target without traces is
        `not_available`, a failed fetch is logged loudly and recorded as `error`; the
        client records are never touched."""
        plan = self.plan
        opts = options(self.env)
        if plan is None:
            raise ValueError("no run to fetch the traces of")
        record: dict[str, Any]
        if opts.no_server_traces:
            record = {"status": "off", "reason": "--no-server-traces"}
        elif not self.env.host:
            record = {"status": "not_available", "reason": "no target host (-H)"}
        elif not (profile := profile_named(opts.target_profile or "calculet")).traces:
            record = {"status": "not_available", "reason": f"the {profile.name} profile has none"}
        else:
            window = TraceWindow(plan.run_id, self.started_wall_ns, time.time_ns())
            try:
                record = collect_traces(
                    TargetAPI(target_access(opts, self.env.host)),
                    plan.run_dir,
                    window=window,
                    timeout_s=float(opts.trace_timeout),
                )
            except Exception as exc:  # the run's records stand whatever this did
                log.exception("calculet run %s: fetching the target's traces failed", plan.run_id)
                record = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
        self.server_traces = record
        kinds = record.get("kinds") or {}
        got = ", ".join(f"{k} {v['rows']} rows" for k, v in kinds.items() if "rows" in v)
        if record["status"] == "error":
            log.error(
                "calculet run %s: the target's traces were NOT all fetched (%s)%s: "
                "the analysis joins only what is in %s/server/",
                plan.run_id,
                record.get("reason"),
                f"; fetched {got}" if got else "",
                plan.run_dir,
            )
        elif record["status"] == "fetched":
            log.info(
                "calculet run %s: server traces: %s in %s/server/", plan.run_id, got, plan.run_dir
            )
        else:
            log.warning(
                "calculet run %s: no server traces (%s: %s); the records are analysed "
                "without a server breakdown",
                plan.run_id,
                record["status"],
                record.get("reason"),
            )
        return record

    # --- periodic work ----------------------------------------------------------------
    def _tick_loop(self) -> None:
        while True:
            gevent.sleep(1.0)
            try:
                self.tick()
            except Exception:
                log.exception("calculet master tick failed")

    def tick(self) -> None:
        runner = self.env.runner
        if runner is None:
            return
        history = runner.stats.history
        if len(history) > HISTORY_KEEP:
            del history[: len(history) - HISTORY_KEEP]
        if isinstance(runner, MasterRunner):
            now = time.time_ns()
            for c in runner.clients.values():
                name = f"w{runner.get_worker_index(c.id):02d}"
                st = self.worker_state.setdefault(name, {"status": c.state})
                if c.state == "missing" and st.get("status") != "missing":
                    st["missing_since_wall_ns"] = now
                    log.warning("calculet: worker %s went missing", name)
                st["status"] = c.state
            if self.plan is not None:
                runner.send_message(
                    "calculet_target",
                    {"users": runner.target_user_count or 0, "run_id": self.plan.run_id},
                )
        elif (w := self.local_worker()) is not None:
            w.target_users = runner.target_user_count or 0
        if self.plan is not None and self.ended_wall_ns is None:
            self.write_index("running")  # first: the index never waits on the series
            self.series.add(self.point())

    # --- the figures on view ----------------------------------------------------------------
    def current(self) -> tuple[LiveStats, LLMTable]:
        """The run's live figures: merged from the workers, or a local run's own (its
        worker's while it runs; adopted when it stops, and kept until the next start)."""
        if not self.distributed and (w := self.local_worker()) is not None:
            return w.stats, w.llm
        return self.stats, self.llm

    def point(self, final: bool = False) -> LiveSeriesPoint:
        """The live figures now, as a point of the run's series."""
        stats, llm = self.current()
        opts = options(self.env)
        runner = self.env.runner
        open_loop = self.plan is not None and self.plan.arrival in OPEN_LOOP
        return point_of(
            llm,
            stats,
            wall_ns=time.time_ns(),
            started_wall_ns=self.started_wall_ns,
            users=int(runner.user_count if runner is not None else 0),
            rate=float(opts.rate) if open_loop else None,
            final=final,
        )

    def marks(self) -> list[dict[str, Any]]:
        """What the charts mark: each rate change (at its schedule instant, as a wall
        time) and each burst (at its fire-at), in time order."""
        plan = self.plan
        if plan is None:
            return []
        out = [
            {"wall_ns": plan.origin_wall_ns + at_ns, "kind": "rate", "label": f"{rate:g}/s"}
            for at_ns, rate in plan.rate_changes
        ]
        out += [
            {"wall_ns": b["fire_at_wall_ns"], "kind": "burst", "label": f"burst {b['size']}"}
            for b in self.bursts
        ]
        return sorted(out, key=lambda m: int(m["wall_ns"]))

    # --- rate changes (web UI, load shape) ----------------------------------------------
    def change_rate(self, rate: float, lead_s: float = 0.5) -> None:
        plan = self.plan
        if plan is None or self.ended_wall_ns is not None:
            raise ValueError("no run is running")
        if plan.arrival not in OPEN_LOOP:
            raise ValueError(
                f"the rate applies to an open-loop run (--arrival poisson, constant, gamma "
                f"or replay); this run's arrival is {plan.arrival}"
            )
        at_ns = max(time.time_ns() + int(lead_s * 1e9) - plan.origin_wall_ns, 0)
        plan.rate_changes.append((at_ns, rate))
        options(self.env).rate = rate
        options(self.env).calculet_plan = plan.to_json()
        msg = {"at_ns": at_ns, "rate": rate}
        if isinstance(self.env.runner, MasterRunner):
            self.env.runner.send_message("calculet_rate", msg)
        elif (w := self.local_worker()) is not None:
            w.change_rate(at_ns, rate)
        log.info("calculet: rate %.3f/s from schedule time %.3f s", rate, at_ns / 1e9)

    # --- bursts ---------------------------------------------------------------------------
    def _burst_loop(self, delay: float) -> None:
        """`--arrival burst`: one burst after the start delay, then one every
        `--burst-every` s (0: no more). An Edit of the size or the period takes effect
        at once: the next burst is due a period after the last one (now, if that passed)."""
        opts = options(self.env)
        gevent.sleep(delay)
        last = time.monotonic()
        self.fire_burst(int(opts.burst_size), float(opts.burst_lead))
        while True:
            every = float(opts.burst_every)
            wait = None if every <= 0 else max(last + every - time.monotonic(), 0.0)
            self._bursts_changed.clear()
            if wait is None or wait > 0:
                self._bursts_changed.wait(wait)
                continue
            last = time.monotonic()
            self.fire_burst(int(opts.burst_size), float(opts.burst_lead))

    def change_option(self, name: str, value: Any) -> None:
        """An option an Edit may change while the run goes on (calculet_load.locust.edit),
        set and listed in the index's `option_changes`; the rate goes through change_rate."""
        if name == "rate":
            self.change_rate(float(value))
            return
        setattr(options(self.env), name, value)
        self.option_changes.append({"wall_ns": time.time_ns(), "option": name, "value": value})
        self._bursts_changed.set()
        log.info("calculet: --%s %s from now on", name.replace("_", "-"), value)

    def fire_burst(self, size: int, lead_s: float) -> dict[str, Any]:
        plan = self.plan
        if plan is None or self.ended_wall_ns is not None:
            raise ValueError("no run is running")
        self._burst_seq += 1
        burst_id = f"{plan.run_id}.b{self._burst_seq:04d}"
        indexes = sorted(plan.slots, key=int)
        counts = {
            i: size // len(indexes) + (1 if n < size % len(indexes) else 0)
            for n, i in enumerate(indexes)
        }
        first_k: dict[str, int] = {}
        k = self._burst_seq * 1_000_000
        for i in indexes:
            first_k[i] = k
            k += counts[i]
        fire_at = time.time_ns() + int(lead_s * 1e9)
        msg = {"id": burst_id, "fire_at_wall_ns": fire_at, "counts": counts, "first_k": first_k}
        self.bursts.append(
            {"id": burst_id, "size": size, "fire_at_wall_ns": fire_at, "counts": counts}
        )
        if isinstance(self.env.runner, MasterRunner):
            self.env.runner.send_message("calculet_burst", msg)
        elif (w := self.local_worker()) is not None:
            gevent.spawn(w.burst, burst_id, fire_at, counts["0"], first_k["0"])
        return msg

    def expected_workers(self) -> set[str]:
        """Workers of the plan that are not known to be gone."""
        names = {f"w{int(i):02d}" for i in self.plan.slots} if self.plan else set()
        gone = {n for n, st in self.worker_state.items() if st.get("status") == "missing"}
        return names - gone

    # --- worker reports ---------------------------------------------------------------------
    def on_worker_stats(self, client_id: str, data: dict[str, Any]) -> None:
        wire = data.get("calculet")
        if wire:
            self.stats.merge_wire(wire, process=wire.get("worker", client_id))
            self.llm.merge_wire(wire.get("llm") or {})

    def adopt(self, worker: Worker) -> None:
        """A local run's own figures become this side's when its worker stops (and stay
        on view until the next start)."""
        self.stats, self.llm = worker.stats, worker.llm

    def on_parts(self, report: dict[str, Any]) -> None:
        llm = report.pop("llm", None)  # a worker's last figures, not part of the index
        if llm and self.distributed:
            self.llm.merge_wire(llm)
        self.reports[report["worker"]] = report
        self.write_index("running" if self.ended_wall_ns is None else "stopping")

    # --- the run's index ----------------------------------------------------------------------
    def write_index(self, status: str) -> dict[str, Any] | None:
        plan = self.plan
        if plan is None:
            return None
        workers = []
        names = sorted(
            set(self.reports) | {f"w{int(i):02d}" for i in plan.slots} | set(self.worker_state)
        )
        missing = False
        for name in names:
            entry: dict[str, Any] = {"worker": name, **self.worker_state.get(name, {})}
            rep = self.reports.get(name)
            if rep is not None:
                entry.update(rep, status="reported")  # IndexWorker.check_sink: lost rows
            elif status == "complete":
                entry["status"] = "reported" if entry.get("status") == "reported" else "missing"
                missing = True
            clock = self._clock_of(name)
            if clock is not None:
                entry["master_clock_sync"] = clock
            workers.append(IndexWorker(**entry))
        if status == "complete" and not self.series.closed:
            self.series.add(self.point(final=True))  # every request of the run has ended
            self.series.close()
        extra = {"option_changes": list(self.option_changes)} if self.option_changes else {}
        index = ClientIndex(
            run_id=plan.run_id,
            status="incomplete" if missing else status,
            started_wall_ns=self.started_wall_ns,
            ended_wall_ns=self.ended_wall_ns,
            plan=json.loads(plan.to_json()),
            options=_options_snapshot(options(self.env)),
            target=self.env.host,
            workers=workers,
            bursts=[{**b, **burst_spread(b["id"], self.reports.values())} for b in self.bursts],
            live_series=self.series.descriptor(),
            **extra,
        )
        if self.server_traces is not None:
            index.server_traces = self.server_traces
        index.check_sinks()
        index.write(plan.run_dir)
        return index.to_dict()

    def _clock_of(self, name: str) -> dict[str, Any] | None:
        """The master's latest offset measurement of the worker called `name`."""
        runner = self.env.runner
        if self.clock_sync is None or not isinstance(runner, MasterRunner):
            return None
        for cid in list(self.clock_sync.latest):
            if f"w{runner.get_worker_index(cid):02d}" == name:
                return self.clock_sync.for_client(cid)
        return None


def burst_spread(burst_id: str, reports: Any) -> dict[str, Any]:
    """A burst's spread across workers: its last actual send minus its first, both on the
    master's wall clock (each worker converted its sends with its measured offset)."""
    firsts: list[int] = []
    lasts: list[int] = []
    for rep in reports:
        for b in rep.get("bursts") or []:
            if b.get("id") == burst_id and b.get("first_send_master_ns") is not None:
                firsts.append(int(b["first_send_master_ns"]))
                lasts.append(int(b["last_send_master_ns"]))
    if not firsts:
        return {"spread_ms": None, "workers_sent": 0}
    return {
        "spread_ms": (max(lasts) - min(firsts)) / 1e6,
        "workers_sent": len(firsts),
        "first_send_master_ns": min(firsts),
    }


def _options_snapshot(opts: Any) -> dict[str, Any]:
    keys = (
        "protocol",
        "model",
        "arrival",
        "rate",
        "burstiness",
        "replay_file",
        "mix",
        "prompt_tokens",
        "max_tokens",
        "max_in_flight",
        "late_ms",
        "burst_size",
        "burst_every",
        "seed",
        "request_timeout",
        "num_users",
        "no_stream",
    )
    out = {k: getattr(opts, k, None) for k in keys}
    # how the target was reached, secrets as <redacted> and the key by its source only;
    # "insecure": true when certificate verification was off (--insecure)
    out["target_access"] = target_access(opts, opts.host or "").describe() if opts.host else None
    return out


def _write_json(run_dir: str, rel: str, obj: Any) -> None:
    write_file(run_dir, rel, json.dumps(obj, indent=1, default=str).encode())
