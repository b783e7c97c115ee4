"""Small helpers shared by the simulator tests: prompts, concurrent requests, trace views."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tests.support.simproc import SimProcess, Stream

T = TypeVar("T")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LLAMA = "/completion"


def prompt_ids(n: int, salt: int = 0) -> list[int]:
    """`n` in-vocabulary word-token ids (vocab 32000, words from 259), distinct per salt."""
    return [300 + (i * 7919 + salt * 104_729) % 31_000 for i in range(n)]


def parallel(fn: Callable[[int], T], n: int) -> list[T]:
    """Run fn(0..n-1) at once on n threads; results in index order."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


def llama(sim: SimProcess, prompt: Any, n: int, rid: str | None = None, **kw: Any) -> Stream:
    body = {"prompt": prompt, "n_predict": n, "stream": True, "ignore_eos": True, **kw}
    s = sim.stream(LLAMA, body, headers={"X-Request-Id": rid} if rid else None)
    assert s.status == 200, s.raw[:300]
    return s


def llama_ids(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for t in e.get("tokens", [])]


def by_request(rows: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("request_id") is not None:
            out[r["request_id"]].append(r)
    return out


def device_ms(steps: list[dict[str, Any]], rid: str, kind: str) -> list[float]:
    return [r["device_wait_ms"] for r in steps if r["request_id"] == rid and r["kind"] == kind]


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def wait_steps(sim: SimProcess, rids: Iterable[str]) -> list[dict[str, Any]]:
    """steps.jsonl rows once every request in `rids` has its rows flushed."""
    want = set(rids)

    def ready() -> list[dict[str, Any]] | None:
        rows = sim.traces("steps")
        return rows if want <= {r["request_id"] for r in rows} else None

    rows: list[dict[str, Any]] = sim.wait_for(ready, what=f"steps rows of {sorted(want)}")
    return rows
