"""The report's figures: matplotlib (Agg backend) drawn to SVG strings for inline use.

Every function takes plain arrays the view model prepared (already downsampled: a
caller passes at most a few thousand points per line) and returns one `<svg>` element
as text, with no XML prolog, no metadata, no global `<style>` and ids prefixed per
figure, so that many figures can share one HTML document. Text stays text
(`svg.fonttype: none`): smaller files, searchable labels, no embedded glyph paths.
Nothing here reads files or computes statistics.
"""

from __future__ import annotations

import io
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import ticker
from matplotlib.figure import Figure

__all__ = [
    "BreakdownBar",
    "Line",
    "Panel",
    "breakdown_bars",
    "cdf_figure",
    "curve_figure",
    "log_ticks",
    "scatter_curve",
    "shaded_scatter",
    "timeseries_figure",
]

_RC: Any = {
    "svg.fonttype": "none",
    "svg.hashsalt": "calculet-report",  # stable clip-path ids: same inputs, same bytes
    "font.size": 8,
    "axes.titlesize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.fontsize": 7,
    "figure.dpi": 100,
}
_COUNTER = itertools.count(1)
_ID = re.compile(r'\bid="([^"]+)"')
_REF = re.compile(r'(\bid="|url\(#|href="#)([^"()]+)("|\))')


