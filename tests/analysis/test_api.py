"""The analysis package's public names are pinned, and it never imports Locust or gevent
(DESIGN §1)."""

import subprocess
import sys
from pathlib import Path

from analysis.stats import compare
from analysis.stats import quantiles as stats
from analysis.stats import trend as leaks


def test_public_names_are_pinned() -> None:
    assert stats.__all__ == [
        "BOOTSTRAP_CI_METHOD",
        "MAD_METHOD",
        "MEAN_CI_METHOD",
        "MIN_N_BOOTSTRAP",
        "PERCENTILE_METHOD",
        "QUANTILE_CI_METHOD",
        "RULES_INTERVAL",
        "SPREAD_CI_METHOD",
        "THROUGHPUT_BATCHES",
        "THROUGHPUT_CI_METHOD",
        "THROUGHPUT_METHOD",
        "CellStats",
        "Estimate",
        "FloatArray",
        "PercentileStat",
        "batch_means_ci",
        "finite_values",
        "mad",
        "mean_ci",
        "min_n_for_ci",
        "order_stat_bootstrap_cdf",
        "percentile_name",
        "percentile_warnings",
        "percentiles",
        "quantile",
        "quantile_ci",
        "quantile_rank",
        "spread_ci",
        "steady_throughput",
        "summarize",
        "window_tokens",
    ]
    assert compare.__all__ == [
        "DECISION_RULE",
        "MEAN_DELTA_METHOD",
        "QUANTILE_DELTA_METHOD",
        "THROUGHPUT_DELTA_METHOD",
        "Comparison",
        "Direction",
        "MetricRule",
        "Thresholds",
        "Verdict",
        "compare_cells",
        "compare_mean",
        "compare_quantile",
        "compare_throughput",
        "decide",
        "direction_for",
    ]
    assert leaks.__all__ == [
        "LEAK_METHOD",
        "MIN_BINS",
        "THEIL_SEN_MAX_POINTS",
        "LeakResult",
        "LeakStatus",
        "TrendTest",
        "bin_means",
        "detect_leak",
        "mann_kendall_hamed_rao",
        "theil_sen",
    ]
    for module in (stats, compare, leaks):
        assert all(hasattr(module, name) for name in module.__all__)


def test_importing_the_statistics_layer_imports_neither_locust_nor_gevent() -> None:
    code = (
        "import sys, analysis.stats.quantiles, analysis.stats.compare, analysis.stats.trend\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('locust', 'gevent'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2]
    )


