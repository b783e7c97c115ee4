"""Cross-talk under concurrency as a step of `calculet-load accept` (spec §14.1).

After golden before, each greedy case of the golden set is sent once alone (its
reference, taken in this run), then the cases are sent side by side: a closed loop of
`concurrency` users and `ROUNDS` bursts of `concurrency` requests fired at one instant,
every request a copy of one case's prompt (`reuse`: no per-request nonce). Cases with
different prompts run together, so a token leaking from one request into another
changes the copy's output (two copies of one prompt would hide it). Each copy's token
hash is compared with its reference's (calculet_load.schema.crosstalk); the analysis
judges the same records again (the `crosstalk` rule, analysis.judge.crosstalk).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import gevent

from calculet_drivers.accept.acceptrun import AcceptRun
from calculet_drivers.skeleton.steps import StepResult
from calculet_load.errors import EXIT_FAIL
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.prompts import Prompt
from calculet_load.measure.session import RequestSpec, Session, golden_spec
from calculet_load.schema.crosstalk import Sent, cell_name, compare
from calculet_load.schema.records import RequestRecord
from calculet_load.workload.matrix import GoldenCase

__all__ = ["ROUNDS", "crosstalk", "greedy_cases", "run_crosstalk"]

ROUNDS = 2  # closed-loop requests per user, and bursts


def crosstalk(run: AcceptRun) -> StepResult:
    """The step: a difference makes the run a correctness failure (exit 1) and the run
    goes on (the analysis shows it)."""
    if run.golden is None:
        return StepResult.not_available("no golden set given: nothing to compare")
    n = run.o.crosstalk_concurrency
    result = run_in_greenlet(
        functools.partial(run_crosstalk, run.client.session, run.prompt, run.golden.cases, n,
                          run.manifest.run_id)
    )  # fmt: skip
    d = result.detail
    if d.get("differences"):
        run.code = EXIT_FAIL
        run.notes.append(f"crosstalk: {result.reason}")
    run.say(
        f"crosstalk at concurrency {n}: {d.get('different', 0)} of "
        f"{d.get('compared', 0)} copies differ from their reference sent alone"
    )
    return result


def greedy_cases(cases: Sequence[GoldenCase]) -> list[GoldenCase]:
    return [c for c in cases if c.temperature == 0]


def _sent(record: RequestRecord) -> Sent:
    return Sent(
        request_id=record.request_id,
        cell=record.ext.cell or "",
        arrival=record.ext.arrival,
        concurrency=record.workload.concurrency,
        token_hash=record.result.token_hash,
        ok=record.ext.error_class is None,
        burst_id=record.ext.burst_id,
    )


def run_crosstalk(
    session: Session,
    prompt: Callable[[int, int], Prompt],
    cases: Sequence[GoldenCase],
    concurrency: int,
    run_id: str,
) -> StepResult:
    """Send the references and the concurrent copies (blocks until all ended) and
    compare: failed, naming both requests and the concurrency, when a copy differs."""
    cases = greedy_cases(cases)
    if not cases:
        return StepResult.not_available("the golden set has no greedy case (temperature 0)")
    specs = [golden_spec(c, prompt(c.prompt_tokens, c.sample), cell_name(c.name)) for c in cases]
    records = [session.send(s)[0] for s in specs]  # the references, one at a time

    def copy(k: int, **over: Any) -> RequestSpec:
        return golden_spec(
            cases[k % len(cases)], specs[k % len(cases)].prompt, specs[k % len(cases)].cell or "",
            concurrency=concurrency, **over,
        )  # fmt: skip

    keys = iter(range(concurrency * ROUNDS))  # each user takes the next case when free

    def user() -> None:
        for k in keys:
            records.append(session.send(copy(k, arrival="closed"))[0])

    gevent.joinall([gevent.spawn(user) for _ in range(concurrency)])
    session.pool.prewarm(concurrency)
    for r in range(ROUNDS):
        burst = f"{run_id}.crosstalk.{r:03d}"
        batch = [copy(k, arrival="burst", burst_id=burst) for k in range(concurrency)]
        sent = gevent.joinall([gevent.spawn(session.send, s) for s in batch])
        records += [g.value[0] for g in sent]
    result = compare(_sent(r) for r in records)
    detail: dict[str, Any] = {
        "concurrency": concurrency,
        "cases": [c.name for c in cases],
        "requests": len(records),
        "compared": result.compared,
        "different": len(result.differences),
        "failed": result.failed,
        "references": result.references,
        "differences": [d.detail() for d in result.differences[:20]],
        "without_reference": result.without_reference,
    }
    if result.differences:
        first = result.differences[0]
        return StepResult.failed(
            f"{len(result.differences)} of {result.compared} concurrent copies differ from "
            f"their reference; first: {first.describe()}",
            **detail,
        )
    if result.without_reference:
        return StepResult.failed(
            f"no reference for {', '.join(result.without_reference)}: the request sent "
            "alone failed",
            **detail,
        )
    return StepResult.ok(**detail)
