"""Token events reduced part by part (analysis.tables.tokens): known answers, and the same
figures however the events are split into parts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from analysis.errors import ArtifactError
from analysis.tables.load import TokenParts
from analysis.tables.tokens import EventSums, SteadyWindows, reduce_events
from calculet_load.schema.arrow import token_events_table
from calculet_load.schema.records import TokenEvent

MS = 1_000_000
N_GROUPS = 3


def _parts(root: Path, chunks: list[list[TokenEvent]]) -> TokenParts:
    root.mkdir(exist_ok=True)
    paths = []
    for i, chunk in enumerate(chunks):
        path = root / f"part-{i + 1:05d}.tokens.parquet"
        pq.write_table(token_events_table(chunk), path)
        paths.append(str(path))
    return TokenParts(pafs.LocalFileSystem(), tuple(paths))


def _reduce(parts: TokenParts, ids: list[str], group: list[int]) -> EventSums:
    windows = SteadyWindows(
        start_ns=np.array([0, 300 * MS, 0]),
        end_ns=np.array([250 * MS, 900 * MS, 0]),  # group 2: an empty window
        wall_offset_ns=np.arange(len(ids)) * MS,
    )
    return reduce_events(parts, pa.array(ids), np.array(group), N_GROUPS, windows)


def test_known_answer(tmp_path: Path) -> None:
    # r0 (group 0): 1 token at 10 ms, 2 at 30 ms, 1 at 35 ms → ITL 10, 10, 5 ms
    # r1 (group 1): 1 token at 400 ms, a usage-only event at 405, 1 at 420 → ITL 20 ms
    # r2 failed (no group): its events count nowhere; "x" names no request
    events = [
        TokenEvent("r0", 3, 35 * MS, 1, 4),  # out of order: sorted by event index
        TokenEvent("r0", 1, 10 * MS, 1, 1),
        TokenEvent("r0", 2, 30 * MS, 2, 3),
        TokenEvent("r1", 1, 400 * MS, 1, 1),
        TokenEvent("r1", 2, 405 * MS, 0, 1),
        TokenEvent("r1", 3, 420 * MS, 1, 2),
        TokenEvent("r2", 1, 500 * MS, 5, 5),
        TokenEvent("x", 1, 0, 1, 1),
    ]
    got = _reduce(_parts(tmp_path, [events]), ["r0", "r1", "r2"], [0, 1, N_GROUPS])
    assert [list(v) for v in got.itl] == [[10.0, 10.0, 5.0], [20.0], []]
    assert got.has_events.tolist() == [True, True, True]
    assert got.tokens.tolist() == [4, 2, 0]
    # wall = arrival + row · 1 ms: r1's events at 401, 406, 421 ms, inside [300, 900)
    assert got.window_tokens.tolist() == [4.0, 2.0, 0.0]
    assert got.touched.tolist() == [True, True, False]


def _many() -> tuple[list[str], list[int], list[TokenEvent]]:
    rng = np.random.default_rng(5)
    ids = [f"r{i}" for i in range(12)]
    group = [i % N_GROUPS if i % 5 else N_GROUPS for i in range(12)]
    events = []
    for i, rid in enumerate(ids):
        t = i * 80 * MS
        for k in range(1, 10):
            t += int(rng.integers(1, 30)) * MS
            events.append(TokenEvent(rid, k, t, int(rng.integers(0, 4)), None))
    return ids, group, events


def _assert_same(a: EventSums, b: EventSums) -> None:
    assert len(a.itl) == len(b.itl) == N_GROUPS
    for x, y in zip(a.itl, b.itl, strict=True):
        np.testing.assert_array_equal(x, y)
    for f in ("has_events", "window_tokens", "touched", "tokens"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_parts_give_the_figures_of_the_whole(tmp_path: Path) -> None:
    ids, group, events = _many()
    whole = _reduce(_parts(tmp_path / "whole", [events]), ids, group)
    assert sum(v.size for v in whole.itl) > 50
    shuffled = [events[i] for i in np.random.default_rng(1).permutation(len(events))]
    by_request = [
        [e for e in shuffled if int(e.request_id[1:]) >= 8],  # later requests first
        [e for e in shuffled if int(e.request_id[1:]) < 3],
        [e for e in shuffled if 3 <= int(e.request_id[1:]) < 8],
    ]
    _assert_same(_reduce(_parts(tmp_path / "parts", by_request), ids, group), whole)


def test_a_request_split_across_parts_is_reduced_as_one(tmp_path: Path) -> None:
    ids, group, events = _many()
    whole = _reduce(_parts(tmp_path / "whole", [events]), ids, group)
    # r4's and r7's events alternate between two parts (a restarted worker reusing ids)
    split = {"r4", "r7"}
    a = [e for i, e in enumerate(events) if e.request_id not in split or i % 2]
    b = [e for i, e in enumerate(events) if e.request_id in split and not i % 2]
    _assert_same(_reduce(_parts(tmp_path / "parts", [a, b]), ids, group), whole)


def test_negative_count_of_a_success_is_an_artifact_error(tmp_path: Path) -> None:
    parts = _parts(tmp_path, [[TokenEvent("r0", 1, MS, 1, 1), TokenEvent("r0", 2, 2 * MS, -1, 0)]])
    with pytest.raises(ArtifactError, match=r"part-00001\.tokens\.parquet: .*negative"):
        _reduce(parts, ["r0"], [0])
    # a failed request's events count nowhere: no error
    assert _reduce(parts, ["r0"], [N_GROUPS]).tokens.tolist() == [0, 0, 0]
