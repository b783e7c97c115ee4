"""Where a run folder lives: a local path or an object-store URI, through pyarrow.fs.

The one resolver every writer (the sink, the scrapers) and reader (the analysis) uses.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs

__all__ = ["resolve_fs", "write_file"]


def resolve_fs(uri: str) -> tuple[pafs.FileSystem, str]:
    """A filesystem and a path inside it for a local path or a URI (s3://, file://)."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


def write_file(run_dir: str, rel: str, data: bytes) -> str:
    """Write `<run_dir>/<rel>` whole: a temporary file beside it, then a move, so a
    reader never sees half a file. Returns the path inside the filesystem."""
    fs, root = resolve_fs(run_dir)
    path = f"{root.rstrip('/')}/{rel}"
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    tmp = path + ".tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)
    return path
