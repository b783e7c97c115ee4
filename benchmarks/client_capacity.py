"""How many token events per second one client process sustains, and what the sink costs.

Part 1 — the client. calculet-load's `Session` (gevent, one process pinned to core 0)
runs closed loops of C streams against calculet-sim (pinned to core 1):
  a) on a *traced* simulator with every delay set to 0, so each token's `token_flushed`
     row can be joined to the client's `TokenEvent` (event-time error, as in
     timing_accuracy.py). The firehose profile writes no traces at all, so it cannot
     give this error; this profile is `default` with `--set timing.*=0`, a compiled
     batch as wide as the most streams (C tokens leave per step) and only the
     server_events trace on. The level list starts with 'floor': timing_accuracy's
     blocking http.client reader, the machine's own error floor on this simulator.
  b) on the firehose profile (no traces, 16 tokens per write): the client's raw
     throughput ceiling, next to sim_firehose.py's cheap raw-socket reader on the same
     simulator (the simulator's own ceiling, measured in the same run).
Part 2 — the sink. `PartSink.add` of the records and token events of Part 1a's last
level, then the flush to zstd Parquet: CPU per token event on the caller and in the
writer thread, bytes on disk; next to json.dumps-ing the same rows to a JSONL file.

Every level also reports what other processes did on the two cores meanwhile: on a
shared machine a level they disturbed is marked inconclusive, not failed.

Usage: .venv/bin/python benchmarks/client_capacity.py [--seconds 5] [--quick] [--cprofile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import gc
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

# benchmarks/ is on sys.path as this script's own directory.
from sim_firehose import drive
from speedkit import start_sim, stop_child  # this folder's
from timing_accuracy import (
    TARGET_P99_US,
    Join,
    TraceReader,
    flush_times,
    join,
    pct,
    run_floor,
    run_level,
    warm_up,
)

from calculet_load.measure.outcome import Outcome
from calculet_load.measure.prompts import Prompt, PromptFactory, http_tokenizer
from calculet_load.measure.session import RequestSpec, RunContext, make_record
from calculet_load.measure.sink import PartSink
from calculet_load.schema.records import RequestRecord, TokenEvent
from calculet_load.schema.runfolder import iter_jsonl

# The project's research notes (peer-clients.md): "the bar is ≥ 160 req/s ≈ 10k token
# events/s per worker core at TTFT p99 error ≤ 10 ms (twice the best tool) ... and the goal is
# the reference client's 20k events/s" (a 250-line asyncio client, at 64% of its core).
PEER_BAR_EV_S = 10_000
PEER_GOAL_EV_S = 20_000
ZERO_TIMING = (
    "prefill_base_ms",
    "prefill_per_token_ms",
    "prefill_per_token_sq_ms",
    "decode_base_ms",
    "decode_per_context_token_ms",
    "prepare_ms",
    "h2d_ms_per_mtoken",
    "h2d_base_ms",
    "d2h_ms",
    "bf16_ms",
    "sampling_ms_per_lane",
    "warmup_extra_ms",
    "jitter",
)
SIM_BUSY = 0.9  # a simulator above this share of its core is what limits the rate
NOISY = 0.1  # other processes above this share of a core make a level's figures suspect


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def busy_s() -> float:
    """CPU seconds all cores spent on anything but idle (steal included)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


class GCWatch:
    """The longest pause of the client's cyclic garbage collector while it is on."""

    def __init__(self) -> None:
        self.longest_s = 0.0
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.longest_s = max(self.longest_s, time.perf_counter() - self._t)


