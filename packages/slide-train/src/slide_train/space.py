"""Disk space for what a run writes (checkpoints, exports): folders that take files, sizes counted from the
files' real sizes and checked before writing, and nothing half-written left behind when the disk fills anyway."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from safetensors import SafetensorError

from slide_io import free_bytes, is_disk_full

from .errors import ConfigError, DiskFullError

T = TypeVar("T")


def check_writable(key: str, folder: str | os.PathLike) -> None:
    """`folder` is, or can be made, a folder that takes files: a file is created and removed in it, or in the
    nearest folder above it that exists (which is left as it was)."""
    folder = pathlib.Path(folder).absolute()
    existing = folder
    try:
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(f"{key}: {existing} is a file, so {folder} cannot be a folder: choose another path")
        fd, probe = tempfile.mkstemp(prefix=".slide-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{key}: cannot create files in {existing} ({e.strerror or e}): set {key} to a folder on "
                          "a disk this user can write") from e

BLOCK = 4096  # a filesystem block: a file takes whole ones
ALLOWANCE = 64 << 10  # the margin's floor (its ceiling: the larger of this and 1% of the bytes)

# The order safetensors writes tensors in: dtypes from this end first, then names in order (it sorts by its own
# dtype enum, descending). Offsets follow that order, and their digits are part of the header's length.
_SAFETENSORS_ORDER = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E5M2FNUZ",
                      "F8_E4M3FNUZ", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"]
_SAFETENSORS_DTYPE = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.complex64: "C64", torch.float32: "F32",
    torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint16: "U16",
    torch.int16: "I16", torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL"}


@dataclasses.dataclass(frozen=True)
class Size:
    """What some files will take: their bytes, and how many files and folders hold them."""

    nbytes: int
    files: int = 0

    def __add__(self, other: Size) -> Size:
        return Size(self.nbytes + other.nbytes, self.files + other.files)

    @property
    def needed(self) -> int:
        """The free bytes to ask for: the bytes, plus the unused end of each file's (and folder's) last block,
        at most max(1%, 64 KiB) of the bytes."""
        return self.nbytes + min(BLOCK * self.files, max(self.nbytes // 100, ALLOWANCE))


def safetensors_bytes(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                      metadata: dict[str, str] | None = None) -> int:
    """The exact size of the safetensors file `save_file` writes for these (name, dtype, shape): an 8-byte
    length, the JSON header (tensors in the library's order, padded with spaces to 8 bytes), then the data."""
    entries = sorted(((name, _SAFETENSORS_DTYPE[dtype], dtype.itemsize, [int(n) for n in shape])
                      for name, dtype, shape in tensors),
                     key=lambda e: (_SAFETENSORS_ORDER.index(e[1]), e[0]))
    header: dict = {"__metadata__": metadata} if metadata is not None else {}
    offset = 0
    for name, code, itemsize, shape in entries:
        end = offset + itemsize * _numel(shape)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, end]}
        offset = end
    text = len(json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode())
    return 8 + -(-text // 8) * 8 + offset


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def files_size(paths: Iterable[pathlib.Path]) -> Size:
    """The bytes of these existing files (a folder: every file under it, and the folders)."""
    nbytes = files = 0
    for path in paths:
        found = [path, *path.rglob("*")] if path.is_dir() else [path]
        for p in found:
            nbytes += p.stat().st_size if p.is_file() else 0
            files += 1
    return Size(nbytes, files)


def filesystem_of(path: pathlib.Path) -> int:
    """The device id of the filesystem that holds, or will hold, `path` (its nearest existing ancestor's)."""
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path.stat().st_dev


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
