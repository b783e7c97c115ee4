# size: one concept, the rules file: a pydantic model per rule kind and its settings
"""Acceptance rules as data (spec §14): the YAML file `calculet-load analyze` evaluates.

The file is validated by these pydantic models (their JSON Schema: `rules_json_schema`);
an invalid file raises `RulesError` naming the field path (exit 2), and a file of a
newer schema version is refused. `configs/acceptance/default.yaml` holds every §14
threshold one run, or a baseline/candidate pair, can check.

Each rule has an `id`, a `kind` (the handler that evaluates it: RULE_KINDS) and
`enabled`; its class — correctness (exit 1) or performance (exit 4) — follows from the
kind (RULE_CLASS). Cells are chosen by a `CellSelector`.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from analysis.errors import RulesError
from analysis.tables.cells import METRICS, CellKey
from calculet_load.schema.records import SchemaVersionError, check_schema

__all__ = [
    "BOUNDARY_CELLS",
    "DEFAULT_RULES",
    "RULES_SCHEMA",
    "RULE_CLASS",
    "AnalysisSettings",
    "BatchRule",
    "BoundaryPolicyRule",
    "BurstRecoveryRule",
    "CapacityRule",
    "CellSelector",
    "CrosstalkRule",
    "DeviceFaultsRule",
    "DeviceLimitsRule",
    "ErrorRateRule",
    "GoldenRule",
    "GoodputCriterion",
    "GoodputRule",
    "IdleRules",
    "IdleSeries",
    "ImprovementSpec",
    "InfrastructureRules",
    "LeakRule",
    "MaxCountRule",
    "OptimizationRule",
    "RegressionRule",
    "RegressionSpec",
    "RejectExpectation",
    "Rule",
    "RulesFile",
    "SloRule",
    "ThroughputGainRule",
    "TruncateExpectation",
    "load_rules",
    "parse_rules",
    "rules_json_schema",
]

RULES_SCHEMA = "calculet-acceptance-rules/v1"
DEFAULT_RULES = Path(__file__).resolve().parents[2] / "configs" / "acceptance" / "default.yaml"

_STAT = re.compile(r"mean|p(\d+(?:\.\d+)?)")


# The server resources the leak rule may name, with their units (spec §13).
LEAK_SERIES: dict[str, str] = {
    "rss_bytes": "bytes",
    "device_memory_mib": "MiB",
    "leases_unavailable": "leases",
    "kv_allocated_tokens": "tokens",
    "fds": "FDs",
    "threads": "threads",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CellSelector(_Strict):
    """Which cells a rule reads; every given condition must hold (all None: every cell).

    `names`/`exclude` are shell patterns on ext.cell (`golden*`); `concurrency` lists
    closed-loop concurrencies; `arrival` lists arrival shapes."""

    names: list[str] | None = None
    exclude: list[str] | None = None
    concurrency: list[int] | None = None
    min_concurrency: int | None = None
    max_concurrency: int | None = None
    arrival: list[str] | None = None
    stream: bool | None = None

    def matches(self, key: CellKey) -> bool:
        name = key.name or ""
        if self.names is not None and not any(fnmatch.fnmatchcase(name, p) for p in self.names):
            return False
        if self.exclude is not None and any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
            return False
        c = key.concurrency
        if self.concurrency is not None and c not in self.concurrency:
            return False
        if self.min_concurrency is not None and (c is None or c < self.min_concurrency):
            return False
        if self.max_concurrency is not None and (c is None or c > self.max_concurrency):
            return False
        if self.arrival is not None and key.arrival not in self.arrival:
            return False
        return self.stream is None or key.stream == self.stream

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.model_dump(exclude_none=True).items()]
        return ", ".join(parts) or "every cell"


_METRIC_NAMES = tuple(m.name for m in METRICS)


def _known_metric(v: str) -> str:
    if v not in _METRIC_NAMES:
        raise ValueError(f"unknown metric {v!r}; one of {', '.join(_METRIC_NAMES)}")
    return v


class _MetricSpec(_Strict):
    metric: str
    statistic: str = "p50"

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        return _known_metric(v)

    @field_validator("statistic")
    @classmethod
    def _statistic(cls, v: str) -> str:
        m = _STAT.fullmatch(v)
        if m is None or (m.group(1) is not None and not 0 < float(m.group(1)) < 100):
            raise ValueError("use 'mean' or 'pNN' with 0 < NN < 100 (p50, p99, p99.9)")
        return v


class RegressionSpec(_MetricSpec):
    """A statistic that may get worse by at most `max_regression_pct` % of the baseline."""

    max_regression_pct: float = Field(ge=0)


class ImprovementSpec(_MetricSpec):
    """A statistic that must get better by at least `min_improvement_pct` %."""

    min_improvement_pct: float = Field(gt=0)


class _Rule(_Strict):
    id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    enabled: bool = True
    description: str = ""


class GoldenRule(_Rule):
    """Golden set (§14): records whose ext.cell matches `cells` succeed with the reference
    token hash of their prompt (the baseline's golden run, else the run's own majority)."""

    kind: Literal["golden"]
    cells: list[str] = Field(default_factory=lambda: ["golden*"], min_length=1)
    min_pass_rate: float = Field(default=1.0, ge=0, le=1)


class CrosstalkRule(_Rule):
    """§14.1 no cross-talk between requests: in the cells matching `cells` (accept's
    crosstalk step), each greedy request sent under concurrency generated the token hash
    of the same request sent alone in the run."""

    kind: Literal["crosstalk"]
    cells: list[str] = Field(default_factory=lambda: ["crosstalk:*"], min_length=1)


class MaxCountRule(_Rule):
    """At most `max_count` sent records with the flag: `nonfinite` (NaN/Inf in a
    response), `token_count_mismatch` (per-event counts ≠ the server's total beyond the
    declared slack, or a count anomaly) or `error_output`
    (an error response that carried generated output, §14.1)."""

    kind: Literal["nonfinite", "token_count_mismatch", "error_output"]
    max_count: int = Field(default=0, ge=0)


class ErrorRateRule(_Rule):
    """Errors / attempts ≤ max_error_rate in every selected cell (measured + throttled;
    dropped, cut-at-stop and deliberately cancelled requests are not attempts)."""

    kind: Literal["error_rate"]
    select: CellSelector = Field(default_factory=CellSelector)
    max_error_rate: float = Field(default=0.0, ge=0, le=1)


class RegressionRule(_Rule):
    """Baseline vs candidate per matched cell (analysis.stats.compare): REGRESSION fails."""

    kind: Literal["regression"]
    select: CellSelector = Field(default_factory=CellSelector)
    metrics: list[RegressionSpec] = Field(min_length=1)


class OptimizationRule(_Rule):
    """§14 optimization candidate: a target metric improves ≥ its target in the target
    cells, or an end-to-end key metric does; non-target cells regress ≤ their limits."""

    kind: Literal["optimization"]
    target: CellSelector = Field(default_factory=CellSelector)
    target_metrics: list[ImprovementSpec] = Field(min_length=1)
    key_metrics: list[ImprovementSpec] = Field(default_factory=list)
    non_target_metrics: list[RegressionSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _needs_target(self) -> OptimizationRule:
        if self.enabled and not self.target.names:
            raise ValueError("target.names: name the target cells when the rule is enabled")
        return self


class ThroughputGainRule(_Rule):
    """Steady-state output tokens/s of the candidate ≥ baseline · (1 + min_gain_pct/100)
    in every selected cell (ping/pong +10%, batch vs B1 at target concurrency)."""

    kind: Literal["throughput_gain"]
    select: CellSelector = Field(default_factory=CellSelector)
    min_gain_pct: float | None = None


class SloRule(_MetricSpec, _Rule):
    """An absolute limit: the statistic's interval must lie below `max_ms` (pass), or
    wholly above it (fail); otherwise inconclusive."""

    kind: Literal["slo"]
    select: CellSelector = Field(default_factory=CellSelector)
    statistic: str = "p99"
    max_ms: float | None = Field(default=None, gt=0)


class GoodputCriterion(_Strict):
    """Goodput as a capacity criterion: a rate is stable only when the share of its
    requests that succeeded within `max_ttft_ms` and `max_tpot_ms` (analysis.stats.goodput;
    null: that objective unchecked) is shown ≥ `min_share` (its interval's lower bound)."""

    max_ttft_ms: float | None = Field(default=None, gt=0)
    max_tpot_ms: float | None = Field(default=None, gt=0)
    min_share: float = Field(gt=0, le=1)

    @model_validator(mode="after")
    def _an_objective(self) -> GoodputCriterion:
        if self.max_ttft_ms is None and self.max_tpot_ms is None:
            raise ValueError("set max_ttft_ms or max_tpot_ms (or both): goodput needs an SLO")
        return self


class GoodputRule(_Rule):
    """Goodput (spec §14.3, per request): in every selected cell, the requests that
    succeeded with TTFT ≤ `max_ttft_ms` and TPOT ≤ `max_tpot_ms` (analysis.stats.goodput),
    per second of the cell's steady window and as a share of its attempts. The share's
    interval must lie at or above `min_share` (pass), or wholly below it (fail);
    otherwise inconclusive. With both objectives null the rule is not configured; with
    `min_share` null the goodput is reported (verdict.json, the report) but not judged.
    Each rule judges the cells it selects by its own SLOs (give cells different SLOs by
    rules whose selectors do not overlap); verdict.json's goodput section shows a cell
    under the first enabled rule that selects it and sets one."""

    kind: Literal["goodput"]
    select: CellSelector = Field(default_factory=CellSelector)
    max_ttft_ms: float | None = Field(default=None, gt=0)
    max_tpot_ms: float | None = Field(default=None, gt=0)
    min_share: float | None = Field(default=None, gt=0, le=1)

    @property
    def configured(self) -> bool:
        return self.max_ttft_ms is not None or self.max_tpot_ms is not None


class CapacityRule(_Rule):
    """§14.3 at the target arrival rate (the selected open-loop cells): server queue
    P99, reject rate (429/503 answers) and device utilisation, each against its SLA;
    the queue-growth test; and the stable max QPS of the run's rate sweep
    (analysis.judge.capacity): the highest rate held for `window_s` whose errors, rejects,
    queue P99 and latency P99 meet the limits with a queue that does not keep growing,
    and, with `goodput`, whose goodput share is shown at or above its minimum."""

    kind: Literal["capacity"]
    select: CellSelector = Field(default_factory=lambda: CellSelector(arrival=["poisson"]))
    max_queue_p99_ms: float | None = Field(default=None, gt=0)
    max_reject_rate: float | None = Field(default=None, ge=0, le=1)
    max_utilisation: float | None = Field(default=None, gt=0)
    window_s: float = Field(default=1800.0, gt=0)
    max_error_rate: float = Field(default=0.0, ge=0, le=1)
    latency_metric: str = "ttft_from_intended_ms"
    max_latency_p99_ms: float | None = Field(default=None, gt=0)
    queue_growth_ms_per_min: float = Field(default=10.0, ge=0)
    min_stable_qps: float | None = Field(default=None, gt=0)
    goodput: GoodputCriterion | None = None

    @field_validator("latency_metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        return _known_metric(v)


class BatchRule(_Rule):
    """§7/§14 batch: at low fill (active lanes ≤ low_fill_ratio · B) the single-request
    TPOT P99 still meets the interactive SLA; the SLA is also what the batch section's
    profile recommendation assumes. `compiled_batch` is B of the calbin under test
    (null: the most active lanes any decode step of steps.jsonl had)."""

    kind: Literal["batch"]
    select: CellSelector = Field(default_factory=CellSelector)
    compiled_batch: int | None = Field(default=None, gt=0)
    max_tpot_p99_ms: float | None = Field(default=None, gt=0)
    low_fill_ratio: float = Field(default=0.5, gt=0, le=1)


class LeakRule(_Rule):
    """§13 leaks: per resource series of server/resources.jsonl, a LEAK (analysis.stats.trend:
    significant Theil–Sen growth at or above `min_slope_per_h`, in the series' unit per
    hour of server time) fails; and, when `idle_baseline`, KV and leases held must be 0
    whenever no sequence is active or queued."""

    kind: Literal["leaks"]
    min_slope_per_h: dict[str, float] = Field(default_factory=dict)
    alpha: float = Field(default=0.01, gt=0, lt=1)
    warmup_s: float | None = Field(default=None, ge=0)
    bin_s: float | None = Field(default=None, gt=0)
    idle_baseline: bool = True

    @field_validator("min_slope_per_h")
    @classmethod
    def _series(cls, v: dict[str, float]) -> dict[str, float]:
        for name, gate in v.items():
            if name not in LEAK_SERIES:
                raise ValueError(f"unknown resource {name!r}; one of {', '.join(LEAK_SERIES)}")
            if gate < 0:
                raise ValueError(f"{name}: a growth-rate gate must be >= 0")
        return v


class RejectExpectation(_Strict):
    """How a refused boundary request reads in its record: `result.http_status` one of
    `http_status`, `ext.error_class` one of `error_class`, and (unless null)
    `result.error_code` (the error body's type) one of `error_code`."""

    http_status: list[int] = Field(default_factory=lambda: [400], min_length=1)
    error_class: list[str] = Field(default_factory=lambda: ["http_4xx"], min_length=1)
    error_code: list[str] | None = None


class TruncateExpectation(_Strict):
    """How an accepted, truncated boundary request reads: a success whose
    `result.finish_reason` is one of `finish_reason` and whose output fits the context
    (prompt + output tokens ≤ max_context)."""

    finish_reason: list[str] = Field(default_factory=lambda: ["length"], min_length=1)


class BoundaryPolicyRule(_Rule):
    """Spec §6.1 boundary cells (prompt + output over the context, `kind: boundary` in
    the matrix): judged only against the target's declared overflow policy, one verdict
    per cell, and kept out of every other rule and of the performance statistics.

    A request whose prompt + requested output exceeds `max_context` follows the policy
    when it is refused as `reject` says (policy `reject`), or served, truncated, as
    `truncate` says (policy `truncate`); a request of the cell that fits the context
    must be served. Anything else — accepted and run past the context, a 5xx, a
    timeout, a reset — fails. Cells are those whose name (ext.cell) matches `cells`."""

    kind: Literal["boundary_policy"]
    cells: list[str] = Field(default_factory=lambda: ["boundary*"], min_length=1)
    policy: Literal["reject", "truncate"] = "reject"
    max_context: int = Field(default=40960, gt=1)
    reject: RejectExpectation = Field(default_factory=RejectExpectation)
    truncate: TruncateExpectation = Field(default_factory=TruncateExpectation)


class DeviceLimitsRule(_Rule):
    """§14 power/temperature within limits, over every device.jsonl row of the run."""

    kind: Literal["device_limits"]
    max_temperature_c: float | None = None
    max_power_w: float | None = Field(default=None, gt=0)


class BurstRecoveryRule(_Rule):
    """§13 candidate/release: after each burst (records sharing an `ext.burst_id`) the
    service recovers within `max_recovery_s` server seconds: every burst request has
    ended and the background requests (not of a burst) that start after it have
    `metric` back at most (1 + `tolerance`) × its median over the `baseline_s` before
    the burst, `settle_requests` of them in a row (analysis.judge.stability)."""

    kind: Literal["burst_recovery"]
    max_recovery_s: float = Field(gt=0)
    metric: str = "ttft_ms"
    baseline_s: float = Field(default=60.0, gt=0)
    tolerance: float = Field(default=0.5, ge=0)
    settle_requests: int = Field(default=3, ge=1)
    min_baseline_requests: int = Field(default=3, ge=1)

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if _known_metric(v) == "itl_ms":
            raise ValueError("itl_ms is per token: use a per-request metric (ttft_ms, e2e_ms)")
        return v


class DeviceFaultsRule(_Rule):
    """§13 release: zero unrecovered device faults. A device fault (runtime_error,
    reset, a state change to recovering/resetting/failed in server_events.jsonl) is
    recovered when the service is ready again (a state change to ready, or a request
    finished after a fault that changed no state) within `max_recovery_s` server
    seconds; at most `max_unrecovered` may not be. With `exclude_injected`, faults while
    a fault was armed (fault_armed .. fault_cleared: the fault matrix's) are left to
    the fault matrix's verdicts (analysis.judge.stability)."""

    kind: Literal["device_faults"]
    max_unrecovered: int = Field(default=0, ge=0)
    max_recovery_s: float = Field(default=300.0, gt=0)
    exclude_injected: bool = True


Rule = Annotated[
    GoldenRule
    | CrosstalkRule
    | MaxCountRule
    | ErrorRateRule
    | RegressionRule
    | OptimizationRule
    | ThroughputGainRule
    | SloRule
    | GoodputRule
    | CapacityRule
    | DeviceLimitsRule
    | BatchRule
    | LeakRule
    | BoundaryPolicyRule
    | BurstRecoveryRule
    | DeviceFaultsRule,
    Field(discriminator="kind"),
]

RULE_CLASS: dict[str, str] = {
    "golden": "correctness",
    "nonfinite": "correctness",
    "token_count_mismatch": "correctness",
    "crosstalk": "correctness",
    "error_output": "correctness",
    "error_rate": "correctness",
    "regression": "performance",
    "optimization": "performance",
    "throughput_gain": "performance",
    "slo": "performance",
    "goodput": "performance",
    "capacity": "performance",
    "device_limits": "performance",
    "batch": "performance",
    "leaks": "correctness",
    "boundary_policy": "correctness",
    "burst_recovery": "correctness",
    "device_faults": "correctness",
}

BOUNDARY_CELLS = ("boundary*",)
"""The names the matrix gives `kind: boundary` cells (calculet_load.workload.matrix): boundary
cells when the rules file has no boundary_policy rule to say otherwise."""


class AnalysisSettings(_Strict):
    """How the summaries are computed. The std/MAD intervals bootstrap at most
    `bootstrap_max_n` values `bootstrap_resamples` times per cell and metric
    (analysis.stats.quantiles.SPREAD_CI_METHOD): that, not the record count, bounds the cost."""

    confidence_level: float = Field(default=0.95, gt=0, lt=1)
    steady_trim_fraction: float = Field(default=0.1, ge=0, lt=0.5)
    fail_on_inconclusive: bool = False
    bootstrap_resamples: int = Field(default=1000, ge=100)
    bootstrap_max_n: int = Field(default=2000, ge=100)


class InfrastructureRules(_Strict):
    """When the measurement itself is not valid (exit 3). A fraction is of the sent
    records (clock: of the successes); None disables that check."""

    require_complete_index: bool = True
    max_saturated_fraction: float | None = Field(default=0.05, ge=0, le=1)
    max_clock_incomplete_fraction: float | None = Field(default=0.01, ge=0, le=1)
    max_network_break_fraction: float | None = Field(default=0.0, ge=0, le=1)
    max_send_lag_p99_ms: float | None = Field(default=10.0, gt=0)


class IdleSeries(_Strict):
    """One device series of §8.2's idle criterion, over the window: its range (max - min)
    and the magnitude of its Theil–Sen slope (unit per minute); None leaves one unchecked."""

    max_range: float | None = Field(default=None, ge=0)
    max_slope_per_min: float | None = Field(default=None, ge=0)


class IdleRules(_Strict):
    """Spec §8.2: idle sampling until temperature, power and frequency are stable. `accept`
    samples the target's chip gauges and waits until, over the last `window_s`, each
    series holds its limits (the rule ids `idle.temperature_c`, `idle.power_w`,
    `idle.frequency_mhz`); after `timeout_s` without that, the run stops with exit 3
    naming the series that did not hold. `--idle-window-s`/`--idle-timeout-s` override
    the two durations."""

    window_s: float = Field(default=300.0, gt=0)  # spec §8.2: 5 minutes
    timeout_s: float = Field(default=1800.0, gt=0)
    temperature_c: IdleSeries = IdleSeries(max_range=0.5, max_slope_per_min=0.1)  # hottest chip
    power_w: IdleSeries = IdleSeries(max_range=1.0, max_slope_per_min=0.2)  # chips summed
    frequency_mhz: IdleSeries = IdleSeries(max_range=0.0, max_slope_per_min=0.0)  # slowest

    @property
    def series(self) -> dict[str, IdleSeries]:
        """The limits of each series, by the name the device sample gives it."""
        return {
            "temperature_c": self.temperature_c,
            "power_w": self.power_w,
            "frequency_mhz": self.frequency_mhz,
        }


class RulesFile(_Strict):
    schema_: str = Field(alias="schema")
    extends: str | None = None  # a rules file beside this one that this one overrides
    analysis: AnalysisSettings = Field(default_factory=AnalysisSettings)
    infrastructure: InfrastructureRules = Field(default_factory=InfrastructureRules)
    idle: IdleRules = Field(default_factory=IdleRules)
    rules: list[Rule] = Field(default_factory=list)

    @field_validator("schema_")
    @classmethod
    def _version(cls, v: str) -> str:
        try:
            check_schema(v, RULES_SCHEMA)
        except SchemaVersionError as exc:
            raise ValueError(str(exc).removeprefix("schema: ")) from None
        return v

    @property
    def boundary_cells(self) -> tuple[str, ...]:
        """Name patterns of the boundary cells: every boundary_policy rule's `cells`,
        enabled or not (a disabled rule leaves them unjudged, never judged as
        performance cells); BOUNDARY_CELLS without such a rule."""
        found = [p for r in self.rules if isinstance(r, BoundaryPolicyRule) for p in r.cells]
        return tuple(dict.fromkeys(found)) or BOUNDARY_CELLS

    @model_validator(mode="after")
    def _unique_ids(self) -> RulesFile:
        seen: set[str] = set()
        for r in self.rules:
            if r.id in seen:
                raise ValueError(f"rules: id {r.id!r} appears twice")
            seen.add(r.id)
        return self


def _where(loc: tuple[Any, ...], data: Any) -> str:
    """A field path with rule ids instead of list positions where possible."""
    parts: list[str] = []
    node = data
    for p in loc:
        if isinstance(p, int) and isinstance(node, list) and 0 <= p < len(node):
            node = node[p]
            rid = node.get("id") if isinstance(node, dict) else None
            parts.append(f"[{p}]" + (f"({rid})" if rid else ""))
            continue
        if isinstance(node, dict) and node.get("kind") == p:
            continue  # a discriminated union's tag (the kind) is not part of the path
        if p == "schema_":
            p = "schema"
        node = node.get(p) if isinstance(node, dict) else None
        parts.append(f".{p}" if parts else str(p))
    return "".join(parts) or "(top level)"


def parse_rules(data: Any, source: str = "rules") -> RulesFile:
    """Validate a parsed rules document; RulesError names the first bad field."""
    if not isinstance(data, dict):
        raise RulesError(f"{source}: top level must be a mapping")
    try:
        return RulesFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = "required field missing" if err["type"] == "missing" else err["msg"]
        msg = msg.removeprefix("Value error, ")
        loc = tuple(err["loc"])
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc = (*loc, "kind")
        raise RulesError(f"{source}: {_where(loc, data)}: {msg}") from None


def _read_yaml(p: Path) -> tuple[Any, str]:
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise RulesError(f"{p}: cannot read the rules file: {exc.strerror}") from None
    try:
        return yaml.safe_load(text), text
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise RulesError(f"{p}:{where} invalid YAML") from None


def _extended(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """`child` over `base`: settings sections key by key; a child rule replaces the base
    rule of its id in place, and a rule of a new id is appended."""
    out = {**base, **child}
    for section in ("analysis", "infrastructure", "idle"):
        if isinstance(base.get(section), dict) and isinstance(child.get(section), dict):
            out[section] = {**base[section], **child[section]}
    rules = list(base.get("rules") or [])
    ids = [r.get("id") if isinstance(r, dict) else None for r in rules]
    for r in child.get("rules") or []:
        rid = r.get("id") if isinstance(r, dict) else None
        if rid is not None and rid in ids:
            rules[ids.index(rid)] = r
        else:
            rules.append(r)
    out["rules"] = rules
    return out


def load_rules(path: str | Path | None = None) -> tuple[RulesFile, str]:
    """The rules of `path` (default: DEFAULT_RULES) and the file's text. A file with
    `extends: NAME` is read over the rules file NAME (beside it; one level), and the text
    returned (what verdict.json hashes) is the base's, then the file's."""
    p = Path(path) if path is not None else DEFAULT_RULES
    data, text = _read_yaml(p)
    base = data.get("extends") if isinstance(data, dict) else None
    if base is not None:
        if not isinstance(base, str) or not base:
            raise RulesError(f"{p}: extends: expected the name of a rules file")
        bp = p.parent / base
        base_data, base_text = _read_yaml(bp)
        if not isinstance(base_data, dict):
            raise RulesError(f"{bp}: top level must be a mapping")
        if base_data.get("extends") is not None:
            raise RulesError(f"{p}: extends: {base} extends another file (one level only)")
        data = _extended(base_data, data)
        text = f"{base_text}\n# --- {p.name}, extending {base} ---\n{text}"
    return parse_rules(data, str(p)), text


def rules_json_schema() -> dict[str, Any]:
    return RulesFile.model_json_schema(by_alias=True)
