"""`calculet-load probe`: one request against a target, its timeline, and its record.

Prints t0..t6 (ms after t0, and the step from the previous stamp), the §2.2 durations,
the client's and the server's token counts, and the server's own timings; writes the
record to a run folder (Parquet part and a §3 JSON line). Exit 0 when the request
succeeded, 1 when the server answered with an error, 2 for bad arguments or manifest,
3 when the target cannot be reached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.outcome import Timeouts
from calculet_load.measure.prompts import WorkloadError, target_prompts
from calculet_load.measure.session import RequestSpec, RunContext, Session
from calculet_load.measure.sink import PartSink, SinkStats, sink_status
from calculet_load.ranges import OUTPUT_TOKENS, POSITIVE_SECONDS, PROMPT_TOKENS, SEED, Number
from calculet_load.schema.access import AccessError, access_from, add_access_arguments
from calculet_load.schema.manifest import ManifestError, load_manifest
from calculet_load.schema.profiles import PROFILE_NAMES, profile_named
from calculet_load.schema.records import record_to_dict
from calculet_load.target.describe import DetectError, detect_profile, model_for

_STAMPS = (
    ("t0", "request_start", "request start"),
    ("t1", "headers_sent", "request's last byte left"),
    ("t2", "response_headers", "response headers"),
    ("t3", "first_event", "first stream event"),
    ("t4", "first_token", "first generated token"),
    ("t5", "last_token", "last generated token"),
    ("t6", "response_end", "response end"),
)
_UNREACHABLE = ("connect_refused", "connect_timeout", "unreachable", "tls_verify", "tls_handshake")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        help="target URL, http(s)://HOST[:PORT][/BASE/PATH] (default: the manifest's target.url)",
    )
    add_access_arguments(p.add_argument)
    p.add_argument(
        "--protocol",
        choices=("llama", "openai-chat", "openai-completions"),
        help="target protocol (default: the manifest's, else llama)",
    )
    p.add_argument("--manifest", help="run manifest (YAML); supplies run id and provenance")
    p.add_argument(
        "--model",
        help="model name to send (OpenAI protocols; default: the manifest's, else the first "
        "one the target lists)",
    )
    p.add_argument(
        "--target-profile",
        choices=PROFILE_NAMES,
        help="what kind of server the target is (default: the manifest's, else detected "
        "from the target)",
    )
    p.add_argument(
        "--tokenizer",
        help="a local tokenizer.json that sizes the prompt (and counts events the server "
        "sends no count for)",
    )
    p.add_argument(
        "--prompt-reuse",
        action="store_true",
        help="send the prompt as built, not made unique (cache studies)",
    )
    p.add_argument("--prompt-tokens", type=PROMPT_TOKENS, default=128, help="exact prompt length")
    p.add_argument("--max-tokens", type=OUTPUT_TOKENS, default=32, help="output tokens to request")
    p.add_argument(
        "--sample", type=Number(int, 0, 1_000_000), default=0, help="corpus sample index"
    )
    p.add_argument("--no-stream", action="store_true", help="ask for a whole response")
    p.add_argument("--temperature", type=Number(float, 0, 100), default=0.0)
    p.add_argument("--seed", type=SEED)
    p.add_argument(
        "--timeout", type=POSITIVE_SECONDS, help="total timeout in s (default: manifest, 900)"
    )
    p.add_argument("--run-dir", help="where to write the record (default: runs/probe-<time>)")


def run(args: argparse.Namespace) -> int:
    manifest = None
    if args.manifest:
        try:
            manifest = load_manifest(args.manifest)
        except ManifestError as exc:
            print(exc, file=sys.stderr)
            return 2
    target = manifest.target if manifest is not None else None
    url = args.url or (target.url if target else None)
    if not url:
        print("probe: --url is required (or a manifest with target.url)", file=sys.stderr)
        return 2
    try:
        access = access_from(args, url, target)
    except AccessError as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return 2
    if access.banner():
        print(access.banner(), file=sys.stderr)
    protocol = args.protocol or (target.protocol if target else "llama")
    model = args.model or (target.model if target else None)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    run_id = manifest.run_id if manifest is not None else f"probe-{stamp}"
    run_dir = args.run_dir or str(Path("runs") / run_id)
    ctx = (
        RunContext.from_manifest(manifest, "probe")
        if manifest is not None
        else RunContext(run_id, "probe")
    )
    timeout = args.timeout or (manifest.timeout_s if manifest is not None else 900.0)
    timeouts = Timeouts.within(timeout)
    name = args.target_profile or (target.profile if target else None)
    if name is None:
        try:
            name, why = detect_profile(access)
        except DetectError as exc:
            print(f"probe: cannot reach {url}: {exc}", file=sys.stderr)
            return 3
        except LookupError as exc:
            print(
                f"probe: cannot tell what kind of server {url} is ({exc}): give "
                f"--target-profile, one of {', '.join(PROFILE_NAMES)}",
                file=sys.stderr,
            )
            return 2
        print(f"probe: the target is {name} ({why})", file=sys.stderr)
    try:
        profile = profile_named(name)
        tokenizer = args.tokenizer or (target.tokenizer if target else None)
        factory = target_prompts(
            access, protocol, SimpleNamespace(profile=profile.name, tokenizer=tokenizer)
        )
        prompt = factory.prompt(args.prompt_tokens, args.sample)
        model = model_for(access, profile, protocol, model)
    except WorkloadError as exc:
        print(f"probe: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"probe: cannot reach {url} for /tokenize: {exc}", file=sys.stderr)
        return 3
    sink = PartSink(run_dir, "probe")
    reuse = bool(args.prompt_reuse or (target and target.prompt_reuse))
    session = Session(
        ctx,
        access,
        protocol,
        model=model,
        timeouts=timeouts,
        sink=sink,
        prompt_reuse=reuse,
        count_text=factory.count_text,
    )
    spec = RequestSpec(
        prompt=prompt,
        max_tokens=args.max_tokens,
        stream=not args.no_stream,
        temperature=args.temperature,
        seed=args.seed,
        cell="probe",
        concurrency=1,
        arrival="single",
    )
    record, out = run_in_greenlet(lambda: session.send(spec))
    session.close()
    stats = sink.close()
    jsonl = Path(run_dir) / "client" / "probe" / "requests.jsonl"
    try:
        with jsonl.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record_to_dict(record, strict=True)) + "\n")
        jsonl_written: str | None = None
    except (OSError, ValueError) as exc:
        jsonl_written = f"{type(exc).__name__}: {exc}"

    print(f"probe {protocol} {url}  request {record.request_id}")
    print(f"  prompt {prompt.tokens} tokens ({prompt.sample_id}), max_tokens {args.max_tokens}")
    unique = record.ext.prompt_unique_from
    print(
        f"  prompt counted by {prompt.count_source}; "
        + ("reused as built" if unique is None else f"unique from token {unique}")
    )
    t0 = record.client_ns.request_start
    prev = t0
    for label, field, meaning in _STAMPS:
        value = getattr(record.client_ns, field)
        if value is None:
            print(f"  {label} {'-':>10}            {meaning}")
            continue
        step = (value - prev) / 1e6 if prev is not None else 0.0
        if label == "t1":  # the kernel's transmit time, or when the send call returned
            meaning += f" ({record.ext.sent_stamp_source or 'not sent'})"
        print(f"  {label} {(value - t0) / 1e6:10.3f} ms ({step:+9.3f})  {meaning}")
        prev = value
    d = record.durations_ms
    for name in ("ttfh", "ttfe", "ttft", "tpot", "e2e"):
        value = getattr(d, name)
        print(f"  {name.upper():5} {'null' if value is None else f'{value:.3f} ms'}")
    e = record.ext
    print(
        f"  tokens: client {e.client_output_tokens} in {e.token_events} events "
        f"({e.events} events in all), server {e.server_output_tokens}, "
        f"counted from {e.token_count_source}" + ("  MISMATCH" if e.token_count_mismatch else "")
    )
    if e.count_anomaly:
        print(f"  count anomaly: {e.count_anomaly}")
    if e.cached_prompt_tokens is not None:
        print(f"  server cache: {e.cached_prompt_tokens} prompt tokens served from cache")
    if out.timings:
        shown = ", ".join(f"{k}={v}" for k, v in out.timings.items())
        print(f"  server timings: {shown}")
    print(f"  result: http {record.result.http_status}, finish {record.result.finish_reason}")
    if out.error_class:
        print(f"  error: {out.error_class}: {out.error_detail}")
    if e.invalid_value is not None:
        print(f"  offending value: {e.invalid_value}")
    written = _written(stats, run_dir, jsonl, jsonl_written)
    if out.error_class in _UNREACHABLE:
        return 3
    if not written:
        return 3  # the record is not (wholly) where the analysis reads it
    return 0 if out.ok else 1


def _written(stats: SinkStats, run_dir: str, jsonl: Path, jsonl_error: str | None) -> bool:
    """Say exactly where the probe's record went; True when it is in a Parquet part."""
    in_part = stats.records == 1
    if in_part:
        print(f"  record written: Parquet part under {run_dir}/client/probe/")
    else:
        problem = sink_status(dataclasses.asdict(stats)) or "; ".join(stats.errors)
        print(f"  record NOT in a Parquet part: {problem or 'unknown'}", file=sys.stderr)
    for name in stats.quarantine_files:
        print(f"  quarantined rows: {run_dir}/client/probe/{name}", file=sys.stderr)
    if stats.token_events:
        print(f"  token events written: {stats.token_events}")
    if jsonl_error is None:
        print(f"  §3 line written: {jsonl}")
    else:
        print(f"  §3 line NOT written to {jsonl}: {jsonl_error}", file=sys.stderr)
    return in_part and jsonl_error is None
