"""Goodput (spec §14.3; analysis.stats.goodput, analysis.judge.goodput): which request is
good, the share's interval, the rate over the steady window, the rule's verdicts, the
verdict.json section, and goodput as the capacity rule's criterion."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from scipy import stats as st

from analysis.analyze import analyze
from analysis.stats.goodput import goodput, meets_slos, proportion_ci
from tests.analysis.test_capacity import _sweep
from tests.support.runs import MS, RunBuilder, request

NAN = math.nan


def test_a_good_request_meets_every_objective_it_has() -> None:
    ok = [True, True, True, True, True, False, True, True]
    ttft = [50, 150, 50, 50, NAN, 10, 50, 50]
    tpot = [9, 9, 30, NAN, 9, 9, NAN, NAN]
    tokens = [5, 5, 5, 1, 5, 5, 5, NAN]
    good = meets_slos(ok, ttft, tpot, tokens, max_ttft_ms=100, max_tpot_ms=10)
    # 0 meets both; 1 too slow to start; 2 too slow per token; 3 one token: TTFT alone;
    # 4 no TTFT: not shown good; 5 failed; 6 five tokens, no TPOT: not good; 7 count
    # unknown and no TPOT: not good
    assert good.tolist() == [True, False, False, True, False, False, False, False]
    # an objective that is None is not checked
    assert meets_slos(ok, ttft, tpot, tokens, max_ttft_ms=None, max_tpot_ms=10).tolist() == [
        True, True, False, True, True, False, False, False,
    ]  # fmt: skip
    assert meets_slos(ok, ttft, tpot, tokens, max_ttft_ms=None, max_tpot_ms=None).tolist() == ok


def test_the_share_interval_is_exact_and_covers() -> None:
    assert proportion_ci(0, 10) == (0.0, pytest.approx(1 - 0.025 ** (1 / 10)))
    assert proportion_ci(10, 10) == (pytest.approx(0.025 ** (1 / 10)), 1.0)
    assert proportion_ci(0, 0) == (None, None)
    # scipy's own exact interval agrees
    ref = st.binomtest(37, 50).proportion_ci(0.95, method="exact")
    assert proportion_ci(37, 50) == (pytest.approx(ref.low), pytest.approx(ref.high))
    # coverage over seeded draws at a share near 1 (where a normal interval fails)
    rng = np.random.default_rng(7)
    for p, n in ((0.97, 40), (0.5, 25)):
        hits = 0
        for k in rng.binomial(n, p, size=2000):
            lo, hi = proportion_ci(int(k), n)
            assert lo is not None and hi is not None
            hits += lo <= p <= hi
        assert hits / 2000 >= 0.94  # exact: ≥ 0.95; 2000 draws, s.e. 0.005


def test_the_rate_counts_good_requests_ending_inside_the_window() -> None:
    good = np.array([True, True, False, True])
    end = np.array([0, 5, 6, 20]) * 1_000_000_000
    g = goodput(good, 5, end, (1_000_000_000, 11_000_000_000))
    # 3 good of 5 attempts; inside [1 s, 11 s]: the one ending at 5 s, over 10 s
    assert (g.good, g.attempts, g.share, g.good_in_window) == (3, 5, 0.6, 1)
    assert g.window_s == 10.0 and g.rps == pytest.approx(0.1)
    none = goodput(good, 5, end, None)
    assert none.rps is None and none.share == 0.6


def _run(root: Path) -> str:
    """Cell "a", 10 closed-loop requests 300 ms apart, 5 tokens each: r0..r5 TTFT 50 and
    TPOT 10 ms (good under 100/20 ms), r6 TTFT 150 ms, r7 TPOT 30 ms, r8 failed, r9
    TTFT 150 ms."""
    b = RunBuilder(root)
    for i in range(10):
        ttft = 150 if i in (6, 9) else 50
        tpot = 30 if i == 7 else 10
        b.add(request(f"r{i}", t0=i * 300 * MS, ttft=ttft * MS, tpot=tpot * MS, cell="a",
                      error="http_5xx" if i == 8 else None), tpot=tpot * MS)  # fmt: skip
    return b.write()


def _rules(tmp_path: Path, *rules: dict[str, Any]) -> str:
    path = tmp_path / f"rules-{len(list(tmp_path.glob('rules-*')))}.yaml"
    doc = {"schema": "calculet-acceptance-rules/v1", "analysis": {"steady_trim_fraction": 0.0},
           "rules": list(rules)}  # fmt: skip
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _goodput_rule(**kw: Any) -> dict[str, Any]:
    return {"id": "gp", "kind": "goodput", "max_ttft_ms": 100, "max_tpot_ms": 20, **kw}


def test_the_rule_and_the_section_on_a_known_run(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    result = analyze(run, rules_path=_rules(tmp_path, _goodput_rule(min_share=0.1)))
    (cell,) = result.document["goodput"]["cells"]
    assert cell["cell"] == "a|c1|closed|stream" and cell["rule"] == "gp"
    assert (cell["good"], cell["attempts"]) == (6, 10)
    # steady window (no trim): r0's start to the last success's end, r9's:
    # 9·300 + 150 + 4·10 + 0.1 ms = 2,890.1 ms; r0..r5 end inside it
    assert cell["window_s"] == pytest.approx(2.8901)
    assert cell["good_in_window"] == 6
    assert cell["goodput_rps"] == pytest.approx(6 / 2.8901)
    assert cell["share_lo"] == pytest.approx(st.beta.ppf(0.025, 6, 5))
    v = {x["rule"]: x for x in result.document["verdicts"]}["gp"]
    assert v["status"] == "pass" and v["class"] == "performance" and v["n"] == 10
    # 6 of 10 cannot show 0.99 (fail: the interval lies below it) nor rule out 0.5
    fail = analyze(run, rules_path=_rules(tmp_path, _goodput_rule(min_share=0.99)))
    assert {x["rule"]: x for x in fail.document["verdicts"]}["gp"]["status"] == "fail"
    assert fail.exit_code == 4
    unsure = analyze(run, rules_path=_rules(tmp_path, _goodput_rule(min_share=0.5)))
    assert {x["rule"]: x for x in unsure.document["verdicts"]}["gp"]["status"] == "inconclusive"


def test_not_configured_says_what_to_set_and_a_cell_takes_its_first_rule(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    bare = {"id": "gp", "kind": "goodput"}
    result = analyze(run, rules_path=_rules(tmp_path, bare))
    v = {x["rule"]: x for x in result.document["verdicts"]}["gp"]
    assert v["status"] == "not_evaluated" and "set max_ttft_ms" in v["reason"]
    assert result.document["goodput"] is None
    # SLOs but no gate: reported, not judged; the observed share is in the reason
    seen = analyze(run, rules_path=_rules(tmp_path, _goodput_rule()))
    v = {x["rule"]: x for x in seen.document["verdicts"]}["gp"]
    assert v["status"] == "not_evaluated"
    assert "set min_share" in v["reason"] and "60.0%" in v["reason"]
    # two rules select the cell: the first that sets an SLO gives its goodput
    strict = {"id": "strict", "kind": "goodput", "max_ttft_ms": 40, "select": {"names": ["a"]}}
    bare2 = {**bare, "id": "bare"}
    both = analyze(run, rules_path=_rules(tmp_path, bare2, strict, _goodput_rule()))
    (cell,) = both.document["goodput"]["cells"]
    assert cell["rule"] == "strict" and cell["good"] == 0 and cell["max_tpot_ms"] is None
    assert both.document["goodput"]["rules"] == ["strict", "gp"]


def test_goodput_is_a_criterion_of_the_capacity_rule(tmp_path: Path) -> None:
    run = _sweep(tmp_path / "run")  # TTFT 50 ms, TPOT 10 ms; 20 of poisson20's 400 rejected

    def cap(goodput: dict[str, Any]) -> dict[str, Any]:
        rule = {"id": "cap", "kind": "capacity", "window_s": 15, "goodput": goodput}
        doc: dict[str, Any] = analyze(run, rules_path=_rules(tmp_path, rule)).document
        section: dict[str, Any] = doc["capacity"]
        return section

    met = cap({"max_ttft_ms": 60, "max_tpot_ms": 20, "min_share": 0.99})
    slow, fast = met["points"]
    assert slow["goodput_share"] == 1.0 and slow["goodput_share_lo"] >= 0.99
    assert slow["stable"] and met["stable_max_qps"] == 10.0
    assert fast["goodput_share"] == pytest.approx(380 / 400)
    assert any("goodput share not shown ≥ 0.99 (380/400)" in r for r in fast["not_stable_because"])
    missed = cap({"max_ttft_ms": 40, "min_share": 0.5})
    assert missed["stable_max_qps"] is None
    assert all(any("goodput share" in r for r in p["not_stable_because"]) for p in missed["points"])
    assert missed["criteria"]["goodput"] == {"max_ttft_ms": 40.0, "max_tpot_ms": None,
                                             "min_share": 0.5}  # fmt: skip
