"""What a failed connection says about the network (spec §9/§15: a network break makes a
run infrastructure-invalid; a server that fails is judged on reliability).

One vocabulary for the client (calculet_load.measure.outcome), the RTT probe
(calculet_load.target.netprobe) and the analysis (analysis.tables.netbreaks), read from
what each failure is on the wire:

    refused        an RST answered the SYN: the host is up and nothing listens on the
                   port (a server that crashed or is restarting). Not the network.
    reset          an established connection was reset or closed: the peer (the server
                   or its proxy) did it. Not the network.
    connect_timeout  the SYN got no answer at all: packets are lost on the way (or the
                   host is gone). A network sign.
    unreachable    the kernel says there is no way to the host (EHOSTUNREACH,
                   ENETUNREACH, EHOSTDOWN, ENETDOWN: no route, a link down, ARP/ND
                   unanswered). A network sign.

This module imports nothing but the standard library (the analysis reads it).
"""

from __future__ import annotations

import errno

__all__ = [
    "NETWORK_ERROR_CLASSES",
    "NETWORK_PROBE_KINDS",
    "PROBE_FAILURE_KINDS",
    "UNREACHABLE_ERRNOS",
    "is_unreachable",
]

UNREACHABLE_ERRNOS = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN,
                                errno.ENETDOWN})  # fmt: skip

# Request records' error classes (calculet_load.measure.outcome.ERROR_CLASSES) that are a
# sign of a network break; connect_refused and connection_reset are the target's doing.
NETWORK_ERROR_CLASSES = ("connect_timeout", "unreachable")

# How one sample of the RTT/health probe failed (a round's `failures`: kind -> count).
PROBE_FAILURE_KINDS: dict[str, str] = {
    "connect_timeout": "the TCP connect got no answer within the probe's timeout",
    "unreachable": "no route to the target (host or network unreachable, link down)",
    "refused": "the target refused the TCP connection (nothing listens on the port)",
    "connect_error": "the TCP connect failed otherwise (name resolution, ...)",
    "health_timeout": "connected, but no /health response headers within the timeout",
    "reset": "connected, then the target reset or closed the connection",
    "health_error": "connected, then the /health exchange failed otherwise",
}
# the kinds that are a sign of a network break: the SYN was lost, or there is no route
NETWORK_PROBE_KINDS = ("connect_timeout", "unreachable")


def is_unreachable(exc: BaseException) -> bool:
    """Whether `exc` is the kernel saying there is no way to the host."""
    return isinstance(exc, OSError) and exc.errno in UNREACHABLE_ERRNOS
