"""The exit codes every command of calculet-load ends with (spec §15).

One declaration for the load generator and the analysis (which re-exports it): 0 pass,
1 correctness/reliability fail, 2 artifact/config invalid, 3 infrastructure invalid,
4 performance regression. Precedence when several apply: 2, then 3, then 1, then 4.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "EXIT_FAIL",
    "EXIT_INFRA",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_REGRESSION",
    "ExitCode",
    "RunStop",
]


class ExitCode(IntEnum):
    """Spec §15. Precedence when several apply: 2, then 3, then 1, then 4 (see docs)."""

    PASS = 0
    CORRECTNESS = 1
    INVALID_ARTIFACT = 2
    INFRASTRUCTURE = 3
    REGRESSION = 4


# The short names the drivers use (the same members).
EXIT_OK: int = ExitCode.PASS
EXIT_FAIL: int = ExitCode.CORRECTNESS
EXIT_INVALID: int = ExitCode.INVALID_ARTIFACT
EXIT_INFRA: int = ExitCode.INFRASTRUCTURE
EXIT_REGRESSION: int = ExitCode.REGRESSION


class RunStop(Exception):
    """A step ended the run early with an exit code and a one-line reason."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
