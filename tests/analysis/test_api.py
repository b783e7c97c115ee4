"""The analysis package's public names are pinned, and it never imports Locust or gevent
(DESIGN §1)."""

import subprocess
import sys
from pathlib import Path

from analysis import compare, leaks, stats


def test_public_names_are_pinned() -> None:
    assert stats.__all__ == [
        "MAD_METHOD",
        "MEAN_CI_METHOD",
        "PERCENTILE_METHOD",
        "QUANTILE_CI_METHOD",
        "SPREAD_CI_METHOD",
        "THROUGHPUT_METHOD",
        "CellStats",
        "Estimate",
        "FloatArray",
        "PercentileStat",
        "finite_values",
        "mad",
        "mad_ci",
        "mean_ci",
        "min_n_for_ci",
        "percentile_name",
        "quantile",
        "quantile_ci",
        "quantile_rank",
        "std_ci",
        "steady_throughput",
        "summarize",
    ]
    assert compare.__all__ == [
        "DECISION_RULE",
        "MEAN_DELTA_METHOD",
        "QUANTILE_DELTA_METHOD",
        "Comparison",
        "Direction",
        "MetricRule",
        "Thresholds",
        "Verdict",
        "compare_cells",
        "compare_mean",
        "compare_quantile",
        "decide",
        "direction_for",
    ]
    assert leaks.__all__ == [
        "LEAK_METHOD",
        "MIN_BINS",
        "LeakResult",
        "LeakStatus",
        "TrendTest",
        "bin_means",
        "detect_leak",
        "mann_kendall_hamed_rao",
    ]
    for module in (stats, compare, leaks):
        assert all(hasattr(module, name) for name in module.__all__)


def test_importing_the_statistics_layer_imports_neither_locust_nor_gevent() -> None:
    code = (
        "import sys, analysis.stats, analysis.compare, analysis.leaks\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('locust', 'gevent'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2]
    )
