"""The exit codes every command of calculet-load ends with (spec §15).

One declaration for the load generator and the analysis (which re-exports it): 0 pass,
1 correctness/reliability fail, 2 artifact/config invalid, 3 infrastructure invalid,
4 performance regression. Precedence when several apply: 2, then 3, then 1, then 4.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode"]


class ExitCode(IntEnum):
    """Spec §15. Precedence when several apply: 2, then 3, then 1, then 4 (see docs)."""

    PASS = 0
    CORRECTNESS = 1
    INVALID_ARTIFACT = 2
    INFRASTRUCTURE = 3
    REGRESSION = 4
