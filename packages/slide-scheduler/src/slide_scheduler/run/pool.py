"""One host allocation shared by the boundary activations and the gradients exact clipping holds.

With clipping, every sliding block's gradient waits on the host for the global norm; the boundary activations
(the hidden state entering each block) wait there for the backward. Their lifetimes interleave:
- the backward reads boundary j (into block j's recompute) before it makes the gradient of any block below j;
- the next forward writes boundary j only after block j-1's forward, and every block up to j-1 has loaded its
  update by then: that load is the last read of the block's gradient, as long as the update runs whole (a split
  update's moments part reads the gradient again after the forward, so pooled blocks update whole).
So block i's gradient may lie over boundaries i+1 and up, never over 0..i. Boundaries are laid out from the
bottom, gradients from the top down, highest block first; the pool is as large as the activations, or as large
as the gradients need for each to stay clear of its own boundary and those below it.
"""

from __future__ import annotations

import torch

from slide_memory import host_empty

from ..plan.sizes import boundary_layout, page_round, pool_bytes, pool_layout

__all__ = ["SharedPool", "pool_bytes", "pool_layout"]  # (the layout is the plan's: sizes.py)


class SharedPool:
    """Host buffers for `blocks`' gradients (`grad_numel` elements of `dtype` each) and `boundaries` boundary
    activations, carved from one allocation made at the first forward, when the activations' sizes are known.

    A later step whose activations need more room gets a new allocation (`fit`). The old one still holds the
    gradients that step's updates read, on the host or by copies a CUDA stream has yet to run, which keep no
    Python reference to it: the pool keeps it until the engine says the step is over (`drop_replaced`)."""

    def __init__(self, blocks: list[int], grad_numel: int, dtype: torch.dtype, boundaries: int):
        self.blocks, self.grad_numel, self.dtype, self.boundaries = sorted(blocks), grad_numel, dtype, boundaries
        self.grad_bytes = page_round(grad_numel * dtype.itemsize)
        self.boundary_bytes = 0
        self.nbytes = 0
        self._micro: list[int] = []  # offset of each micro-batch's activation within a boundary
        self._buffer: torch.Tensor | None = None
        self._replaced: list[torch.Tensor] = []
        self._offsets: dict[int, int] = {}

    def fit(self, micro_bytes: list[int]) -> bool:
        """Make room for boundaries of micro-batch activations of these sizes; True when that took a new
        allocation (activations and gradients taken before live on in the old one). Within the room a boundary
        has, micro-batches are laid out afresh: the gradients' places do not move."""
        self._micro, total = boundary_layout(micro_bytes)
        if self._buffer is not None and total <= self.boundary_bytes:
            return False
        if self._buffer is not None:
            self._replaced.append(self._buffer)
        self.boundary_bytes = total
        self.nbytes, self._offsets = pool_layout(self.blocks, self.grad_bytes, total, self.boundaries)
        self._buffer = host_empty(self.nbytes, torch.uint8)
        return True

    def drop_replaced(self) -> None:
        """Let go of allocations `fit` replaced: call once nothing queued can still read them."""
        self._replaced.clear()

    def activation(self, boundary: int, micro: int, like: torch.Tensor) -> torch.Tensor:
        """The host buffer of `boundary`'s activation for micro-batch `micro`, shaped like `like`."""
        start = boundary * self.boundary_bytes + self._micro[micro]
        nbytes = like.numel() * like.element_size()
        return self._buffer[start : start + nbytes].view(like.dtype).view(like.shape)

    def gradient(self, block: int) -> torch.Tensor:
        """`block`'s flat gradient buffer (only after `fit`)."""
        start = self._offsets[block]
        return self._buffer[start : start + self.grad_numel * self.dtype.itemsize].view(self.dtype)