@dataclasses.dataclass
class Level:
    label: str
    streams: int  # 0 = the blocking floor reader
    wall: float = 0.0
    client_cpu: float = 0.0  # cores (1.0 = the client's whole core)
    sim_cpu: float = 0.0
    others_cpu: float = 0.0  # every other process, steal and kernel softirq, both cores
    gc_ms: float = 0.0  # the client's longest garbage-collector pause
    events: int = 0
    tokens: int = 0
    requests: int = 0
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    join: Join | None = None

    @property
    def ev_s(self) -> float:
        return self.events / self.wall if self.wall else float("nan")

    @property
    def us_per_event(self) -> float:
        return self.client_cpu * self.wall / self.events * 1e6 if self.events else float("nan")

    def errors_us(self) -> list[float]:
        """The joined event-time errors, sorted, in µs."""
        return sorted(x / 1e3 for x in self.join.diffs_ns) if self.join else []

    def within(self, p99_us: float) -> bool:
        """A client level whose every request ended ok and every event joined, p99 ≤ limit."""
        j = self.join
        if self.streams == 0 or j is None or j.unmatched or j.failed or not j.diffs_ns:
            return False
        return pct(self.errors_us(), 99) <= p99_us


def measure(lv: Level, sim: psutil.Process, load: Callable[[], Sequence[Outcome]]) -> None:
    """Run `load` and fill the level's rate, CPU and GC figures."""
    me = psutil.Process()
    gc.collect()  # start each level without the previous one's garbage
    watch = GCWatch()
    gc.callbacks.append(watch)
    c0, s0, b0, t0 = cpu_s(me), cpu_s(sim), busy_s(), time.monotonic()
    try:
        outcomes = list(load())
    finally:
        gc.callbacks.remove(watch)
    lv.wall = time.monotonic() - t0
    lv.client_cpu = (cpu_s(me) - c0) / lv.wall
    lv.sim_cpu = (cpu_s(sim) - s0) / lv.wall
    lv.others_cpu = max(0.0, (busy_s() - b0) / lv.wall - lv.client_cpu - lv.sim_cpu)
    lv.gc_ms = watch.longest_s * 1e3
    lv.outcomes = outcomes
    lv.requests = len(outcomes)
    lv.events = sum(len(o.token_events) for o in outcomes)
    lv.tokens = sum(o.output_tokens for o in outcomes)


def closed_loop(
    url: str, prompt: Prompt, streams: int, seconds: float, max_tokens: int, tag: str
) -> Callable[[], list[Outcome]]:
    """timing_accuracy's closed loop of `streams` Session greenlets, as a load."""
    return lambda: run_level(url, prompt, streams, seconds, max_tokens, tag)[0]


def parse_levels(text: str) -> list[Level]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    return [Level(x, 0 if x == "floor" else int(x)) for x in items]


# ------------------------------------------------------------------- part 1a
def traced_sweep(
    levels: list[Level],
    tmp: Path,
    core: int | None,
    seconds: float,
    prompt_tokens: int,
    max_tokens: int,
) -> tuple[list[str], Prompt]:
    """Event-time error per level on the traced zero-delay simulator.

    Returns the simulator's `--set` overrides and the prompt every request sent."""
    width = max([lv.streams for lv in levels] + [1])
    sets = [f"timing.{k}=0" for k in ZERO_TIMING]
    sets += [f"scheduling.compiled_batch={width}", f"scheduling.slots={width}"]
    sets += ["traces.steps=false", "traces.device=false"]
    args = ["--profile", "default", "--trace-dir", str(tmp / "sim-traces")]
    for s in sets:
        args += ["--set", s]
    proc, url = start_sim(core, args)
    try:
        sim = psutil.Process(proc.pid)
        prompt = PromptFactory(http_tokenizer(url), mode="ids").prompt(prompt_tokens)
        traces = TraceReader(url)
        warm_up(url, prompt)
        traces.new_rows(b'"token_flushed"')
        for i, lv in enumerate(levels):
            if lv.streams == 0:
                measure(lv, sim, lambda: run_floor(url, prompt, seconds, max_tokens))
            else:
                tag = f"L{i}c{lv.streams}"
                measure(lv, sim, closed_loop(url, prompt, lv.streams, seconds, max_tokens, tag))
            time.sleep(0.3)  # the sim flushes traces every 0.2 s
            lv.join = join(lv.outcomes, flush_times(traces.new_rows(b'"token_flushed"')))
            if i < len(levels) - 1:
                # Kept outcomes would make every later level's GC pauses longer; Part 2
                # uses the last level's.
                lv.outcomes = []
    finally:
        stop_child(proc)
    return sets, prompt


