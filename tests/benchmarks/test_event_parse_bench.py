"""A smoke of benchmarks/event_parse.py: Part 1's hot loop, briefly.

Checks the machinery, not the figures (those need a quiet machine and their own run):
each protocol's response is read on both paths to its 64 tokens (the benchmark asserts
that), and a line per protocol gives both costs and their ratio.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_part_one_reads_each_protocol_both_ways() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "event_parse.py"), "--repeat", "30"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", done.stdout, re.M)
    assert [r[0] for r in rows] == ["openai-completions", "openai-chat", "llama"], done.stdout
    for _, fast, general, ratio in rows:
        assert float(fast) > 0 and float(general) > 0
        assert abs(float(fast) / float(general) - float(ratio)) < 0.01
