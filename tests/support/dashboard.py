"""The Grafana dashboard as data: its panels, its PromQL, and the metric names it reads."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "calculet-dashboard.json"

# PromQL functions and aggregations the dashboard may call; any other `name(` is a typo
FUNCTIONS = {
    "abs", "avg", "clamp_min", "count", "delta", "histogram_quantile", "increase", "irate",
    "max", "min", "quantile", "rate", "sum", "topk", "label_values",
}  # fmt: skip
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and"}
_KEYWORDS |= {"or", "unless", "offset", "inf", "nan"}


def load() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def expressions(dash: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and template-variable queries."""
    out = [t["expr"] for p in panels(dash) for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        out.append(query["query"] if isinstance(query, dict) else str(query or ""))
    return [x for x in out if x]


def metric_names(expr: str) -> set[str]:
    """The series names an expression reads (label matchers, ranges, grouping lists,
    strings, numbers, functions and keywords removed). Raises on an unknown function."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    s = re.sub(r"\{[^{}]*\}", "", s)
    s = re.sub(r"\[[^\[\]]*\]", "", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", "", s)
    s = re.sub(r"^\s*label_values\(([^,()]+),[^()]*\)\s*$", r"\1", s)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        token = m.group(0)
        if s[m.end() :].lstrip().startswith("("):
            if token not in FUNCTIONS:
                raise ValueError(f"unknown PromQL function {token!r} in {expr!r}")
            continue
        if token.lower() not in _KEYWORDS:
            names.add(token)
    return names


def referenced_series(dash: dict[str, Any]) -> set[str]:
    return {n for e in expressions(dash) for n in metric_names(e)}
