"""The one definition of a clock offset, and the arithmetic every writer and reader uses.

Convention (everywhere in calculet-load, in files and in code):

    offset_ns = reference − local        so   reference ≈ local + offset_ns

A positive offset means the local clock is *behind* its reference. It is chrony's and
ntpd's sign, so `ntp_offset_ns` (a host against its NTP reference) is stored as the
daemon reports it; `master_offset_ns` (a Locust worker against its master) uses the same
sign with the master as the reference. Nothing else may add or subtract an offset by
hand: `to_reference_ns` and `from_reference_ns` are the only conversions.

The master measures a worker with NTP-style exchanges of four wall stamps: t1 (master
sends), t2 (worker receives), t3 (worker replies), t4 (master receives). `exchange`
turns them into one `OffsetSample`; `best_sample` keeps the one with the least round
trip, whose offset error is bounded by half its round trip.

This module imports nothing but the standard library (the analysis reads it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

__all__ = [
    "OffsetSample",
    "best_sample",
    "exchange",
    "from_reference_ns",
    "rtt_measured",
    "rtt_summary",
    "to_reference_ns",
]


class _Ns(Protocol):
    def __add__(self, other: Any, /) -> Any: ...
    def __sub__(self, other: Any, /) -> Any: ...


_T = TypeVar("_T", bound=_Ns)  # an int, or a numpy array of int64 ns in the analysis


def to_reference_ns(local_ns: _T, offset_ns: Any) -> _T:
    """A local wall time on the reference clock: `local + (reference − local)`."""
    return cast(_T, local_ns + offset_ns)


def from_reference_ns(reference_ns: _T, offset_ns: Any) -> _T:
    """A reference wall time on the local clock of the host whose offset is `offset_ns`."""
    return cast(_T, reference_ns - offset_ns)


@dataclass(frozen=True, slots=True)
class OffsetSample:
    """One four-stamp exchange with a remote host.

    `offset_ns` is the remote host's clock offset in our convention with the measuring
    host as the reference: master − worker, so master ≈ worker + offset_ns.
    `rtt_ns` is the round trip less the remote host's time between receiving and
    replying. The true offset lies within `offset_ns ± rtt_ns / 2`.
    """

    offset_ns: int
    rtt_ns: int
    t1_ns: int  # the measuring host's send, its wall clock: when the sample was taken


def exchange(t1_ns: int, t2_ns: int, t3_ns: int, t4_ns: int) -> OffsetSample:
    """One exchange (RFC 5905 §8): t1/t4 on the reference's clock, t2/t3 on the remote's.

    Formula: offset = ((t1 − t2) + (t4 − t3)) / 2 (reference − remote),
    rtt = (t4 − t1) − (t3 − t2). Integer ns; the halving floors.
    """
    return OffsetSample(
        ((t1_ns - t2_ns) + (t4_ns - t3_ns)) // 2, (t4_ns - t1_ns) - (t3_ns - t2_ns), t1_ns
    )


def best_sample(samples: Iterable[OffsetSample]) -> OffsetSample | None:
    """The sample with the least round trip (its offset is the best bounded); None if none."""
    return min(samples, key=lambda s: s.rtt_ns, default=None)


def rtt_summary(rtts_ns: Sequence[int]) -> dict[str, float | int | None]:
    """Round trips in ms: n, min, p50, mean, max and jitter.

    Jitter is the standard deviation of the round trips (population form, ms), netem's
    meaning of its jitter parameter. p50 is the `higher` median. With no sample every
    figure is None (n = 0); with one, jitter is 0.0.
    """
    n = len(rtts_ns)
    if n == 0:
        return {"n": 0, "min_ms": None, "p50_ms": None, "mean_ms": None, "max_ms": None,
                "jitter_ms": None}  # fmt: skip
    ordered = sorted(rtts_ns)
    mean = sum(ordered) / n
    var = sum((x - mean) ** 2 for x in ordered) / n
    return {
        "n": n,
        "min_ms": ordered[0] / 1e6,
        "p50_ms": ordered[n // 2] / 1e6,
        "mean_ms": mean / 1e6,
        "max_ms": ordered[-1] / 1e6,
        "jitter_ms": math.sqrt(var) / 1e6,
    }


def rtt_measured(index: Any) -> bool:
    """Whether a `client/index.json` document holds round trips to the target that some
    worker measured (`workers[].target_rtt.before.{connect,health}.n` > 0; spec §5)."""
    workers = index.get("workers") if isinstance(index, dict) else None
    for w in workers if isinstance(workers, list) else []:
        rtt = w.get("target_rtt") if isinstance(w, dict) else None
        before = rtt.get("before") if isinstance(rtt, dict) else None
        if isinstance(before, dict) and any(
            isinstance(s, dict) and s.get("n") for s in before.values()
        ):
            return True
    return False
