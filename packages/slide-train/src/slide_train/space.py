"""Disk space for what a run writes (checkpoints, exports): checked before writing, and nothing half-written left
behind when the disk fills anyway."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable
from typing import TypeVar

from safetensors import SafetensorError

from slide_io import free_bytes, is_disk_full

from .errors import DiskFullError

T = TypeVar("T")


def write_within(where: pathlib.Path, needed: int, partial: pathlib.Path, write: Callable[[], T],
                 full: Callable[[int], DiskFullError]) -> T:
    """`write()`, once `needed` bytes are free at `where`. A full disk, before or during the write, raises
    `full(free bytes)`; during it, `partial` (where the write puts its files until done) is removed first."""
    if needed > (free := free_bytes(where)):
        raise full(free)
    try:
        return write()
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error
        if not is_disk_full(e):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise full(free_bytes(where)) from e
