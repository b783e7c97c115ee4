"""One request before the load: is the target there, does its TLS hold, does the endpoint
exist, and does it stream?

A run against a wrong URL (nothing listening, `https://` to a plain-HTTP server, a
server that is not an LLM endpoint) would otherwise send its whole load into errors and
end as if it had measured something. `preflight` sends one short streamed request, as
the run's requests go (the protocol's endpoint, the access's TLS, headers and key), and
says in one line what is wrong with the target, or nothing. It is not a record of the
run: its request id is its own, and nothing is written.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import gevent

from calculet_load.measure.connections import Endpoint
from calculet_load.measure.gevent_engine import GeventPool
from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.outcome import Outcome, Timeouts
from calculet_load.measure.protocols import Adapter, adapter_for
from calculet_load.schema.access import TargetAccess

REQUEST_ID = "calculet-preflight"  # its X-Request-Id: a proxy or a server can tell it apart
TIMEOUTS = Timeouts(connect_s=5.0, first_byte_s=30.0, idle_s=30.0, total_s=60.0)
# What an answer that is not an LLM endpoint's means of the target, by error class. An
# HTTP error with a JSON error body ({"error": ...}) is an LLM server's answer (a model it
# does not serve, a request it refuses, an overload): the run goes on and records it.
CAUSES = {
    "connect_refused": "nothing accepts connections there",
    "connect_timeout": "no connection within 5 s",
    "unreachable": "no route to it",
    "tls_verify": "its TLS certificate failed verification",
    "tls_handshake": "the TLS handshake failed (is it TLS at all?)",
    "connection_reset": "it closed the connection without an answer",
    "first_byte_timeout": "it answered nothing within 30 s",
    "pool_exhausted": "no connection could be opened",
    "auth": "it refused the credentials (--api-key-env, --api-key-file, --header)",
    "malformed_http": "it does not answer HTTP/1.1",
    "protocol_violation": "its answer is not the protocol's (does it stream SSE?)",
    "content_encoding": "it compresses its answer though asked not to",
}
HTTP_ERRORS = ("not_found", "http_4xx", "http_5xx", "http_other")
# A target that refuses the connection is asked again for this long: one started beside
# the run (a simulator in the background, a compose stack) may not listen yet.
STARTING_S = 5.0
STARTING_POLL_S = 0.25
NOT_JSON = ("non-JSON error body", "error body without an error object")


@dataclasses.dataclass(frozen=True, slots=True)
class Preflight:
    """What the one request found: `problem` (one line naming the URL and the cause) or
    None; `warning`: an LLM server's error answer (the run goes on and records its own)."""

    problem: str | None
    warning: str | None = None
    outcome: Outcome | None = None


def _send(access: TargetAccess, adapter: Adapter, body: dict[str, Any]) -> Outcome:
    pool = GeventPool(Endpoint(access), 1)
    try:
        return run_in_greenlet(
            lambda: pool.execute(adapter, body, REQUEST_ID, stream=True, timeouts=TIMEOUTS)
        )
    finally:
        pool.close()


def preflight(access: TargetAccess, protocol: str, model: str | None) -> Preflight:
    """Send one streamed request of one output token to the target (in a greenlet of its
    own: callable from anywhere)."""
    adapter = adapter_for(protocol)
    body = adapter.body(
        "Hello", 1, stream=True, model=model, temperature=0.0, seed=None, ignore_eos=False
    )
    url = f"{access.url}{adapter.path}"
    deadline = time.monotonic() + STARTING_S
    while True:
        out = _send(access, adapter, body)
        if out.error_class != "connect_refused" or time.monotonic() >= deadline:
            break
        gevent.sleep(STARTING_POLL_S)
    detail = (out.error_detail or "").split("\n", 1)[0][:160]
    said = (
        f"{out.error_class}: " + (f"HTTP {out.http_status}: " if out.http_status else "") + detail
    )
    if out.error_class in HTTP_ERRORS:
        if detail.startswith(NOT_JSON):
            # an LLM server's errors are JSON: this is some other server
            return Preflight(
                f"the target {url} is not usable: it is not an LLM endpoint ({said})", outcome=out
            )
        return Preflight(None, f"the target {url} answered its first request with {said}", out)
    if out.error_class in CAUSES:
        return Preflight(
            f"the target {url} is not usable: {CAUSES[out.error_class]} ({said})", outcome=out
        )
    return Preflight(None, outcome=out)
