"""Spec §14.1 from records: cross-talk under concurrency (each copy against the same
request sent alone) and error responses that carry output (analysis.judge.crosstalk,
analysis.judge.correctness `error_output`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.analyze import analyze
from calculet_load.schema.crosstalk import Sent, compare
from tests.support.runs import MS, RunBuilder, request

RULES = [
    {"id": "no_crosstalk", "kind": "crosstalk", "cells": ["crosstalk:*"]},
    {"id": "no_error_output", "kind": "error_output", "max_count": 0},
]


def _rules(tmp_path: Path) -> str:
    path = tmp_path / "rules.yaml"
    doc = {"schema": "calculet-acceptance-rules/v1", "rules": RULES}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _verdicts(result: Any) -> dict[str, dict[str, Any]]:
    return {v["rule"]: v for v in result.document["verdicts"]}


def _crosstalk_run(root: Path, *, leak: str | None = None, ref_error: bool = False) -> str:
    """Two cases, each once alone and four times beside the other case (closed loop at
    concurrency 4). `leak`: that copy generated other tokens than its reference."""
    b = RunBuilder(root)
    t = 0
    for case in ("short", "medium"):
        cell = f"crosstalk:{case}"
        b.add(
            request(f"ref-{case}", t0=t, cell=cell, concurrency=1, arrival="single",
                    token_hash=f"h-{case}", sample=case,
                    error="http_5xx" if ref_error and case == "short" else None)
        )  # fmt: skip
        t += 100 * MS
    for k in range(4):
        for case in ("short", "medium"):
            rid = f"copy-{case}-{k}"
            b.add(
                request(rid, t0=t, cell=f"crosstalk:{case}", concurrency=4, arrival="closed",
                        token_hash="h-other" if rid == leak else f"h-{case}", sample=case)
            )  # fmt: skip
        t += 100 * MS
    return b.write()


def test_copies_that_match_their_reference_pass(tmp_path: Path) -> None:
    result = analyze(_crosstalk_run(tmp_path / "run"), rules_path=_rules(tmp_path))
    v = _verdicts(result)["no_crosstalk"]
    assert (v["status"], v["observed"], v["n"]) == ("pass", 0, 8)
    assert "up to 4" in v["reason"] and "2 references" in v["reason"]
    assert result.exit_code == 0


def test_a_copy_that_differs_fails_naming_both_requests_and_the_concurrency(
    tmp_path: Path,
) -> None:
    result = analyze(
        _crosstalk_run(tmp_path / "run", leak="copy-medium-2"), rules_path=_rules(tmp_path)
    )
    v = _verdicts(result)["no_crosstalk"]
    assert (v["status"], v["observed"], v["n"]) == ("fail", 1, 8)
    assert "copy-medium-2 (closed, concurrency 4)" in v["reason"]
    assert "its reference ref-medium sent alone (crosstalk:medium)" in v["reason"]
    assert v["details"] == [
        {"request_id": "copy-medium-2", "reference_id": "ref-medium", "cell": "crosstalk:medium",
         "concurrency": 4, "arrival": "closed", "burst_id": None}
    ]  # fmt: skip
    assert result.exit_code == 1


def test_without_a_reference_the_rule_is_inconclusive_and_without_cells_not_evaluated(
    tmp_path: Path,
) -> None:
    result = analyze(_crosstalk_run(tmp_path / "run", ref_error=True), rules_path=_rules(tmp_path))
    v = _verdicts(result)["no_crosstalk"]
    assert v["status"] == "inconclusive" and "no reference for crosstalk:short" in v["reason"]
    assert v["n"] == 4  # the medium copies were compared
    plain = RunBuilder(tmp_path / "plain").add(request("a", t0=0)).write()
    v = _verdicts(analyze(plain, rules_path=_rules(tmp_path)))["no_crosstalk"]
    assert v["status"] == "not_evaluated" and v["reason"].startswith("no data")


@pytest.mark.parametrize(("chars", "status", "code"), [(None, "pass", 0), (12, "fail", 1)])
def test_an_error_response_with_output_fails(
    tmp_path: Path, chars: int | None, status: str, code: int
) -> None:
    b = RunBuilder(tmp_path / "run")
    b.add(request("ok", t0=0))
    b.add(request("bad", t0=MS, error="server_error_event", ext={"error_output_chars": chars}))
    result = analyze(b.write(), rules_path=_rules(tmp_path))
    v = _verdicts(result)["no_error_output"]
    assert (v["status"], v["observed"], v["n"]) == (status, 0 if chars is None else 1, 2)
    if chars:
        assert "uninitialized output" in v["reason"] and "(first bad)" in v["reason"]
    assert result.exit_code == code


def test_compare_pairs_each_copy_with_its_cells_first_good_reference() -> None:
    rows = [
        Sent("r0", "crosstalk:a", "single", 1, None, ok=False),  # failed: not a reference
        Sent("r1", "crosstalk:a", "single", 1, "A", ok=True),
        Sent("r2", "crosstalk:a", "single", 1, "A2", ok=True),  # a second alone: ignored
        Sent("c1", "crosstalk:a", "burst", 4, "A", ok=True, burst_id="b0"),
        Sent("c2", "crosstalk:a", "burst", 4, "X", ok=True, burst_id="b0"),
        Sent("c3", "crosstalk:a", "burst", 4, None, ok=False),
        Sent("c4", "crosstalk:b", "closed", 4, "B", ok=True),  # b has no reference
    ]
    got = compare(rows)
    assert (got.compared, got.failed, got.references) == (2, 1, {"crosstalk:a": "r1"})
    assert [(d.request_id, d.reference_id, d.burst_id) for d in got.differences] == [
        ("c2", "r1", "b0")
    ]
    assert got.without_reference == ["crosstalk:b"]
