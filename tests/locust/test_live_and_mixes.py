"""Live histograms (merge, 1 % quantiles), mixes as data, the event hooks, the docs' tables."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import numpy as np
import pytest

from calculet_load.events import EventHook
from calculet_load.locust.livestats import LiveStats, LogHistogram
from calculet_load.measure.outcome import ERROR_CLASSES
from calculet_load.workload.mixes import MIX_DIR, MixError, load_mix, parse_mix, single

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dist", ["lognormal", "exponential", "bimodal"])
def test_histogram_quantiles_are_within_one_percent_of_the_exact_order_statistic(
    dist: str,
) -> None:
    rng = np.random.default_rng(5)
    if dist == "lognormal":
        x = rng.lognormal(3, 1, 20_000)
    elif dist == "exponential":
        x = rng.exponential(40, 20_000)
    else:
        x = np.concatenate([rng.normal(20, 2, 15_000), rng.normal(900, 50, 5_000)])
    h = LogHistogram()
    for v in x:
        h.add(float(v))
    s = np.sort(x)
    for q in (0.5, 0.9, 0.99, 0.999):
        exact = s[int(np.ceil(q * (len(s) - 1)))]  # analyze's `higher`: x_(ceil(q(n-1))+1)
        got = h.quantile(q)
        assert got is not None and got == pytest.approx(exact, rel=0.01)
    assert h.quantile(1.0) == pytest.approx(s[-1])
    assert LogHistogram().quantile(0.5) is None  # no data is None, never 0


def test_workers_merge_through_the_wire_to_the_same_figures() -> None:
    rng = np.random.default_rng(1)
    parts = [rng.lognormal(2, 0.7, n) for n in (300, 1000, 50)]
    whole = LiveStats()
    merged = LiveStats()
    for values in parts:
        worker = LiveStats()
        for v in values:
            worker.observe("ttft", float(v))
            whole.observe("ttft", float(v))
        worker.counters["requests"] += len(values)
        worker.errors["http_5xx"] += 1
        merged.merge_wire(worker.to_wire(), process="w")
    assert merged.hist["ttft"].count == 1350
    assert merged.hist["ttft"].buckets == whole.hist["ttft"].buckets
    assert merged.hist["ttft"].quantile(0.99) == whole.hist["ttft"].quantile(0.99)
    assert merged.counters["requests"] == 1350 and merged.errors["http_5xx"] == 3


def test_shipped_mixes_load_and_the_70_20_10_mix_has_its_shares() -> None:
    names = sorted(p.stem for p in MIX_DIR.glob("*.yaml"))
    assert {"mixed-70-20-10", "decode-heavy", "prefill-heavy", "head-of-line"} <= set(names)
    for name in names:
        load_mix(name)
    mix = load_mix("mixed-70-20-10")
    shapes = {e.name: (e.prompt_tokens, e.max_tokens) for e in mix.entries}
    assert shapes == {"short": (128, 32), "medium": (2048, 128), "long": (16384, 256)}
    chooser = mix.chooser(seed=3)
    counts = collections.Counter(chooser.entry_for(k)[0].name for k in range(20_000))
    assert counts["short"] / 20_000 == pytest.approx(0.70, abs=0.015)
    assert counts["medium"] / 20_000 == pytest.approx(0.20, abs=0.015)
    assert counts["long"] / 20_000 == pytest.approx(0.10, abs=0.015)
    # a pure function of (seed, k): another chooser agrees, another seed does not
    again = mix.chooser(seed=3)
    assert [again.entry_for(k)[0].name for k in range(200)] == [
        chooser.entry_for(k)[0].name for k in range(200)
    ]
    other = mix.chooser(seed=4)
    assert [other.entry_for(k)[0].name for k in range(200)] != [
        chooser.entry_for(k)[0].name for k in range(200)
    ]
    assert single(64, 8).entries[0].prompt_tokens == 64


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "x", "entries": []}, "entries"),
        ({"name": "x", "entries": [{"name": "a", "weight": 0, "prompt_tokens": 1,
                                    "max_tokens": 1}]}, "entries.0.weight"),
        ({"name": "x", "entries": [{"name": "a", "weight": 1, "prompt_tokens": 40960,
                                    "max_tokens": 1}]}, "entries.0.prompt_tokens"),
        ({"name": "x", "entries": [{"name": "a", "weight": 1, "prompt_tokens": 1,
                                    "max_tokens": 1, "colour": "red"}]}, "entries.0.colour"),
    ],
)  # fmt: skip
def test_a_bad_mix_names_the_field(data: dict[str, object], message: str) -> None:
    with pytest.raises(MixError, match=re.escape(message)):
        parse_mix(data, "mix.yaml")


def test_an_unknown_mix_lists_the_known_ones() -> None:
    with pytest.raises(MixError, match="mixed-70-20-10"):
        load_mix("no-such-mix")


def test_event_hooks_cost_nothing_unheard_and_survive_a_failing_listener() -> None:
    hook = EventHook()
    assert not hook
    seen: list[int] = []

    def bad(**_kw: object) -> None:
        raise RuntimeError("listener bug")

    hook.add_listener(bad)
    hook.add_listener(lambda n, **_kw: seen.append(n))
    assert hook
    hook.fire(n=1)  # the failing listener is logged; the next one still runs
    assert seen == [1]


def test_the_error_table_in_the_docs_is_the_taxonomy() -> None:
    text = (REPO / "docs" / "measurement.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_0-9]+)` \| (.+?) \|$", text, re.M))
    assert {k: rows.get(k) for k in ERROR_CLASSES} == ERROR_CLASSES
