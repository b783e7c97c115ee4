"""Cross-talk under concurrency (spec §14.1: "no logits/KV cross-talk between requests").

The contract between `accept`'s crosstalk step, which sends, and the analysis, which
judges (analysis.judge.crosstalk). In a cell named `crosstalk:<case>` every request sends
the same greedy prompt (no per-request nonce): one of them alone (`ext.arrival` "single",
concurrency 1) is the reference, taken in the run; the others went out beside requests of
the other cases (closed loop or a burst, `workload.concurrency` > 1). Greedy output is a
function of the prompt alone, so each copy's token hash must equal its reference's: a
prefix cache that served the prompt to a copy changes how fast it prefilled, never what
it generated. A difference is a correctness failure naming both requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["CELL_PREFIX", "Comparison", "Difference", "Sent", "cell_name", "compare"]

CELL_PREFIX = "crosstalk:"


def cell_name(case: str) -> str:
    return f"{CELL_PREFIX}{case}"


@dataclass(frozen=True, slots=True)
class Sent:
    """What the comparison reads of one request record."""

    request_id: str
    cell: str
    arrival: str | None
    concurrency: int | None
    token_hash: str | None
    ok: bool
    burst_id: str | None = None

    @property
    def alone(self) -> bool:
        return self.arrival == "single"


@dataclass(frozen=True, slots=True)
class Difference:
    cell: str
    request_id: str
    reference_id: str
    concurrency: int | None
    arrival: str | None
    burst_id: str | None
    token_hash: str | None
    reference_hash: str

    def detail(self) -> dict[str, str | int | None]:
        """Both requests and how the copy was sent (a verdict's or step's detail row)."""
        return {
            "request_id": self.request_id,
            "reference_id": self.reference_id,
            "cell": self.cell,
            "concurrency": self.concurrency,
            "arrival": self.arrival,
            "burst_id": self.burst_id,
        }

    def describe(self) -> str:
        how = self.arrival or "concurrent"
        return (
            f"{self.request_id} ({how}, concurrency {self.concurrency}) generated other tokens "
            f"than its reference {self.reference_id} sent alone ({self.cell})"
        )


@dataclass(slots=True)
class Comparison:
    """`compared`: copies that succeeded and had a reference to compare with; `failed`:
    copies that did not succeed (their errors are the error-rate rule's);
    `without_reference`: cells whose reference failed or is missing."""

    compared: int = 0
    failed: int = 0
    references: dict[str, str] = field(default_factory=dict)  # cell -> reference request id
    differences: list[Difference] = field(default_factory=list)
    without_reference: list[str] = field(default_factory=list)


def compare(rows: Iterable[Sent]) -> Comparison:
    """Each concurrent copy's token hash against its cell's reference (the first
    successful request sent alone)."""
    rows = list(rows)
    ref: dict[str, Sent] = {}
    for r in rows:
        if r.alone and r.ok and r.token_hash and r.cell not in ref:
            ref[r.cell] = r
    out = Comparison(references={c: r.request_id for c, r in sorted(ref.items())})
    missing: set[str] = set()
    for r in rows:
        if r.alone:
            continue
        if not r.ok:
            out.failed += 1
            continue
        base = ref.get(r.cell)
        if base is None:
            missing.add(r.cell)
            continue
        out.compared += 1
        if r.token_hash != base.token_hash:
            out.differences.append(
                Difference(
                    cell=r.cell,
                    request_id=r.request_id,
                    reference_id=base.request_id,
                    concurrency=r.concurrency,
                    arrival=r.arrival,
                    burst_id=r.burst_id,
                    token_hash=r.token_hash,
                    reference_hash=str(base.token_hash),
                )
            )
    out.without_reference = sorted(missing)
    return out
