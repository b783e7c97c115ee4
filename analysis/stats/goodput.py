"""Goodput (spec §14.3's "meet the SLA", per request): the requests that succeeded within
their TTFT and TPOT objectives, as a rate and as a share of the attempts.

    good        success ∧ (TTFT ≤ max_ttft_ms) ∧ (TPOT ≤ max_tpot_ms)     per request
    share       good / attempts                 attempts: the requests sent and not
                                                cancelled on purpose (failures count)
    goodput     good requests that ended inside the steady window / its length  (req/s)

An objective that is None is not checked. A request of one output token has no TPOT:
it is judged by its TTFT alone. A success whose TTFT (or, with more than one token, its
TPOT) is missing cannot be shown to meet the objective, so it is not good: a missing
stamp is never read as a fast one. The share's interval is Clopper–Pearson's
(PROPORTION_CI_METHOD): exact, distribution-free, coverage ≥ the level.

`meets_slos` is the one definition of "good": the analysis' goodput rule and its
capacity criterion use it, and so does the capacity search (calculet_drivers.capacity).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import stats as st

__all__ = [
    "GOODPUT_METHOD",
    "PROPORTION_CI_METHOD",
    "Goodput",
    "goodput",
    "meets_slos",
    "proportion_ci",
]

GOODPUT_METHOD = (
    "good = success with TTFT ≤ its SLO and TPOT ≤ its SLO (one-token replies: TTFT only; "
    "a missing figure is not good); share = good / attempts (sent, not cancelled on "
    "purpose); goodput = good requests ended inside the steady window / window length"
)
PROPORTION_CI_METHOD = "Clopper–Pearson exact binomial interval, equal tails"

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


def meets_slos(
    ok: npt.ArrayLike,
    ttft_ms: npt.ArrayLike,
    tpot_ms: npt.ArrayLike,
    output_tokens: npt.ArrayLike,
    *,
    max_ttft_ms: float | None,
    max_tpot_ms: float | None,
) -> BoolArray:
    """Per request: whether it is good (module docstring). NaN marks a missing figure;
    `output_tokens` ≤ 1 (or NaN: unknown, treated as more than one) exempts TPOT."""
    good = np.asarray(ok, dtype=bool).copy()
    ttft = np.asarray(ttft_ms, dtype=np.float64)
    tpot = np.asarray(tpot_ms, dtype=np.float64)
    tokens = np.asarray(output_tokens, dtype=np.float64)
    if max_ttft_ms is not None:
        good &= ttft <= max_ttft_ms  # NaN compares False: missing is not good
    if max_tpot_ms is not None:
        one_token = tokens <= 1  # NaN compares False: an unknown count needs its TPOT
        good &= one_token | (tpot <= max_tpot_ms)
    return good


def proportion_ci(k: int, n: int, level: float = 0.95) -> tuple[float | None, float | None]:
    """PROPORTION_CI_METHOD interval of k successes in n trials; (None, None) for n = 0.
    k = 0 gives a lower bound of 0, k = n an upper bound of 1."""
    if not 0 < level < 1:
        raise ValueError(f"level={level}: a confidence level is in (0, 1)")
    if n <= 0:
        return None, None
    if not 0 <= k <= n:
        raise ValueError(f"k={k} successes of n={n} trials")
    a = (1.0 - level) / 2.0
    lo = 0.0 if k == 0 else float(st.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(st.beta.isf(a, k + 1, n - k))
    return lo, hi


@dataclass(frozen=True, slots=True)
class Goodput:
    """One cell's goodput. `rps` is None without a steady window (no success)."""

    good: int
    attempts: int
    share: float | None
    share_lo: float | None
    share_hi: float | None
    good_in_window: int
    window_s: float | None
    rps: float | None


def goodput(
    good: npt.ArrayLike,
    attempts: int,
    end_ns: npt.ArrayLike,
    window_ns: tuple[int, int] | None,
    *,
    level: float = 0.95,
) -> Goodput:
    """The cell's goodput from its requests' `good` flags and end times (wall ns, the
    clock of `window_ns`): the share of `attempts` with its interval, and the rate of
    good requests ending inside the closed window [start, end]."""
    g = np.asarray(good, dtype=bool)
    end = np.asarray(end_ns, dtype=np.int64)
    k = int(np.count_nonzero(g))
    lo, hi = proportion_ci(k, attempts, level)
    share = k / attempts if attempts > 0 else None
    if window_ns is None or window_ns[1] <= window_ns[0]:
        return Goodput(k, attempts, share, lo, hi, 0, None, None)
    inside = g & (end >= window_ns[0]) & (end <= window_ns[1])
    n_in = int(np.count_nonzero(inside))
    length_s = (window_ns[1] - window_ns[0]) / 1e9
    return Goodput(k, attempts, share, lo, hi, n_in, length_s, n_in / length_s)
