"""Disk preflight: fail before a run starts, not an hour into it, when a directory is too small."""

from __future__ import annotations

import os
import shutil

from slide_io.errors import StoreFullError


def free_bytes(directory: str | os.PathLike[str]) -> int:
    """Free bytes (for an unprivileged user) on the filesystem that holds, or will hold, `directory`."""
    path = os.path.abspath(os.fspath(directory))
    # The run may create the directory later: measure the nearest ancestor that exists.
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return shutil.disk_usage(path).free


def preflight(directory: str | os.PathLike[str], nbytes: int) -> int:
    """Check that `directory` has at least `nbytes` free; return the free bytes, or raise StoreFullError."""
    if nbytes < 0:
        raise ValueError(f"slide-io: preflight needs a byte count >= 0, got {nbytes}")
    free = free_bytes(directory)
    if free < nbytes:
        raise StoreFullError(os.path.abspath(os.fspath(directory)), nbytes, free, what="preflight")
    return free
