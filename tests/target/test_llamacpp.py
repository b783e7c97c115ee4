"""Against a real llama.cpp `llama-server` (tests/support/llamacpp.py builds it once per machine):
exact prompt lengths for all three protocols, output counts equal to the server's own,
prompts no prefix cache can serve, and a plain Locust run.

The model has random weights, so its tokens are arbitrary pieces of the real Qwen2
vocabulary (multi-byte characters included): what a client's counting must survive.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pytest
import yaml

from analysis.tables.join import load_run
from analysis.tables.quality import apply_quality
from calculet_drivers.cli import main
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.outcome import Timeouts
from calculet_load.measure.prompts import (
    LocalTokenizer,
    PromptFactory,
    sample_words,
    target_prompts,
)
from calculet_load.measure.session import RequestSpec, RunContext, Session
from calculet_load.schema.profiles import profile_named
from calculet_load.target.describe import model_for
from tests.support.acceptkit import read_events, relaxed_rules, write_manifest, write_matrix
from tests.support.llamacpp import LlamaServer, tokenizer_path
from tests.support.locustproc import LocustRun

PROTOCOLS = ("llama", "openai-completions", "openai-chat")
LLAMA = SimpleNamespace(profile="llama.cpp", tokenizer=None)


ACCEPT_CELLS = [
    {"kind": "single", "prompt_tokens": 128, "max_tokens": 16},
    {"kind": "single", "prompt_tokens": 1024, "max_tokens": 16},
    {"kind": "closed", "concurrency": 2, "prompt_tokens": 128, "max_tokens": 16},
    {"kind": "closed", "concurrency": 4, "prompt_tokens": 64, "max_tokens": 8},
    {"kind": "burst", "size": 4, "rounds": 2, "prompt_tokens": 64, "max_tokens": 8},
]
OPEN_CELL = {"kind": "open", "arrival": "poisson", "rate": 4.0}
MIX_SHORT = {"name": "short", "weight": 3, "prompt_tokens": 64, "max_tokens": 8}
MIX_LONG = {"name": "long", "weight": 1, "prompt_tokens": 512, "max_tokens": 16}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    # 4 slots of 4,096 tokens: the longest prompt here is 1,024 (the accept matrix's)
    with LlamaServer(tmp_path_factory.mktemp("llama"), parallel=4, ctx=16384) as server:
        yield server


def _session(url: str, protocol: str, *, reuse: bool = False) -> Session:
    t = Timeouts(connect_s=5.0, total_s=60.0, first_byte_s=60.0)
    return Session(RunContext("llama-test", "w00"), url, protocol, timeouts=t, prompt_reuse=reuse)


def _send(session: Session, prompt: Any, max_tokens: int, stream: bool = True) -> Any:
    spec = RequestSpec(prompt=prompt, max_tokens=max_tokens, stream=stream, cell="t")
    return run_in_greenlet(lambda: session.send(spec))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_exact_prompts_and_the_servers_own_counts(
    llama: LlamaServer, protocol: str, stream: bool
) -> None:
    factory = target_prompts(llama.url, protocol, LLAMA)
    session = _session(llama.url, protocol)
    try:
        for tokens, sample, max_tokens in ((64, 0, 24), (700, 1, 40), (33, 2, 1)):
            prompt = factory.prompt(tokens, sample)
            record, out = _send(session, prompt, max_tokens, stream)
            e = record.ext
            assert out.ok, (out.error_class, out.error_detail)
            # the server counted exactly the prompt we sized, template tokens included
            assert e.server_prompt_tokens == tokens, (protocol, tokens, e.server_prompt_tokens)
            # the output count is the server's: timings.predicted_n / usage.completion_tokens
            assert e.server_output_tokens == max_tokens  # ignore_eos: every token asked for
            if out.timings is not None and "predicted_n" in out.timings:
                assert out.timings["predicted_n"] == max_tokens
            assert record.workload.actual_output_tokens == max_tokens
            assert not e.token_count_mismatch, e.count_anomaly
            if stream:
                assert sum(ev.tokens for ev in out.token_events) <= max_tokens
                assert record.durations_ms.ttft is not None
            # a fresh, unique prompt: nothing served from cache beyond the chat template
            assert e.cached_prompt_tokens is not None
            assert e.prompt_unique_from is not None
            assert e.cached_prompt_tokens <= e.prompt_unique_from, (
                e.cached_prompt_tokens,
                e.prompt_unique_from,
            )
            if protocol != "openai-chat":
                assert e.prompt_unique_from == 0 and e.cached_prompt_tokens == 0
            assert e.prompt_count_source == (
                "server:/apply-template+/tokenize"
                if protocol == "openai-chat"
                else "server:/tokenize"
            )
    finally:
        session.close()


def test_unique_prompts_defeat_the_prefix_cache_and_reuse_hits_it(llama: LlamaServer) -> None:
    """The same prompt twice is served from llama.cpp's cache
    (cache_n = 63 of 64). Unique prompts (the default) never are; --prompt-reuse is."""
    protocol = "openai-completions"
    factory = target_prompts(llama.url, protocol, LLAMA)
    prompt = factory.prompt(64, 5)
    cached: dict[bool, list[int]] = {}
    for reuse in (False, True):
        session = _session(llama.url, protocol, reuse=reuse)
        try:
            records = [_send(session, prompt, 4)[0] for _ in range(4)]
        finally:
            session.close()
        assert all(r.result.http_status == 200 for r in records)
        cached[reuse] = [r.ext.cached_prompt_tokens for r in records]
        unique = {r.ext.prompt_unique_from for r in records}
        assert unique == ({None} if reuse else {0})
    assert cached[False] == [0, 0, 0, 0]
    assert min(cached[True][1:]) >= 60, cached[True]  # the cache serves a reused prompt


def test_chat_prompts_differ_right_after_the_template(llama: LlamaServer) -> None:
    factory = target_prompts(llama.url, "openai-chat", LLAMA)
    session = _session(llama.url, "openai-chat")
    try:
        records = [_send(session, factory.prompt(96, 3), 2)[0] for _ in range(5)]
    finally:
        session.close()
    fixed = {r.ext.prompt_unique_from for r in records}
    assert len(fixed) == 1 and 0 < fixed.pop() < 96  # the chat template's fixed prefix
    # llama.cpp serves the shared template from its cache, and nothing more
    assert all(r.ext.cached_prompt_tokens <= r.ext.prompt_unique_from for r in records)
    assert all(r.ext.server_prompt_tokens == 96 for r in records)


def test_a_local_tokenizer_counts_as_the_server_does(llama: LlamaServer) -> None:
    """--tokenizer: a Hugging Face tokenizer.json of the same vocabulary (with its chat
    template) sizes prompts the server then counts the same, for text and for chat."""
    local = LocalTokenizer(tokenizer_path())
    server = target_prompts(llama.url, "openai-chat", LLAMA).tokenize
    texts = [
        " ".join(sample_words(0, 7, 400)),
        "héllo wörld 你好 123456 \n\n  spaced  ",
        "it's a <|im_start|> test",
    ]
    for text in texts:
        assert local({"content": text}) == server({"content": text, "add_special": False})
        chat = {"messages": [{"role": "user", "content": text}]}
        assert local(chat) == server(chat)
    factory = PromptFactory(local, mode="chat")
    session = _session(llama.url, "openai-chat")
    try:
        record, out = _send(session, factory.prompt(150, 4), 8)
    finally:
        session.close()
    assert out.ok and record.ext.server_prompt_tokens == 150
    assert record.ext.prompt_count_source == "local:tokenizer.json"


def test_a_local_tokenizer_counts_each_event_where_the_server_sends_no_count(
    llama: LlamaServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama.cpp's OpenAI streams carry no per-event usage: with --tokenizer each
    event's text is counted by the local tokenizer (not one token per chunk), and the
    final usage total stays the request's count."""
    local = LocalTokenizer(tokenizer_path())
    counted: list[int] = []

    def count(text: str) -> int:
        counted.append(local.count(text))
        return counted[-1]

    factory = PromptFactory(local, mode="chat")
    session = _session(llama.url, "openai-chat")
    session.count_text = count
    try:
        record, out = _send(session, factory.prompt(64, 2), 40)
    finally:
        session.close()
    assert out.ok, (out.error_class, out.error_detail)
    events = [ev.tokens for ev in out.token_events]
    assert events == counted and all(n >= 1 for n in counted)  # one count per text event
    assert record.ext.token_count_source in ("tokenizer", "tokenizer+usage_total")
    assert (record.ext.token_count_source == "tokenizer") == (sum(counted) == 40)
    assert record.workload.actual_output_tokens == record.ext.server_output_tokens == 40
    assert record.ext.client_output_tokens == sum(counted)
    # the tokenizer's sum, where it differs from the server's, is flagged (no slack declared)
    assert record.ext.token_count_mismatch == (sum(counted) != 40)

    # the same through the CLI a user runs: probe --tokenizer
    code = main(
        [
            *("probe", "--url", llama.url, "--protocol", "openai-chat"),
            *("--target-profile", "llama.cpp", "--tokenizer", str(tokenizer_path())),
            *("--prompt-tokens", "48", "--max-tokens", "12", "--run-dir", str(tmp_path / "p")),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "counted from tokenizer" in text, text
    assert "prompt counted by local:tokenizer.json" in text, text


def test_a_plain_locust_run_of_50_requests_is_never_served_from_cache(
    llama: LlamaServer, tmp_path: Path
) -> None:
    run = LocustRun(
        tmp_path,
        llama.url,
        [
            *("--protocol", "openai-completions", "--target-profile", "llama.cpp"),
            *("--arrival", "constant", "--rate", "10", "--start-delay", "1"),
            *("--prompt-tokens", "64", "--max-tokens", "8", "-u", "2", "-r", "2"),
        ],
        workers=2,
        run_time_s=7.0,
    ).start()
    try:
        assert run.wait(120) == 0, run.log_text()
    finally:
        run.stop()
    t = run.requests()
    sent = t.filter(pc.invert(pc.fill_null(t.column("ext.dropped"), False)))
    done = sent.filter(pc.is_null(sent.column("ext.error_class")))
    assert done.num_rows >= 50, done.num_rows  # 10/s for 6 s after the start delay
    assert set(done.column("ext.worker").to_pylist()) == {"w00", "w01"}
    assert set(done.column("ext.cached_prompt_tokens").to_pylist()) == {0}
    assert set(done.column("ext.prompt_unique_from").to_pylist()) == {0}
    assert set(done.column("ext.server_prompt_tokens").to_pylist()) == {64}
    assert set(done.column("workload.actual_output_tokens").to_pylist()) == {8}


@pytest.mark.parametrize("tokenizer", [False, True], ids=["chunks", "tokenizer"])
def test_output_tokens_and_tokens_per_s_are_the_servers_usage_totals(
    llama: LlamaServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], tokenizer: bool
) -> None:
    """llama.cpp's OpenAI stream has no per-event usage: its tokens are placed in time by
    one per content chunk (fewer than the tokens: a token that ends inside a UTF-8
    character comes with the next) or by a local tokenizer re-counting each event's text
    (more or fewer). Either way the run's output tokens are the sum of the server's usage
    totals, and its tokens/s counts them; a tokenizer's events that disagree with the
    usage are flagged in the record and counted by the analysis's count rule."""
    args = [
        *("--protocol", "openai-chat", "--target-profile", "llama.cpp"),
        *("--arrival", "constant", "--rate", "4", "-u", "2", "-r", "2"),
        *("--prompt-tokens", "32", "--max-tokens", "24"),
    ]
    if tokenizer:
        args += ["--tokenizer", str(tokenizer_path())]
    run = LocustRun(tmp_path, llama.url, args, workers=0, run_time_s=6.0).start()
    try:
        assert run.wait(120) == 0, run.log_text()
    finally:
        run.stop()
    t = run.requests()
    done = t.filter(pc.is_null(t.column("ext.error_class")))
    assert done.num_rows >= 10, done.num_rows
    usage = done.column("ext.server_output_tokens").to_pylist()
    events = done.column("ext.client_output_tokens").to_pylist()
    flagged = done.column("ext.token_count_mismatch").to_pylist()
    assert done.column("workload.actual_output_tokens").to_pylist() == usage
    assert set(done.column("ext.token_total_source").to_pylist()) == {"server"}
    if tokenizer:
        assert flagged == [e != u for e, u in zip(events, usage, strict=True)]
    else:
        assert all(e <= u for e, u in zip(events, usage, strict=True)) and not any(flagged)
    # the whole run as the steady window (no trim), no record excluded for the client's
    # load (this test is about counts): every success summarized, every token in it
    rules = relaxed_rules(tmp_path)
    doc = yaml.safe_load(rules.read_text())
    doc["analysis"]["steady_trim_fraction"] = 0.0
    rules.write_text(yaml.safe_dump(doc))
    assert main(["analyze", str(run.run_dir), "--rules", str(rules)]) == (1 if any(flagged) else 0)
    capsys.readouterr()
    rows = pa_csv.read_csv(run.run_dir / "summary.csv").to_pylist()  # a row per metric
    (summary,) = {(r["cell"], r["partition"]): r for r in rows}.values()
    # the summary's successes: those of its partition (on a busy machine the client's
    # self-watch may set some aside as saturated: they are summarized nowhere)
    joined, _ = apply_quality(load_run(str(run.run_dir)))
    part = dict(zip(joined.column("request_id").to_pylist(),
                    joined.column("quality.partition").to_pylist(), strict=True))  # fmt: skip
    kept = pa.array(
        [part[r] == summary["partition"] for r in done.column("request_id").to_pylist()]
    )
    summed = done.filter(kept)
    assert summed.num_rows >= done.num_rows // 2, (summed.num_rows, done.num_rows)
    assert summary["ok"] == summed.num_rows
    assert summary["output_tokens"] == sum(summed.column("ext.server_output_tokens").to_pylist())
    # tokens/s from the usage totals: each request's usage spread over its events in
    # proportion to their counts, those in [first start, last end) on the wall clock
    assert summary["steady_output_tokens_per_s"] == pytest.approx(
        _tokens_per_s_of_usage(summed, run.token_events()), rel=1e-9
    )
    # the figures of docs/performance.md (pytest -s shows them)
    print(f"{len(usage)} requests: usage {sum(usage)}, per-event counts {sum(events)}")
    verdicts = json.loads((run.run_dir / "verdict.json").read_text())["verdicts"]
    counts = next(v for v in verdicts if v["kind"] == "token_count_mismatch")
    assert counts["observed"] == sum(flagged), counts


def _tokens_per_s_of_usage(done: pa.Table, tokens: pa.Table) -> float:
    """Steady tokens/s over the whole run, each request counted by its server's usage."""
    rec = {
        r["request_id"]: r
        for r in done.select(
            ["request_id", "ext.wall_anchor_ns", "client_ns.request_start",
             "client_ns.response_end", "ext.server_output_tokens", "ext.client_output_tokens"]
        ).to_pylist()
    }  # fmt: skip
    w0 = min(r["ext.wall_anchor_ns"] for r in rec.values())
    w1 = max(
        r["ext.wall_anchor_ns"] + r["client_ns.response_end"] - r["client_ns.request_start"]
        for r in rec.values()
    )
    inside = 0.0
    for ev in tokens.to_pylist():
        r = rec.get(ev["request_id"])
        if r is None or not ev["tokens"]:
            continue
        wall = r["ext.wall_anchor_ns"] + ev["arrival_ns"] - r["client_ns.request_start"]
        if w0 <= wall < w1:
            inside += ev["tokens"] * r["ext.server_output_tokens"] / r["ext.client_output_tokens"]
    return inside / ((w1 - w0) / 1e9)


def test_the_two_turn_user_counts_both_turns_tokens_exactly(
    llama: LlamaServer, tmp_path: Path
) -> None:
    """The example's locustfile, unchanged, against the real server's chat endpoint:
    every turn's output is the server's own count (ignore_eos: exactly what was asked),
    turn 2 carries turn 1's answer, and Locust counts each completed turn once."""
    example = Path(__file__).resolve().parents[2] / "locustfiles" / "examples" / "two_turns.py"
    run = LocustRun(
        tmp_path,
        llama.url,
        ["--protocol", "openai-chat", "--target-profile", "llama.cpp", "-u", "2", "-r", "2"],
        workers=0,
        run_time_s=8.0,
        locustfile=str(example),
    ).start()
    try:
        assert run.wait(120) == 0, run.log_text()
    finally:
        run.stop()
    rows = run.requests().to_pylist()
    done = [r for r in rows if r["ext.error_class"] is None]
    asked = {"turn1": 16, "turn2": 8}
    for cell, n in asked.items():
        mine = [r for r in done if r["ext.cell"] == cell]
        assert len(mine) >= 2, rows
        for r in mine:
            # the server's usage is the count (its chunks only place the tokens in time)
            assert r["workload.actual_output_tokens"] == r["ext.server_output_tokens"] == n, r
            assert r["ext.token_total_source"] == "server" and not r["ext.token_count_mismatch"]
    first = min(r["workload.prompt_tokens"] for r in done if r["ext.cell"] == "turn1")
    assert min(r["workload.prompt_tokens"] for r in done if r["ext.cell"] == "turn2") > first
    counted = sum(1 for r in rows if r["ext.cancelled_at"] != "run_stop")
    assert sum(r["num_requests"] for r in run.locust_stats().values()) == counted


def test_accept_against_llama_cpp_passes_with_its_missing_steps_named(
    llama: LlamaServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A target that is simply not Calculet: no admin API, traces or device telemetry.
    The steps that need them end `not_available` with the reason; the run is judged on
    what the target does give, and it passes (exit 0, never 3)."""
    monkeypatch.delenv("CALCULET_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("CALCULET_SIGNING_KEY", raising=False)
    monkeypatch.delenv("CALCULET_SIGNING_KEY_FILE", raising=False)
    manifest = write_manifest(tmp_path, llama.url, run_id="llama-accept", warmup_requests=2)
    doc = yaml.safe_load(manifest.read_text())
    doc["target"] = {"url": llama.url, "protocol": "openai-chat", "profile": "llama.cpp"}
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
    # one cell of each load shape, the open one a mix, with short outputs: this server
    # decodes on the CPU at ~6 ms a token (its 151k-token vocabulary), so the demo's smoke
    # matrix (4,700 tokens, two 16K prefills) cost a minute of CPU and 3 min beside the suite
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({"schema": "calculet-mix/v1", "name": "two-sizes",
                                   "entries": [MIX_SHORT, MIX_LONG]}))  # fmt: skip
    matrix = write_matrix(tmp_path, [*ACCEPT_CELLS, {**OPEN_CELL, "mix": str(mix)}], reps=10)
    run_dir = tmp_path / "run"
    rules = relaxed_rules(tmp_path)
    args = ["accept", "--manifest", str(manifest), "--matrix", str(matrix)]
    code = main([*args, "--run-dir", str(run_dir), "--rules", str(rules), "--idle-gap-s", "0",
                 "--min-repetitions", "10"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    ends = {e["step"]: e for e in read_events(run_dir) if e.get("status") == "end"}
    for step, what in (("idle", "device telemetry"), ("resources", "admin API"),
                       ("traces", "traces")):  # fmt: skip
        assert ends[step]["outcome"] == "not_available", ends[step]
        assert ends[step]["reason"] == f"the llama.cpp target has no {what}"
    release = ends["release"]
    assert release["outcome"] == "ok" and release["health"] == "ok"
    assert release["target"]["server_header"] == "llama.cpp"
    assert release["target"]["props"]["build_info"]
    assert release["target"]["models"]["ids"]
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["exit_code"] == 0, verdict
    # the rules whose data the target cannot give are not evaluated, and say why
    why = {v["rule"]: v["reason"] for v in verdict["verdicts"] if v["status"] == "not_evaluated"}
    assert why["device_limits.temperature"].startswith(
        "not available: the llama.cpp target has no device telemetry"
    )
    assert why["leaks.kv_allocated_tokens"].startswith(
        "not available: the llama.cpp target has no admin API"
    )


def test_faults_capacity_and_soak_use_what_llama_cpp_has(
    llama: LlamaServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The other drivers on a target that is not Calculet: the fault matrix has no admin
    API to inject through (every scenario NOT_AVAILABLE, exit 0, never 3); the capacity
    search and a soak stage run on what the target does give."""
    monkeypatch.delenv("CALCULET_ADMIN_TOKEN", raising=False)
    manifest = write_manifest(tmp_path, llama.url, run_id="llama-drivers")
    doc = yaml.safe_load(manifest.read_text())
    doc["target"] = {"url": llama.url, "protocol": "openai-completions", "profile": "llama.cpp"}
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
    repo = Path(__file__).resolve().parents[2]

    faults = tmp_path / "faults"
    scenarios = str(repo / "configs" / "faults")
    code = main(["faults", "--manifest", str(manifest), "--scenarios", scenarios,
                 "--run-dir", str(faults)])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    doc = json.loads((faults / "faults.json").read_text())
    assert doc["summary"]["NOT_AVAILABLE"] == len(doc["scenarios"]) > 10
    assert {s["reason"] for s in doc["scenarios"]} == {
        "the llama.cpp target has no admin API to inject faults through"
    }

    capacity = tmp_path / "capacity"
    code = main([
        "capacity", "--manifest", str(manifest), "--run-dir", str(capacity),
        "--start-rate", "4", "--max-rate", "8", "--window-s", "3",
        "--prompt-tokens", "64", "--max-tokens", "8", "--max-queue-p99-ms", "1000",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "queue p99 not available: the llama.cpp target has no traces" in out
    result = json.loads((capacity / "capacity.json").read_text())
    # 8 (the max rate) on a quiet machine; the figure is llama-server's capacity on the two
    # cores it shares with the suite, and a fresh-clone run on a loaded machine found 4
    # unstable (3.875). What the test holds to: a stable rate was found, and a window was
    # unstable for the server's capacity (backlog, latency), never for failed requests.
    assert result["stable_max_qps"] is not None and result["stable_max_qps"] > 0, result
    reasons = [r for w in result["curve"] for r in w["reasons"]]
    assert not [r for r in reasons if "failed" in r or "no request" in r], reasons

    soak = tmp_path / "soak"
    # the client-load gates off (relaxed rules): this machine's load is not the subject
    code = main(["soak", "--stage", "dev", "--manifest", str(manifest), "--run-dir", str(soak),
                 "--duration-scale", "0.004", "--quiet",
                 "--rules", str(relaxed_rules(tmp_path, "soak"))])  # fmt: skip
    assert code == 0, capsys.readouterr().out
    verdict = json.loads((soak / "soak.json").read_text())
    assert verdict["exit_code"] == 0, verdict


def test_the_model_is_the_one_the_target_lists_when_none_is_given(llama: LlamaServer) -> None:
    profile = profile_named("llama.cpp")
    listed = model_for(llama.url, profile, "openai-chat", None)
    assert listed is not None and listed.endswith(".gguf")  # llama-server lists its file
    assert model_for(llama.url, profile, "openai-chat", "mine") == "mine"
    assert model_for(llama.url, profile, "llama", None) is None  # /completion takes none
