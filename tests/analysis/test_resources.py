"""Leak verdicts from server/resources.jsonl (analysis.judge.resources, spec §13), and the
sampler's Prometheus parsing (calculet_load.target.resources)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from analysis.analyze import analyze, write_outputs
from analysis.judge.verdict import render_summary
from analysis.report import build_view
from calculet_load.target.resources import parse_metrics
from tests.support.runs import WALL0, RunBuilder, request

MB = 1_000_000
GATES = {"rss_bytes": 64 * 2**20, "fds": 10, "leases_unavailable": 1, "kv_allocated_tokens": 4096}


def _rules(tmp_path: Path, **leaks: Any) -> str:
    path = tmp_path / f"rules-{len(list(tmp_path.glob('rules-*')))}.yaml"
    rule = {"id": "leaks", "kind": "leaks", "min_slope_per_h": GATES, **leaks}
    doc = {"schema": "calculet-acceptance-rules/v1", "rules": [rule]}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _run(
    root: Path,
    *,
    rss_per_h: float,
    span_s: float = 3600.0,
    time_scale: float | None = None,
    idle_kv: int = 0,
    samples: int = 240,
) -> str:
    """One request, and `samples` resource rows over `span_s` seconds of wall time: RSS
    500 MB + rss_per_h per wall hour + ±2 MB noise; 15 FDs; every 10th sample idle."""
    b = RunBuilder(root)
    b.add(request("r0", t0=0))
    rng = np.random.default_rng(7)
    rows = []
    for k in range(samples):
        t_s = k * span_s / samples
        idle = k % 10 == 0
        rows.append(
            {
                "wall_ns": WALL0 + int(t_s * 1e9),
                "mono_ns": int(t_s * 1e9),
                "rss_bytes": int(500 * MB + rss_per_h * t_s / 3600 + rng.uniform(-2, 2) * MB),
                "fds": 15,
                "threads": 3,
                "kv_allocated_tokens": idle_kv if idle else 2048,
                "leases": 0 if idle else 4,
                "leases_free": 32 if idle else 28,
                "leases_total": 32,
                "device_memory_mib": 12400.0,
                "sequences_active": 0 if idle else 4,
                "requests_queued": 0,
                "time_scale": time_scale,
            }
        )
    b.trace("resources", rows)
    return b.write()


def _verdicts(result: Any) -> dict[str, dict[str, Any]]:
    return {v["rule"]: v for v in result.document["verdicts"]}


def test_a_growing_rss_is_a_leak_and_exits_1(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "leak", rss_per_h=200 * MB)
    result = analyze(run_dir, rules_path=_rules(tmp_path))
    v = _verdicts(result)
    assert v["leaks.rss_bytes"]["status"] == "fail", v["leaks.rss_bytes"]["reason"]
    assert v["leaks.rss_bytes"]["class"] == "correctness" and int(result.exit_code) == 1
    assert 150 * MB < v["leaks.rss_bytes"]["observed"] < 250 * MB  # bytes per hour
    assert v["leaks.fds"]["status"] == "pass"
    assert v["leaks.leases_unavailable"]["status"] == "pass"
    assert v["leaks.kv_allocated_tokens"]["status"] == "pass"
    assert v["leaks.idle_baseline"]["status"] == "pass"
    section = result.document["leaks"]
    assert section["samples"] == 240 and section["time_scale"] == 1.0
    assert section["series"]["rss_bytes"]["status"] == "leak"
    assert section["series"]["threads"]["status"] == "not_configured"
    lo, hi = section["series"]["rss_bytes"]["ci_per_h"]
    assert lo < 200 * MB < hi
    json.dumps(result.document)

    flat = analyze(_run(tmp_path / "flat", rss_per_h=0), rules_path=_rules(tmp_path))
    assert _verdicts(flat)["leaks.rss_bytes"]["status"] == "pass"
    assert int(flat.exit_code) == 0


def test_slopes_are_per_hour_of_server_time(tmp_path: Path) -> None:
    # a 72 s rehearsal at time scale 0.02 stands for an hour: 4 MB over it is 4 MB per
    # server hour, under the 64 MiB gate; read as wall time it would be 200 MB/h
    kw: dict[str, Any] = {"rss_per_h": 4 * MB * 50, "span_s": 72.0}
    scaled = analyze(_run(tmp_path / "s", time_scale=0.02, **kw), rules_path=_rules(tmp_path))
    v = _verdicts(scaled)["leaks.rss_bytes"]
    assert v["status"] == "pass" and 2 * MB < v["observed"] < 6 * MB
    assert scaled.document["leaks"]["span_server_s"] > 3500
    wall = analyze(_run(tmp_path / "w", **kw), rules_path=_rules(tmp_path))
    assert _verdicts(wall)["leaks.rss_bytes"]["status"] == "fail"


def test_kv_held_while_idle_fails_the_baseline(tmp_path: Path) -> None:
    result = analyze(_run(tmp_path / "r", rss_per_h=0, idle_kv=128), rules_path=_rules(tmp_path))
    v = _verdicts(result)["leaks.idle_baseline"]
    assert v["status"] == "fail" and v["observed"] == 24 and v["n"] == 24
    assert "KV 128 tokens" in v["reason"]


def test_too_short_is_inconclusive_and_no_file_is_no_data(tmp_path: Path) -> None:
    short = analyze(_run(tmp_path / "s", rss_per_h=0, samples=10), rules_path=_rules(tmp_path))
    assert _verdicts(short)["leaks.rss_bytes"]["status"] == "inconclusive"
    # a sample every 360 s: 21 bins of 360 s after a 10% warmup need 21·360/0.9 = 8,400 s
    assert _verdicts(short)["leaks.rss_bytes"]["too_short"] == {
        "need": "≥ 20 bins of resource samples",
        "run_s": 8400.0,
    }
    b = RunBuilder(tmp_path / "none")
    b.add(request("r0", t0=0))
    none = analyze(b.write(), rules_path=_rules(tmp_path))
    assert none.document["leaks"] is None
    v = _verdicts(none)
    assert v["leaks.rss_bytes"]["status"] == "not_evaluated"
    assert v["leaks.idle_baseline"]["status"] == "not_evaluated"


def test_prometheus_text_is_summed_over_labels() -> None:
    text = (
        "# HELP calculet_chip_memory_used_mib Device memory used (MiB)\n"
        "# TYPE calculet_chip_memory_used_mib gauge\n"
        'calculet_chip_memory_used_mib{chip="0"} 6200.5\n'
        'calculet_chip_memory_used_mib{chip="1"} 6199.5\n'
        "calculet_process_rss_bytes 5.3e+07\n"
        "not a metric line\n"
    )
    m = parse_metrics(text)
    assert m["calculet_chip_memory_used_mib"] == 12400.0
    assert m["calculet_process_rss_bytes"] == 53_000_000
    assert "not" not in m


def test_without_resources_jsonl_the_scrapes_are_read(tmp_path: Path) -> None:
    """server/metrics.jsonl (the harness's /metrics scrapes) and server/process.jsonl
    (psutil) give the same series: RSS from the process rows, the rest from /metrics."""
    b = RunBuilder(tmp_path / "run")
    b.add(request("r0", t0=0))
    metrics, procs = [], []
    for k in range(240):
        mono = k * 15 * 10**9  # an hour, every 15 s
        samples = {
            "calculet_kv_allocated_tokens": 0.0,
            "calculet_buffer_pool_total": 32.0,
            "calculet_buffer_pool_free": 32.0,
            'calculet_chip_memory_used_mib{chip="0"}': 6200.0,
            'calculet_chip_memory_used_mib{chip="1"}': 6200.0 + k,  # 4 MiB/min
            "calculet_process_rss_bytes": 1.0,  # the process row wins
        }
        head = {"wall_ns": WALL0 + mono, "mono_ns": mono, "url": "u", "ok": True}
        metrics.append({**head, "scrape_ms": 1.0, "error": None, "buckets": False,
                        "samples": samples})  # fmt: skip
        procs.append({"wall_ns": WALL0 + mono, "mono_ns": mono - 1, "pid": 1, "alive": True,
                      "rss_bytes": 500 * MB, "fds": 15, "threads": 3})  # fmt: skip
    metrics.append({"wall_ns": WALL0, "mono_ns": 0, "url": "u", "ok": False, "scrape_ms": None,
                    "error": "refused", "buckets": False, "samples": {}})  # fmt: skip
    b.trace("metrics", metrics).trace("process", procs)
    result = analyze(b.write(), rules_path=_rules(tmp_path, min_slope_per_h={
        **GATES, "device_memory_mib": 64}))  # fmt: skip
    v = _verdicts(result)
    assert v["leaks.device_memory_mib"]["status"] == "fail"
    assert 200 < v["leaks.device_memory_mib"]["observed"] < 280  # 240 MiB/h
    assert v["leaks.rss_bytes"]["status"] == "pass"
    assert result.document["leaks"]["series"]["rss_bytes"]["first"] == 500 * MB
    assert any("server/metrics.jsonl" in n for n in result.document["run"]["notes"])


def test_rules_the_run_was_too_short_for_are_one_line(tmp_path: Path) -> None:
    """The four gated series, each undecided for want of bins, are one line in analyze's
    printout and in the report's banner, with how long a run would decide them; in wall
    time, whatever the time scale (server seconds × the scale)."""
    for name, scale in (("s", None), ("scaled", 0.5)):
        run = _run(tmp_path / name, rss_per_h=0, samples=10, time_scale=scale)
        result = analyze(run, rules_path=_rules(tmp_path))
        text = render_summary(result.document)
        line = "4 leak rules need ≥ 20 bins of resource samples: run ≥ 2.4 h"  # 8,400 s
        assert f"  TOO SHORT    {line}" in text.splitlines()
        assert "INCONCLUSIVE" not in text
        write_outputs(result, run)
        banner = build_view(run).banner
        assert banner.too_short == (line,)
        assert not [f for f in banner.failing if f[0].startswith("leaks.")]
