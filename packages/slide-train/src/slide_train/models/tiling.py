"""Sequence tiling inside a block: the per-token work around a decoder layer's MLP run over tiles of the sequence,
each tile recomputed in the backward, so only one tile's intermediates are alive at a time.

The norm before the MLP, the MLP and the norm after it (Gemma 2/3's and OLMo 2/3's post-feedforward norm), found
by the layer's attributes, run as one function of the residual stream: the norms pass long rows through unchanged
where the layer calls them, and are applied tile by tile inside it, so neither their outputs nor the MLP's
intermediates are kept whole. Everything tiled is per token, so tiles give the same outputs; parameters' gradients
are summed tile by tile (the same terms in another order). Rows no longer than a tile run the modules as they
are, bit for bit.

Attention sees the whole sequence, and a mixture of experts' MLP is left whole: its routing statistics and
load-balancing loss are the whole micro-batch's. The input norm stays whole too: its output feeds three
projections the attention calls one by one, so tiling it would mean three tiled functions, each with its own norm
backward (the input's gradient then sums three rounded norm backwards, not one), for one hidden state per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class _Tiled(torch.autograd.Function):
    """y = fn(x) over tiles of dim 1, x alone saved; the backward recomputes each tile with its graph and runs it
    back, which accumulates the parameters' gradients in place (they are the slot's gradient views) and gives
    x's. Outputs and input gradients are written tile by tile into one tensor (no list of tiles to concatenate)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn, tile: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.tile = fn, tile
        ctx.save_for_backward(x)
        out = None
        with torch.no_grad():
            for start, part in zip(range(0, x.shape[1], tile), x.split(tile, dim=1)):
                y = fn(part)
                if out is None:
                    out = y.new_empty(x.shape[:2] + y.shape[2:])
                out[:, start:start + part.shape[1]] = y
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        for start, part, grad_part in zip(range(0, x.shape[1], ctx.tile), x.split(ctx.tile, dim=1),
                                          grad.split(ctx.tile, dim=1)):
            part = part.detach().requires_grad_()
            with torch.enable_grad():
                out = ctx.fn(part)
            torch.autograd.backward(out, grad_part)
            grad_x[:, start:start + part.shape[1]] = part.grad
        return (grad_x, None, None) + (None,) * (len(ctx.needs_input_grad) - 3)


def _long(x: torch.Tensor, tile: int) -> bool:
    return x.dim() >= 2 and x.shape[1] > tile


def _deferred(norm: nn.Module, tile: int) -> Callable:
    """`norm`'s own forward; from here on the norm passes rows longer than `tile` through unchanged, for the tiled
    function it feeds to apply it tile by tile (patched once, should a layer be tiled twice)."""
    own = norm.__dict__.get("_tiled_own_forward")
    if own is None:
        own = norm.forward

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            return x if _long(x, tile) else own(x, *args, **kwargs)

        norm._tiled_own_forward, norm.forward = own, forward
    return own


def tile_through(module: nn.Module, tile: int, before: nn.Module | None = None,
                 after: nn.Module | None = None) -> None:
    """Run `before`, `module` and `after` (each mapping [rows, seq, ...] token by token; either norm may be left
    out) as one function over tiles of `tile` positions where the rows are longer than that, in place: the
    modules keep their parameters and names, and short rows run them as they are."""
    own = module.forward
    first = _deferred(before, tile) if before is not None else None
    last = _deferred(after, tile) if after is not None else None
    modules = [m for m in (before, module, after) if m is not None]

    def fn(x: torch.Tensor) -> torch.Tensor:
        x = own(first(x) if first is not None else x)
        return last(x) if last is not None else x

    def tiled(x: torch.Tensor) -> torch.Tensor:
        if not _long(x, tile):  # (short rows: the module as it is, bit for bit)
            return own(x)
        # (the parameters as they are now, the engine's slot views: the function's gradients reach them)
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        return _Tiled.apply(x, fn, tile, *params)

    module.forward = tiled


def mlp_norms(layer: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The norms around a decoder layer's MLP, (before, after), None where it has none. Before: Gemma 2/3's
    pre-feedforward norm, else the post-attention norm of a layer that also has an input norm (Llama's shape: the
    attention reads the input norm's output, the MLP the post-attention norm's); a layer without an input norm
    (OLMo 2/3) applies its post-attention norm to the attention's output. After: the post-feedforward norm."""
    before = getattr(layer, "pre_feedforward_layernorm", None)
    if before is None and getattr(layer, "input_layernorm", None) is not None:
        before = getattr(layer, "post_attention_layernorm", None)
    return before, getattr(layer, "post_feedforward_layernorm", None)


def tile_layer(layer: nn.Module, tile: int) -> bool:
    """Run a decoder layer's dense MLP, with the norms around it, over tiles of `tile` positions where rows are
    longer than that; False where its MLP is a mixture of experts (left whole)."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module) or hasattr(mlp, "experts"):
        return False
    tile_through(mlp, tile, *mlp_norms(layer))
    return True
