"""The timed streaming client against the real simulator process.

Every check compares what the client measured with the simulator's own truth: its
response usage/timings, `/tokenize`, and its `server_events` trace rows (same host, same
CLOCK_MONOTONIC, so the client's t4 can be set against the server's token flush).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import pytest

from calculet_load.measure.connections import Endpoint
from calculet_load.measure.durations import durations
from calculet_load.measure.gevent_engine import GeventPool
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.outcome import CancelAt, Outcome, Timeouts
from calculet_load.measure.protocols import adapter_for
from tests.support.simhelpers import prompt_ids
from tests.support.simproc import SimProcess

StartSim = Callable[..., SimProcess]

PROTOCOLS = ("openai-chat", "openai-completions", "llama")
COUNT_SOURCE = {
    "openai-chat": "usage",
    "openai-completions": "usage",
    "llama": "tokens_predicted",
}
PROMPT = "The quick brown fox jumps over the lazy calculet."
# Ignore-EOS greedy runs always reach max tokens: the OpenAI reason is "length", and
# llama's stop_type "limit" maps to "length" too.
FINISH = "length"

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ helpers


def _run(
    pool: GeventPool,
    protocol: str,
    prompt: str | list[int],
    n: int,
    rid: str,
    *,
    stream: bool = True,
    timeouts: Timeouts | None = None,
    cancel: CancelAt = None,
) -> Outcome:
    """One greedy ignore-EOS request through the client, in its own greenlet."""
    adapter = adapter_for(protocol)
    body = adapter.body(
        prompt, n, stream=stream, model=None, temperature=0.0, seed=None, ignore_eos=True
    )
    return run_in_greenlet(
        lambda: pool.execute(
            adapter,
            body,
            rid,
            stream=stream,
            timeouts=timeouts or Timeouts(connect_s=5, first_byte_s=30, idle_s=30, total_s=60),
            cancel=cancel,
        )
    )


@pytest.fixture
def pool(fast_sim: SimProcess) -> Iterator[GeventPool]:
    p = GeventPool(Endpoint(fast_sim.url), max_connections=4)
    yield p
    p.close()


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    """The `slow` profile in real time: 10 ms prefill base, 15 ms per decode step."""
    sim = SimProcess(tmp_path_factory.mktemp("slow-sim"), "--profile", "slow")
    yield sim
    sim.stop()


def _rows(sim: SimProcess, rid: str, event: str | None = None) -> list[dict[str, Any]]:
    return [
        r
        for r in sim.traces("server_events")
        if r["request_id"] == rid and (event is None or r["event"] == event)
    ]


def _wait_rows(
    sim: SimProcess, rid: str, event: str, timeout: float = 10.0
) -> list[dict[str, Any]]:
    """The trace rows of `event` for `rid`, once there is at least one (gevent-friendly)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = _rows(sim, rid, event)
        if rows:
            return rows
        gevent.sleep(0.02)
    raise AssertionError(f"no {event!r} trace row for {rid} within {timeout} s")


def _tokenized(sim: SimProcess, protocol: str, prompt: str) -> tuple[list[int], int]:
    """The simulator's own prompt ids and count for what `protocol` sends for `prompt`."""
    if protocol == "openai-chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    else:
        body = {"content": prompt}
    status, out = sim.json("POST", "/tokenize", body)
    assert status == 200, out
    return out["tokens"], out["count"]


def _assert_exact(out: Outcome, protocol: str, n: int, stream: bool) -> None:
    assert out.ok, (out.error_class, out.error_detail)
    assert out.http_status == 200
    assert out.output_tokens == n
    assert out.server_total == n
    assert not out.token_count_mismatch
    assert out.finish_reason == FINISH
    assert out.token_hash is not None and len(out.token_hash) == 64
    if stream:
        assert out.count_source == COUNT_SOURCE[protocol]
        assert sum(e.tokens for e in out.token_events) == n
        assert out.token_events[-1].server_cumulative == n
    else:
        # A whole response is counted from the server's usage / tokens_predicted.
        assert out.count_source != "chunks"
        assert out.events == 1


