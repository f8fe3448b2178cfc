"""The POSIX path: one key's file moved with os.pwrite/os.preadv, O_DIRECT for its block-aligned part.

This is the path of CI (no CUDA driver), of ROCm machines (kvikio is NVIDIA-only) and of any machine
without kvikio. It moves host memory only; device tensors are staged through pinned buffers by the caller.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import torch

from slide_io.tensors import byte_array

# O_DIRECT wants buffer address, file offset and length aligned to the logical block size; 4096 covers
# both 512-byte and 4K-sector devices.
ALIGN = 4096


def open_direct(path: str) -> int | None:
    """An O_DIRECT descriptor for `path`, or None where the platform or filesystem refuses one (tmpfs...)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDWR | flag)
    except OSError as error:
        if error.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def _pwrite(fd: int, view: memoryview, offset: int) -> int:
    return os.pwrite(fd, view, offset)


def _pread(fd: int, view: memoryview, offset: int) -> int:
    # os.pread returns a new bytes object; preadv fills the caller's buffer in place.
    return os.preadv(fd, [view], offset)


def _transfer(op: Callable[[int, memoryview, int], int], fd: int, view: memoryview, offset: int) -> None:
    # The kernel may move fewer bytes than asked (signals, large requests): loop until all have moved.
    done = 0
    while done < len(view):
        moved = op(fd, view[done:], offset + done)
        if moved == 0:
            raise OSError(errno.EIO, "slide-io: the file ended before the transfer did")
        done += moved


class PosixFile:
    """One key's file. Whole 4 KiB blocks of an aligned buffer go through O_DIRECT (no page-cache copy,
    no cache pollution by 16 bytes/param of optimizer state); the rest, or all of an unaligned buffer,
    goes through the page cache."""

    def __init__(self, path: str, key: str, direct: bool) -> None:
        self.path = path
        self.key = key
        self.stamp: tuple[int, int, int] | None = None  # the file as the store last wrote it (NVMeStore sets it)
        self._fd = os.open(path, os.O_RDWR)
        self._direct_fd = open_direct(path) if direct else None

    @property
    def direct(self) -> bool:
        return self._direct_fd is not None

    def pwrite(self, tensor: torch.Tensor) -> None:
        self._move(_pwrite, memoryview(byte_array(tensor)), tensor.data_ptr())

    def pread(self, out: torch.Tensor) -> None:
        self._move(_pread, memoryview(byte_array(out)), out.data_ptr())

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd is not None:
                os.close(fd)
        self._direct_fd = None

    def _move(self, op: Callable[[int, memoryview, int], int], view: memoryview, address: int) -> None:
        head = 0
        if self._direct_fd is not None and address % ALIGN == 0:
            head = len(view) // ALIGN * ALIGN
            try:
                _transfer(op, self._direct_fd, view[:head], 0)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                # The device wants a larger alignment than we assumed: use the page cache from now on.
                os.close(self._direct_fd)
                self._direct_fd = None
                head = 0
        _transfer(op, self._fd, view[head:], head)