# ------------------------------------------------------------------- part 1b
@dataclasses.dataclass
class Reference:
    streams: int
    ev_s: float
    reader_cpu: float
    sim_cpu: float


def firehose(
    levels: list[Level],
    core: int | None,
    seconds: float,
    prompt_tokens: int,
    tokens: int,
    ref_streams: int,
) -> Reference:
    """The client's raw rate on the firehose, then the cheap reader's on the same sim."""
    proc, url = start_sim(core, ["--profile", "firehose"])
    try:
        sim = psutil.Process(proc.pid)
        prompt = PromptFactory(http_tokenizer(url), mode="ids").prompt(prompt_tokens)
        warm_up(url, prompt)
        for i, lv in enumerate(levels):
            tag = f"F{i}c{lv.streams}"
            measure(lv, sim, closed_loop(url, prompt, lv.streams, seconds, tokens, tag))
            lv.outcomes = []  # 4096 token events a request: not kept
        me = psutil.Process()
        c0, s0, t0 = cpu_s(me), cpu_s(sim), time.monotonic()
        port = int(url.rsplit(":", 1)[1])
        events = asyncio.run(drive(port, ref_streams, seconds, tokens))
        wall = time.monotonic() - t0
        ref = Reference(
            ref_streams, events / wall, (cpu_s(me) - c0) / wall, (cpu_s(sim) - s0) / wall
        )
    finally:
        stop_child(proc)
    return ref


def profile_client(
    core: int | None, seconds: float, prompt_tokens: int, tokens: int, streams: int
) -> str:
    """cProfile of the client on the firehose, top functions by own time."""
    proc, url = start_sim(core, ["--profile", "firehose"])
    try:
        prompt = PromptFactory(http_tokenizer(url), mode="ids").prompt(prompt_tokens)
        warm_up(url, prompt)
        prof = cProfile.Profile()
        prof.enable()
        outcomes, wall = run_level(url, prompt, streams, seconds, tokens, "prof")
        prof.disable()
    finally:
        stop_child(proc)
    out = io.StringIO()
    n = sum(len(o.token_events) for o in outcomes)
    out.write(f"  cProfile, {streams} streams on the firehose, {n / wall:,.0f} ev/s under it:\n")
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    lines = [x for x in out.getvalue().splitlines() if x.strip()]
    return "\n".join("    " + x.strip() for x in lines)


# -------------------------------------------------------------------- part 2
@dataclasses.dataclass
class SinkCost:
    records: int
    events: int
    add_s: float  # caller thread CPU in PartSink.add
    writer_s: float  # CPU of the other threads while the caller waits for the flush
    token_bytes: int
    request_bytes: int
    jsonl_s: float  # caller CPU to json.dumps + write the same rows
    jsonl_bytes: int
    errors: list[str]


def sink_once(
    rows: list[tuple[RequestRecord, list[TokenEvent]]], run_dir: Path
) -> tuple[float, float, dict[str, int], list[str]]:
    """One default PartSink (zstd, a part per 10 s or 50k records): add, then flush."""
    sink = PartSink(str(run_dir), "bench")
    t0 = time.thread_time()
    for rec, evs in rows:
        sink.add(rec, evs)
    add_s = time.thread_time() - t0
    p0, m0 = time.process_time(), time.thread_time()
    if not sink.flush(120):
        raise SystemExit("sink: parts not written within 120 s")
    writer_s = (time.process_time() - p0) - (time.thread_time() - m0)
    errors = sink.close().errors
    part_dir = run_dir / "client" / "bench"
    size = {
        table: sum(p.stat().st_size for p in part_dir.glob(f"part-*.{table}.parquet"))
        for table in ("tokens", "requests")
    }
    return add_s, writer_s, size, errors


