"""What a failed request costs the master: Locust keys its failures table by the
exception's text, and each worker ships every key of the last 3 s to the master in its
report. calculet-load names a failure by its class and code (`failure_name`), so a
failure storm whose details vary per request (a request id, a token count in the
server's message) stays one entry, not one per request; the detail is in the record."""

from __future__ import annotations

import json
import subprocess
import sys

from calculet_load.locust.llmstats import failure_name


def test_a_failure_is_named_by_its_class_and_code_only() -> None:
    assert failure_name("http_5xx", "503") == "http_5xx: 503"
    assert failure_name("read_timeout", "read_timeout") == "read_timeout"
    assert failure_name("connect_refused", None) == "connect_refused"


# Locust's own statistics, in a process of their own (importing Locust patches gevent):
# 500 failures of one cell whose details all differ, named both ways.
_STORM = """
import json, sys
sys.path.insert(0, ".")
from locust.stats import RequestStats
from locust.rpc import Message
from calculet_load.locust.llmstats import failure_name
out = {}
for form in ("detail", "failure_name"):
    stats = RequestStats()
    for i in range(500):
        detail = f"context length exceeded: {4096 + i} tokens requested (req-{i:06d})"
        text = f"http_4xx: {detail}" if form == "detail" else failure_name("http_4xx", "400")
        stats.log_error("llama", "p128-o32", Exception(text))
    wire = Message("stats", {"errors": stats.serialize_errors()}, "w").serialize()
    out[form] = [len(stats.errors), len(wire)]
print(json.dumps(out))
"""


def test_a_failure_storm_is_one_entry_on_the_wire() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _STORM], capture_output=True, text=True, timeout=60, check=True
    )
    out = json.loads(done.stdout.splitlines()[-1])
    entries, wire = out["failure_name"]
    assert entries == 1 and wire < 512, out
    # keyed by the detail, as the text was before: one entry, and its bytes, per request
    entries, wire = out["detail"]
    assert entries == 500 and wire > 500 * 60, out
