"""`calculet-load capacity`: the stable maximum QPS of spec §14.3, by search.

Windows of open-loop load at one rate each: the rate doubles from `--start-rate` until a
window is not stable (or `--max-rate`), then bisects between the last stable and the
first unstable rate until they are within `--tolerance` of each other. A window is
stable when, over its measured part (after a warmup share),

  - the backlog does not keep growing: the Theil–Sen slope of the requests in flight
    (sampled through the window), times the measured span, stays under
    max(2, backlog_tolerance x arrivals): a queue that keeps growing is not stable,
    however good the latencies of the requests that did finish;
  - the reject rate (HTTP 429/503 and arrivals dropped at the client's in-flight cap)
    is within the SLA;
  - the P99 server queue time (accepted -> first job prepared, from the server's
    events), the P99 TTFT and the P99 end-to-end latency are within the SLA, where set;
  - with the SLA's `goodput`, the share of the measured arrivals that succeeded within
    its TTFT and TPOT objectives (the analysis' one definition of a good request,
    `analysis.stats.goodput.meets_slos`) is at least its `min_share`; an arrival
    dropped at the client's cap is not good.

Rates are requests per *target* second and durations target seconds: against a
simulator at `--time-scale F` (or the `time_scale` of `/admin/state`) a window of W
target seconds runs W*F real seconds at rate/F real requests per second. Between windows
the target drains (nothing in flight, queue empty) so windows do not leak into each
other. `capacity.json` holds every window (the curve), the verdict reasons and the
stable maximum; the records go to the run folder through the sink. The spec asks for
30-minute windows (`--window-s 1800`); shorter ones are a rehearsal and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import gevent
import gevent.pool

from calculet_drivers.capacity.sla import SPEC_WINDOW_S, load_sla
from calculet_drivers.capacity.window import Req, judge_window, ms, p99
from calculet_drivers.skeleton.progress import Progress
from calculet_drivers.skeleton.runclient import RunClient
from calculet_drivers.skeleton.runtarget import RunTarget
from calculet_load.errors import EXIT_FAIL, EXIT_INFRA, EXIT_INVALID, EXIT_OK, RunStop
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.session import RequestSpec
from calculet_load.schema.manifest import ManifestError, load_manifest
from calculet_load.target.api import TargetAPI, time_scale
from calculet_load.workload.arrivals import RateClock, Schedule
from calculet_load.workload.dispatch import LATE_AFTER_MS, OpenLoop, Sender
from calculet_load.workload.mixes import MixError, load_mix, single

CAPACITY_SCHEMA = "calculet-capacity/v1"


class Capacity:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.say = Progress(not args.quiet)
        self.manifest = load_manifest(args.manifest)
        t = self.target = RunTarget.of(self.manifest, args.url)
        self.url, self.protocol, self.model = t.url, t.protocol, t.model
        self.access = t.access  # TLS, base path, headers, API key (schema.access)
        self.token = os.environ.get("CALCULET_ADMIN_TOKEN")
        self.api = TargetAPI(self.access, self.token, operator="calculet-load-capacity")
        self.sla = load_sla(
            args.sla,
            {
                "max_reject_rate": args.max_reject_rate,
                "max_queue_p99_ms": args.max_queue_p99_ms,
                "max_ttft_p99_ms": args.max_ttft_p99_ms,
                "max_e2e_p99_ms": args.max_e2e_p99_ms,
            },
        )
        if not 0 < args.start_rate <= args.max_rate:
            raise ValueError("rates: need 0 < --start-rate <= --max-rate")
        self.mix = load_mix(args.mix) if args.mix else single(args.prompt_tokens, args.max_tokens)
        self.run_dir = Path(args.run_dir or Path("runs") / f"{self.manifest.run_id}-capacity")
        self.curve: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ the search
    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.client = RunClient.open(
            self.manifest, self.target, self.run_dir, "w00", max_in_flight=self.a.max_in_flight + 64
        )
        self.session = self.client.session
        try:
            code = run_in_greenlet(self._search)
        finally:
            self.client.close()
        return code

    def _search(self) -> int:
        problem = self.target.check()
        if problem is not None:
            self.say(f"capacity: {problem}")
            return EXIT_INFRA
        self.scale = time_scale(self.api, self.a.time_scale_hint)
        if self.target.profile.traces:
            self.api.skip_to_end("server_events")
        elif self.sla.max_queue_p99_ms is not None:
            self.say(
                f"capacity: queue p99 not available: the {self.target.profile.name} target has no "
                "traces (the queue SLA is not judged)"
            )
        self.session.pool.prewarm(min(self.a.max_in_flight, 64))
        self.say(
            f"capacity search on {self.url}: windows of {self.a.window_s:g} target s "
            f"({self.a.window_s * self.scale:.1f} s real), rates {self.a.start_rate:g}.."
            f"{self.a.max_rate:g} req/s (target), tolerance {self.a.tolerance:.0%}"
        )
        lo: float | None = None
        hi: float | None = None
        rate = self.a.start_rate
        while rate <= self.a.max_rate * (1 + 1e-9):  # doubling
            if self._window(rate)["stable"]:
                lo = rate
                rate *= 2
            else:
                hi = rate
                break
        if lo is None:  # even the start rate is not stable: halve down
            rate = self.a.start_rate / 2
            while rate >= self.a.start_rate / 64:
                if self._window(rate)["stable"]:
                    lo = rate
                    break
                hi = rate
                rate /= 2
        if lo is not None and hi is not None:  # bisect
            for _ in range(self.a.max_bisections):
                if (hi - lo) / lo <= self.a.tolerance:
                    break
                mid = (lo + hi) / 2
                if self._window(mid)["stable"]:
                    lo = mid
                else:
                    hi = mid
        return self._finish(lo, hi)

    # ------------------------------------------------------------------ a window
    def _window(self, rate: float) -> dict[str, Any]:
        a = self.a
        real_window = a.window_s * self.scale
        rate_real = rate / self.scale
        chooser = self.mix.chooser(a.seed)
        clock = RateClock(rate_real, 1)
        pool = gevent.pool.Pool(a.max_in_flight)
        reqs: list[Req] = []
        dropped = 0
        cell = f"capacity:{rate:.6g}"
        samples: list[tuple[float, int]] = []
        start = time.monotonic()
        end = start + real_window
        measure_from = start + a.warmup_fraction * real_window

        def sampler() -> None:
            every = max(real_window / 200, 0.005)
            while True:
                samples.append((time.monotonic(), self.session.in_flight))
                gevent.sleep(every)

        def send(spec: RequestSpec) -> None:
            req = Req(sent_mono=time.monotonic())
            reqs.append(req)
            rec, out = self.session.send(spec)
            tpot = rec.durations_ms.tpot
            req.tpot_s = None if tpot is None else tpot / 1e3
            req.output_tokens = rec.workload.actual_output_tokens
            req.rid = out.request_id
            req.status = out.http_status
            req.error = out.error_code if out.error_class else None
            req.done_mono = time.monotonic()
            ns = out.client_ns
            if out.ok and ns.request_start is not None:
                if ns.response_end is not None:
                    req.e2e_s = (ns.response_end - ns.request_start) / 1e9
                if ns.first_token is not None:
                    req.ttft_s = (ns.first_token - ns.request_start) / 1e9

        def dropped_arrival(spec: RequestSpec, reason: str) -> None:
            nonlocal dropped
            self.session.record_dropped(spec, reason)
            if time.monotonic() >= measure_from:
                dropped += 1

        def spec_for(k: int, due: int) -> RequestSpec:
            entry, sample = chooser.entry_for(k)
            return RequestSpec(
                prompt=self.client.prompt(entry.prompt_tokens, sample),
                max_tokens=entry.max_tokens,
                stream=entry.stream,
                cell=cell,
                arrival=a.arrival,
                intended_start_ns=due,
                late_after_ms=LATE_AFTER_MS,
            )

        watcher = gevent.spawn(sampler)
        OpenLoop(
            schedule=Schedule(a.arrival, a.seed + len(self.curve), clock),
            clock=clock,
            origin_ns=time.monotonic_ns() + 50_000_000,
            sender=Sender(pool, send, dropped_arrival),
            spec=spec_for,
            end_ns=int(end * 1e9),
        ).run()
        samples.append((time.monotonic(), self.session.in_flight))
        watcher.kill()
        # the requests still in flight: a grace for the ones about to finish, then cut
        pool.join(timeout=max(2.0, 0.25 * real_window))
        cut = len(pool)
        pool.kill(block=True, timeout=10)
        self._drain()
        queue = self._queue_ms({r.rid for r in reqs if r.sent_mono >= measure_from and r.rid})
        queue_limit = self.sla.max_queue_p99_ms if self.target.profile.traces else None
        result = judge_window(self.sla, self.scale, rate, reqs, dropped, samples,
                              measure_from, end, cut, queue, queue_limit)  # fmt: skip
        self.curve.append(result)
        m = result["metrics"]
        self.say(
            f"  {rate:8.4g} req/s: {'stable  ' if result['stable'] else 'UNSTABLE'} "
            f"served {m['served_rate']:.4g}/s, backlog +{m['backlog_growth']:.1f}, "
            f"rejects {m['reject_rate']:.1%}, e2e p99 {ms(m['e2e_p99_ms'])}, "
            f"queue p99 {ms(m['queue_p99_ms'])}"
            + (f", goodput {m['goodput_share']:.1%}" if "goodput_share" in m else "")
            + ("" if result["stable"] else f" ({'; '.join(result['reasons'])})")
        )
        return result

    def _queue_ms(self, rids: set[str]) -> float | None:
        """P99 of the server's queue time (accepted -> job_prepared of step 0), target ms."""
        if not self.target.profile.traces:
            return None
        try:
            rows = self.api.trace_rows("server_events")
        except OSError:
            return None
        accepted: dict[str, int] = {}
        queue: list[float] = []
        for r in rows:
            rid = r.get("request_id")
            if rid not in rids:
                continue
            if r["event"] == "accepted":
                accepted[rid] = r["mono_ns"]
            elif r["event"] == "job_prepared" and r.get("step_index") == 0 and rid in accepted:
                queue.append((r["mono_ns"] - accepted.pop(rid)) / 1e6 / self.scale)
        return p99(queue)

    def _drain(self) -> None:
        """Wait until the target is idle again (nothing queued or running)."""
        deadline = time.monotonic() + max(5.0, 60 * self.scale)
        while time.monotonic() < deadline and not self.target.profile.admin_api:
            # a target that is not Calculet says nothing of its queue: our requests ended
            if self.session.in_flight == 0:
                break
            gevent.sleep(0.05)
        while time.monotonic() < deadline and self.target.profile.admin_api:
            try:
                if self.token:
                    st = self.api.state()
                    if st.get("sequences_active") == 0 and st.get("queue", {}).get("waiting") == 0:
                        break
                else:
                    q = self.api.metric("calculet_requests_queued")
                    a = self.api.metric("calculet_sequences_active")
                    if not q and not a:
                        break
            except OSError:
                pass
            gevent.sleep(0.05)
        gevent.sleep(max(0.5, 2 * self.scale))  # the target flushes its traces

    # ------------------------------------------------------------------ output
    def _finish(self, lo: float | None, hi: float | None) -> int:
        doc = {
            "schema": CAPACITY_SCHEMA,
            "run_id": self.manifest.run_id,
            "target": self.url,
            "time_scale": self.scale,
            "window_s": self.a.window_s,
            "rehearsal": self.a.window_s < SPEC_WINDOW_S or self.scale != 1.0,
            "arrival": self.a.arrival,
            "workload": self.mix.model_dump(by_alias=True),
            "sla": self.sla.model_dump(),
            "tolerance": self.a.tolerance,
            "stable_max_qps": lo,
            "first_unstable_qps": hi,
            "reached_max_rate": hi is None and lo is not None,
            "curve": sorted(self.curve, key=lambda w: w["rate"]),
            "search_order": [w["rate"] for w in self.curve],
        }
        (self.run_dir / "capacity.json").write_text(json.dumps(doc, indent=1, default=str))
        self.say("capacity curve (target req/s):")
        for w in doc["curve"]:
            m = w["metrics"]
            self.say(
                f"  {w['rate']:10.4g}  {'stable' if w['stable'] else 'UNSTABLE':8}  "
                f"served {m['served_rate']:8.4g}  e2e p99 {ms(m['e2e_p99_ms']):>10}  "
                f"rejects {m['reject_rate']:6.1%}"
            )
        if lo is None:
            self.say("capacity: no stable rate found")
            print(f"capacity: no stable rate; {self.run_dir / 'capacity.json'}")
            return EXIT_FAIL
        bound = "at least (the max rate was stable)" if hi is None else f"below {hi:.4g}"
        print(f"capacity: stable max {lo:.4g} req/s ({bound}); {self.run_dir / 'capacity.json'}")
        return EXIT_OK


# ---------------------------------------------------------------------- CLI
def run(args: argparse.Namespace) -> int:
    try:
        cap = Capacity(args)
    except (ValueError, ManifestError, MixError) as exc:
        print(f"capacity: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except RunStop as stop:
        print(f"capacity: {stop}", file=sys.stderr)
        return stop.code
    return cap.run()