def jsonl_once(rows: list[tuple[RequestRecord, list[TokenEvent]]], path: Path) -> float:
    """The reference: every record and token event as a JSON line, written inline."""
    names = list(TokenEvent.__struct_fields__)
    t0 = time.thread_time()
    with open(path, "w", encoding="utf-8") as f:
        lines = iter_jsonl([rec for rec, _ in rows], strict=False)
        for (_, evs), line in zip(rows, lines, strict=True):
            f.write(line)
            for ev in evs:
                f.write(json.dumps({n: getattr(ev, n) for n in names}) + "\n")
    return time.thread_time() - t0


def sink_cost(
    rows: list[tuple[RequestRecord, list[TokenEvent]]], tmp: Path, repeats: int
) -> SinkCost:
    """Medians of `repeats` rounds of the sink and of the JSONL reference."""
    add, writer, jsonl = [], [], []
    size: dict[str, int] = {}
    errors: list[str] = []
    for k in range(repeats):
        gc.collect()
        a, w, size, errs = sink_once(rows, tmp / f"run{k}")
        add.append(a)
        writer.append(w)
        errors += errs
        gc.collect()
        jsonl.append(jsonl_once(rows, tmp / f"reference{k}.jsonl"))
    return SinkCost(
        len(rows),
        sum(len(e) for _, e in rows),
        statistics.median(add),
        statistics.median(writer),
        size["tokens"],
        size["requests"],
        statistics.median(jsonl),
        (tmp / "reference0.jsonl").stat().st_size,
        errors,
    )


def sink_rows(
    lv: Level, prompt: Prompt, max_tokens: int
) -> list[tuple[RequestRecord, list[TokenEvent]]]:
    """The records `Session.send` built for a level's requests, with their token events."""
    ctx = RunContext(run_id="cc", worker=f"c{lv.streams}")
    spec = RequestSpec(prompt, max_tokens, concurrency=lv.streams)
    return [(make_record(ctx, spec, o, "llama"), o.token_events) for o in lv.outcomes]


# ------------------------------------------------------------------- report
def plural(streams: int) -> str:
    return f"{streams} stream{'' if streams == 1 else 's'}"


