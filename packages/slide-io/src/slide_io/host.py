"""HostStore: the pinned host-memory tier (plain host memory where there is no CUDA to pin for)."""

from __future__ import annotations

import torch

from slide_io.store import TensorStore
from slide_io.tensors import byte_tensor, copy_and_wait


class HostStore(TensorStore):
    """Keeps each key in a host buffer made on its first write and reused by later writes of its size.

    Buffers are pinned when CUDA is available (pageable copies are ~8x slower), so a CUDA tensor moves
    to and from this store at PCIe speed.
    """

    def __init__(self, *, pin: bool | None = None, workers: int = 2) -> None:
        super().__init__(workers, "host")
        self.pinned = torch.cuda.is_available() if pin is None else pin

    def _allocate(self, key: str, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def _put(self, room: torch.Tensor, tensor: torch.Tensor) -> None:
        copy_and_wait(room, byte_tensor(tensor))

    def _get(self, room: torch.Tensor, out: torch.Tensor) -> None:
        copy_and_wait(byte_tensor(out), room)

    def _release(self, room: torch.Tensor) -> None:
        pass  # the buffer goes with its last reference
