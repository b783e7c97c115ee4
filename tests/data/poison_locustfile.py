"""Test-only locustfile: calculet-load's, with one record poisoned after validation.

It stands for a bug that lets a value past every check upstream: the record with the
request id suffix `POISON_SUFFIX` gets `ext.server_output_tokens = 2**70` (beyond int64)
just before the sink. The sink must quarantine that one record, write the rest, and the
run must say it is incomplete (index, exit code, analyze).
"""

from __future__ import annotations

import dataclasses
import os

from calculet_load.locust.plugin import CalculetUser
from calculet_load.measure import session as _session

__all__ = ["CalculetUser"]

POISON_SUFFIX = os.environ.get("CALCULET_TEST_POISON_SUFFIX", ".00000050")
_make_record = _session.make_record


def _poisoned(*args, **kwargs):  # type: ignore[no-untyped-def]
    record = _make_record(*args, **kwargs)
    if record.request_id.endswith(POISON_SUFFIX):
        ext = dataclasses.replace(record.ext, server_output_tokens=2**70)
        record = dataclasses.replace(record, ext=ext)
    return record


_session.make_record = _poisoned