def print_traced(levels: list[Level], sets: list[str], args: argparse.Namespace) -> list[str]:
    """Part 1a's table and verdict; returns the problems seen."""
    print("Part 1a  event-time error = client TokenEvent arrival − sim token_flushed row")
    print(f"  sim: --profile default --set {' '.join(sets[len(ZERO_TIMING) :])}")
    print(f"       and --set timing.X=0 for X in {', '.join(ZERO_TIMING)}")
    print(
        "       (the firehose profile writes no server_events rows, so nothing to join);\n"
        f"       prompt {args.prompt_tokens} tokens, {args.max_tokens} output tokens/request"
    )
    print(
        f"  {'streams':>7} {'req':>4} {'ev/s':>6} {'tok/s':>6} {'client%':>7} {'sim%':>4} "
        f"{'others%':>7} {'µs/ev':>5} {'gc ms':>5} {'p50 µs':>6} {'p99 µs':>6} "
        f"{'p99.9 µs':>8} {'unmatched':>9} {'failed':>6}"
    )
    problems: list[str] = []
    floor: Level | None = None
    for lv in levels:
        j = lv.join
        assert j is not None
        d = lv.errors_us()
        print(
            f"  {lv.label:>7} {lv.requests:>4} {lv.ev_s:>6,.0f} {lv.tokens / lv.wall:>6,.0f} "
            f"{lv.client_cpu:>7.0%} {lv.sim_cpu:>4.0%} {lv.others_cpu:>7.0%} "
            f"{lv.us_per_event:>5.0f} {lv.gc_ms:>5.1f} {pct(d, 50):>6.0f} {pct(d, 99):>6.0f} "
            f"{pct(d, 99.9):>8.0f} {j.unmatched:>9} {j.failed:>6}"
        )
        if lv.streams == 0:
            floor = lv
        if j.server_tokens != j.client_tokens:
            problems.append(
                f"{lv.label}: server flushed {j.server_tokens} tokens, client counted "
                f"{j.client_tokens}"
            )
        if j.unmatched or j.failed:
            problems.append(f"{lv.label}: {j.unmatched} unmatched events, {j.failed} failed")
        if lv.others_cpu > NOISY:
            problems.append(
                f"{lv.label}: other processes used {lv.others_cpu:.0%} of a core during the "
                "level; its errors are partly theirs"
            )
    passing = [lv for lv in levels if lv.within(TARGET_P99_US)]
    if not passing:
        print(f"  no client level kept p99 ≤ {TARGET_P99_US:.0f} µs")
    else:
        top = max(passing, key=lambda lv: lv.streams)
        fast = max(passing, key=lambda lv: lv.ev_s)
        print(
            f"  highest level with p99 ≤ {TARGET_P99_US:.0f} µs: {plural(top.streams)}, "
            f"{top.ev_s:,.0f} token events/s ({top.tokens / top.wall:,.0f} tokens/s), client "
            f"at {top.client_cpu:.0%} of its core, sim at {top.sim_cpu:.0%} of its"
        )
        failing = [lv.label for lv in levels if lv.streams and lv not in passing]
        if failing:
            print(f"  levels above 1 ms p99 (or with failures): {', '.join(failing)}")
        if fast is not top:
            print(f"  highest rate with p99 ≤ 1 ms: {fast.ev_s:,.0f} ev/s, {plural(fast.streams)}")
        if fast.sim_cpu >= SIM_BUSY:
            print(
                f"  -> the simulator's core was full: {fast.ev_s:,.0f} ev/s is the traced sim's "
                "ceiling and only a lower bound on the client's.\n"
                f"     At {fast.us_per_event:.0f} µs of client CPU per event the client's core "
                f"would be full near {1e6 / fast.us_per_event:,.0f} ev/s (linear "
                "extrapolation, not a measurement)."
            )
    noisy = [lv.label for lv in levels if lv.streams and lv.others_cpu > NOISY]
    if noisy:
        print(
            f"  INCONCLUSIVE at {', '.join(noisy)} streams: other processes were busy on these "
            "cores then ('others%' > 10%); rerun on a quiet machine"
        )
    if floor is not None and floor.join and pct(floor.errors_us(), 99) > TARGET_P99_US:
        print(
            f"  NOTE: the blocking floor reader's own p99 is {pct(floor.errors_us(), 99):.0f} "
            "µs: the machine is too noisy right now for a 1 ms verdict to be about the client."
        )
    return problems


def print_firehose(levels: list[Level], ref: Reference, args: argparse.Namespace) -> list[str]:
    """Part 1b's table and the ratio to the cheap reader; returns the problems seen."""
    print(
        "Part 1b  raw throughput on --profile firehose (no delays, 16 tokens per write, "
        f"no traces: no error figure); {args.firehose_tokens} output tokens/request"
    )
    print(
        f"  {'streams':>7} {'req':>4} {'ev/s':>7} {'tok/s':>7} {'client%':>7} {'sim%':>4} "
        f"{'others%':>7} {'µs/ev':>5} {'gc ms':>5}"
    )
    for lv in levels:
        print(
            f"  {lv.label:>7} {lv.requests:>4} {lv.ev_s:>7,.0f} {lv.tokens / lv.wall:>7,.0f} "
            f"{lv.client_cpu:>7.0%} {lv.sim_cpu:>4.0%} {lv.others_cpu:>7.0%} "
            f"{lv.us_per_event:>5.1f} {lv.gc_ms:>5.1f}"
        )
    same = [lv for lv in levels if lv.streams == ref.streams]
    cmp = same[0] if same else max(levels, key=lambda lv: lv.ev_s)
    print(
        f"  reference: sim_firehose.py's raw-socket reader, {ref.streams} streams, same sim: "
        f"{ref.ev_s:,.0f} ev/s, reader at {ref.reader_cpu:.0%} of its core, sim at "
        f"{ref.sim_cpu:.0%} of its"
    )
    print(
        f"  client/reference: {cmp.ev_s / ref.ev_s:.2f} (client at {plural(cmp.streams)}: "
        f"{cmp.ev_s:,.0f} ev/s)"
    )
    return [
        f"firehose {lv.label}: other processes used {lv.others_cpu:.0%} of a core during the "
        "level; its rate is partly theirs"
        for lv in levels
        if lv.others_cpu > NOISY
    ]


