"""Which path the NVMe store takes (gds, kvikio-compat or posix), and the kvikio file handle.

The choice is a pure function of two probes (does kvikio import, is there a CUDA driver) so tests can
replace either one; kvikio calls into libcuda for every read and write, host memory included, so a
machine without the driver must take the POSIX path even when kvikio is installed.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from slide_io.tensors import byte_array, byte_tensor, nbytes_of

PATHS = ("gds", "kvikio-compat", "posix")


@dataclass(frozen=True)
class PathChoice:
    path: str  # one of PATHS
    reason: str  # why, in words, for the run's log
    kvikio: ModuleType | None = None


def _import_kvikio() -> ModuleType | None:
    try:
        import kvikio
        import kvikio.defaults  # a submodule that `import kvikio` does not bind
    except (ImportError, OSError):  # OSError: the wheel is there but its shared libraries do not load
        return None
    return kvikio


def _cuda_driver() -> bool:
    # torch.version.cuda is None on ROCm builds, where torch.cuda.is_available() means HIP.
    return torch.version.cuda is not None and torch.cuda.is_available()


def compat_preferred(kvikio: Any) -> bool:
    """Whether kvikio will do POSIX I/O itself (its compat mode) rather than cuFile/GDS, by its defaults."""
    defaults = kvikio.defaults
    if hasattr(defaults, "is_compat_mode_preferred"):
        return bool(defaults.is_compat_mode_preferred())  # resolves AUTO against this machine
    return bool(defaults.compat_mode())  # older kvikio: a plain bool


def select_path(
    want: str = "auto",
    *,
    import_kvikio: Callable[[], Any] | None = None,
    cuda_driver: Callable[[], bool] | None = None,
) -> PathChoice:
    """Pick the NVMe path: `want` is "auto", "kvikio" (fail if it cannot be had) or "posix"."""
    if want not in ("auto", "kvikio", "posix"):
        raise ValueError(f"slide-io: path must be 'auto', 'kvikio' or 'posix', got {want!r}")
    if want == "posix":
        return PathChoice("posix", "asked for")
    kvikio = (import_kvikio or _import_kvikio)()
    if kvikio is None:
        reason = "kvikio is not installed (pip install 'slide-io[gds]')"
    elif not (cuda_driver or _cuda_driver)():
        reason = "kvikio is installed but there is no CUDA driver (kvikio needs libcuda for every transfer)"
    elif compat_preferred(kvikio):
        return PathChoice("kvikio-compat", "kvikio in compat mode (no GPUDirect Storage here)", kvikio)
    else:
        return PathChoice("gds", "kvikio with GPUDirect Storage", kvikio)
    if want == "kvikio":
        raise RuntimeError(f"slide-io: the kvikio path was asked for, but {reason}")
    return PathChoice("posix", reason)


def bypass_page_cache(kvikio: Any) -> bool:
    """Ask kvikio's POSIX I/O to use O_DIRECT where buffers and offsets allow (its settings
    `auto_direct_io_read` and `auto_direct_io_write`); False where this kvikio has no such settings.
    Through the page cache, a host with spare RAM would measure its RAM, not the disk."""
    names = ("auto_direct_io_read", "auto_direct_io_write")
    try:
        kvikio.defaults.set(dict.fromkeys(names, True))
        return all(kvikio.defaults.get(name) for name in names)
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError):  # an older kvikio
        return False


class KvikioFile:
    """One key's file through kvikio's CuFile: device tensors go file<->GPU (DMA under GDS), host ones too."""

    def __init__(self, kvikio: Any, path: str, key: str) -> None:
        self.path = path
        self.key = key
        self.stamp: tuple[int, int, int] | None = None  # the file as the store last wrote it (NVMeStore sets it)
        self._file = kvikio.CuFile(path, "r+")

    def pwrite(self, tensor: torch.Tensor) -> None:
        self._check(self._file.pwrite(_buffer(tensor), nbytes_of(tensor), 0).get(), tensor)

    def pread(self, out: torch.Tensor) -> None:
        self._check(self._file.pread(_buffer(out), nbytes_of(out), 0).get(), out)

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def _check(moved: int, tensor: torch.Tensor) -> None:
        if moved != nbytes_of(tensor):
            raise OSError(errno.EIO, f"slide-io: kvikio moved {moved} of {nbytes_of(tensor)} bytes")


def _buffer(tensor: torch.Tensor) -> Any:
    # kvikio takes device memory through __cuda_array_interface__ (bf16 has no typestr there: use bytes)
    # and host memory through the buffer protocol.
    return byte_tensor(tensor) if tensor.device.type == "cuda" else byte_array(tensor)