def _stamps(out: Outcome) -> list[int | None]:
    ns = out.client_ns
    return [
        ns.request_start,
        ns.headers_sent,
        ns.response_headers,
        ns.first_event,
        ns.first_token,
        ns.last_token,
        ns.response_end,
    ]


# ---------------------------------------------------- exact counts and hashes


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_exact_counts_and_same_hash_stream_and_whole(
    fast_sim: SimProcess, pool: GeventPool, protocol: str
) -> None:
    n = 37
    _, n_prompt = _tokenized(fast_sim, protocol, PROMPT)
    outs = {}
    for stream in (True, False):
        rid = f"cs-exact-{protocol}-{stream}"
        out = _run(pool, protocol, PROMPT, n, rid, stream=stream)
        _assert_exact(out, protocol, n, stream)
        assert out.prompt_tokens_server == n_prompt
        # The server flushed exactly the tokens the client counted.
        assert len(_rows(fast_sim, rid, "token_flushed")) == n
        if protocol == "llama":
            assert out.timings is not None
            assert out.timings["predicted_n"] == n and out.timings["prompt_n"] == n_prompt
        outs[stream] = out
    assert outs[True].token_hash == outs[False].token_hash


def test_same_text_hash_across_protocols(fast_sim: SimProcess, pool: GeventPool) -> None:
    """Output ids are a function of the prompt ids: the same ids give the same text."""
    n = 25
    hashes: dict[str, str | None] = {}
    for protocol in PROTOCOLS:
        out = _run(pool, protocol, PROMPT, n, f"cs-xproto-{protocol}")
        _assert_exact(out, protocol, n, stream=True)
        hashes[protocol] = out.token_hash
    # Completions and llama tokenize the same text into the same ids.
    assert hashes["openai-completions"] == hashes["llama"]
    # A chat request is its ChatML ids: sent as a prompt, they give the chat's text.
    chat_ids, _ = _tokenized(fast_sim, "openai-chat", PROMPT)
    for protocol in ("openai-completions", "llama"):
        for stream in (True, False):
            out = _run(pool, protocol, chat_ids, n, f"cs-xchat-{protocol}-{stream}", stream=stream)
            _assert_exact(out, protocol, n, stream)
            assert out.prompt_tokens_server == len(chat_ids)
            assert out.token_hash == hashes["openai-chat"]
    assert hashes["openai-chat"] != hashes["llama"]  # a different prompt, another text


# --------------------------------------------------------- k tokens per event