def print_peer(traced: list[Level], raw: Level | None) -> None:
    print(
        f"Peer bar (the research notes, peer-clients.md): ≥ {PEER_BAR_EV_S:,} token events/s "
        "per worker core at TTFT p99 error ≤ 10 ms,"
    )
    print(
        f"  goal {PEER_GOAL_EV_S:,} ev/s (its 250-line asyncio reference client, at 64% of its "
        "core); measured with one event per write and Poisson arrivals"
    )
    for limit in (TARGET_P99_US, 10 * TARGET_P99_US):
        ok = [lv for lv in traced if lv.within(limit)]
        if not ok:
            print(f"  this client, every event within {limit / 1e3:g} ms p99: no level")
            continue
        best = max(ok, key=lambda lv: lv.ev_s)
        print(
            f"  this client, every event within {limit / 1e3:g} ms p99: {best.ev_s:,.0f} ev/s "
            f"({plural(best.streams)}) = {best.ev_s / PEER_BAR_EV_S:.2f}x the bar, "
            f"{best.ev_s / PEER_GOAL_EV_S:.2f}x the goal"
            f"{' (simulator-bound)' if best.sim_cpu >= SIM_BUSY else ''}"
        )
    if raw is not None:
        print(
            f"  this client, raw on the firehose: {raw.ev_s:,.0f} ev/s = "
            f"{raw.ev_s / PEER_BAR_EV_S:.1f}x the bar, {raw.ev_s / PEER_GOAL_EV_S:.1f}x the goal "
            "(16 events per write: cheaper reads per event than one by one)"
        )


def print_sink(c: SinkCost, repeats: int, level: str) -> list[str]:
    per = 1e6 / c.events
    print(
        f"Part 2  PartSink cost per token event: the {c.records:,} records and {c.events:,} "
        f"token events of Part 1a's last level ({level} streams); default sink (zstd, one "
        f"part); median of {repeats} round{'s' if repeats > 1 else ''}"
    )
    print(
        f"  caller, PartSink.add on the event loop : {c.add_s * per:6.3f} µs CPU per token event "
        f"({c.add_s * 1e6 / c.records:.2f} µs per record)"
    )
    print(
        f"  writer thread, Arrow + Parquet zstd    : {c.writer_s * per:6.3f} µs CPU per token event"
    )
    print(
        f"  on disk: tokens parts {c.token_bytes / c.events:.2f} bytes per token event; requests "
        f"parts {c.request_bytes / c.records:,.0f} bytes per record; together "
        f"{(c.token_bytes + c.request_bytes) / c.events:.2f} bytes per token event"
    )
    print(
        "  reference, json.dumps of the same records and events to a JSONL file on the caller: "
        f"{c.jsonl_s * per:.3f} µs CPU, {c.jsonl_bytes / c.events:.1f} bytes per token event"
    )
    print(
        f"  sink/reference: caller {c.add_s / c.jsonl_s:.3f}x, caller+writer "
        f"{(c.add_s + c.writer_s) / c.jsonl_s:.2f}x, bytes "
        f"{(c.token_bytes + c.request_bytes) / c.jsonl_bytes:.3f}x"
    )
    return [f"sink: {e}" for e in c.errors]


