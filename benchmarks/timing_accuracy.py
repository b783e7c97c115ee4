"""How late the client stamps a token event: client arrival minus the server's flush time.

The simulator runs on 127.0.0.1, so it and this client read the same CLOCK_MONOTONIC.
Each `token_flushed` row of the simulator's `server_events` trace is stamped right
after that token's bytes were handed to the socket (one row per token; the tokens of
one SSE event share the write). Each client `TokenEvent` carries the monotonic time
its read returned and the server's cumulative token count, so the event that brought
tokens [prev, cumulative) is joined to the rows of those step indexes; the earliest
of them is the server's send time of the event. The difference is what the client adds
to every TTFT/ITL it reports: kernel delivery, wake-up, and loop latency.

The simulator is pinned to core 1 and the client to core 0 when the machine allows.
Levels are closed loops of C concurrent streams (llama.cpp `/completion`).

Usage: .venv/bin/python benchmarks/timing_accuracy.py [--duration 12] [--levels 1,8,16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gevent
from speedkit import start_sim, stop_child  # this folder's

from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.outcome import Outcome, Timeouts
from calculet_load.measure.prompts import Prompt, PromptFactory, http_tokenizer
from calculet_load.measure.session import RequestSpec, RunContext, Session
from calculet_load.measure.sse import SSEParser
from calculet_load.schema.records import TokenEvent

TARGET_P99_US = 1000.0


# ----------------------------------------------------------------- the simulator
class TraceReader:
    """Reads `GET /traces/server_events?offset=N` incrementally."""

    def __init__(self, url: str) -> None:
        hostport = url.removeprefix("http://")
        host, port = hostport.rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.offset = 0

    def new_rows(self, only: bytes = b"") -> list[dict[str, Any]]:
        """Rows appended since the last call; with `only`, just the lines containing it
        (the sim writes ~7 rows per token; parsing them all costs more than the join)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", f"/traces/server_events?offset={self.offset}")
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise SystemExit(f"/traces/server_events: HTTP {resp.status}")
            self.offset = int(resp.getheader("X-Next-Offset") or self.offset + len(body))
        finally:
            conn.close()
        # A row may be half-written only at the very end; keep whole lines.
        cut = body.rfind(b"\n") + 1
        self.offset -= len(body) - cut
        return [json.loads(line) for line in body[:cut].splitlines() if line and only in line]


# ---------------------------------------------------------------- the join
@dataclass
class Join:
    diffs_ns: list[int]
    events: int  # client token events seen
    unmatched: int  # client events with no server flush row for their tokens
    server_tokens: int  # token_flushed rows of the joined requests
    client_tokens: int  # tokens the client counted
    failed: int  # requests that did not end ok


def flush_times(rows: Sequence[dict[str, Any]]) -> dict[str, dict[int, int]]:
    """request id -> step index -> server flush mono_ns (`token_flushed` rows)."""
    out: dict[str, dict[int, int]] = defaultdict(dict)
    for r in rows:
        if r.get("event") == "token_flushed" and r.get("request_id") is not None:
            step = r.get("step_index")
            if step is not None:
                out[r["request_id"]][int(step)] = int(r["mono_ns"])
    return out


def join(outcomes: Sequence[Outcome], flushes: dict[str, dict[int, int]]) -> Join:
    j = Join([], 0, 0, 0, 0, 0)
    for out in outcomes:
        if not out.ok:
            j.failed += 1
        steps = flushes.get(out.request_id, {})
        j.server_tokens += len(steps)
        j.client_tokens += out.output_tokens
        prev = 0
        for te in out.token_events:
            j.events += 1
            cum = te.server_cumulative if te.server_cumulative is not None else prev + te.tokens
            stamps = [steps[s] for s in range(prev, cum) if s in steps]
            prev = cum
            if not stamps:
                j.unmatched += 1
                continue
            j.diffs_ns.append(te.arrival_ns - min(stamps))
    return j