@pytest.mark.parametrize("n", [11, 12])
def test_k_tokens_per_event_counts_tokens(start_sim: StartSim, n: int) -> None:
    k = 3
    sim = start_sim(
        "--time-scale", "0.02",
        "--set", f"output.tokens_per_event={k}",
        "--set", "output.multibyte_rate=0",
    )  # fmt: skip
    pool = GeventPool(Endpoint(sim.url), max_connections=2)
    try:
        for protocol in PROTOCOLS:
            rid = f"cs-k-{protocol}-{n}"
            # Chat takes text; the others get token ids here (text elsewhere).
            prompt: str | list[int] = PROMPT if protocol == "openai-chat" else prompt_ids(12)
            out = _run(pool, protocol, prompt, n, rid)
            _assert_exact(out, protocol, n, stream=True)
            assert len(out.token_events) == math.ceil(n / k)
            expected = [k] * (n // k) + ([n % k] if n % k else [])
            assert [e.tokens for e in out.token_events] == expected
            assert len(_rows(sim, rid, "token_flushed")) == n
            ns = out.client_ns
            assert ns.first_token is not None and ns.last_token is not None
            # later, unless a starved client read every event at once (one stamp)
            assert ns.last_token > ns.first_token or out.event_reads == 1, out.event_reads
            d = durations(ns, out.output_tokens)
            # TPOT divides by tokens - 1, not by events - 1.
            assert d.tpot == pytest.approx((ns.last_token - ns.first_token) / 1e6 / (n - 1))
            whole = _run(pool, protocol, prompt, n, f"{rid}-whole", stream=False)
            _assert_exact(whole, protocol, n, stream=False)
            assert whole.token_hash == out.token_hash
    finally:
        pool.close()


# ------------------------------------------------------------ UTF-8 hold-back


def test_utf8_holdback_exact_counts_and_hash(start_sim: StartSim) -> None:
    sim = start_sim("--time-scale", "0.02", "--set", "output.multibyte_rate=0.4")
    n = 80
    pool = GeventPool(Endpoint(sim.url), max_connections=2)
    try:
        for protocol in PROTOCOLS:
            rid = f"cs-utf8-{protocol}"
            out = _run(pool, protocol, PROMPT, n, rid)
            _assert_exact(out, protocol, n, stream=True)
            per_event = [e.tokens for e in out.token_events]
            # Held-back tokens merge events: fewer events than tokens, some carry 2+.
            assert len(per_event) < n and max(per_event) >= 2, per_event
            assert len(_rows(sim, rid, "token_flushed")) == n
            whole = _run(pool, protocol, PROMPT, n, f"{rid}-whole", stream=False)
            _assert_exact(whole, protocol, n, stream=False)
            assert whole.token_hash == out.token_hash
    finally:
        pool.close()


# ------------------------------------------- role-only and usage-only chunks


def test_role_chunk_is_an_event_not_a_token(slow_sim: SimProcess) -> None:
    pool = GeventPool(Endpoint(slow_sim.url), max_connections=1)
    try:
        n = 3
        out = _run(pool, "openai-chat", PROMPT, n, "cs-role")
        _assert_exact(out, "openai-chat", n, stream=True)
    finally:
        pool.close()
    ns = out.client_ns
    assert ns.request_start is not None
    assert ns.first_event is not None and ns.first_token is not None
    # The role chunk comes with the headers, the first token after a >= 10 ms prefill.
    assert ns.first_event < ns.first_token
    d = durations(ns, out.output_tokens)
    assert d.ttft == (ns.first_token - ns.request_start) / 1e6
    assert d.ttfe == (ns.first_event - ns.request_start) / 1e6
    assert d.ttft is not None and d.ttfe is not None and d.ttft > d.ttfe
    # Events: role, token chunk(s), finish chunk, usage-only chunk, [DONE].
    assert out.token_events[0].event_index == 1  # event 0 (the role chunk) carried no token
    assert out.events == 1 + len(out.token_events) + 3
    assert out.token_events[-1].event_index == out.events - 4  # nothing after the last token
    assert sum(e.tokens for e in out.token_events) == n == out.server_total
    # The wire really has that shape (same greedy request, read raw).
    s = slow_sim.stream(
        "/v1/chat/completions",
        adapter_for("openai-chat").body(
            PROMPT, n, stream=True, model=None, temperature=0.0, seed=None, ignore_eos=True
        ),
    )
    data = s.json_events()
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] == n
    assert s.events[-1][1].data == "[DONE]"


@pytest.mark.parametrize("protocol", ["openai-completions", "llama"])
def test_first_event_is_the_first_token_without_role_chunk(pool: GeventPool, protocol: str) -> None:
    out = _run(pool, protocol, PROMPT, 5, f"cs-norole-{protocol}")
    _assert_exact(out, protocol, 5, stream=True)
    assert out.client_ns.first_event == out.client_ns.first_token
    assert out.token_events[0].event_index == 0


# ------------------------------------------------------------- stamp shapes


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_one_token_output(pool: GeventPool, protocol: str) -> None:
    out = _run(pool, protocol, PROMPT, 1, f"cs-one-{protocol}")
    _assert_exact(out, protocol, 1, stream=True)
    ns = out.client_ns
    assert ns.first_token is not None and ns.first_token == ns.last_token
    d = durations(ns, out.output_tokens)
    assert d.tpot is None
    assert d.ttft is not None and d.ttft > 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_non_stream_stamps(pool: GeventPool, protocol: str) -> None:
    out = _run(pool, protocol, PROMPT, 9, f"cs-whole-{protocol}", stream=False)
    _assert_exact(out, protocol, 9, stream=False)
    t0, t1, t2, t3, t4, t5, t6 = _stamps(out)
    assert t0 is not None and t1 is not None and t2 is not None and t6 is not None
    assert t0 <= t1 <= t2 <= t6
    assert t3 == t4 == t6
    assert t5 is None
    d = durations(out.client_ns, out.output_tokens)
    assert d.tpot is None
    assert d.ttft == d.ttfe == d.e2e


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stream_stamps_are_ordered(pool: GeventPool, protocol: str) -> None:
    out = _run(pool, protocol, PROMPT, 20, f"cs-order-{protocol}")
    _assert_exact(out, protocol, 20, stream=True)
    stamps = [t for t in _stamps(out) if t is not None]
    assert len(stamps) == 7, _stamps(out)
    assert stamps == sorted(stamps)  # t0 <= t1 <= ... <= t6
    # 20 tokens: a real decode interval, unless a starved client read every event at once
    # (a busy machine): then all share the read's stamp, and the record says so
    assert stamps[4] < stamps[5] or out.event_reads == 1, (out.event_reads, _stamps(out))
    assert [e.arrival_ns for e in out.token_events] == sorted(
        e.arrival_ns for e in out.token_events
    )
    d = durations(out.client_ns, out.output_tokens)
    assert d.tpot is not None and d.tpot > 0


