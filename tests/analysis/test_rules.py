"""The rules file (analysis.judge.rules): the default validates, its JSON Schema is current,
and a bad file names the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from analysis.errors import RulesError
from analysis.judge.rules import (
    DEFAULT_RULES,
    CellSelector,
    load_rules,
    parse_rules,
    rules_json_schema,
)
from analysis.tables.cells import CellKey

SCHEMA_FILE = DEFAULT_RULES.parent / "rules.schema.json"


def _default() -> dict[str, Any]:
    data = yaml.safe_load(DEFAULT_RULES.read_text())
    assert isinstance(data, dict)
    return data


def test_default_rules_are_valid_and_cover_section_14() -> None:
    rules, _ = load_rules()
    kinds = {r.kind for r in rules.rules}
    assert kinds == {
        "golden",
        "crosstalk",
        "error_output",
        "nonfinite",
        "token_count_mismatch",
        "error_rate",
        "regression",
        "optimization",
        "throughput_gain",
        "batch",
        "goodput",
        "capacity",
        "device_limits",
        "leaks",
        "boundary_policy",
    }
    refactor = next(r for r in rules.rules if r.id == "refactor")
    assert refactor.kind == "regression"
    assert {(m.metric, m.statistic, m.max_regression_pct) for m in refactor.metrics} == {
        ("ttft_ms", "p50", 3),
        ("ttft_ms", "p99", 5),
        ("tpot_ms", "p50", 3),
        ("tpot_ms", "p99", 5),
    }


def test_json_schema_file_is_current_and_validates_the_default() -> None:
    schema = json.loads(SCHEMA_FILE.read_text())
    assert schema == rules_json_schema(), "regenerate: calculet-load analyze --rules-schema"
    jsonschema.validate(_default(), schema)


def _rule(data: dict[str, Any], rid: str) -> dict[str, Any]:
    rule: dict[str, Any] = next(r for r in data["rules"] if r["id"] == rid)
    return rule


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["rules"][4]["metrics"][1].update(max_regression_pct=-1),
         "rules[4](refactor).metrics[1].max_regression_pct: Input should be greater"),
        (lambda d: d["rules"][4]["metrics"][0].update(metric="ttfx_ms"),
         "rules[4](refactor).metrics[0].metric: unknown metric 'ttfx_ms'"),
        (lambda d: d["rules"][4]["metrics"][0].update(statistic="p100"),
         "rules[4](refactor).metrics[0].statistic: use 'mean' or 'pNN'"),
        (lambda d: d["rules"][0].update(kind="nope"), "rules[0](golden).kind: Input tag 'nope'"),
        (lambda d: d["rules"][1].update(id="golden"), "id 'golden' appears twice"),
        (lambda d: d["infrastructure"].update(max_saturated_fraction="x"),
         "infrastructure.max_saturated_fraction: Input should be a valid number"),
        (lambda d: d.update(schema="calculet-acceptance-rules/v2"), "schema: calculet-acceptance"
         "-rules/v2 is newer than this calculet-load reads"),
        (lambda d: d["rules"][5].update(enabled=True), "rules[5](optimization): target.names"),
        (lambda d: d["rules"][5].update(typo=1), "rules[5](optimization).typo: Extra inputs"),
        (lambda d: d.pop("schema"), "x.yaml: schema: required field missing"),
        (lambda d: _rule(d, "goodput").update(min_share=1.5),
         "rules[10](goodput).min_share: Input should be less than or equal to 1"),
        (lambda d: _rule(d, "capacity").update(goodput={"min_share": 0.9}),
         "rules[11](capacity).goodput: set max_ttft_ms or max_tpot_ms"),
        (lambda d: _rule(d, "capacity").update(goodput={"max_ttft_ms": 500}),
         "rules[11](capacity).goodput.min_share: required field missing"),
    ],
)  # fmt: skip
def test_a_bad_rules_file_names_the_field(edit: Any, message: str) -> None:
    data = _default()
    edit(data)
    with pytest.raises(RulesError) as err:
        parse_rules(data, "x.yaml")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(RulesError, match=r"cannot read the rules file"):
        load_rules(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [\n")
    with pytest.raises(RulesError, match=r"bad\.yaml: line 2 invalid YAML"):
        load_rules(bad)


def test_cell_selector() -> None:
    key = CellKey("golden-short", 1, "closed", True)
    assert CellSelector().matches(key)
    assert CellSelector(names=["golden*"], concurrency=[1]).matches(key)
    assert not CellSelector(exclude=["golden*"]).matches(key)
    assert not CellSelector(min_concurrency=2).matches(key)
    assert not CellSelector(min_concurrency=1).matches(CellKey("x", None, "poisson", True))
    assert CellSelector(arrival=["poisson"]).matches(CellKey("x", None, "poisson", True))
    assert not CellSelector(stream=False).matches(key)
