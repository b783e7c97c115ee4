"""Open-loop arrival schedules: a pure function of (seed, rate history, time).

One global schedule is defined for the whole run, and every dispatcher (one per worker
process) computes the same one and takes its share: arrival k belongs to slot k mod D.
So the aggregate is exactly the requested process, whatever D is, for every shape
(Poisson, constant, gamma, replay), not just for Poisson's superposition.

The schedule is built by time change (the standard construction for a varying rate):
a unit-rate point process U_0 < U_1 < ... is drawn from the seed (exponential gaps for
Poisson, gaps of 1 for constant, Gamma(k, 1/k) gaps for gamma with burstiness k, the
recorded gaps for a replay), and arrival k is at the time T_k where the integrated rate
Lambda(T_k) = U_k. A rate change at time t_c keeps Lambda continuous, so changing the
rate (a shape stage, a web-UI edit) never re-draws or skips arrivals.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

KINDS = ("poisson", "constant", "gamma", "replay")


class ArrivalError(ValueError):
    pass


def unit_gaps(
    kind: str, seed: int, *, burstiness: float = 1.0, replay: Sequence[float] = ()
) -> Iterator[float]:
    """Gaps of the unit-rate process (mean 1, except replay: recorded seconds)."""
    rng = random.Random(f"calculet-arrivals:{seed}")
    if kind == "poisson":
        while True:
            yield rng.expovariate(1.0)
    elif kind == "constant":
        yield 0.0  # the first arrival comes at the start, then one every 1/rate
        while True:
            yield 1.0
    elif kind == "gamma":
        if burstiness <= 0:
            raise ArrivalError(f"burstiness: must be > 0, got {burstiness}")
        # shape k, scale 1/k: mean 1, coefficient of variation 1/sqrt(k) (k=1 is Poisson)
        while True:
            yield rng.gammavariate(burstiness, 1.0 / burstiness)
    elif kind == "replay":
        if len(replay) < 2:
            raise ArrivalError("replay: the arrival log needs at least two timestamps")
        times = sorted(replay)
        yield 0.0  # the first logged arrival comes at the start
        for a, b in itertools.pairwise(times):
            yield b - a
    else:
        raise ArrivalError(f"arrival: unknown kind {kind!r}; one of {KINDS}")


def load_replay(path: str | Path) -> list[float]:
    """Arrival timestamps in seconds, one per line (blank lines and # comments skipped)."""
    out: list[float] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = float(text.split(",")[0])
        except ValueError:
            raise ArrivalError(f"{path}:{n}: not a timestamp: {text[:40]!r}") from None
        if not math.isfinite(value):
            raise ArrivalError(f"{path}:{n}: timestamp must be finite")
        out.append(value)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    start_ns: int  # when this rate takes effect (schedule time, ns from the run's origin)
    unit_at_start: float  # Lambda(start)
    rate: float  # arrivals per second (replay: speed factor)
    slots: int  # dispatchers sharing the schedule from here on


class RateClock:
    """Lambda(t) for a piecewise-constant rate; maps unit time back to schedule time."""

    def __init__(self, rate: float, slots: int) -> None:
        self.segments = [Segment(0, 0.0, _check_rate(rate), _check_slots(slots))]

    def change(self, at_ns: int, rate: float, slots: int | None = None) -> None:
        """From `at_ns` on (not before the last change), use `rate` and `slots`."""
        last = self.segments[-1]
        at_ns = max(at_ns, last.start_ns)
        unit = last.unit_at_start + (at_ns - last.start_ns) / 1e9 * last.rate
        seg = Segment(at_ns, unit, _check_rate(rate), _check_slots(slots if slots else last.slots))
        if at_ns == last.start_ns:
            self.segments[-1] = seg
        else:
            self.segments.append(seg)

    def time_of(self, unit: float) -> int | None:
        """T with Lambda(T) = unit (ns), or None if the rate is 0 from there on."""
        starts = [s.unit_at_start for s in self.segments]
        # the segment reaching `unit` first (at a boundary, the earlier one's end)
        i = max(0, bisect.bisect_left(starts, unit) - 1)
        while i < len(self.segments):
            seg = self.segments[i]
            nxt = self.segments[i + 1] if i + 1 < len(self.segments) else None
            if seg.rate > 0:
                t = seg.start_ns + round((unit - seg.unit_at_start) / seg.rate * 1e9)
                if nxt is None or t <= nxt.start_ns:
                    return t
            elif nxt is None:
                return None
            i += 1
        return None

    def slots_at(self, t_ns: int) -> int:
        starts = [s.start_ns for s in self.segments]
        return self.segments[bisect.bisect_right(starts, t_ns) - 1].slots


def _check_rate(rate: float) -> float:
    if not math.isfinite(rate) or rate < 0:
        raise ArrivalError(f"rate: must be a finite number >= 0, got {rate}")
    return rate


def _check_slots(slots: int) -> int:
    if slots < 1:
        raise ArrivalError(f"slots: must be >= 1, got {slots}")
    return slots


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival:
    index: int  # k in the global schedule
    t_ns: int  # intended time, ns from the run's origin


class Schedule:
    """The global schedule and one slot's share of it.

    `next_for(slot)` returns this slot's next arrival with its intended time computed
    from the rate history known now; call it again after a rate change to re-time an
    arrival not yet fired (its unit time U_k does not change, only T_k).
    """

    def __init__(
        self,
        kind: str,
        seed: int,
        clock: RateClock,
        *,
        burstiness: float = 1.0,
        replay: Sequence[float] = (),
    ) -> None:
        self.kind = kind
        self.clock = clock
        self._gaps = unit_gaps(kind, seed, burstiness=burstiness, replay=replay)
        self._k = -1
        self._unit = 0.0
        self._held = False  # the current arrival was not handed out yet

    def _advance(self) -> bool:
        if self._held:
            self._held = False
            return True
        try:
            self._unit += next(self._gaps)
        except StopIteration:
            return False
        self._k += 1
        return True

    def pending_unit(self) -> float:
        return self._unit

    def next_for(self, slot: int) -> tuple[int, float] | None:
        """(k, U_k) of this slot's next arrival; None when a replay log is exhausted.

        An arrival whose time is unknown (rate 0 from there on) is returned with its unit
        time; `clock.time_of` says when it is due once a rate arrives. A slot that the
        latest plan no longer has gets None for arrivals after that plan starts (the
        arrival is kept for the next call, after a further change).
        """
        last = self.clock.segments[-1]
        while self._advance():
            t = self.clock.time_of(self._unit)
            if slot >= last.slots and (t is None or t >= last.start_ns):
                self._held = True
                return None
            slots = self.clock.slots_at(t) if t is not None else last.slots
            if slot < slots and self._k % slots == slot:
                return self._k, self._unit
        return None


def intended_times(
    kind: str,
    seed: int,
    rate: float,
    duration_s: float,
    *,
    slots: int = 1,
    slot: int | None = None,
    burstiness: float = 1.0,
    replay: Sequence[float] = (),
) -> list[float]:
    """Intended times (s) of the arrivals in [0, duration) at a constant rate: all of them
    (`slot=None`) or one slot's share. For tests, plans and documentation."""
    clock = RateClock(rate, slots)
    out: list[float] = []
    slot_ids = range(slots) if slot is None else [slot]
    for s in slot_ids:
        sched = Schedule(kind, seed, clock, burstiness=burstiness, replay=replay)
        while (nxt := sched.next_for(s)) is not None:
            t = clock.time_of(nxt[1])
            if t is None or t >= duration_s * 1e9:
                break
            out.append(t / 1e9)
    return sorted(out)
