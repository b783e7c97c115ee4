"""The Prometheus exposition's pieces and the server sampler, without Locust.

Labelled live series (bucketing, wire merge, the cap on label sets), the collector's
text as Prometheus' own parser reads it, the exposition parser of `scrape`, and the
process/metrics samplers against a real simulator process.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from calculet_drivers.commands.tools import _schemas
from calculet_load.locust.livestats import (
    LATENCY_BOUNDS_S,
    MAX_SERIES,
    OVERFLOW,
    FixedHistogram,
    LiveStats,
    outcome_of,
    series_key,
)
from calculet_load.locust.options import OPTIONS
from calculet_load.locust.prom import ClientCollector
from calculet_load.schema.records import DurationsMs, Ext, RequestRecord, Workload
from calculet_load.target.scrape import (
    JsonlAppender,
    ServerSampler,
    find_server_pid,
    parse_exposition,
    sample_process,
    sampler_for_run,
)
from tests.support.simproc import SimProcess


def _rec(
    prompt: int = 128,
    out: int = 32,
    conc: int | None = 4,
    arrival: str = "closed",
    error: str | None = None,
    ttft_ms: float | None = 20.0,
    alias: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        "run",
        "r",
        model_alias=alias,
        workload=Workload(
            prompt_tokens=prompt,
            requested_output_tokens=out,
            actual_output_tokens=out,
            concurrency=conc,
        ),
        durations_ms=DurationsMs(ttft=ttft_ms, tpot=2.0, e2e=90.0),
        ext=Ext(arrival=arrival, error_class=error, client_output_tokens=out),
    )


# ------------------------------------------------------------------ labelled live series
def test_labels_are_buckets_of_fixed_lists() -> None:
    assert series_key(_rec(16, 32, 4)) == ("unknown", "16", "32", "4")
    # 17 tokens is past the 16 boundary: the next bucket; 40959 is the context limit
    assert series_key(_rec(17, 33, 3), "qwen") == ("qwen", "128", "256", "4")
    assert series_key(_rec(40959, 5000, 2000))[1:] == ("40960", "inf", "inf")
    assert series_key(_rec(arrival="poisson", conc=None))[3] == "open"
    assert series_key(_rec(arrival="burst", conc=None))[3] == "burst"
    # the manifest's alias wins over --model; a huge name is cut
    assert series_key(_rec(alias="m" * 500), "other")[0] == "m" * 64
    assert [outcome_of(c) for c in (None, "http_4xx", "http_5xx", "idle_timeout")] == [
        "ok",
        "4xx",
        "5xx",
        "timeout",
    ]
    assert outcome_of("cancelled") == "cancel" and outcome_of("invalid_json") == "error"


def test_failed_requests_count_but_never_enter_latency_histograms() -> None:
    s = LiveStats()
    s.observe_series(_rec(ttft_ms=20.0))
    s.observe_series(_rec(error="http_5xx", ttft_ms=5000.0))
    (series,) = s.series.values()
    assert series.outcomes == {"ok": 1, "5xx": 1}
    assert series.hist["ttft"].count == 1 and series.hist["ttft"].sum == pytest.approx(0.020)
    assert series.output_tokens == 64 and series.prompt_tokens == 256


def test_label_sets_are_capped_and_merge_through_the_wire() -> None:
    worker = LiveStats()
    for p in range(MAX_SERIES + 10):  # distinct models: more label sets than the cap
        worker.observe_series(_rec(), model=f"m{p}")
    assert len(worker.series) == MAX_SERIES + 1  # the cap, plus the one overflow set
    assert sum(x.outcomes["ok"] for x in worker.series.values()) == MAX_SERIES + 10
    assert worker.series[OVERFLOW].outcomes["ok"] == 10
    master = LiveStats()
    for _ in range(3):
        master.merge_wire(json.loads(json.dumps(worker.to_wire())), process="w00")
    assert sum(x.outcomes["ok"] for x in master.series.values()) == 3 * (MAX_SERIES + 10)
    h = master.series[("m0", "128", "32", "4")].hist["ttft"]
    assert h.count == 3 and h.sum == pytest.approx(0.060)


def test_fixed_histogram_buckets_are_inclusive_upper_bounds() -> None:
    h = FixedHistogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 2.0, 7.0):  # 1.0 is in le=1, 2.0 in le=2 (Prometheus' le)
        h.add(v)
    assert h.cumulative() == [(1.0, 2), (2.0, 4), (math.inf, 5)]
    h.merge_wire([1, 0, 0, 3.0])
    assert h.count == 6 and h.sum == pytest.approx(15.0)
    h.merge_wire([1, 2])  # another version's bounds: ignored, not misread
    assert h.count == 6


def test_collector_text_reads_back_with_prometheus_own_parser() -> None:
    s = LiveStats()
    for ttft in (3.0, 30.0, 300.0):
        s.observe_series(_rec(ttft_ms=ttft), model="sim")
    s.observe_series(_rec(error="http_4xx"), model="sim")
    s.errors["http_4xx"] += 1
    s.counters["late"] += 2
    s.in_flight.update(w00=3, w01=1)
    s.observe("loop_lag", 0.3)
    registry = CollectorRegistry()
    registry.register(
        ClientCollector(lambda: s, lambda: {"run_id": "r1", "arrival": "closed", "target_users": 4})
    )
    text = generate_latest(registry).decode()
    samples = [x for fam in text_string_to_metric_families(text) for x in fam.samples]

    def value(name: str, **labels: str) -> float:
        (hit,) = [x.value for x in samples if x.name == name and x.labels == labels]
        return float(hit)

    lab = {"model": "sim", "prompt_bucket": "128", "output_bucket": "32", "concurrency": "4"}
    assert value("calculet_client_requests_total", **lab, outcome="ok") == 3
    assert value("calculet_client_requests_total", **lab, outcome="4xx") == 1
    buckets = {
        float(x.labels["le"]): x.value
        for x in samples
        if x.name == "calculet_client_ttft_seconds_bucket"
    }
    assert sorted(buckets) == [*LATENCY_BOUNDS_S, math.inf]
    # 3, 30 and 300 ms: one at le=0.005, two at le=0.05, three at le=0.5 and above
    assert (buckets[0.005], buckets[0.05], buckets[0.5], buckets[math.inf]) == (1, 2, 3, 3)
    assert value("calculet_client_ttft_seconds_sum", **lab) == pytest.approx(0.333)
    assert value("calculet_client_output_tokens_total", **lab) == 4 * 32
    assert value("calculet_client_errors_total", error_class="http_4xx") == 1
    assert value("calculet_client_late_arrivals_total") == 2
    assert value("calculet_client_requests_in_flight", process="w01") == 1
    assert value("calculet_client_loop_lag_seconds_count") == 1
    assert value("calculet_client_target_users") == 4
    assert value("calculet_client_run_info", run_id="r1", arrival="closed", protocol="") == 1
    # before any run: every family is there, with no labelled samples and no error
    empty = CollectorRegistry()
    empty.register(ClientCollector(lambda: None))
    assert b"calculet_client_ttft_seconds" in generate_latest(empty)


# ------------------------------------------------------------------ the exposition parser
def test_exposition_parser_keeps_series_as_written() -> None:
    text = "\n".join(
        [
            "# HELP x_total things",
            "# TYPE x_total counter",
            "x_total 3",
            'y{a="b c",d="}"} 1.5 1700000000000',  # spaces and a brace inside values
            'h_bucket{le="0.5"} 2',
            'h_bucket{le="+Inf"} 4',
            "h_sum 1.25",
            "nan_gauge NaN",
            "inf_gauge +Inf",
            "broken_line",
            "# EOF",
        ]
    )
    got = parse_exposition(text)
    assert got == {
        "x_total": 3.0,
        'y{a="b c",d="}"}': 1.5,
        'h_bucket{le="0.5"}': 2.0,
        'h_bucket{le="+Inf"}': 4.0,
        "h_sum": 1.25,
        "nan_gauge": None,  # no data is null, never a number
        "inf_gauge": None,
    }
    assert set(parse_exposition(text, buckets=False)) == set(got) - {
        'h_bucket{le="0.5"}',
        'h_bucket{le="+Inf"}',
    }


def test_row_schemas_are_published() -> None:
    schemas = _schemas()
    assert set(schemas["server_process"]()["properties"]) >= {"rss_bytes", "fds", "threads"}
    assert "samples" in schemas["server_metrics"]()["properties"]


# ------------------------------------------------------------------ against a real server
def test_process_samples_of_a_live_and_a_gone_process(tmp_path: Path) -> None:
    row = sample_process(psutil.Process(os.getpid()))
    assert row.alive and row.rss_bytes and row.rss_bytes > 10 << 20
    assert row.threads and row.threads >= 1 and row.fds and row.fds >= 3
    assert row.tree_rss_bytes is not None and row.tree_rss_bytes >= row.rss_bytes
    proc = psutil.Popen(["sleep", "30"])
    p = psutil.Process(proc.pid)
    proc.kill()
    proc.wait()
    gone = sample_process(p)
    assert not gone.alive and gone.rss_bytes is None and gone.error == "process gone"


def test_sampler_writes_both_series_from_a_simulator(
    tmp_path: Path, start_sim: Callable[..., SimProcess]
) -> None:
    sim = start_sim("--time-scale", "0.02")
    assert find_server_pid(sim.url) == sim.pid  # by the port: the sim runs on this host
    assert find_server_pid("http://192.0.2.1:8000") is None  # not this host
    run_dir = tmp_path / "run"
    sampler = sampler_for_run(str(run_dir), sim.url, interval_s=0.2)
    assert sampler is not None
    sim.stream("/completion", {"prompt": "hello", "n_predict": 8, "stream": True})
    sim.wait_for(lambda: sampler.scrapes >= 3, timeout=20, what="three scrapes")
    sampler.stop()
    assert sampler.proc is not None and sampler.proc.pid == sim.pid
    metrics = [json.loads(x) for x in (run_dir / "server/metrics.jsonl").read_text().splitlines()]
    process = [json.loads(x) for x in (run_dir / "server/process.jsonl").read_text().splitlines()]
    assert len(metrics) >= 4 and all(r["ok"] for r in metrics)
    assert metrics[0]["buckets"] and metrics[-1]["buckets"] and not metrics[1]["buckets"]
    last = metrics[-1]["samples"]
    assert last["calculet_requests_finished_total"] >= 1
    assert any(k.startswith("calculet_sequence_length_tokens_bucket") for k in last)
    assert not any(k.endswith("_bucket") for k in metrics[1]["samples"])
    walls = [r["wall_ns"] for r in metrics]
    assert walls == sorted(walls)
    assert {r["pid"] for r in process} == {sim.pid}
    assert all(r["alive"] and r["rss_bytes"] > 0 and r["fds"] > 0 for r in process)
    # the server's own view of its RSS is what psutil read (same process, same moment ±)
    assert last["calculet_process_rss_bytes"] == pytest.approx(process[-1]["rss_bytes"], rel=0.2)


def test_a_failed_scrape_is_a_row_and_sampling_goes_on(tmp_path: Path) -> None:
    sampler = ServerSampler(str(tmp_path), metrics_url="http://127.0.0.1:9/metrics", pid=None)
    sampler.sample()
    sampler.stop()
    rows = [json.loads(x) for x in (tmp_path / "server/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and not rows[0]["ok"] and rows[0]["samples"] == {}
    assert "Connection" in rows[0]["error"] or "refused" in rows[0]["error"]
    assert not (tmp_path / "server/process.jsonl").exists()
    assert sampler_for_run(str(tmp_path), "http://x", interval_s=0) is None


def test_local_rows_are_appended_so_a_crash_keeps_them(tmp_path: Path) -> None:
    out = JsonlAppender(str(tmp_path), "server/process.jsonl")
    out.add(sample_process(psutil.Process(os.getpid())))
    # readable before close: each row is flushed as it is written
    assert len((tmp_path / "server/process.jsonl").read_text().splitlines()) == 1
    out.close()
    again = JsonlAppender(str(tmp_path), "server/process.jsonl")  # a resumed run appends
    again.add(sample_process(psutil.Process(os.getpid())))
    again.close()
    assert len((tmp_path / "server/process.jsonl").read_text().splitlines()) == 2


def test_the_docs_list_exactly_the_series_and_options() -> None:
    """docs/metrics.md's tables name every client series the collector emits, and every
    option it documents is one the plugin registers (Locust's --help cannot show them)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    documented = {
        "calculet_client_" + n.removesuffix("_total")
        for row in re.findall(r"^\| (`[a-z0-9_]+`(?:, `[a-z0-9_]+`)*) \|", text, re.M)
        for n in re.findall(r"`([a-z0-9_]+)`", row)
    }
    s = LiveStats()
    s.observe_series(_rec())
    info = {"run_id": "r", "target_rate": 1.0, "target_users": 1}
    emitted = {fam.name for fam in ClientCollector(lambda: s, lambda: info).collect()}
    assert documented == emitted, documented ^ emitted
    options = set(re.findall(r"^\| `(--[a-z-]+)`", text, re.M))
    assert options == {
        "--metrics-port",
        "--metrics-host",
        "--scrape-interval",
        "--server-metrics-url",
        "--server-pid",
    }
    registered = {f for o in OPTIONS for f in o.flags}  # the plugin's, declared once
    assert options <= registered, options - registered
