"""The report's axes read in plain numbers (analysis.views.plots): log axes get round
ticks of their own, never matplotlib's 3×10¹ or 2¹⁰, and no axis an offset or a factor."""

from __future__ import annotations

import re

import numpy as np
import pytest

from analysis.views import plots


@pytest.mark.parametrize(
    ("lo", "hi", "base", "expected"),
    [
        (1, 1000, 10, [1, 10, 100, 1000]),
        (1.5, 80, 10, [2, 5, 10, 20, 50]),
        (30, 45, 10, [30, 33, 36, 39, 42, 45]),  # inside a decade: evenly spaced round numbers
        (16, 4096, 2, [16, 64, 256, 1024, 4096]),  # 9 powers: every other one
        (1, 2**20, 2, [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576][::2]),
    ],
)
def test_log_ticks(lo: float, hi: float, base: int, expected: list[float]) -> None:
    assert plots.log_ticks(lo, hi, base) == pytest.approx(expected)


def _texts(svg: str) -> list[str]:
    return re.findall(r"<text[^>]*>(.*?)</text>", svg, re.S)


def test_a_cdf_inside_one_decade_has_plain_ticks() -> None:
    """The CDF that read 3×10¹, 4×10¹: TTFT between 30 and 45 ms."""
    x = np.linspace(30.0, 45.0, 50)
    svg = plots.cdf_figure([("TTFT (ms)", [plots.Line("c", x.tolist(), (x / 45).tolist())])])
    texts = _texts(svg)
    assert not [t for t in texts if "×" in t or "^" in t or "mathdefault" in t]
    x_ticks = [float(t) for t in texts if re.fullmatch(r"\d+", t) and 30 <= float(t) <= 45]
    assert len(x_ticks) >= 3


def test_large_values_keep_their_digits() -> None:
    """A time series in the millions: every tick is the number, with separators, never a
    1e6 offset above the axis."""
    x = [0.0, 1.0, 2.0]
    panel = plots.Panel("bytes", [plots.Line("rss", x, [2.0e9, 2.0e9 + 3e6, 2.0e9 + 6e6])])
    texts = _texts(plots.timeseries_figure([panel], xlabel="s"))
    assert "2,000,000,000" in texts or "2,001,000,000" in texts
    assert not [t for t in texts if "e+" in t or "1e" in t or "×" in t]
