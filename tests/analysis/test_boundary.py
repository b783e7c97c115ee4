"""Boundary cells (spec §6.1, analysis.judge.boundary): prompt + output over the 40960 context,
judged only by the declared overflow policy under the default rules, one verdict per
cell, and kept out of the error-rate rule and the performance statistics."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from analysis.analyze import analyze, write_outputs
from analysis.judge.rules import DEFAULT_RULES
from analysis.report import write_report
from calculet_load.schema.records import RequestRecord, Result
from tests.support.runs import MS, RunBuilder, request

BOUNDARY = "boundary-p40959-o32"
VERDICT = f"boundary_policy.{BOUNDARY}"


def _edge(
    rid: str,
    t0: int,
    *,
    error: str | None,
    status: int,
    code: str | None = None,
    output: int = 0,
    finish: str | None = None,
    requested: int = 32,
    ext: dict[str, Any] | None = None,
) -> RequestRecord:
    """A request of the boundary cell: prompt 40959 + max_tokens 32 > 40960."""
    rec = request(
        rid, t0=t0, n=max(output, 1), cell=BOUNDARY, arrival="single", error=error,
        prompt_tokens=40959, http_status=status, ext=ext,
    )  # fmt: skip
    workload = dataclasses.replace(
        rec.workload, requested_output_tokens=requested, actual_output_tokens=output
    )
    result = Result(status, finish, None if error else "h", code if error else None)
    return dataclasses.replace(rec, workload=workload, result=result)


def _run(root: Path, *edges: RequestRecord) -> str:
    """Ten clean requests of a performance cell, then the boundary cell's requests."""
    b = RunBuilder(root)
    for i in range(10):
        b.add(request(f"ok{i}", t0=i * 200 * MS, cell="single-p16-o5", arrival="single"))
    for rec in edges:
        b.add(rec)
    return b.complete_index().write()


def _rules(tmp_path: Path, **boundary: Any) -> str:
    """The default rules, the boundary_policy rule changed by `boundary`."""
    doc = yaml.safe_load(DEFAULT_RULES.read_text())
    rule = next(r for r in doc["rules"] if r["kind"] == "boundary_policy")
    rule.update(boundary)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _verdicts(result: Any) -> dict[str, dict[str, Any]]:
    return {v["rule"]: v for v in result.document["verdicts"]}


T = 5_000 * MS  # the boundary requests come after the performance cell's


def test_refused_as_declared_passes_and_stays_out_of_the_other_rules(tmp_path: Path) -> None:
    # the simulator's refusal: HTTP 400, error body type context_length_exceeded
    edges = [
        _edge(f"b{i}", T + i * MS, error="http_4xx", status=400, code="context_length_exceeded")
        for i in range(3)
    ]
    run = _run(tmp_path / "run", *edges)
    result = analyze(run)  # the default rules, as `calculet-load accept` uses them
    v = _verdicts(result)
    assert result.exit_code == 0, [x for x in v.values() if x["status"] == "fail"]
    edge = v[VERDICT]
    assert edge["status"] == "pass" and edge["class"] == "correctness"
    assert (edge["observed"], edge["n"]) == (1.0, 3)
    assert edge["threshold"] == "reject: HTTP 400, error class http_4xx"
    assert "3 of 3 requests (3 over the context) followed the policy" in edge["reason"]
    # the refusals are not errors of the error-rate rule, nor in the statistics
    assert v["error_rate"]["status"] == "pass"
    assert {d["cell"].split("|")[0] for d in v["error_rate"]["details"]} == {"single-p16-o5"}
    assert BOUNDARY not in set(result.summary.column("cell_name").to_pylist())
    rows = {c["cell"].split("|")[0]: c for c in result.document["cells"]}
    assert rows[BOUNDARY]["boundary"] is True and rows[BOUNDARY]["records"] == 3
    assert rows[BOUNDARY]["errors_by_class"] == {"http_4xx": 3}
    assert rows["single-p16-o5"]["boundary"] is False
    (cell,) = result.document["boundary"]["cells"]
    assert cell["status"] == "pass" and cell["http_status"] == {"400": 3}
    assert cell["error_code"] == {"context_length_exceeded": 3}

    # the report shows the boundary cell in its own table, with its policy verdict
    write_outputs(result, run)
    html = Path(write_report(run)).read_text()
    table = html[html.index('data-table="boundary"') :]
    table = table[: table.index("</table>")]
    assert BOUNDARY in table and '<tr class="pass">' in table
    assert "single-p16-o5" not in table


@pytest.mark.parametrize(
    ("error", "status", "problem", "advice"),
    [
        ("http_5xx", 500, "server_failed", "failed instead of refusing"),
        ("server_error_event", 200, "server_failed", "failed instead of refusing"),
        ("total_timeout", 200, "timeout", "did not answer in time"),
        ("first_byte_timeout", 200, "timeout", "did not answer in time"),
        ("connection_reset", 200, "failed", "ext.error_detail"),
        ("http_4xx", 413, "other_refusal", "not as the rule declares"),
    ],
)
def test_another_outcome_than_the_refusal_fails(
    tmp_path: Path, error: str, status: int, problem: str, advice: str
) -> None:
    ok = [_edge(f"b{i}", T + i * MS, error="http_4xx", status=400) for i in range(2)]
    bad = _edge("bad", T + 2 * MS, error=error, status=status)
    result = analyze(_run(tmp_path / "run", *ok, bad))
    v = _verdicts(result)
    assert result.exit_code == 1
    edge = v[VERDICT]
    assert edge["status"] == "fail" and edge["observed"] == pytest.approx(2 / 3) and edge["n"] == 3
    assert f"first bad: {problem}" in edge["reason"] and advice in edge["reason"]
    assert [(d["request_id"], d["problem"]) for d in edge["details"]] == [("bad", problem)]
    assert v["error_rate"]["status"] == "pass"  # failed only by the boundary rule


