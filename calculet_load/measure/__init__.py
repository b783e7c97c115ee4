"""Measuring one request: SSE parsing, protocol adapters, the timed client, durations, the
session, the Parquet sink, the self-watch, exact-length prompts, the OS names of the
client's threads.

The modules a response's reads go through run compiled when a build of these sources is
there (measure.native).
"""

from calculet_load.measure import native

native.enable(__path__)
