"""Rule kinds beyond the default gates (analysis.judge.comparisons, analysis.judge.limits):
optimization targets, throughput gains, SLOs, capacity and device limits."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.analyze import analyze
from tests.support.runs import MS, RunBuilder, device_row, request

N = 60


def _run(
    root: Path,
    *,
    tpot_ms: float = 10.0,
    spacing_ms: int = 200,
    cells: tuple[str, ...] = ("target", "other"),
    rejected: int = 0,
    temps: tuple[float, ...] = (),
) -> str:
    b = RunBuilder(root)
    t = 0
    for cell in cells:
        for i in range(N):
            tpot = int((tpot_ms if cell == "target" else 10.0) * MS) + i * 1000
            err = "http_4xx" if i < rejected else None
            b.add(
                request(
                    f"{cell}{i}",
                    t0=t,
                    tpot=tpot,
                    cell=cell,
                    error=err,
                    http_status=429 if err else None,
                ),
                tpot=tpot,
            )
            t += spacing_ms * MS
    if temps:
        b.trace("device", [device_row(k * 1000 * MS, (x, x - 1)) for k, x in enumerate(temps)])
    return b.write()


def _rules(tmp_path: Path, *rules: dict[str, Any]) -> str:
    path = tmp_path / f"rules-{len(list(tmp_path.glob('rules-*')))}.yaml"
    doc = {"schema": "calculet-acceptance-rules/v1", "rules": list(rules)}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _verdicts(result: Any) -> dict[str, dict[str, Any]]:
    return {v["rule"]: v for v in result.document["verdicts"]}


OPT = {
    "id": "opt",
    "kind": "optimization",
    "target": {"names": ["target"]},
    "target_metrics": [{"metric": "tpot_ms", "statistic": "p50", "min_improvement_pct": 8}],
    "non_target_metrics": [{"metric": "tpot_ms", "statistic": "p50", "max_regression_pct": 5}],
}


def test_optimization_target_reached(tmp_path: Path) -> None:
    base = _run(tmp_path / "base", tpot_ms=13.0)
    cand = _run(tmp_path / "cand", tpot_ms=10.0)  # −23% in the target cell
    result = analyze(cand, baseline=base, rules_path=_rules(tmp_path, OPT))
    v = _verdicts(result)
    assert v["opt.target"]["status"] == "pass"
    assert v["opt.target"]["observed"] == pytest.approx(-23.1, abs=0.5)
    assert v["opt.non_target"]["status"] == "pass"  # the other cell did not move
    assert result.exit_code == 0


def test_optimization_target_missed(tmp_path: Path) -> None:
    base = _run(tmp_path / "base", tpot_ms=13.0)
    cand = _run(tmp_path / "cand", tpot_ms=12.5)  # only −3.8%: the 8% is ruled out
    result = analyze(cand, baseline=base, rules_path=_rules(tmp_path, OPT))
    v = _verdicts(result)["opt.target"]
    assert v["status"] == "fail"
    assert "does not deliver" in v["reason"]
    assert result.exit_code == 4


def test_throughput_gain(tmp_path: Path) -> None:
    rule = {"id": "tp", "kind": "throughput_gain", "min_gain_pct": 10}
    base = _run(tmp_path / "base", spacing_ms=200, cells=("target",))
    fast = _run(tmp_path / "fast", spacing_ms=100, cells=("target",))  # twice the rate
    result = analyze(fast, baseline=base, rules_path=_rules(tmp_path, rule))
    v = _verdicts(result)["tp"]
    assert v["status"] == "pass" and v["observed"] == pytest.approx(100, abs=5)
    result = analyze(base, baseline=fast, rules_path=_rules(tmp_path, rule))
    assert _verdicts(result)["tp"]["status"] == "fail"
    assert result.exit_code == 4
    unset = {"id": "tp", "kind": "throughput_gain"}
    result = analyze(fast, baseline=base, rules_path=_rules(tmp_path, unset))
    assert _verdicts(result)["tp"]["status"] == "not_evaluated"


def test_throughput_gain_near_its_target_is_inconclusive(tmp_path: Path) -> None:
    """The gain has an interval (batch means), so a gain near the target
    is INCONCLUSIVE, not a pass or a fail on a point estimate."""
    rule = {"id": "tp", "kind": "throughput_gain", "min_gain_pct": 10}
    base = _run(tmp_path / "base", spacing_ms=200, cells=("target",))
    near = _run(tmp_path / "near", spacing_ms=182, cells=("target",))  # about +10%
    result = analyze(near, baseline=base, rules_path=_rules(tmp_path, rule))
    v = _verdicts(result)["tp"]
    assert v["status"] == "inconclusive", v["reason"]
    lo, hi = v["details"][0]["ci_pct"]
    assert lo < 10 < hi and lo < v["observed"] < hi
    assert "straddles the +10% target" in v["reason"]
    assert v["details"][0]["method"].startswith("batch means")
    assert result.exit_code == 0  # inconclusive fails only with fail_on_inconclusive


def test_slo(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "run", tpot_ms=10.0, cells=("target",))

    def status(statistic: str, max_ms: float) -> str:
        rule = {
            "id": "slo",
            "kind": "slo",
            "metric": "tpot_ms",
            "statistic": statistic,
            "max_ms": max_ms,
        }
        return str(_verdicts(analyze(run_dir, rules_path=_rules(tmp_path, rule)))["slo"]["status"])

    # TPOT 10.000 … 10.059 ms
    assert status("p50", 12.0) == "pass"
    assert status("p50", 9.0) == "fail"
    assert status("p50", 10.03) == "inconclusive"  # the interval straddles the limit
    assert status("p99", 12.0) == "inconclusive"  # 60 values: no upper bound for P99
    assert status("mean", 12.0) == "pass"


def test_capacity_reject_rate(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "run", cells=("target",), rejected=6)  # 10% answered 429
    rule = {
        "id": "cap",
        "kind": "capacity",
        "select": {},
        "max_reject_rate": 0.05,
        "max_queue_p99_ms": 100.0,
    }
    v = _verdicts(analyze(run_dir, rules_path=_rules(tmp_path, rule)))
    assert v["cap.reject_rate"]["status"] == "fail"
    assert v["cap.reject_rate"]["observed"] == pytest.approx(0.1)
    assert v["cap.queue_p99"]["status"] == "not_evaluated"  # no server traces
    assert v["cap.utilisation"]["status"] == "not_evaluated"
    assert v["cap.stable_max_qps"]["status"] == "not_evaluated"


def test_device_limits(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "run", cells=("target",), temps=(50.0, 70.0, 60.0))
    rule = {"id": "dev", "kind": "device_limits", "max_temperature_c": 65.0, "max_power_w": 100.0}
    v = _verdicts(analyze(run_dir, rules_path=_rules(tmp_path, rule)))
    assert v["dev.temperature"]["status"] == "fail" and v["dev.temperature"]["observed"] == 70.0
    assert v["dev.power"]["status"] == "pass" and v["dev.power"]["observed"] == 40.0
    bare = _run(tmp_path / "bare", cells=("target",))
    v = _verdicts(analyze(bare, rules_path=_rules(tmp_path, rule)))
    assert v["dev.temperature"]["status"] == "not_evaluated"
    assert "no data" in v["dev.temperature"]["reason"]


def test_disabled_rules_are_reported_not_evaluated(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "run", cells=("target",))
    rule = {**OPT, "enabled": False, "target": {"names": []}}
    v = _verdicts(analyze(run_dir, rules_path=_rules(tmp_path, rule)))["opt"]
    assert v["status"] == "not_evaluated" and v["reason"].startswith("disabled")


def test_the_reports_throughput_comparison_has_an_interval(tmp_path: Path) -> None:
    """The paired comparison's throughput table: the gain with its
    interval, a win only when the interval excludes 0."""
    from analysis.analyze import write_outputs
    from analysis.report import build_view, render
    from tests.analysis.test_report import Page

    base = _run(tmp_path / "base", spacing_ms=200, cells=("target",))
    fast = _run(tmp_path / "fast", spacing_ms=150, cells=("target",))
    for run, baseline in ((base, None), (fast, base)):
        write_outputs(analyze(run, baseline=baseline), run)
    rows = Page(render(build_view(fast, baseline=base))).tables["throughput-delta"]
    assert len(rows) == 1
    cell, _b, _c, delta, outcome = rows[0]
    assert cell == "target|c1|closed|stream"
    m = re.fullmatch(r"\+([\d.]+)% \[\+?([-\d.]+), \+?([-\d.]+)\]%", delta)
    assert m is not None, delta
    gain, lo, hi = (float(x) for x in m.groups())
    assert 0 < lo < gain < hi and gain == pytest.approx(33.0, abs=1.0)
    assert outcome == "higher (win)"
