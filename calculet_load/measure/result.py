"""What a programmed call gets back: one request's figures and its generated text.

`LLMResult` is what `LLMUser.llm.chat(...)` (calculet_load.locust.llmuser) and a
conversation's turn (calculet_load.workload.conversation) return: the record's figures
under short names, and the text the server generated, which the caller may send back in
its next turn. The text lives in memory only: the record, the token events, the logs and
the reports never hold it (measure.session writes neither it nor the prompt).
"""

from __future__ import annotations

import dataclasses

from calculet_load.measure.outcome import Outcome
from calculet_load.schema.records import RequestRecord


@dataclasses.dataclass(frozen=True, slots=True)
class LLMResult:
    """One request as its caller sees it; figures are None where the request did not
    reach them (a failed request has no TPOT or E2E)."""

    request_id: str
    ok: bool
    error_class: str | None
    output_tokens: int
    prompt_tokens: int | None  # as the client built it, else as the server counted it
    cached_prompt_tokens: int | None  # where the server says (null: it did not)
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    ttft_answer_ms: float | None  # a reasoning model's first answer token
    reasoning_tokens: int | None
    answer_tokens: int | None
    cancelled: bool
    unanswered: bool  # not a byte of an answer came (a closed loop pauses after one)
    # the answer's text and a reasoning model's thinking: memory only, never recorded
    text: str = dataclasses.field(repr=False)
    reasoning: str = dataclasses.field(repr=False)
    record: RequestRecord = dataclasses.field(repr=False)

    @classmethod
    def of(cls, record: RequestRecord, out: Outcome) -> LLMResult:
        d, e = record.durations_ms, record.ext
        return cls(
            request_id=record.request_id,
            ok=out.ok,
            error_class=out.error_class,
            output_tokens=out.output_tokens,
            prompt_tokens=record.workload.prompt_tokens,
            cached_prompt_tokens=e.cached_prompt_tokens,
            ttft_ms=d.ttft,
            tpot_ms=d.tpot,
            e2e_ms=d.e2e,
            ttft_answer_ms=e.ttft_answer_ms,
            reasoning_tokens=e.reasoning_tokens,
            answer_tokens=e.answer_tokens,
            cancelled=out.error_class == "cancelled",
            unanswered=out.unanswered,
            text=out.text or "",
            reasoning=out.reasoning_text or "",
            record=record,
        )