# ------------------------------------------------- request id and the server


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_request_id_joins_the_server_trace_and_t4_follows_the_flush(
    fast_sim: SimProcess, pool: GeventPool, protocol: str
) -> None:
    rid = f"cs-join-{protocol}.1:a"
    n = 12
    out = _run(pool, protocol, PROMPT, n, rid)
    _assert_exact(out, protocol, n, stream=True)
    rows = _rows(fast_sim, rid)
    events = {r["event"] for r in rows}
    assert {"accepted", "admitted", "token_flushed"} <= events, events
    flushed = [r for r in rows if r["event"] == "token_flushed"]
    assert len(flushed) == n
    # Same host, same CLOCK_MONOTONIC: the first token's stamp is its bytes' arrival in
    # the client's socket (the kernel's), which cannot precede the start of the server's
    # write of them (`detail.write_start_mono_ns`), but for the µs the kernel's stamp
    # moves when put on the monotonic clock. The row's own mono_ns, stamped once the
    # write returned, is no lower bound: the server may be descheduled between its
    # write and its stamp (-5.2 ms once in CI's parallel phase, on 2 cores).
    starts = [r["detail"]["write_start_mono_ns"] for r in flushed]
    t4 = out.client_ns.first_token
    assert t4 is not None
    lag_ms = (t4 - min(starts)) / 1e6
    assert -1.0 < lag_ms < 50.0, lag_ms
    t5 = out.client_ns.last_token
    assert t5 is not None
    last_lag_ms = (t5 - max(starts)) / 1e6
    assert -1.0 < last_lag_ms < 50.0, last_lag_ms
    assert not [r for r in rows if r["request_id"] != rid]


# ---------------------------------------------------------------- cancel


@pytest.mark.parametrize("cancel", ["before_headers", "first_token", 3])
def test_cancel(fast_sim: SimProcess, pool: GeventPool, cancel: CancelAt) -> None:
    rid = f"cs-cancel-{cancel}"
    n = 3000  # over a second at this time scale: the client leaves long before the end
    out = _run(pool, "llama", PROMPT, n, rid, cancel=cancel)
    assert out.error_class == "cancelled"
    assert out.error_code == "cancelled"
    assert out.cancelled_at is not None
    ns = out.client_ns
    assert ns.headers_sent is not None and ns.response_end is None
    if cancel == "before_headers":
        assert out.cancelled_at == "before_headers"
        assert ns.response_headers is None and out.output_tokens == 0
    elif cancel == "first_token":
        assert out.cancelled_at == "first_token"
        assert len(out.token_events) == 1 and ns.first_token == ns.last_token
    else:
        assert out.cancelled_at == "mid_stream"
        assert len(out.token_events) == 3
        assert out.output_tokens == out.token_events[-1].server_cumulative
        assert out.output_tokens >= 3
    assert pool.open == 0  # a cancelled connection is closed, not kept
    # The server saw the client go away: a `cancelled` row, no `finished`, not every token.
    cancelled = _wait_rows(fast_sim, rid, "cancelled")
    assert cancelled[0]["detail"]["where"] in ("waiting", "between_steps", "submitted")
    rows = _rows(fast_sim, rid)
    assert not [r for r in rows if r["event"] == "finished"]
    assert len([r for r in rows if r["event"] == "token_flushed"]) < n
    nxt = _run(pool, "llama", PROMPT, 2, f"{rid}-next")
    assert nxt.ok and nxt.connection_reused is False