def pct(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


# ------------------------------------------------------------------ the load
def run_level(
    url: str,
    prompt: Prompt,
    conc: int,
    duration: float,
    max_tokens: int,
    tag: str,
) -> tuple[list[Outcome], float]:
    """C greenlets sending back to back for `duration` seconds; returns outcomes, wall."""
    session = Session(
        RunContext(run_id="ta", worker=tag),
        url,
        "llama",
        max_in_flight=conc,
        timeouts=Timeouts(first_byte_s=120, idle_s=60, total_s=300),
    )
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + duration

    def user() -> None:
        while time.monotonic() < deadline:
            spec = RequestSpec(prompt=prompt, max_tokens=max_tokens, concurrency=conc)
            _, out = session.send(spec)
            outcomes.append(out)

    t0 = time.monotonic()
    gevent.joinall([gevent.spawn(user) for _ in range(conc)], raise_error=True)
    wall = time.monotonic() - t0
    session.close()
    return outcomes, wall


def warm_up(url: str, prompt: Prompt) -> None:
    """One short request: the simulator's first prefill pays its warm-up cost."""
    session = Session(RunContext(run_id="ta", worker="warm"), url, "llama")
    run_in_greenlet(lambda: session.send(RequestSpec(prompt, max_tokens=8))[1])
    session.close()


def run_floor(url: str, prompt: Prompt, duration: float, max_tokens: int) -> list[Outcome]:
    """The machine's floor: one blocking http.client reader, no gevent, same join.

    It stamps each read the moment `read1` returns, like `tests/support/simproc.py`; what it
    shows beyond zero is loopback delivery and scheduling on this machine right now.
    """
    hostport = url.removeprefix("http://")
    host, port = hostport.rsplit(":", 1)
    assert isinstance(prompt.payload, list)
    body = json.dumps(
        {"prompt": prompt.payload, "n_predict": max_tokens, "stream": True, "ignore_eos": True}
    ).encode()
    outcomes: list[Outcome] = []
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    deadline = time.monotonic() + duration
    n = 0
    while time.monotonic() < deadline:
        n += 1
        rid = f"ta.floor.{n:08d}"
        out = Outcome(rid)
        conn.request("POST", "/completion", body=body, headers={"X-Request-Id": rid})
        resp = conn.getresponse()
        parser = SSEParser()
        index = 0
        while True:
            data = resp.read1(65536)
            t = time.monotonic_ns()
            if not data:
                break
            for ev in parser.feed(data):
                obj = json.loads(ev.data)
                cum = obj.get("tokens_predicted")
                if isinstance(cum, int) and cum > out.output_tokens:
                    out.token_events.append(TokenEvent(rid, index, t, cum - out.output_tokens, cum))
                    out.output_tokens = cum
                index += 1
        outcomes.append(out)
    conn.close()
    return outcomes


@dataclass
class Level:
    label: str
    profile: str
    conc: int  # 0 = the blocking floor reader
    join: Join | None = None
    wall: float = 0.0
    requests: int = 0


def parse_levels(text: str, default_profile: str) -> list[Level]:
    """ "floor,1,8,16,16@b16" -> levels; `C@profile` runs C streams on another profile."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        conc, _, profile = item.partition("@")
        profile = profile or default_profile
        label = item if profile != default_profile else conc
        out.append(Level(label, profile, 0 if conc == "floor" else int(conc)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per load level")
    ap.add_argument(
        "--levels",
        default="floor,1,8,16,16@b16",
        help="comma list: 'floor' (blocking reader), C streams, or C@PROFILE",
    )
    ap.add_argument("--profile", default="default", help="simulator profile of plain levels")
    ap.add_argument("--time-scale", type=float, default=1.0, help="simulator --time-scale")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--no-pin", action="store_true", help="do not pin sim and client to cores")
    args = ap.parse_args()
    levels = parse_levels(args.levels, args.profile)
    pin = not args.no_pin and (os.cpu_count() or 1) > 1 and hasattr(os, "sched_setaffinity")
    if pin:
        os.sched_setaffinity(0, {0})

    with tempfile.TemporaryDirectory(prefix="timing-accuracy-") as tmp:
        for profile in dict.fromkeys(lv.profile for lv in levels):
            sim_args = ["--profile", profile, "--trace-dir", str(Path(tmp) / profile)]
            sim_args += ["--time-scale", str(args.time_scale)]
            proc, url = start_sim(1 if pin else None, sim_args)
            try:
                prompt = PromptFactory(http_tokenizer(url), mode="ids").prompt(args.prompt_tokens)
                traces = TraceReader(url)
                warm_up(url, prompt)
                traces.new_rows()
                for i, lv in enumerate(levels):
                    if lv.profile != profile:
                        continue
                    t0 = time.monotonic()
                    if lv.conc == 0:
                        outcomes = run_floor(url, prompt, args.duration, args.max_tokens)
                        lv.wall = time.monotonic() - t0
                    else:
                        tag = f"L{i}c{lv.conc}"
                        outcomes, lv.wall = run_level(
                            url, prompt, lv.conc, args.duration, args.max_tokens, tag
                        )
                    time.sleep(0.3)  # the sim flushes traces every 0.2 s; reading flushes too
                    lv.join = join(outcomes, flush_times(traces.new_rows()))
                    lv.requests = len(outcomes)
            finally:
                stop_child(proc)

    print("timing_accuracy: client token-event arrival − server flush (same CLOCK_MONOTONIC)")
    print(
        f"  sim profile={args.profile} time-scale={args.time_scale} "
        f"prompt={args.prompt_tokens} output={args.max_tokens} tokens/request, "
        f"{args.duration:.0f} s per level, pinned: {'sim core 1, client core 0' if pin else 'no'}"
    )
    print(
        f"  {'streams':>9} {'req':>5} {'ev/s':>6} {'n':>6} {'p50 µs':>7} {'p90 µs':>7} "
        f"{'p99 µs':>7} {'p99.9 µs':>8} {'max µs':>7} {'neg':>4} {'unmatched':>9} {'failed':>6}"
    )
    worst: tuple[float, str] | None = None
    floor_p99: float | None = None
    problems: list[str] = []
    for lv in levels:
        j = lv.join
        if j is None:
            continue
        d = sorted(x / 1e3 for x in j.diffs_ns)
        neg = sum(1 for x in d if x < 0)
        p99 = pct(d, 99)
        print(
            f"  {lv.label:>9} {lv.requests:>5} {j.events / max(lv.wall, 1e-9):>6.0f} {len(d):>6} "
            f"{pct(d, 50):>7.0f} {pct(d, 90):>7.0f} {p99:>7.0f} {pct(d, 99.9):>8.0f} "
            f"{(d[-1] if d else float('nan')):>7.0f} {neg:>4} {j.unmatched:>9} {j.failed:>6}"
        )
        if lv.conc == 0:
            floor_p99 = p99
        elif lv.conc > 1 and d and (worst is None or p99 > worst[0]):
            worst = (p99, lv.label)
        if j.server_tokens != j.client_tokens:
            problems.append(
                f"{lv.label}: server flushed {j.server_tokens} tokens, "
                f"client counted {j.client_tokens}"
            )
    if worst is not None:
        verdict = "PASS" if worst[0] <= TARGET_P99_US else "FAIL"
        print(
            f"  target p99 <= {TARGET_P99_US:.0f} µs at moderate load (> 1 stream): worst p99 "
            f"{worst[0]:.0f} µs ({worst[1]}) -> {verdict}"
        )
    if floor_p99 is not None and floor_p99 > TARGET_P99_US:
        print(
            f"  NOTE: the blocking floor reader's own p99 is {floor_p99:.0f} µs: this machine"
            " is too noisy right now for a 1 ms verdict to be about the client."
        )
    for p in problems:
        print(f"  LOST/EXTRA TOKENS: {p}")
    print(
        "  Meaning: each figure is how much later the client stamped a token event than the\n"
        "  simulator finished handing its bytes to the kernel, on one shared monotonic clock:\n"
        "  loopback delivery + the client's wake-up + time the event waited behind other work\n"
        "  on the client's gevent loop. It is added to every TTFT and ITL the client reports.\n"
        "  'floor' is a blocking http.client reader with no gevent (the machine's own floor\n"
        "  now); 'N' is calculet-load's Session with N concurrent streams. The default\n"
        "  profile runs batch 1, so its tokens never leave at the same instant however many\n"
        "  streams there are; '@b16' runs batch 16: 16 streams' tokens are flushed together,\n"
        "  and the last one the loop handles waits behind the other 15 (the burst case).\n"
        "  'neg' counts events stamped before the server's flush row; the clock is shared, so\n"
        "  they are not clock error but the server being descheduled between its socket write\n"
        "  and its time stamp. 'unmatched' = client events with no flush row for their tokens\n"
        "  (should be 0); 'failed' = requests that did not end ok."
    )


if __name__ == "__main__":
    main()