def test_accepted_and_run_past_the_context_fails_the_reject_policy(tmp_path: Path) -> None:
    # 40959 prompt tokens + 32 generated: 40991 > 40960
    served = _edge("long", T, error=None, status=200, output=32, finish="length")
    result = analyze(_run(tmp_path / "run", served))
    edge = _verdicts(result)[VERDICT]
    assert result.exit_code == 1 and edge["status"] == "fail"
    assert "first long: past_context" in edge["reason"] and "not enforced" in edge["reason"]
    (row,) = result.document["boundary"]["cells"]
    assert (row["accepted"], row["max_output_tokens"]) == (1, 32)


def test_an_error_code_other_than_the_declared_one_fails(tmp_path: Path) -> None:
    edges = [
        _edge("b0", T, error="http_4xx", status=400, code="context_length_exceeded"),
        _edge("b1", T + MS, error="http_4xx", status=400, code="invalid_length"),
    ]
    rules = _rules(
        tmp_path,
        reject={"http_status": [400], "error_class": ["http_4xx"],
                "error_code": ["context_length_exceeded"]},
    )  # fmt: skip
    edge = _verdicts(analyze(_run(tmp_path / "run", *edges), rules_path=rules))[VERDICT]
    assert edge["status"] == "fail" and "first b1: other_refusal" in edge["reason"]
    assert edge["threshold"].endswith("error code context_length_exceeded")


def test_truncate_policy_passes_accepted_truncated_outputs(tmp_path: Path) -> None:
    # 40959 + 1 = 40960: the output was cut at the context, finish reason "length"
    edges = [
        _edge(f"b{i}", T + i * 100 * MS, error=None, status=200, output=1, finish="length")
        for i in range(3)
    ]
    run = _run(tmp_path / "run", *edges)
    result = analyze(run, rules_path=_rules(tmp_path, policy="truncate"))
    v = _verdicts(result)
    assert result.exit_code == 0, [x for x in v.values() if x["status"] == "fail"]
    edge = v[VERDICT]
    assert edge["status"] == "pass" and (edge["observed"], edge["n"]) == (1.0, 3)
    assert edge["threshold"] == "truncate: finish reason length, prompt + output ≤ 40960"
    (row,) = result.document["boundary"]["cells"]
    assert (row["accepted"], row["max_output_tokens"], row["finish_reason"]) == (
        3, 1, {"length": 3},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("edge", "problem"),
    [
        (dict(error=None, status=200, output=2, finish="length"), "past_context"),
        (dict(error=None, status=200, output=1, finish="stop"), "finish_reason"),
        (dict(error="http_4xx", status=400), "refused"),
        # NaN/Inf in a boundary response fails this rule (no_nonfinite leaves it alone)
        (dict(error=None, status=200, output=1, finish="length",
              ext={"nonfinite_field": True}), "nonfinite"),
    ],
)  # fmt: skip
def test_truncate_policy_fails_what_is_not_a_truncation(
    tmp_path: Path, edge: dict[str, Any], problem: str
) -> None:
    run = _run(tmp_path / "run", _edge("b0", T, **edge))
    result = analyze(run, rules_path=_rules(tmp_path, policy="truncate"))
    verdicts = _verdicts(result)
    v = verdicts[VERDICT]
    assert result.exit_code == 1 and v["status"] == "fail"
    assert f"first b0: {problem}" in v["reason"]
    assert [x["rule"] for x in verdicts.values() if x["status"] == "fail"] == [VERDICT]


def test_without_boundary_cells_the_rule_is_not_evaluated(tmp_path: Path) -> None:
    result = analyze(_run(tmp_path / "run"))
    assert result.exit_code == 0
    assert _verdicts(result)["boundary_policy"]["status"] == "not_evaluated"
    assert result.document["boundary"] is None


def test_a_disabled_rule_leaves_boundary_cells_unjudged_not_errors(tmp_path: Path) -> None:
    bad = _edge("bad", T, error="http_5xx", status=500)
    result = analyze(_run(tmp_path / "run", bad), rules_path=_rules(tmp_path, enabled=False))
    v = _verdicts(result)
    assert result.exit_code == 0
    assert v["boundary_policy"]["status"] == "not_evaluated"
    assert v["error_rate"]["status"] == "pass"
    (row,) = result.document["boundary"]["cells"]
    assert row["status"] == "not_evaluated" and row["problems"] == {"server_failed": 1}


@pytest.mark.parametrize(
    ("edge", "problem"),
    [
        (dict(error=None, status=200, output=1, finish="length"), None),
        (dict(error=None, status=200, output=2, finish="length"), "over_requested"),
        (dict(error="http_4xx", status=400), "fits_failed"),
    ],
)
def test_a_request_of_a_boundary_cell_that_fits_the_context_must_be_served(
    tmp_path: Path, edge: dict[str, Any], problem: str | None
) -> None:
    # 40959 + max_tokens 1 = 40960: fits, whatever the overflow policy
    run = _run(tmp_path / "run", _edge("b0", T, requested=1, **edge))
    v = _verdicts(analyze(run))[VERDICT]
    assert v["status"] == ("pass" if problem is None else "fail")
    assert "(0 over the context)" in v["reason"]
    if problem is not None:
        assert f"first b0: {problem}" in v["reason"]