# ------------------------------------------------------------ the connection pool


def test_keep_alive_reuses_the_connection(pool: GeventPool) -> None:
    first = _run(pool, "openai-chat", PROMPT, 4, "cs-ka-1")
    second = _run(pool, "llama", PROMPT, 4, "cs-ka-2")
    third = _run(pool, "openai-completions", PROMPT, 4, "cs-ka-3", stream=False)
    assert first.ok and second.ok and third.ok
    assert first.connection_reused is False
    assert second.connection_reused is True
    assert third.connection_reused is True
    assert pool.open == 1
    # the new connection's connect, on loopback within the call: well under a second
    assert first.connect_ns is not None and 0 < first.connect_ns < 1_000_000_000
    assert second.connect_ns is None and third.connect_ns is None


def test_a_new_connection_does_not_wait_on_the_hub(fast_sim: SimProcess) -> None:
    """When the kernel has connected a socket by the time `connect` returns (on loopback
    it usually has: the handshake runs inside the call), no other greenlet runs during
    the connect (`connect_now`), so `connect_ns` is the connect's own, not the hub's
    other work. gevent's own connect always waits on the hub after EINPROGRESS: a
    greenlet made ready just before the request would hold it 30 ms inside the connect.
    Three tries, each on a new connection: the kernel can finish a loopback handshake
    after the call now and then (its softirq deferred), and then the wait is real."""
    adapter = adapter_for("llama")
    body = adapter.body(PROMPT, 2, stream=True, model=None, temperature=0.0, seed=None,
                        ignore_eos=True)  # fmt: skip
    took = []
    for i in range(3):
        pool = GeventPool(Endpoint(fast_sim.url), max_connections=1)
        pool.endpoint.address()  # resolved beforehand (a first lookup may wait on the hub)

        def request(rid: str) -> Outcome:
            gevent.spawn(time.sleep, 0.03)  # blocks the hub at its next turn
            return pool.execute(adapter, body, rid, stream=True)  # noqa: B023

        try:
            out = gevent.spawn(request, f"cs-conn-hub-{i}").get(timeout=30)
        finally:
            pool.close()
        assert out.ok and out.connection_reused is False and out.connect_ns is not None
        took.append(out.connect_ns / 1e6)
    assert min(took) < 10.0, took


def test_pool_sized_to_the_cap_refuses_instead_of_queueing(fast_sim: SimProcess) -> None:
    pool = GeventPool(Endpoint(fast_sim.url), max_connections=2)
    adapter = adapter_for("llama")
    n = 400
    returned: dict[str, int] = {}

    def one(rid: str) -> Outcome:
        body = adapter.body(
            PROMPT, n, stream=True, model=None, temperature=0.0, seed=None, ignore_eos=True
        )
        out = pool.execute(adapter, body, rid, stream=True, timeouts=Timeouts(total_s=30))
        returned[rid] = time.monotonic_ns()
        return out

    try:
        greenlets = [gevent.spawn(one, f"cs-cap-{i}") for i in range(3)]
        gevent.joinall(greenlets, raise_error=True)
        outs = [g.value for g in greenlets]
        dropped = [o for o in outs if o.error_class == "pool_exhausted"]
        served = [o for o in outs if o.ok]
        assert len(dropped) == 1 and len(served) == 2, [o.error_class for o in outs]
        drop = dropped[0]
        assert drop.error_code == "pool_exhausted"
        assert drop.connection_reused is None and drop.client_ns.headers_sent is None
        # Refused at once, not parked until a connection came free (at the end of a
        # served response: its last token; not its first, which can come while the
        # third greenlet's refusal is still on its way out, now that a loopback connect
        # does not hand the hub to the other greenlets: measure.connections.connect_now).
        assert returned[drop.request_id] < min(o.client_ns.last_token or 0 for o in served), (
            "the dropped request waited for a connection"
        )
        for o in served:
            assert o.output_tokens == n and o.server_total == n
        assert not _rows(fast_sim, drop.request_id)  # it never reached the server
        assert pool.open == 2
        again = _run(pool, "llama", PROMPT, 2, "cs-cap-again")
        assert again.ok and again.connection_reused is True
    finally:
        pool.close()
    assert pool.open == 0