PIPELINE_API = {
    "analyze": ["OUTPUTS", "Analysis", "analyze", "write_outputs"],
    "judge.batch": [
        "BATCH_METHOD",
        "HANDLERS",
        "BatchAnalysis",
        "BatchCell",
        "LaneLevel",
        "analyze_batch",
        "batch_section",
        "cached_batch",
    ],
    "judge.boundary": [
        "HANDLERS",
        "BoundaryCell",
        "analyze_boundary",
        "boundary_section",
        "cached_boundary",
    ],
    "judge.capacity": [
        "CAPACITY_METHOD",
        "HANDLERS",
        "OPEN_LOOP",
        "CapacityAnalysis",
        "RatePoint",
        "analyze_capacity",
        "cached_capacity",
        "capacity_section",
    ],
    "tables.cells": [
        "CELL_FIELDS",
        "ERROR_GROUPS",
        "METRICS",
        "SUMMARY_PARTITIONS",
        "CellData",
        "CellKey",
        "CellSummary",
        "Metric",
        "client_wall_span",
        "group_cells",
        "summarize_cells",
    ],
    "cli": ["add_arguments", "add_import_legacy", "analyze_run", "run", "run_import_legacy"],
    "judge.comparisons": ["HANDLERS", "NO_BASELINE"],
    "judge.correctness": ["HANDLERS"],
    "errors": ["AnalysisError", "ArtifactError", "ExitCode", "RulesError"],
    "judge.evaluate": ["HANDLERS", "Context", "evaluate"],
    "judge.evidence": [
        "Context",
        "Evidence",
        "build_evidence",
        "column_np",
        "not_evaluated",
        "sent_mask",
        "verdict_for",
    ],
    "judge.infra": ["check_infrastructure"],
    "tables.join": [
        "COALESCED_EVENTS",
        "COALESCED_SPAN_MS",
        "JOIN_COLUMNS",
        "VENDOR_COUNTERS",
        "coalesced_note",
        "device_extremes",
        "join_run",
        "load_run",
        "positions",
    ],
    "legacy": [
        "LEGACY_SCHEMA",
        "LegacyImport",
        "check_not_legacy",
        "import_legacy",
        "legacy_index",
        "load_legacy_trend",
    ],
    "judge.limits": ["HANDLERS", "limit_verdict"],
    "tables.load": [
        "INDEX_SCHEMA",
        "MANIFEST_SCHEMA",
        "NETWORK_BREAKS_SCHEMA",
        "TRACE_FILES",
        "NetworkBreak",
        "Progress",
        "RunData",
        "TokenParts",
        "read_run_files",
    ],
    "tables.quality": ["QUALITY_COLUMNS", "Partition", "QualityReport", "Reason", "apply_quality"],
    "tables.netbreaks": [
        "BURST_GAP_NS",
        "BURST_MIN",
        "NETWORK_ERROR_CLASSES",
        "RESTART_AFTER_NS",
        "Detection",
        "SetAside",
        "detect_breaks",
    ],
    "judge.crosstalk": ["HANDLERS"],
    "judge.resources": [
        "HANDLERS",
        "LEAK_SERIES",
        "leak_results",
        "leak_section",
        "leak_segments",
        "resource_series",
    ],
    "tables.summary": ["SUMMARY_SCHEMA", "summary_table"],
    "tables.conversations": [
        "CONVERSATIONS_FILES",
        "CONVERSATIONS_SCHEMA",
        "NOT_REPORTED",
        "OVER",
        "QUANTILES",
        "SHARE_GROUPS",
        "cached_share",
        "conversation_rows",
        "conversations_table",
        "share_groups",
    ],
    "judge.idle": ["SERIES_UNITS", "IdleCheck", "IdleCriterion", "idle_criterion"],
    "judge.rules": [
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
    ],
    "judge.verdict": [
        "VERDICT_SCHEMA",
        "RuleClass",
        "RuleVerdict",
        "Status",
        "TooShort",
        "clean",
        "exit_code",
        "is_too_short",
        "render_summary",
        "status_word",
        "to_json",
        "too_short_lines",
        "verdict_dict",
    ],
    "judge.goodput": ["HANDLERS", "CellGoodput", "cell_goodput", "goodput_section", "share_status"],
    "stats.goodput": [
        "GOODPUT_METHOD",
        "PROPORTION_CI_METHOD",
        "Goodput",
        "goodput",
        "meets_slos",
        "proportion_ci",
    ],
    "tables.series": [
        "ITL_BINS_PER_DECADE",
        "ITL_METHOD",
        "MAX_WINDOWS",
        "SERIES_FILES",
        "SERIES_SCHEMA",
        "WIDTHS_S",
        "RateChange",
        "itl_bin",
        "itl_bin_value",
        "rate_changes",
        "series_table",
    ],
    "tables.tokens": [
        "EventSums",
        "SteadyWindows",
        "batch_of",
        "confirmed_scale",
        "event_columns",
        "itl_gaps",
        "reduce_events",
        "split_events",
        "token_scale",
    ],
}


def test_pipeline_public_names_are_pinned() -> None:
    import importlib

    for name, expected in PIPELINE_API.items():
        module = importlib.import_module(f"analysis.{name}")
        assert module.__all__ == expected, name
        assert all(hasattr(module, n) for n in module.__all__), name


def test_the_pipeline_imports_neither_locust_nor_gevent() -> None:
    modules = ", ".join(f"analysis.{m}" for m in PIPELINE_API)
    code = (
        f"import sys, {modules}, calculet_load.schema.selfwatch\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('locust', 'gevent'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2]
    )


def test_the_cli_registration_stays_light() -> None:
    """`calculet-load` imports every command's module to build its parser: the analyze
    command must not pull numpy, pyarrow or scipy into the start-up of other commands."""
    code = (
        "import sys, analysis.cli\n"
        "heavy = sorted(m for m in ('numpy', 'pyarrow', 'scipy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2]
    )
