"""Capacity (spec §14.3, analysis.judge.capacity) on a hand-built two-rate sweep: per rate the
queue, rejects and utilisation, the queue-growth test and the stable max QPS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.analyze import analyze
from tests.support.runs import MS, WALL0, RunBuilder, request, server_chain, step_row

N = 400  # per rate: enough values for a P99 upper bound at 95% (n ≥ 368)


def _rules(tmp_path: Path, **capacity: Any) -> str:
    path = tmp_path / f"rules-{len(list(tmp_path.glob('rules-*')))}.yaml"
    rule = {"id": "cap", "kind": "capacity", "window_s": 15, "max_reject_rate": 0.1,
            "max_queue_p99_ms": 100.0, **capacity}  # fmt: skip
    doc = {"schema": "calculet-acceptance-rules/v1", "rules": [rule]}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _sweep(root: Path) -> str:
    """poisson10: N arrivals 100 ms apart, queue 5.0–5.6 ms (flat), one 5 ms device job
    each. poisson20: N arrivals 50 ms apart, queue 5 + 2·i ms (growing 40 ms per second),
    every 20th answered 429 before the server queued it."""
    b = RunBuilder(root)
    events: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    t0 = 0
    for name, gap_ms, queue_ms in (
        ("poisson10-p16-o5", 100, lambda i: 5.0 + (i % 7) * 0.1),
        ("poisson20-p16-o5", 50, lambda i: 5.0 + 2.0 * i),
    ):
        for i in range(N):
            rid = f"{name}-{i}"
            start = t0 + i * gap_ms * MS
            rejected = name.startswith("poisson20") and i % 20 == 19
            b.add(
                request(
                    rid, t0=start, cell=name, concurrency=None, arrival="poisson",
                    error="http_4xx" if rejected else None, http_status=429 if rejected else None,
                )
            )  # fmt: skip
            if rejected:
                continue
            a = start + 1 * MS
            q = int(queue_ms(i) * MS)
            events += server_chain(rid, accepted=a, steps=[(a + q, a + q + 2 * MS, a + q + 3 * MS)])
            row = step_row(rid, 0, h2d=0.1, wait=5.0, d2h=0.1, sampling=0.1)
            row.update(job_id=len(steps) + 1, wall_ns=WALL0 + a + q + 2 * MS)
            steps.append(row)
        t0 += (N * gap_ms + 5_000) * MS
    b.trace("server_events", events).trace("steps", steps)
    return b.write()


def _verdicts(result: Any) -> dict[str, dict[str, Any]]:
    return {v["rule"]: v for v in result.document["verdicts"]}


def test_rate_points_known_answer(tmp_path: Path) -> None:
    run_dir = _sweep(tmp_path / "run")
    result = analyze(run_dir, rules_path=_rules(tmp_path, min_stable_qps=8))
    cap = result.document["capacity"]
    slow, fast = cap["points"]
    assert (slow["rate_nominal"], fast["rate_nominal"]) == (10.0, 20.0)
    # 400 arrivals 100 ms apart: 399 gaps over 39.9 s → 10/s offered
    assert slow["rate_offered"] == pytest.approx(10.0) and slow["window_s"] == pytest.approx(39.9)
    assert fast["rate_offered"] == pytest.approx(20.0)
    assert (fast["rejects"], fast["sent"], fast["reject_rate"]) == (20, 400, 0.05)
    assert fast["errors"] == 0 and fast["error_rate"] == 0.0  # a 429 is a reject
    # queue P99 = 400·0.99 → k = ⌈0.99·399⌉ + 1 = 397th of 5.0..5.6 (flat) → 5.6
    assert slow["queue_p99_ms"] == pytest.approx(5.6)
    # utilisation: 400 jobs × 5 ms over the server window a₀ … a₃₉₉ + 5.x + 3 ms
    window_ms = 39_900 + slow_queue_last() + 3
    assert slow["utilisation"] == pytest.approx(400 * 5.0 / window_ms)
    assert slow["queue_growth"] == "not_growing"
    assert fast["queue_growth"] == "growing"
    # 2 ms per arrival at 20/s = 40 ms/s = 2400 ms/min
    assert fast["queue_slope_ms_per_min"] == pytest.approx(2400, rel=0.02)
    assert slow["stable"] and not fast["stable"]
    assert any("queue growing" in r for r in fast["not_stable_because"])
    assert any("queue P99 exceeds" in r for r in fast["not_stable_because"])
    assert cap["stable_max_qps"] == 10.0 and cap["stable_cell"].startswith("poisson10")

    v = _verdicts(result)
    assert v["cap.stable_max_qps"]["status"] == "pass"
    assert v["cap.queue_growth"]["status"] == "fail"
    assert "keeps growing" in v["cap.queue_growth"]["reason"]
    assert v["cap.queue_p99"]["status"] == "fail"
    assert v["cap.reject_rate"]["status"] == "pass"
    assert v["cap.utilisation"]["status"] == "not_evaluated"  # not configured…
    assert v["cap.utilisation"]["observed"] == pytest.approx(fast["utilisation"])  # …but seen


def slow_queue_last() -> float:
    return 5.0 + (399 % 7) * 0.1


def test_stable_max_qps_needs_the_window_and_the_target(tmp_path: Path) -> None:
    run_dir = _sweep(tmp_path / "run")
    v = _verdicts(analyze(run_dir, rules_path=_rules(tmp_path, min_stable_qps=15)))
    assert v["cap.stable_max_qps"]["status"] == "fail"  # 20/s was held, and it grows
    assert v["cap.stable_max_qps"]["observed"] == 10.0
    # a 60 s window: neither rate was held that long, so nothing is stable
    result = analyze(run_dir, rules_path=_rules(tmp_path, min_stable_qps=8, window_s=60))
    assert result.document["capacity"]["stable_max_qps"] is None
    v = _verdicts(result)["cap.stable_max_qps"]
    assert v["status"] == "inconclusive" and "held for 60 s" in v["reason"]
    util = _verdicts(analyze(run_dir, rules_path=_rules(tmp_path, max_utilisation=0.05)))
    assert util["cap.utilisation"]["status"] == "fail"  # 20/s keeps the device ~10% busy


def test_no_open_loop_cell_no_section(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path / "run")
    b.add(request("r0", t0=0))
    result = analyze(b.write(), rules_path=_rules(tmp_path))
    assert result.document["capacity"] is None
    v = _verdicts(result)
    assert v["cap.queue_growth"]["status"] == "not_evaluated"
    assert v["cap.stable_max_qps"]["status"] == "not_evaluated"
