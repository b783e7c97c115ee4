"""Arrival schedules: exact laws, exact splitting across dispatchers, rate changes."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from calculet_load.workload.arrivals import (
    ArrivalError,
    RateClock,
    Schedule,
    intended_times,
    load_replay,
    unit_gaps,
)


def test_poisson_gaps_pass_ks_against_the_exponential_law() -> None:
    times = intended_times("poisson", 7, rate=4.0, duration_s=2500)
    gaps = np.diff(times)
    assert len(times) == pytest.approx(10_000, rel=0.05)
    assert stats.kstest(gaps, "expon", args=(0, 1 / 4.0)).pvalue > 0.01


def test_the_same_seed_gives_the_same_schedule_and_another_seed_does_not() -> None:
    a = intended_times("poisson", 1, 2.0, 100)
    assert a == intended_times("poisson", 1, 2.0, 100)
    assert a != intended_times("poisson", 2, 2.0, 100)


@pytest.mark.parametrize("kind", ["poisson", "constant", "gamma"])
@pytest.mark.parametrize("slots", [1, 2, 3, 7])
def test_slots_partition_the_one_global_schedule(kind: str, slots: int) -> None:
    everything = intended_times(kind, 3, 5.0, 60, burstiness=0.25)
    shares = [
        intended_times(kind, 3, 5.0, 60, slots=slots, slot=s, burstiness=0.25) for s in range(slots)
    ]
    assert sorted(t for share in shares for t in share) == everything
    assert all(abs(len(s) - len(everything) / slots) <= 1 for s in shares)


def test_constant_is_evenly_spaced() -> None:
    times = intended_times("constant", 0, 4.0, 10)
    assert np.allclose(np.diff(times), 0.25)
    assert len(times) == 40


def test_gamma_burstiness_sets_the_coefficient_of_variation() -> None:
    for k in (0.25, 1.0, 4.0):
        gaps = np.diff(intended_times("gamma", 11, 10.0, 2000, burstiness=k))
        cv = gaps.std() / gaps.mean()
        assert cv == pytest.approx(1 / np.sqrt(k), rel=0.08)
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)
        # fitted on the unit-rate gaps: at k < 1 some scheduled gaps round to 0 ns
        unit = np.fromiter(itertools.islice(unit_gaps("gamma", 11, burstiness=k), 20000), float)
        shape, _, _ = stats.gamma.fit(unit, floc=0)
        assert shape == pytest.approx(k, rel=0.1)


def test_replay_follows_the_log_and_rate_is_the_speed(tmp_path: Path) -> None:
    log = tmp_path / "arrivals.txt"
    log.write_text("# recorded\n100.0\n100.5\n\n101.5\n104.0,extra\n")
    times = load_replay(log)
    assert intended_times("replay", 0, 1.0, 100, replay=times) == [0.0, 0.5, 1.5, 4.0]
    assert intended_times("replay", 0, 2.0, 100, replay=times) == [0.0, 0.25, 0.75, 2.0]
    log.write_text("1\nnot-a-time\n")
    with pytest.raises(ArrivalError, match=r"arrivals\.txt:2: not a timestamp"):
        load_replay(log)


def test_a_rate_change_retimes_later_arrivals_without_redrawing_them() -> None:
    clock = RateClock(1.0, 1)
    sched = Schedule("constant", 0, clock)
    units = [sched.next_for(0) for _ in range(6)]
    assert [clock.time_of(u[1]) for u in units if u] == [int(i * 1e9) for i in range(6)]
    clock.change(int(3e9), 2.0)  # from t=3 s, twice as fast
    assert [clock.time_of(u[1]) for u in units if u] == [
        0,
        int(1e9),
        int(2e9),
        int(3e9),
        int(3.5e9),
        int(4e9),
    ]
    clock.change(int(4e9), 0.0)  # paused from t=4 s
    assert clock.time_of(5.0) == int(4e9) and clock.time_of(5.5) is None
    clock.change(int(10e9), 1.0)  # resumed at t=10 s
    assert clock.time_of(5.5) == int(10.5e9)


def test_changing_the_number_of_slots_hands_over_the_share() -> None:
    clock = RateClock(10.0, 2)
    clock.change(int(5e9), 10.0, slots=1)  # one dispatcher left from t=5 s
    got: dict[int, list[int]] = {}
    for slot in (0, 1):
        sched = Schedule("constant", 0, clock)
        got[slot] = []
        while (n := sched.next_for(slot)) and n[1] < 100:
            got[slot].append(n[0])
    assert set(got[0]) | set(got[1]) == set(range(100))
    assert not set(got[0]) & set(got[1])
    assert max(got[1]) < 50  # slot 1 takes nothing after t=5 s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "weibull"}, "unknown kind"),
        ({"kind": "gamma", "burstiness": 0}, "burstiness"),
        ({"kind": "replay"}, "at least two"),
        ({"kind": "poisson", "rate": -1}, "rate"),
        ({"kind": "poisson", "slots": 0}, "slots"),
    ],
)
def test_bad_parameters_name_themselves(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"kind": "poisson", "seed": 0, "rate": 1.0, "duration_s": 1}
    args.update(kwargs)
    with pytest.raises(ArrivalError, match=message):
        intended_times(**args)  # type: ignore[arg-type]
