"""A request's confirmed token total, and whether its per-event counts agree with it.

The per-event counts place a request's tokens in time (its token events, ITL); the
request's count is its confirmed total: the server's final total where a complete
response carried one (OpenAI's usage, llama.cpp's predicted count), else the per-event
counts' sum. Every token figure counts the totals (docs/measurement.md, "Token counts").
Pure: values in, values out (measure.request_state `conclude` applies them).
"""

from __future__ import annotations


def confirmed_total(
    events: int, server_total: int | None, complete: bool, source: str | None, counted: bool
) -> tuple[int, str | None, str | None]:
    """(the request's count, whose it is: "server" or "events", None without a count;
    the per-event source, "+usage_total" added where a chunk or tokenizer count differs
    from the server's total). `events`: the per-event counts' sum; `complete`: the
    response ended as its protocol says; `counted`: any event came (a whole response
    without usage has none to count: "missing")."""
    if complete and server_total is not None:
        if events != server_total and source in ("chunks", "tokenizer"):
            # chunks: one token each, but a chunk may carry several (llama.cpp holds a
            # token that ends inside a UTF-8 character back and sends it with the next);
            # a tokenizer counts each event's text alone, which can split or merge
            # differently from the model's own tokens
            source = f"{source}+usage_total"
        return server_total, "server", source
    return events, ("events" if counted and source != "missing" else None), source


def disagreement(events: int, total: int, source: str | None, slack: int) -> str | None:
    """Why per-event counts summing to `events` are not to be believed against the
    server's `total`, or None: they differ by more than the declared `slack`. Counting
    chunks gives a lower bound (a chunk carries at least one token): only more chunks
    than tokens disagree."""
    name = source.split("+")[0] if source else "events"
    if events > total + slack or (name != "chunks" and events < total - slack):
        return (
            f"per-event counts ({name}) sum to {events}, the server's total is {total}"
            f" (±{slack} slack)"
        )
    return None
