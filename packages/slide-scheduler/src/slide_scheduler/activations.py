"""Boundary activations: the hidden state entering each block, per micro-batch, kept for the backward recompute.

They are the only activations kept across a step (everything inside a block is recomputed), and they can live on
the device or on the host ("cpu" tier) so that device memory does not grow with depth.
"""

from __future__ import annotations

import torch

from slide_memory import host_empty


class ActivationStore:
    def __init__(self, tier: str, device: torch.device):
        if tier not in ("none", "cpu"):
            raise ValueError(f"activation tier must be 'none' (keep on device) or 'cpu', got {tier!r}")
        self.offload = tier == "cpu"  # on a CPU device this still copies, so CI exercises the same path
        self.device = device
        self._saved: dict[tuple[int, int], torch.Tensor] = {}

    def put(self, boundary: int, micro: int, hidden: torch.Tensor) -> None:
        if not self.offload:
            self._saved[boundary, micro] = hidden
            return
        buf = self._saved.get((boundary, micro))
        if buf is None or buf.shape != hidden.shape or buf.dtype != hidden.dtype:
            # First step (or a new shape): the host buffer is kept and reused by every later step.
            buf = host_empty(hidden.numel(), hidden.dtype).view(hidden.shape)
            self._saved[boundary, micro] = buf
        buf.copy_(hidden)

    def get(self, boundary: int, micro: int) -> torch.Tensor:
        """The saved activation on the device, detached and ready to take a gradient."""
        saved = self._saved[boundary, micro]
        return saved.to(self.device).detach().requires_grad_()

    def host_bytes(self) -> int:
        return sum(t.nbytes for t in self._saved.values()) if self.offload else 0
