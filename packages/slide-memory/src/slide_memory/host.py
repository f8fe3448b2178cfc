"""Host memory: page-locked (pinned) buffers when a CUDA device is present, plain memory otherwise.

Pinned memory is what makes host<->device copies asynchronous and ~8x faster than pageable ones, so every
buffer that crosses PCIe on the hot path comes from here.
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch


def can_pin() -> bool:
    return torch.cuda.is_available()


def host_empty(numel: int, dtype: torch.dtype, pinned: bool | None = None) -> torch.Tensor:
    """A flat host buffer; pinned by default when a CUDA device is present."""
    pinned = can_pin() if pinned is None else pinned
    if not pinned:
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * dtype.itemsize
    if nbytes < EXACT_PIN_BYTES:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    return _registered(nbytes).view(dtype)


# torch's pinned allocator rounds each request up to a power of two (an 872 MB block takes 1 GiB, an 8B model's
# fp32 masters ~6 GiB more than they need), so large buffers are plain memory page-locked in place instead.
EXACT_PIN_BYTES = 1 << 20
PAGE = 4096


def _registered(nbytes: int) -> torch.Tensor:
    size = -(-nbytes // PAGE) * PAGE
    array = np.empty(size + PAGE, dtype=np.uint8)  # page-aligned start and end: no page shared with others
    start = -array.ctypes.data % PAGE
    array = array[start : start + size]
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(array.ctypes.data, size, 0)
    if int(err) != 0:  # still correct, only slower: copies from pageable memory are staged and synchronous
        warnings.warn(f"could not page-lock {size / 2**30:.2f} GiB of host memory (CUDA error {int(err)}; the "
                      "machine may limit locked memory, see ulimit -l): using pageable memory, copies will be slower",
                      stacklevel=3)
    else:  # unlocked when the array dies: torch keeps it alive as long as any tensor or view of it lives
        weakref.finalize(array, cudart.cudaHostUnregister, array.ctypes.data)
    return torch.from_numpy(array)[:nbytes]


def host_zeros(numel: int, dtype: torch.dtype, pinned: bool | None = None) -> torch.Tensor:
    return host_empty(numel, dtype, pinned).zero_()


class HostArena:
    """One large host allocation carved into tensors.

    Pinning many small buffers is slow and fragments the pinned pool; one arena is pinned once at start-up and
    never grows, which keeps the steady state allocation-free.
    """

    def __init__(self, nbytes: int, pinned: bool | None = None):
        self.buffer = host_empty(nbytes, torch.uint8, pinned)
        self.used = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        itemsize = dtype.itemsize
        base = self.buffer.data_ptr()
        start = self.used + (-(base + self.used)) % 128  # every tensor starts 128-byte aligned in memory
        end = start + numel * itemsize
        if end > self.nbytes:
            raise MemoryError(f"host arena of {self.nbytes} bytes cannot hold {end - self.used} more bytes")
        self.used = end
        return self.buffer[start:end].view(dtype)


class StagingRing:
    """`count` equal pinned host buffers taken round-robin: the one place gradients of many units pass through.

    Whoever takes a buffer must make sure its previous user is done with it; `owner` says who that was.
    """

    def __init__(self, count: int, numel: int, dtype: torch.dtype, pinned: bool | None = None):
        if count < 1:
            raise ValueError("a staging ring needs at least one buffer")
        self.buffers = [host_zeros(numel, dtype, pinned) for _ in range(count)]
        self.owners: list[object] = [None] * count
        self._next = 0

    def __len__(self) -> int:
        return len(self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def take(self, owner: object) -> tuple[torch.Tensor, object]:
        """The next buffer for `owner`, and the owner it had before (None the first time round)."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        previous, self.owners[i] = self.owners[i], owner
        return self.buffers[i], previous
