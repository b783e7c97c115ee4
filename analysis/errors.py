"""The analysis's error tree and exit codes (spec §15).

A user-facing error is one line that names the file or field; the CLI prints it and
exits with the error's code, without a traceback.
"""

from __future__ import annotations

from calculet_load.errors import ExitCode

__all__ = ["AnalysisError", "ArtifactError", "ExitCode", "RulesError"]


class AnalysisError(Exception):
    """Base of the errors the analysis reports to the user; `str()` is one line."""

    exit_code: ExitCode = ExitCode.INVALID_ARTIFACT


class ArtifactError(AnalysisError):
    """A run-folder file is missing, unreadable, corrupt or of a newer schema."""


class RulesError(AnalysisError):
    """The acceptance rules file is invalid; the message names the field path."""