# ------------------------------------------------------------ server refusals


def test_queue_full_is_http_429(start_sim: StartSim) -> None:
    # Time scale 0.5: the holder's 400 tokens take about 2.5 s, so it still holds the slot
    # when the third request comes after two trace polls (at 0.05 it was 0.25 s, which a
    # loaded machine can spend before the waiter is seen queued).
    sim = start_sim(
        "--time-scale", "0.5", "--set", "scheduling.slots=1", "--set", "scheduling.queue_max=1"
    )
    pool = GeventPool(Endpoint(sim.url), max_connections=3)
    try:
        runner = adapter_for("llama")

        def req(rid: str, n: int) -> Outcome:
            body = runner.body(
                PROMPT, n, stream=True, model=None, temperature=0.0, seed=None, ignore_eos=True
            )
            return pool.execute(runner, body, rid, stream=True, timeouts=Timeouts(total_s=30))

        holder = gevent.spawn(req, "cs-q-holder", 400)
        _wait_rows(sim, "cs-q-holder", "admitted")
        waiter = gevent.spawn(req, "cs-q-waiter", 2)
        _wait_rows(sim, "cs-q-waiter", "accepted")
        assert not _rows(sim, "cs-q-waiter", "admitted")  # it waits in the queue
        out = _run(pool, "llama", PROMPT, 2, "cs-q-refused")
        assert out.error_class == "http_4xx"
        assert out.http_status == 429
        assert out.error_code == "queue_full"
        assert out.output_tokens == 0 and out.client_ns.first_event is None
        rejected = _rows(sim, "cs-q-refused", "rejected")
        assert [r["detail"] for r in rejected] == [{"http_status": 429, "code": "queue_full"}]
        gevent.joinall([holder, waiter], raise_error=True)
        assert holder.value.ok and holder.value.output_tokens == 400
        assert waiter.value.ok and waiter.value.output_tokens == 2
    finally:
        pool.close()


@pytest.mark.parametrize("protocol", ["openai-completions", "llama"])
def test_prompt_over_max_context_is_http_400(
    fast_sim: SimProcess, pool: GeventPool, protocol: str
) -> None:
    prompt = prompt_ids(40_959)
    rid = f"cs-ctx-{protocol}"
    out = _run(pool, protocol, prompt, 2, rid)
    assert out.error_class == "http_4xx"
    assert out.http_status == 400
    assert out.error_code == "context_length_exceeded"
    assert out.output_tokens == 0
    assert not _rows(fast_sim, rid)  # refused before it was accepted
    if protocol == "llama":
        # The largest legal request (40959 + 1 = max_context) still runs.
        ok = _run(pool, protocol, prompt, 1, f"{rid}-fits")
        _assert_exact(ok, protocol, 1, stream=True)
        assert ok.prompt_tokens_server == 40_959


# --------------------------------------------------------------- timeouts


def test_total_timeout_with_the_slow_profile(slow_sim: SimProcess) -> None:
    pool = GeventPool(Endpoint(slow_sim.url), max_connections=1)
    # 1 s: past the first tokens (the 250 ms warm-up and a prefill) with room for a loaded
    # machine, and well short of the 200 steps' 3 s
    total_s = 1.0
    try:
        rid = "cs-total-timeout"
        start = time.monotonic_ns()
        # 200 slow decode steps are ~3 s of real time.
        out = _run(pool, "llama", PROMPT, 200, rid, timeouts=Timeouts(total_s=total_s))
        elapsed_s = (time.monotonic_ns() - start) / 1e9
        assert pool.open == 0
    finally:
        pool.close()
    assert out.error_class == "total_timeout", (out.error_class, out.error_detail)
    assert out.client_ns.response_end is None
    assert 0 < out.output_tokens < 200
    assert total_s <= elapsed_s < total_s + 1.0  # given up at the limit, not at the end
    _wait_rows(slow_sim, rid, "cancelled")  # the server saw the client give up
    assert not _rows(slow_sim, rid, "finished")
