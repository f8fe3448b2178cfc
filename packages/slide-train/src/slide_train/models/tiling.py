"""Sequence tiling inside a block: a layer's MLP run over tiles of the sequence, each tile's intermediates
recomputed in the backward, so only one tile's (rows x tile x intermediate) are alive at a time.

The MLP is per token, so tiles give the same outputs; its parameters' gradients are summed tile by tile (the
same terms in another order). Attention still sees the whole sequence, and a mixture of experts' layer is left
whole: its routing statistics and load-balancing loss are the whole micro-batch's.
"""

from __future__ import annotations

import torch
from torch import nn


class _TiledMLP(torch.autograd.Function):
    """y = mlp(x) over tiles of dim 1; the backward recomputes each tile with its graph and runs it back, which
    accumulates the parameters' gradients in place (they are the slot's gradient views) and gives x's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward, tile: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.forward, ctx.tile = forward, tile
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([forward(part) for part in x.split(tile, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        grads = []
        for part, grad_part in zip(x.split(ctx.tile, dim=1), grad.split(ctx.tile, dim=1)):
            part = part.detach().requires_grad_()
            with torch.enable_grad():
                out = ctx.forward(part)
            torch.autograd.backward(out, grad_part)
            grads.append(part.grad)
        return (torch.cat(grads, dim=1), None, None) + (None,) * (len(ctx.needs_input_grad) - 3)


def tile_mlp(mlp: nn.Module, tile: int) -> None:
    """Run `mlp` (a module mapping [rows, seq, hidden] to the same shape, token by token) over tiles of `tile`
    positions where the sequence is longer than that, in place (its parameters keep their names)."""
    forward = mlp.forward

    def tiled(x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] <= tile:  # (short rows: the MLP as it is, bit for bit)
            return forward(x)
        params = [p for p in mlp.parameters() if p.requires_grad]
        return _TiledMLP.apply(x, forward, tile, *params)

    mlp.forward = tiled