@dataclass(frozen=True, slots=True)
class Line:
    """One line of a chart; `lo`/`hi` draw an interval around `y` (None: no interval)."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    lo: Sequence[float] | None = None
    hi: Sequence[float] | None = None
    style: str = "-"
    marker: str | None = None
    color: int | None = None  # matplotlib cycle index; None: by position


@dataclass(frozen=True, slots=True)
class Panel:
    """One axes of a time-series figure: lines, horizontal limits, shaded spans."""

    ylabel: str
    lines: Sequence[Line]
    limits: Sequence[tuple[float, str]] = ()
    spans: Sequence[tuple[float, float]] = ()
    span_label: str = ""
    step: bool = False
    bands: Sequence[tuple[float, float]] = ()  # light grey, e.g. the cells' windows
    band_label: str = ""
    marks: Sequence[tuple[float, str]] = ()  # vertical lines at x, labelled (rate changes)


@dataclass(frozen=True, slots=True)
class BreakdownBar:
    label: str
    segments: dict[str, float] = field(default_factory=dict)


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    text = re.sub(r"<style[^>]*>.*?</style>\s*", "", text, flags=re.S)
    prefix = f"f{next(_COUNTER)}-"
    ids = set(_ID.findall(text))

    def scoped(m: re.Match[str]) -> str:
        head, name, tail = m.group(1), m.group(2), m.group(3)
        return f"{head}{prefix}{name}{tail}" if name in ids else m.group(0)

    text = _REF.sub(scoped, text)  # one pass: ids, url(#id) and href="#id"
    return text.replace("<svg ", '<svg class="plot" role="img" ', 1)


def _figure(ncols: int, width: float, height: float) -> tuple[Figure, list[Any]]:
    with plt.rc_context(_RC):
        fig, axes = plt.subplots(
            1, ncols, figsize=(width, height), squeeze=False, layout="constrained"
        )
    return fig, list(axes[0])


def _color(line: Line, i: int) -> str:
    return f"C{(line.color if line.color is not None else i) % 10}"


def _styled(
    ax: Any, title: str | None = None, xlabel: str | None = None, ylabel: str | None = None
) -> None:
    """The grid every figure has, and the labels given."""
    ax.grid(True, alpha=0.3)
    for set_label, text in ((ax.set_title, title), (ax.set_xlabel, xlabel),
                            (ax.set_ylabel, ylabel)):  # fmt: skip
        if text is not None:
            set_label(text)


def cdf_figure(panels: Sequence[tuple[str, Sequence[Line]]]) -> str:
    """Empirical CDFs, one axes per metric; each line is (value, cumulative fraction)."""
    with plt.rc_context(_RC):
        fig, axes = _figure(len(panels), 3.6 * len(panels), 3.0)
        for ax, (title, lines) in zip(axes, panels, strict=True):
            for i, line in enumerate(lines):
                # ~200 quantile points per line: joined, not stepped (half the vertices)
                ax.plot(
                    line.x, line.y, label=line.label, ls=line.style, color=_color(line, i), lw=1.1
                )
            ax.set_title(title)
            ax.set_ylabel("fraction of requests ≤ x")
            ax.set_ylim(0, 1.01)
            if any(len(line.x) and min(line.x) > 0 for line in lines):
                ax.set_xscale("log")
                _plain_log(ax.xaxis)
            else:
                _plain(ax.xaxis)
            _plain(ax.yaxis)
            _styled(ax)
        axes[0].legend(loc="lower right", frameon=False)
        return _svg(fig)


def curve_figure(panels: Sequence[tuple[str, str, Sequence[Line]]]) -> str:
    """Lines with interval bars (e.g. P50 and P99 with their CIs vs concurrency);
    panels are (title, x label, lines)."""
    with plt.rc_context(_RC):
        fig, axes = _figure(len(panels), 4.2 * len(panels), 3.0)
        for ax, (title, xlabel, lines) in zip(axes, panels, strict=True):
            for i, line in enumerate(lines):
                x, y = np.asarray(line.x, float), np.asarray(line.y, float)
                yerr = None
                if line.lo is not None and line.hi is not None:
                    lo = np.asarray(line.lo, float)
                    hi = np.asarray(line.hi, float)
                    yerr = np.vstack([np.clip(y - lo, 0, None), np.clip(hi - y, 0, None)])
                    yerr = np.nan_to_num(yerr, nan=0.0)
                ax.errorbar(
                    x,
                    y,
                    yerr=yerr,
                    label=line.label,
                    ls=line.style,
                    marker=line.marker or "o",
                    ms=3,
                    capsize=2,
                    lw=1,
                    color=_color(line, i // 2),
                )
            ax.set_title(title)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("ms")
            _plain(ax.xaxis)
            _plain(ax.yaxis)
            _styled(ax)
        axes[0].legend(frameon=False)
        return _svg(fig)


def scatter_curve(
    points: tuple[Sequence[float], Sequence[float]],
    curves: Sequence[Line],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    marks: Sequence[tuple[float, str]] = (),
) -> str:
    """Per-request points (light) with summary curves over them (e.g. TPOT vs prompt)."""
    with plt.rc_context(_RC):
        fig, (ax,) = _figure(1, 7.5, 3.2)
        ax.scatter(points[0], points[1], s=4, alpha=0.25, color="0.45", label="requests")
        for i, line in enumerate(curves):
            ax.plot(
                line.x,
                line.y,
                ls=line.style,
                marker=line.marker or "o",
                ms=3,
                label=line.label,
                color=_color(line, i),
            )
        for x, text in marks:
            ax.axvline(x, color="C3", ls=":", lw=0.8)
            ax.annotate(
                text,
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                fontsize=6,
                ha="right",
                va="top",
                rotation=90,
                color="C3",
            )
        if len(points[0]) and min(points[0]) > 0:
            ax.set_xscale("log", base=2)
            _plain_log(ax.xaxis, base=2)
        else:
            _plain(ax.xaxis)
        _plain(ax.yaxis)
        _styled(ax, title, xlabel, ylabel)
        ax.legend(frameon=False, loc="upper left")
        return _svg(fig)


def _plain(axis: Any) -> None:
    """Ticks as plain numbers with thousands separators: never an offset, a ×10ⁿ factor
    or a power of ten, which a reader misreads at a glance."""
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:,.10g}"))


_LOG_STEPS: tuple[tuple[float, ...], ...] = ((1,), (1, 2, 5), (1, 2, 3, 5))


def log_ticks(lo: float, hi: float, base: int = 10, most: int = 8) -> list[float]:
    """Plain-number ticks for a log axis over [lo, hi] (lo > 0): for base 10 the
    coarsest of 1·10ᵏ; 1, 2, 5; 1, 2, 3, 5 that gives 3 to `most` ticks; for base 2 the
    powers of two, every other one while there are too many; where that gives fewer than
    3 (a range inside a decade, or an octave), evenly spaced round numbers."""
    if not (0 < lo < hi) or not math.isfinite(hi):
        return []
    k0, k1 = math.floor(math.log(lo, base)), math.ceil(math.log(hi, base))
    ticks: list[float] = []
    if base == 2:
        ticks = [2.0**k for k in range(k0, k1 + 1) if lo <= 2.0**k <= hi]
        while len(ticks) > most:
            ticks = ticks[::2]
    else:
        for steps in _LOG_STEPS:
            found = [m * 10.0**k for k in range(k0, k1 + 1) for m in steps]
            found = [t for t in found if lo <= t <= hi]
            if len(found) > most:
                break
            ticks = found
            if len(found) >= 3:
                break
    if len(ticks) >= 3:
        return ticks
    even = [float(t) for t in ticker.MaxNLocator(5).tick_values(lo, hi) if lo <= t <= hi]
    return even if len(even) > len(ticks) else ticks


def _plain_log(axis: Any, base: int = 10) -> None:
    """A log axis with plain-number ticks (log_ticks) and no minor labels: matplotlib's
    own would read 3×10¹ or 2¹⁰. Call once the data are drawn (the limits are final)."""
    lo, hi = axis.get_view_interval()
    axis.set_major_locator(ticker.FixedLocator(log_ticks(min(lo, hi), max(lo, hi), base)))
    axis.set_minor_formatter(ticker.NullFormatter())
    _plain(axis)


def shaded_scatter(
    x: Sequence[float],
    y: Sequence[float],
    shade: Sequence[float],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    shade_label: str,
    missing_label: str,
) -> str:
    """Per-request points on linear axes from 0, each coloured by its `shade` in [0, 1]
    (a colour bar in %; above 1 the bar's "over" colour, red); a NaN shade is a grey
    cross, labelled `missing_label`."""
    with plt.rc_context(_RC):
        fig, (ax,) = _figure(1, 7.5, 3.4)
        xs, ys, c = (np.asarray(v, dtype=float) for v in (x, y, shade))
        known = np.isfinite(c)
        if np.any(~known):
            ax.scatter(
                xs[~known], ys[~known], s=10, marker="x", lw=0.7, color="0.55", label=missing_label
            )
        cmap = matplotlib.colormaps["viridis"].with_extremes(over="C3")
        dots = ax.scatter(xs[known], ys[known], s=9, c=c[known], cmap=cmap, vmin=0.0, vmax=1.0)
        if np.any(known):
            bar = fig.colorbar(dots, ax=ax, extend="max" if np.any(c[known] > 1) else "neither")
            bar.set_label(shade_label)
            if bar.solids is not None:  # vector (the page holds no image), without seams
                bar.solids.set_rasterized(False)
                bar.solids.set_edgecolor("face")
            bar.ax.yaxis.set_major_formatter(ticker.PercentFormatter(1.0))
        if np.any(~known):
            ax.legend(frameon=False, loc="upper left")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        _plain(ax.xaxis)
        _plain(ax.yaxis)
        _styled(ax, title, xlabel, ylabel)
        return _svg(fig)


def breakdown_bars(
    bars: Sequence[BreakdownBar], order: Sequence[str], colors: dict[str, str]
) -> str:
    """Horizontal stacked bars, one per request, segments in `order` (ms)."""
    with plt.rc_context(_RC):
        fig, (ax,) = _figure(1, 8.0, 0.7 + 0.22 * max(1, len(bars)))
        y = np.arange(len(bars))[::-1]
        left = np.zeros(len(bars))
        for name in order:
            widths = np.array([max(0.0, b.segments.get(name, 0.0)) for b in bars])
            if not np.any(widths > 0):
                continue
            ax.barh(y, widths, left=left, height=0.7, label=name, color=colors.get(name))
            left += widths
        ax.set_yticks(y, [b.label for b in bars], fontsize=6)
        ax.set_xlabel("ms (end to end, client clock; server phases from the trace)")
        _plain(ax.xaxis)
        ax.legend(frameon=False, ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=6)
        _styled(ax)
        return _svg(fig)


def _shade(
    ax: Any, spans: Sequence[tuple[float, float]], color: str, alpha: float, label: str | None
) -> None:
    """Shade each span of the x axis; the legend names the first only."""
    for i, (a, b) in enumerate(spans):
        ax.axvspan(a, b, color=color, alpha=alpha, lw=0, label=label if i == 0 and label else None)


def timeseries_figure(panels: Sequence[Panel], *, xlabel: str, ncols: int = 1) -> str:
    """Time-series axes sharing x, in `ncols` columns (filled row by row); limits as
    dashed lines, spans shaded, marks as labelled vertical lines; plain-number ticks."""
    with plt.rc_context(_RC):
        nrows = math.ceil(len(panels) / ncols)
        width = 8.0 if ncols == 1 else 6.6 * ncols
        fig, axes = plt.subplots(
            nrows,
            ncols,
            figsize=(width, (1.5 if ncols == 1 else 2.1) * nrows + 0.5),
            sharex=True,
            squeeze=False,
            layout="constrained",
        )
        flat = list(axes.flat)
        for ax, panel in zip(flat, panels, strict=False):
            _shade(ax, panel.bands, "0.5", 0.12, panel.band_label)
            _shade(ax, panel.spans, "C3", 0.15, panel.span_label)
            for i, line in enumerate(panel.lines):
                if panel.step:
                    ax.step(
                        line.x,
                        line.y,
                        where="post",
                        lw=0.9,
                        ls=line.style,
                        label=line.label,
                        color=_color(line, i),
                    )
                else:
                    ax.plot(
                        line.x,
                        line.y,
                        lw=0.9,
                        ls=line.style,
                        marker=line.marker,
                        ms=2.5,
                        label=line.label,
                        color=_color(line, i),
                    )
            for value, text in panel.limits:
                ax.axhline(value, color="C3", ls="--", lw=0.8, label=text)
            for x, text in panel.marks:
                ax.axvline(x, color="C4", ls=":", lw=0.9)
                ax.annotate(
                    text,
                    (x, 1.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(2, -2),
                    textcoords="offset points",
                    fontsize=6,
                    ha="left",
                    va="top",
                    color="C4",
                )
            ax.set_ylabel(panel.ylabel)
            _plain(ax.xaxis)
            _plain(ax.yaxis)
            _styled(ax)
            if len(panel.lines) > 1 or panel.limits or panel.spans or panel.bands:
                ax.legend(frameon=False, fontsize=6, loc="upper left", ncols=3)
        for ax in flat[len(panels) :]:
            ax.set_visible(False)
        for ax in axes[-1, :]:
            ax.set_xlabel(xlabel)
        if len(panels) % ncols and nrows > 1:  # a column whose last row is empty
            for ax in axes[-2, len(panels) % ncols :]:
                ax.set_xlabel(xlabel)
                ax.xaxis.set_tick_params(labelbottom=True)
        return _svg(fig)
