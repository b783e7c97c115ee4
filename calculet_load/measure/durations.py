"""Per-request durations of spec §2.2 from the t0..t6 stamps (integer monotonic ns).

Each returns milliseconds, or None when a stamp it needs is missing ("no data" is None,
never 0). Aggregation across requests is the analysis' job, not this module's.
"""

from __future__ import annotations

from calculet_load.schema.records import ClientNs, DurationsMs


def _ms(start: int | None, end: int | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start) / 1e6


def ttfh_ms(ns: ClientNs) -> float | None:
    """TTFH = t2 - t0: request start to response headers."""
    return _ms(ns.request_start, ns.response_headers)


def ttfe_ms(ns: ClientNs) -> float | None:
    """TTFE = t3 - t0: request start to the first valid stream event of any kind."""
    return _ms(ns.request_start, ns.first_event)


def ttft_ms(ns: ClientNs) -> float | None:
    """TTFT = t4 - t0: request start to the first event carrying a generated token."""
    return _ms(ns.request_start, ns.first_token)


def e2e_ms(ns: ClientNs) -> float | None:
    """E2E = t6 - t0: request start to the normal end of the response."""
    return _ms(ns.request_start, ns.response_end)


def tpot_ms(ns: ClientNs, output_tokens: int | None) -> float | None:
    """TPOT = (t5 - t4) / (output_tokens - 1); None when output_tokens <= 1.

    Per request; chunk token counts are used, so an event with k tokens counts k.
    """
    decode = _ms(ns.first_token, ns.last_token)
    if decode is None or output_tokens is None or output_tokens <= 1:
        return None
    return decode / (output_tokens - 1)


def output_tokens_per_s(ns: ClientNs, output_tokens: int | None) -> float | None:
    """(output_tokens - 1) / (t5 - t4) in tokens per second; None when undefined."""
    decode = _ms(ns.first_token, ns.last_token)
    if decode is None or not decode or output_tokens is None or output_tokens <= 1:
        return None
    return (output_tokens - 1) / (decode / 1e3)


def durations(ns: ClientNs, output_tokens: int | None) -> DurationsMs:
    return DurationsMs(
        ttfh=ttfh_ms(ns),
        ttfe=ttfe_ms(ns),
        ttft=ttft_ms(ns),
        tpot=tpot_ms(ns, output_tokens),
        e2e=e2e_ms(ns),
    )
