"""Attention by query tiles inside a block: where rows are longer than a tile, a decoder layer's attention half (its
input norm, the HF attention module's own forward, and the norm after it where the family has one) runs over tiles
of queries in order, each tile against the keys and values of every position up to its end, as decoding with a
cache does. Each tile's rows go through the HF module itself, so q/k norms, rope, scaling, soft-capping and the
sliding window stay the family's; the backend runs a tile's queries at an offset (`Backend.tile`).

The keys and values after rope are kept whole, in one buffer filled tile by tile; nothing else of the row but the
block's input is saved. The backward recomputes tile by tile, last tile first: each tile's attention gives the
gradients of all keys and values up to its end, which are added into accumulators, and its own keys and values
take the accumulated gradient (theirs and every later tile's) into their own graph, down to the projections and
the tile's input. Rows no longer than a tile run the modules as they are, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .tiling import _deferred, _long


class KeyValues:
    """A row's keys and values after rope, [B, S, kv_heads, head_dim] each (token-major, so a prefix is one slice),
    written tile by tile in the forward; in the backward also their gradients, accumulated in fp32 where the
    compute dtype is narrower (a bf16 sum over dozens of tiles would drift), else in the compute dtype."""

    def __init__(self, seq: int, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        self.seq, self.keys, self.values = seq, keys, values
        self.grads: tuple[torch.Tensor, torch.Tensor] | None = None

    def write(self, key: torch.Tensor, value: torch.Tensor, start: int) -> None:
        """Tile keys and values in transformers' layout [B, kv_heads, T, head_dim], at position `start`."""
        if self.keys is None:
            b, heads, _, dim = key.shape
            self.keys = key.new_empty(b, self.seq, heads, dim)
            self.values = value.new_empty(b, self.seq, *value.shape[1::2])
        end = start + key.shape[2]
        self.keys[:, start:end] = key.transpose(1, 2)
        self.values[:, start:end] = value.transpose(1, 2)

    def prefix(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end) in transformers' layout (views)."""
        return self.keys[:, :end].transpose(1, 2), self.values[:, :end].transpose(1, 2)

    def accumulators(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.grads is None:
            dtype = torch.promote_types(self.keys.dtype, torch.float32)
            self.grads = (torch.zeros_like(self.keys, dtype=dtype), torch.zeros_like(self.values, dtype=dtype))
        return self.grads


class _Prefix(torch.autograd.Function):
    """A tile's keys and values -> those of every position up to the tile's end (the buffer's prefix, the tile's
    own already in it). Backward: the prefix's gradient is added into the accumulators, and the tile's own keys
    and values take theirs from there (complete once every later tile has run back)."""

    @staticmethod
    def forward(ctx, key, value, cache: KeyValues, start: int):
        ctx.cache, ctx.start, ctx.end = cache, start, start + key.shape[2]
        ctx.dtypes = (key.dtype, value.dtype)
        return cache.prefix(ctx.end)

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        keys, values = ctx.cache.accumulators()
        own = []
        for acc, grad, dtype in ((keys, grad_keys, ctx.dtypes[0]), (values, grad_values, ctx.dtypes[1])):
            if grad is not None:
                acc[:, :ctx.end] += grad.transpose(1, 2)
            own.append(acc[:, ctx.start:ctx.end].transpose(1, 2).to(dtype))
        return own[0], own[1], None, None


@dataclass
class Tile:
    """What a tile's attention call gets as its attention mask: the backend's context for queries [start, end)
    against keys [0, end) (`prepared`), and the row's keys and values. `extend` turns the tile's keys and values
    into the prefix's: written into the buffer in the forward, through `_Prefix` where a graph is recorded."""

    prepared: object  # backends.Prepared for the tile
    cache: KeyValues
    start: int

    @property
    def backend(self):
        return self.prepared.backend

    def extend(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled():  # (the backward's recompute: the buffer holds the forward's keys already)
            return _Prefix.apply(key, value, self.cache, self.start)
        self.cache.write(key, value, self.start)
        return self.cache.prefix(self.start + key.shape[2])


class _QueryTiles(torch.autograd.Function):
    """y = run(x) over query tiles of dim 1, in order; x and the keys and values saved. `run(part, start, cache)`
    is one tile's attention half. The backward recomputes the tiles last first and runs each back, which adds
    the parameters' gradients in place and gives x's, written tile by tile into one tensor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, run: Callable, tile: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.tile = run, tile
        cache, out = KeyValues(x.shape[1]), None
        with torch.no_grad():
            for start in range(0, x.shape[1], tile):
                y = run(x[:, start:start + tile], start, cache)
                if out is None:
                    out = y.new_empty(x.shape[:2] + y.shape[2:])
                out[:, start:start + y.shape[1]] = y
        ctx.save_for_backward(x, cache.keys, cache.values)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, keys, values = ctx.saved_tensors
        cache = KeyValues(x.shape[1], keys, values)
        grad_x = torch.empty_like(x)
        for start in reversed(range(0, x.shape[1], ctx.tile)):
            part = x[:, start:start + ctx.tile].detach().requires_grad_()
            with torch.enable_grad():
                out = ctx.run(part, start, cache)
            torch.autograd.backward(out, grad[:, start:start + part.shape[1]])
            grad_x[:, start:start + part.shape[1]] = part.grad
        return (grad_x, None, None) + (None,) * (len(ctx.needs_input_grad) - 3)


def _tile_kwargs(kwargs: dict, start: int, end: int, cache: KeyValues) -> dict:
    """The attention call's keyword arguments for the tile's rows: rotary tables and positions sliced, the mask
    the backend's context for the tile."""
    out = dict(kwargs)
    cos, sin = kwargs["position_embeddings"]
    out["position_embeddings"] = (cos[:, start:end], sin[:, start:end])
    if kwargs.get("position_ids") is not None:
        out["position_ids"] = kwargs["position_ids"][:, start:end]
    prepared = kwargs["attention_mask"]
    device = cos.device
    out["attention_mask"] = Tile(prepared.backend.tile(prepared, start, end, device), cache, start)
    return out


def tile_attention(attention: nn.Module, tile: int, before: nn.Module | None = None,
                   after: nn.Module | None = None) -> None:
    """Run `before`, the attention module and `after` (either norm may be left out) over query tiles of `tile`
    positions where the rows are longer than that, in place: the modules keep their parameters and names, and
    short rows run them as they are. The module is called as decoder layers call it: hidden states, then keyword
    arguments with the head's rotary tables and its prepared attention (`backends.Prepared`)."""
    own = attention.forward
    first = _deferred(before, tile) if before is not None else None
    last = _deferred(after, tile) if after is not None else None
    modules = [m for m in (before, attention, after) if m is not None]

    def tiled(hidden_states: torch.Tensor, **kwargs):
        if not _long(hidden_states, tile):  # (short rows: the module as it is, bit for bit)
            return own(hidden_states, **kwargs)

        def run(part: torch.Tensor, start: int, cache: KeyValues) -> torch.Tensor:
            h = first(part) if first is not None else part
            y = own(h, **_tile_kwargs(kwargs, start, start + part.shape[1], cache))[0]
            return last(y) if last is not None else y

        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        return _QueryTiles.apply(hidden_states, run, tile, *params), None

    attention.forward = tiled


def attention_norms(layer: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The norms around a decoder layer's attention, (before, after), None where it has none. Before: the input
    norm (OLMo 2/3 have none). After: the post-attention norm where it is applied to the attention's output
    (Gemma 2/3, which have a pre-feedforward norm for the MLP, and OLMo 2/3, which have no input norm), not
    Llama's, which is the MLP's input norm."""
    before = getattr(layer, "input_layernorm", None)
    post = getattr(layer, "post_attention_layernorm", None)
    after = post if getattr(layer, "pre_feedforward_layernorm", None) is not None or before is None else None
    return before, after


def tile_layer_attention(layer: nn.Module, tile: int) -> None:
    """Run a decoder layer's attention half over query tiles of `tile` positions where rows are longer than that
    (dense and mixture-of-experts layers alike)."""
    tile_attention(layer.self_attn, tile, *attention_norms(layer))
