"""Where a run folder lives: a local path or an object-store URI, through pyarrow.fs.

The one resolver every writer (the sink, the scrapers) and reader (the analysis) uses.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

__all__ = ["resolve_fs"]


def resolve_fs(uri: str) -> tuple[pafs.FileSystem, str]:
    """A filesystem and a path inside it for a local path or a URI (s3://, file://)."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path
