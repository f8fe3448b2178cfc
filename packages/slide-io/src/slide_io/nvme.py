"""NVMeStore: the disk tier, one preallocated file per key, through kvikio or plain POSIX I/O.

Why a file per key rather than one arena file with offsets: the filesystem is then the allocator (no
free list or fragmentation logic of ours to get wrong), a new key or a resized one lands in a fresh file
so a failing write never touches another key's bytes, and `delete` returns the space at once. Each file
is preallocated with fallocate when made, so a full disk shows up on a key's first write, and later
same-size rewrites reuse blocks already held. The cost is one open descriptor per key (hundreds for an
8B model's layers and states), which Linux handles easily.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import math
import os
import shutil
import tempfile

import torch

from slide_io.disk import free_bytes, preflight
from slide_io.errors import StoreCorruptError, StoreFullError, is_disk_full
from slide_io.kvikio_path import KvikioFile, bypass_page_cache, select_path
from slide_io.posix import PosixFile, open_direct
from slide_io.store import TensorStore


def _preallocate(fd: int, nbytes: int) -> None:
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # no fallocate here: a sparse file, and a full disk shows at write time


def _stamp(path: str) -> tuple[int, int, int]:  # (inode, modification time, size)
    """The file's identity and last change: a file replaced or written by another program differs."""
    status = os.stat(path)
    return status.st_ino, status.st_mtime_ns, status.st_size


class NVMeStore(TensorStore):
    """Tensors in files under a private folder of `directory`, removed again by `close()` (a scratch tier).

    `store.path` says how bytes move: "gds" (kvikio, GPUDirect Storage), "kvikio-compat" (kvikio doing
    POSIX I/O itself) or "posix" (os.pwrite/os.preadv here, O_DIRECT where allowed; host tensors only).
    `store.path_reason` says why. `path="auto"` takes $SLIDE_IO_PATH where set, else the path `prefer_path`
    named (a machine file's measured choice), else kvikio wherever it runs; "kvikio" and "posix" are taken as
    asked. `reserve` runs `preflight(directory, reserve)` first.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        workers: int = 4,
        path: str = "auto",
        direct: bool = True,
        reserve: int | None = None,
    ) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)
        if reserve is not None:
            preflight(self.directory, reserve)
        choice = select_path(path)
        self.path = choice.path
        self.path_reason = choice.reason
        self._kvikio = choice.kvikio
        # A private folder: two stores (or two runs) on one directory never see each other's files.
        self._root = tempfile.mkdtemp(prefix="slide-io-", dir=self.directory)
        self._names = itertools.count()
        # GDS moves bytes by DMA (no page cache); kvikio's compat path and ours ask for O_DIRECT.
        if not direct:
            self.direct = False
        elif self.path == "posix":
            self.direct = self._probe_direct()
        else:
            self.direct = self.path == "gds" or bypass_page_cache(self._kvikio)
        super().__init__(workers, "nvme")

    def _probe_direct(self) -> bool:
        probe = os.path.join(self._root, "direct-probe")
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT, 0o600))
        try:
            fd = open_direct(probe)
            if fd is not None:
                os.close(fd)
            return fd is not None
        finally:
            os.unlink(probe)

    def mapped(self, key: str) -> torch.Tensor:
        """`key`'s tensor as its file holds it, memory-mapped: pages are read from disk as they are touched and the
        page cache may drop them again, so a caller can walk many keys larger than RAM. It follows the file: use
        it before the key is written again. Writing to it changes only this process's copy of the touched page."""
        with self._lock:
            last = self._last.get(key)
        if last is not None:
            last.result()  # (the newest write of the key is in its file; its error, if it failed)
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"slide-io: no key {key!r} in this store")
        numel = math.prod(entry.shape)
        if numel == 0:  # (nothing to map)
            return torch.empty(entry.shape, dtype=entry.dtype)
        return torch.from_file(entry.room.path, shared=False, size=numel, dtype=entry.dtype).view(entry.shape)

    def _check_tensor(self, tensor: torch.Tensor) -> None:
        if self.path == "posix" and tensor.device.type != "cpu":
            raise ValueError(
                f"slide-io: the NVMe store's POSIX path ({self.path_reason}) moves host memory only; "
                f"stage the {tensor.device} tensor through a pinned host buffer"
            )

    def _full(self, key: str, nbytes: int) -> StoreFullError:
        return StoreFullError(self.directory, nbytes, free_bytes(self.directory), what=f"writing key {key!r}")

    def _allocate(self, key: str, nbytes: int) -> PosixFile | KvikioFile:
        name = os.path.join(self._root, f"{next(self._names):08d}.bin")
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _preallocate(fd, nbytes)
        except OSError as error:
            os.close(fd)
            os.unlink(name)
            if is_disk_full(error):
                raise self._full(key, nbytes) from error
            raise
        os.close(fd)
        if self._kvikio is not None:
            return KvikioFile(self._kvikio, name, key)
        return PosixFile(name, key, self.direct)

    def _put(self, room: PosixFile | KvikioFile, tensor: torch.Tensor) -> None:
        try:
            room.pwrite(tensor)
        except (OSError, RuntimeError) as error:
            if is_disk_full(error):
                raise self._full(room.key, tensor.numel() * tensor.element_size()) from error
            raise
        room.stamp = _stamp(room.path)  # what a read checks the file against

    def _get(self, room: PosixFile | KvikioFile, out: torch.Tensor) -> None:
        expected = out.numel() * out.element_size()
        stamp = _stamp(room.path) if os.path.exists(room.path) else None
        found = stamp[2] if stamp else 0
        if found < expected:  # (its size was set when it was made: anything shorter was cut from outside)
            raise StoreCorruptError(room.path, room.key, expected, found)
        if stamp != room.stamp:  # another file in its place, or written since
            raise StoreCorruptError(room.path, room.key, expected, found, changed=True)
        room.pread(out)

    def _release(self, room: PosixFile | KvikioFile) -> None:
        room.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(room.path)

    def _close_tier(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
