"""The harness's own events, declared in one place (Locust-style hooks).

Listeners are plain callables. Firing an event nobody listens to costs one truth test,
so the per-token hooks can stay on in every run. Listeners run on the worker's event
loop (the request's greenlet): keep them in microseconds (count, bucket, enqueue), never
block. When the token events fire depends on the I/O engine (`--io-engine`): on `thread`
(the default) a request's token events fire together when it ends, with their arrival
stamps; on `gevent` each fires between reads, as it arrives.

    from calculet_load.events import events

    @events.first_token.add_listener
    def on_first(request_id: str, arrival_ns: int, **kw): ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class EventHook:
    """A list of listeners fired with keyword arguments; a failing listener is logged."""

    def __init__(self) -> None:
        self._handlers: list[Callable[..., Any]] = []

    def add_listener(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        self._handlers.append(handler)
        return handler

    def remove_listener(self, handler: Callable[..., Any]) -> None:
        self._handlers.remove(handler)

    def __bool__(self) -> bool:
        return bool(self._handlers)

    def fire(self, **kwargs: Any) -> None:
        for handler in self._handlers:
            try:
                handler(**kwargs)
            except Exception:
                log.exception("listener %r failed", handler)


class Events:
    first_token: EventHook
    """The first event that carried a generated token (t4) of a request arrived.

    :param request_id: the request's id
    :param arrival_ns: t4, client monotonic ns
    """

    token_event: EventHook
    """An event carrying generated tokens arrived.

    :param event: the `TokenEvent` (request id, event index, arrival ns, tokens, the
        server's cumulative count)
    """

    request_done: EventHook
    """A request ended (success or any error class); its record is final.

    :param record: the `RequestRecord`
    :param outcome: the client's `Outcome` (token events, server timings)
    """

    arrival_dropped: EventHook
    """An open-loop arrival found the in-flight cap full and was recorded as dropped.

    :param record: the dropped arrival's `RequestRecord`
    """

    def __init__(self) -> None:
        for name in self.__class__.__annotations__:
            setattr(self, name, EventHook())


events = Events()
