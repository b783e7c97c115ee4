"""What reading a token event costs the client: the fast path against the general path.

Part 1 (no server): a 64-token streamed response of each protocol (OpenAI completions,
chat, llama.cpp; the shape benchmarks/exact_server.py and llama.cpp send: one event per
chunk, one read per chunk) is fed through `measure.exchange.respond` as an engine feeds
it, many times over, with the adapters' fast path on (`_chunked`'s plain chunks,
`Adapter.fast_event`) and off (the general path only: ChunkedDecoder, SSEParser, `json`
and the adapter's checks). It prints µs per event of each, and their ratio: the general
path is the reference, measured in the same run. Both give the same outcome
(tests/measure/test_fastpath.py).

Part 2 (`--engine`, needs two cores to mean anything): the thread I/O engine's loop
alone (no Locust, no greenlets: requests made on the engine's own loop, the main thread
asleep) against benchmarks/exact_server.py on the other core, at a Poisson rate, once
with the fast path and once without. It prints the engine thread's CPU per request over
the steady middle, next to what the same run measured for the other path. A hot loop
(Part 1) runs the same Python 2-3 times faster than a real read loop on this VM: Part 2
is what a request costs the engine.

Part 3 (`--split`, two cores): the engine alone again, fast path on, at 1 and at 64
tokens a response: a token event's cost (its read and its parse) and a request's own.

Usage: .venv/bin/python benchmarks/event_parse.py [--repeat 2000]
       .venv/bin/python benchmarks/event_parse.py --engine --rate 320 --seconds 12
       .venv/bin/python benchmarks/event_parse.py --split --repeat 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time
from typing import Any

import psutil
from speedkit import ExactServer  # this folder's: the exact server, started and stopped

from calculet_load.clock import SystemClock
from calculet_load.measure import native
from calculet_load.measure.exchange import respond, wire
from calculet_load.measure.outcome import Outcome, Timeouts
from calculet_load.measure.protocols import Adapter, LlamaAdapter, OpenAIAdapter
from calculet_load.measure.request_state import Run, conclude
from calculet_load.measure.rxstamps import Reads

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
PROTOCOLS = ("openai-completions", "openai-chat", "llama")


def adapter(proto: str, fast: bool) -> Adapter:
    a: Adapter = LlamaAdapter() if proto == "llama" else OpenAIAdapter(proto == "openai-chat")
    a.fast = fast
    return a


def event(n: int, proto: str) -> bytes:
    """The n-th token event's data as the servers send it (n = 0: the protocol's end)."""
    if proto == "llama":
        if n == 0:
            obj: dict[str, Any] = {"content": "", "stop": True, "stop_type": "limit",
                                   "tokens_predicted": 64, "tokens_evaluated": 128,
                                   "timings": {"cache_n": 0, "predicted_n": 64}}  # fmt: skip
        else:
            obj = {"index": 0, "content": " w", "tokens": [5], "stop": False, "id_slot": -1,
                   "tokens_predicted": n, "tokens_evaluated": 128}  # fmt: skip
        return json.dumps(obj, separators=(",", ":")).encode()
    if n == 0:
        return b"[DONE]"
    choice: dict[str, Any] = (
        {"index": 0, "delta": {"content": " w"}, "finish_reason": None}
        if proto == "openai-chat"
        else {"index": 0, "text": " w", "logprobs": None, "finish_reason": None}
    )
    usage = {"prompt_tokens": 128, "completion_tokens": n, "total_tokens": 128 + n}
    obj = {"id": "exact-1", "object": "text_completion", "created": 0, "model": "exact",
           "choices": [choice], "usage": usage}  # fmt: skip
    return json.dumps(obj, separators=(",", ":")).encode()


def reads_of(proto: str, tokens: int = 64) -> list[bytes]:
    out = [HEAD]
    for n in [*range(1, tokens + 1), 0]:
        body = b"data: %s\n\n" % event(n, proto)
        out.append(b"%x\r\n%s\r\n" % (len(body), body))
    out.append(b"0\r\n\r\n")
    return out


def read_once(reads: list[bytes], a: Adapter, clock: SystemClock) -> Outcome:
    out = Outcome("bench")
    run = Run(a, out, clock, True)
    conn, _ = wire(("/v1/completions", [("Host", "x"), ("Content-Length", "2")], b"{}"))
    ns: dict[str, int | None] = {"t0": 1, "t1": 2, "t2": None, "t6": None}
    rd = Reads(run, ns, Timeouts(), 2**62, False)
    gen = respond(conn, rd, None)
    next(gen)
    try:
        for i, data in enumerate(reads):
            rd.took(data, False, 1_000 * (i + 1), None)
            gen.send((data, False))
    except StopIteration:
        pass
    return conclude(run, ns, None, 0)


def part1(repeat: int) -> None:
    clock = SystemClock()
    print("Part 1: one 64-token response fed through respond(), hot loop, µs per event")
    print(f"  {'protocol':20} {'fast':>7} {'general':>8} {'fast/general':>13}")
    for proto in PROTOCOLS:
        reads = reads_of(proto)
        per: dict[bool, float] = {}
        for fast in (False, True, False, True):  # interleaved: the machine drifts
            a = adapter(proto, fast)
            for _ in range(repeat // 10):
                read_once(reads, a, clock)
            t0 = time.perf_counter()
            for _ in range(repeat):
                out = read_once(reads, a, clock)
            dt = (time.perf_counter() - t0) / repeat / out.events * 1e6
            assert out.ok and out.output_tokens == 64, (out.error_class, out.error_detail)
            per[fast] = min(per.get(fast, dt), dt)
        print(f"  {proto:20} {per[True]:7.2f} {per[False]:8.2f} {per[True] / per[False]:12.2f}x")


def thread_cpu_s(tid: int) -> float:
    """CPU seconds of this process's thread `tid` (its native id)."""
    return next(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == tid)


