"""Which path the NVMe store takes (gds, kvikio-compat or posix), and the kvikio file handle.

Whether kvikio can be taken is a pure function of two probes (does kvikio import, is there a CUDA driver) so
tests can replace either one; kvikio calls into libcuda for every read and write, host memory included, so a
machine without the driver must take the POSIX path even when kvikio is installed. Where both can be taken,
kvikio is the default, and a measurement may say otherwise (`choose_path`, `prefer_path`).
"""

from __future__ import annotations

import errno
import os
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


def kvikio_choice(
    *,
    import_kvikio: Callable[[], Any] | None = None,
    cuda_driver: Callable[[], bool] | None = None,
) -> PathChoice:
    """The kvikio path this machine can take ("gds" or "kvikio-compat"), or "posix" with the reason it cannot
    (no preference or setting is consulted: this is what the machine allows)."""
    kvikio = (import_kvikio or _import_kvikio)()
    if kvikio is None:
        return PathChoice("posix", "kvikio is not installed (pip install 'slide-io[gds]')")
    if not (cuda_driver or _cuda_driver)():
        return PathChoice("posix", "kvikio is installed but there is no CUDA driver (kvikio needs libcuda for every "
                                   "transfer)")
    if compat_preferred(kvikio):
        return PathChoice("kvikio-compat", "kvikio in compat mode (no GPUDirect Storage here)", kvikio)
    return PathChoice("gds", "kvikio with GPUDirect Storage", kvikio)


def select_path(
    want: str = "auto",
    *,
    import_kvikio: Callable[[], Any] | None = None,
    cuda_driver: Callable[[], bool] | None = None,
) -> PathChoice:
    """Pick the NVMe path: `want` is "auto", "kvikio" (fail if it cannot be had) or "posix".

    "auto" follows $SLIDE_IO_PATH where it is set (the same three words), else `prefer_path`'s preference,
    else takes kvikio wherever it runs."""
    if want not in WANTS:
        raise ValueError(f"slide-io: path must be 'auto', 'kvikio' or 'posix', got {want!r}")
    why = "asked for"
    if want == "auto":
        want, why = _preference()
    if want == "posix":
        return PathChoice("posix", why)
    choice = kvikio_choice(import_kvikio=import_kvikio, cuda_driver=cuda_driver)
    if choice.kvikio is None and want == "kvikio":
        raise RuntimeError(f"slide-io: the kvikio path was {why}, but {choice.reason}")
    if choice.kvikio is not None and want == "auto" and why:  # (kvikio kept by a measurement: say so)
        return PathChoice(choice.path, f"{choice.reason}; {why}", choice.kvikio)
    return choice


# -- choosing by measurement ----------------------------------------------------------------------------------

# Posix is taken over kvikio only when it is more than this much faster: two runs of one path on one drive
# differ by several percent, and kvikio is the path that can move device memory without staging.
MARGIN = 0.10
PATH_ENV = "SLIDE_IO_PATH"
WANTS = ("auto", "kvikio", "posix")
_preferred = PathChoice("auto", "")  # what prefer_path last said, for stores asked for "auto"


@dataclass(frozen=True)
class PathRates:
    """What one path moved on one drive, in GB/s (1e9 bytes per second)."""

    read_gbps: float
    write_gbps: float

    @property
    def round_trip_gbps(self) -> float:
        """Bytes per second over a write and a read of them, the way a step's states go out and come back."""
        if self.read_gbps <= 0 or self.write_gbps <= 0:
            return 0.0
        return 2 / (1 / self.read_gbps + 1 / self.write_gbps)


def choose_path(posix: PathRates, kvikio: PathRates | None, kvikio_path: str = "kvikio-compat",
                unavailable: str = "kvikio was not measured", margin: float = MARGIN) -> PathChoice:
    """The path a store should take from measured rates: `kvikio_path` ("gds" or "kvikio-compat") unless posix
    moves more than `margin` more per second written and read back, or kvikio was not measured (`kvikio` None,
    `unavailable` saying why). The reason names both rates."""
    if kvikio is None:
        return PathChoice("posix", f"{unavailable}; posix measured alone")
    ours, theirs = posix.round_trip_gbps, kvikio.round_trip_gbps
    if theirs <= 0:
        return PathChoice("posix", f"{kvikio_path} moved nothing in its measurement")
    ratio = ours / theirs
    rates = (f"(written then read: {ours:.3g} against {theirs:.3g} GB/s; posix is taken above "
             f"{1 + margin:.2f}x)")
    if ratio > 1 + margin:
        return PathChoice("posix", f"posix moved {ratio:.2f}x {kvikio_path}'s rate here {rates}")
    return PathChoice(kvikio_path, f"posix moved {ratio:.2f}x {kvikio_path}'s rate here {rates}")


def prefer_path(path: str | None, reason: str = "") -> None:
    """From now on, stores asked for "auto" take `path`: "posix", or kvikio where it runs ("kvikio", "gds",
    "kvikio-compat", and also "auto", "" or None, which clear the preference). `reason` is kept in each store's
    `path_reason`. $SLIDE_IO_PATH, where set, still comes first: it is the user's word."""
    global _preferred
    name = path or "auto"
    if name not in (*WANTS, *PATHS):
        raise ValueError(f"slide-io: a preferred path is one of {', '.join((*WANTS, *PATHS))}, got {path!r}")
    _preferred = PathChoice("posix" if name == "posix" else "auto", reason)


def _preference() -> tuple[str, str]:
    """What "auto" means now, and why: $SLIDE_IO_PATH, else prefer_path's word, else kvikio where it runs."""
    value = os.environ.get(PATH_ENV, "").strip()
    if value not in WANTS and value:
        raise ValueError(f"slide-io: ${PATH_ENV} must be 'auto', 'kvikio' or 'posix', got {value!r}")
    if value in ("kvikio", "posix"):
        return value, f"asked for by ${PATH_ENV}"
    if _preferred.path == "posix":
        return "posix", _preferred.reason or "preferred (slide_io.prefer_path)"
    return "auto", _preferred.reason


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
