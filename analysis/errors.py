"""The analysis's error tree and exit codes (spec §15).

A user-facing error is one line that names the file or field; the CLI prints it and
exits with the error's code, without a traceback.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["AnalysisError", "ArtifactError", "ExitCode", "RulesError"]


class ExitCode(IntEnum):
    """Spec §15. Precedence when several apply: 2, then 3, then 1, then 4 (see docs)."""

    PASS = 0
    CORRECTNESS = 1
    INVALID_ARTIFACT = 2
    INFRASTRUCTURE = 3
    REGRESSION = 4


class AnalysisError(Exception):
    """Base of the errors the analysis reports to the user; `str()` is one line."""

    exit_code: ExitCode = ExitCode.INVALID_ARTIFACT


class ArtifactError(AnalysisError):
    """A run-folder file is missing, unreadable, corrupt or of a newer schema."""


class RulesError(AnalysisError):
    """The acceptance rules file is invalid; the message names the field path."""