def engine_alone(
    url: str, proto: str, fast: bool, rate: float, seconds: float, tokens: int = 64
) -> float:
    """The engine thread's CPU per request (µs) over the steady middle of a run of
    `tokens`-token responses."""
    from calculet_load.measure.connections import Endpoint
    from calculet_load.measure.exchange import prepare
    from calculet_load.measure.thread_engine import ThreadPool, _execute, _Job
    from calculet_load.measure.thread_loop import LoopThread

    a = adapter(proto, fast)
    engine = LoopThread.shared()
    pool = ThreadPool(Endpoint(url), 4096, engine)
    pool.endpoint.address()
    body = a.body("w " * 128, tokens, stream=True, model=None, temperature=0.0, seed=None,
                  ignore_eos=True)  # fmt: skip
    done = [0]
    tid: list[int] = []

    async def one(i: int) -> None:
        job = _Job(pool=pool, adapter=a, request=prepare(pool.endpoint, a, body, f"b{i}", True,
                   None), request_id=f"b{i}", stream=True, timeouts=Timeouts(),
                   clock=SystemClock(), cancel=None, max_tokens=64, slack=0, count_text=None,
                   send_at=None)  # fmt: skip
        out = await _execute(job)
        if out.ok:
            done[0] += 1

    async def load() -> None:
        tid.append(threading.get_native_id())
        loop, tasks, rng = asyncio.get_running_loop(), set(), random.Random(1)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await asyncio.sleep(rng.expovariate(rate))
            task = loop.create_task(one(len(tasks) + done[0]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)

    fut = asyncio.run_coroutine_threadsafe(load(), engine.loop)
    time.sleep(2.0)
    c0, n0 = thread_cpu_s(tid[0]), done[0]
    time.sleep(seconds - 3.0)
    c1, n1 = thread_cpu_s(tid[0]), done[0]
    fut.result(timeout=60)
    pool.close()
    return (c1 - c0) / max(n1 - n0, 1) * 1e6


def _pinned_server() -> ExactServer:
    """The exact server on core 1 and this process on core 0, where there are two."""
    pin = (os.cpu_count() or 1) > 1
    if pin:
        os.sched_setaffinity(0, {0})
    return ExactServer(1 if pin else None, ttft_ms=50.0, itl_ms=10.0)


def part2(rate: float, seconds: float, proto: str) -> None:
    server = _pinned_server()
    try:
        print(f"Part 2: the thread engine's loop alone, {proto} at {rate:g} req/s for "
              f"{seconds:g} s, engine thread CPU per request (µs), steady middle")  # fmt: skip
        got: dict[bool, list[float]] = {True: [], False: []}
        for fast in (True, False, True, False):
            got[fast].append(engine_alone(server.url, proto, fast, rate, seconds))
            print(f"  fast path {'on ' if fast else 'off'}: {got[fast][-1]:7.0f}")
        on, off = min(got[True]), min(got[False])
        print(f"  best of two: on {on:.0f}, off {off:.0f} µs per request: {on / off:.2f}x")
    finally:
        server.stop()


def part3(rate: float, seconds: float, proto: str) -> None:
    """What a request costs the engine before its token events, and what each token event
    costs: the engine alone (fast path on) at 1 token and at 64 tokens a response, the
    same rate. Each further token is one more read of one event (the exact server writes
    each token alone), so the difference over 63 is a token event's read and parse, and
    the 1-token figure less three such reads (the head, the token, the end) is the
    request's own: its task, timers, request bytes, outcome."""
    server = _pinned_server()
    try:
        print(f"Part 3: the thread engine's loop alone, {proto} at {rate:g} req/s for "
              f"{seconds:g} s, responses of 1 and of 64 tokens (fast path on), engine "
              "thread CPU per request (µs)")  # fmt: skip
        got: dict[int, list[float]] = {1: [], 64: []}
        for tokens in (1, 64, 1, 64):  # interleaved: the machine drifts
            got[tokens].append(engine_alone(server.url, proto, True, rate, seconds, tokens))
            print(f"  {tokens:2d} token(s): {got[tokens][-1]:7.0f}")
        one, many = min(got[1]), min(got[64])
        per_event = (many - one) / 63
        print(
            f"  best of two: a token event (its read and parse) {per_event:.1f} µs; a "
            f"request's own cost {one - 3 * per_event:.0f} µs (64 tokens: {many:.0f})"
        )
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2000, help="Part 1: responses per round")
    ap.add_argument("--engine", action="store_true", help="also Part 2 (exact_server)")
    ap.add_argument("--split", action="store_true", help="also Part 3 (exact_server)")
    ap.add_argument("--rate", type=float, default=320.0, help="Part 2: Poisson req/s")
    ap.add_argument("--seconds", type=float, default=12.0, help="Part 2: seconds per run")
    args = ap.parse_args()
    print(f"calculet-load's compiled modules (calculet_load.measure.native): {native.STATE}")
    part1(args.repeat)
    if args.engine:
        part2(args.rate, args.seconds, "openai-completions")  # what the exact server speaks
    if args.split:
        part3(args.rate, args.seconds, "openai-completions")
    print("  Meaning: 'fast' reads each plain token event straight from the read's bytes "
          "(msgspec decodes and checks it);\n  'general' is the same client with the fast "
          "path off (the reference in this run). Lower is better.")  # fmt: skip


if __name__ == "__main__":
    main()