MEANING = """\
  Meaning: 'ev/s' = token events (SSE events that carried generated tokens) the client
  stamped per second of the level; 'tok/s' = the tokens they carried (llama.cpp holds back a
  token that ends inside a UTF-8 character, so some events carry two). 'client%', 'sim%' =
  CPU of each process over the level in % of one core (each is pinned to its own core);
  'others%' = everything else the two cores did meanwhile (other processes, VM steal,
  kernel softirq): above ~10% the level's errors are partly someone else's. 'µs/ev' =
  client CPU per token event; 'gc ms' = the client's longest cyclic-GC pause in the level
  (the loop stops for it, and every stream's bytes wait). p50/p99/p99.9 = how much later
  the client stamped an event than the simulator finished handing its bytes to the kernel,
  on one shared monotonic clock: loopback delivery + wake-up + time behind other work on the
  gevent loop; it is added to every TTFT and ITL the client reports. 'floor' = a blocking
  http.client reader with no gevent on the same simulator (the machine's floor now). Part
  1a's simulator sends each token as it is made, with no delay, all streams' tokens in one
  step: every level runs it flat out, so levels differ in how many streams share the loop
  more than in rate, and 'sim%' near 100 means the rate is the simulator's (it writes ~7
  trace rows per token), not the client's. Part 1b has no traces and 16 events per write:
  the client's own ceiling, next to a reader that only counts 'data: ' (what the simulator
  can emit). Part 2: 'caller' is what PartSink.add costs the event loop; 'writer' is what
  the sink's native thread spends on Arrow tables and zstd Parquet off the loop (it holds
  the GIL part of that time); the reference writes the same rows as JSON lines inline."""


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per load level")
    ap.add_argument("--quick", action="store_true", help="2 s levels, fewer of them (~25 s)")
    ap.add_argument("--levels", help="Part 1a: 'floor' and stream counts (floor,1,2,...,64)")
    ap.add_argument("--firehose-levels", help="Part 1b stream counts (1,8,64)")
    ap.add_argument("--ref-streams", type=int, default=8, help="streams of the cheap reader")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256, help="Part 1a output tokens/request")
    ap.add_argument("--firehose-tokens", type=int, default=4096, help="Part 1b tokens/request")
    ap.add_argument("--sink-repeats", type=int, default=3, help="Part 2 rounds (median)")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile the client (1b)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin sim and client to cores")
    args = ap.parse_args()
    seconds = 2.0 if args.quick else args.seconds
    traced = parse_levels(
        args.levels or ("floor,1,8,64" if args.quick else "floor,1,2,4,8,16,32,64")
    )
    raw = parse_levels(args.firehose_levels or ("8" if args.quick else "1,8,64"))
    pin = not args.no_pin and (os.cpu_count() or 1) > 1 and hasattr(os, "sched_setaffinity")
    if pin:
        os.sched_setaffinity(0, {0})
    core = 1 if pin else None

    print("client_capacity: token events/s one calculet-load client process sustains, and the")
    print("  sink's cost per token event")
    print(
        f"  {os.cpu_count()} CPUs; pinned: {'sim core 1, client core 0' if pin else 'no'}; "
        f"{seconds:g} s per level; closed loops of C streams (llama.cpp /completion)"
    )
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="client-capacity-") as name:
        tmp = Path(name)
        sets, prompt = traced_sweep(traced, tmp, core, seconds, args.prompt_tokens, args.max_tokens)
        problems += print_traced(traced, sets, args)
        if raw:
            ref = firehose(
                raw, core, seconds, args.prompt_tokens, args.firehose_tokens, args.ref_streams
            )
            problems += print_firehose(raw, ref, args)
        print_peer(traced, max(raw, key=lambda lv: lv.ev_s) if raw else None)
        last = traced[-1]
        if last.streams and last.outcomes:
            rows = sink_rows(last, prompt, args.max_tokens)
            last.outcomes = []
            cost = sink_cost(rows, tmp, args.sink_repeats)
            problems += print_sink(cost, args.sink_repeats, last.label)
    if args.cprofile:
        print(profile_client(core, seconds, args.prompt_tokens, args.firehose_tokens, 8))
    for p in problems:
        print(f"  PROBLEM: {p}")
    print(MEANING)


if __name__ == "__main__":
    main()
