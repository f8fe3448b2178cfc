"""Which positions a query sees, and the attention the blocks run with it.

Causal, within one document of a packed row (a padding position sees only itself, so no softmax row is empty),
and within the layer's sliding window if it has one. For FlexAttention that is a `BlockMask`: the row is cut
into tiles of `TILE` x `TILE` positions, tiles no query sees are skipped, tiles seen whole run unmasked, and only
tiles on a document's or the window's edge evaluate the rule per position, so no [S, S] tensor exists and packed
rows run at the speed of a fused kernel. On the CPU it is the dense [B, 1, S, S] mask that SDPA takes (boolean)
or HF's eager attention adds (float). `attend`, registered with transformers as `IMPLEMENTATION`, runs the
backend (backends.py) the head prepared.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch.nn.attention.flex_attention import BlockMask

from ..data import document_attention_mask

__all__ = ["IMPLEMENTATION", "TILE", "RowMask", "additive_mask", "attend", "attention_mask", "block_mask", "register",
           "row_mask", "tile_block_mask", "tile_of"]

IMPLEMENTATION = "slide"  # the name `attend` is registered under in transformers' attention functions
TILE = 128  # FlexAttention's default block of queries and keys


def attention_mask(document_ids: torch.Tensor | None, window: int | None, seq: int, device) -> torch.Tensor | None:
    """A boolean [B, 1, S, S] mask (True = may attend), or None when plain causal attention is exact."""
    if document_ids is None and (window is None or seq <= window):
        return None
    q = torch.arange(seq, device=device)
    if document_ids is None:
        allowed = (q[:, None] >= q[None, :])[None, None]
    else:
        allowed = document_attention_mask(document_ids)
    if window is not None:
        allowed = allowed & (q[:, None] - q[None, :] < window)
    return allowed


def additive_mask(allowed: torch.Tensor | None, seq: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The float mask HF's eager attention adds to its scores: 0 where `allowed`, the dtype's minimum elsewhere
    (causal where `allowed` is None). Eager attention applies no causal mask of its own."""
    if allowed is None:
        q = torch.arange(seq, device=device)
        allowed = (q[:, None] >= q[None, :])[None, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def block_mask(document_ids: torch.Tensor | None, window: int | None, seq: int, device) -> BlockMask:
    """The same rule as `attention_mask` as a FlexAttention BlockMask (batch 1, broadcast, without documents)."""
    return row_mask(document_ids, window, seq, device).block


@dataclass(frozen=True)
class RowMask:
    """A micro-batch's rows as FlexAttention sees them: the whole rows' BlockMask, and what a tile of queries
    makes its own from (each pair of `TILE`-position blocks partly or wholly seen, and the per-position rule)."""

    block: BlockMask
    partial: torch.Tensor  # [B or 1, blocks, blocks] bool, query block by key block
    whole: torch.Tensor
    rule: Callable


def row_mask(document_ids: torch.Tensor | None, window: int | None, seq: int, device) -> RowMask:
    """The same rule as `attention_mask` for FlexAttention.

    Each tile's lowest and highest document id decide it: a tile pair whose id ranges do not meet, or that lies
    above the diagonal or beyond the window, is skipped; one whose two tiles hold the same single document and no
    padding, below the diagonal and inside the window, is full. Padding gets ids of its own (one per position),
    so it sees only itself through the per-position rule, in its own tile. With documents in order along the row
    (as packing lays them) and no window, exactly the tiles holding an allowed pair are visited.
    """
    pos = torch.arange(seq, device=device)
    if document_ids is None:
        ids = torch.zeros(1, seq, dtype=torch.long, device=device)
    else:
        ids = torch.where(document_ids >= 0, document_ids.long(), -1 - pos)
    tiles = -(-seq // TILE)
    pad = torch.zeros(ids.shape[0], tiles * TILE - seq, dtype=torch.long, device=device) - 1
    tiled = torch.cat([ids if document_ids is None else document_ids.long(), pad], dim=1).view(-1, tiles, TILE)
    real = tiled >= 0
    big = torch.iinfo(torch.long).max
    lo = torch.where(real, tiled, big).amin(dim=-1)  # over the tile's documents (big, -1: none)
    hi = torch.where(real, tiled, -1).amax(dim=-1)
    padding = (~real).any(dim=-1)
    padding[:, -1] = (~real[:, -1, : seq - (tiles - 1) * TILE]).any(dim=-1)  # (beyond seq is not padding)
    t = torch.arange(tiles, device=device)
    below = t[:, None] - t[None, :]  # query tile minus key tile
    seen = (below >= 0) & (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    seen |= (below == 0) & padding[:, :, None]
    single = (lo == hi) & ~padding
    whole = (below > 0) & single[:, :, None] & single[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    if window is not None:
        seen &= (below - 1) * TILE + 1 < window  # the nearest pair of the two tiles is inside the window
        whole &= (below + 1) * TILE - 1 < window  # and the farthest
    partial = seen & ~whole

    if document_ids is None:  # (broadcast over the batch: FlexAttention's dense path calls it with every row's b)
        rule = _causal_rule(window)
    else:
        def rule(b, h, q, kv):
            ok = (q >= kv) & (ids[b, q] == ids[b, kv])
            return ok & (q - kv < window) if window is not None else ok

    return RowMask(_from_tables(partial, whole, rule, seq, seq), partial, whole, rule)


def tile_block_mask(rows: RowMask, start: int, end: int) -> BlockMask:
    """The BlockMask of queries [start, end) against keys [0, end) of `rows` (`start` a multiple of `TILE`): the
    tables' rows of the tile's query blocks up to its last key block, the rule at the tile's offset (a tensor, so
    one compiled kernel serves every tile)."""
    if start % TILE:
        raise ValueError(f"a FlexAttention query tile starts at a multiple of {TILE} positions, not at {start}")
    first, last = start // TILE, -(-end // TILE)
    offset = torch.tensor(start, device=rows.partial.device)
    rule = rows.rule

    def shifted(b, h, q, kv):
        return rule(b, h, q + offset, kv)

    return _from_tables(rows.partial[:, first:last, :last], rows.whole[:, first:last, :last], shifted,
                        end - start, end)


def _from_tables(partial: torch.Tensor, whole: torch.Tensor, rule: Callable, queries: int, keys: int) -> BlockMask:
    def ordered(dense):  # per query tile: how many key tiles, and their indices first
        dense = dense[:, None].to(torch.int32)
        order = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
        return dense.sum(dim=-1, dtype=torch.int32), order

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(whole), BLOCK_SIZE=TILE, mask_mod=rule,
                                    seq_lengths=(queries, keys))


def tile_of(allowed: torch.Tensor | None, start: int, end: int, device) -> torch.Tensor:
    """The [B, 1, end - start, end] rows of queries [start, end) of a dense boolean mask, or of the causal one
    where `allowed` is None: queries at an offset see keys up to their own position."""
    if allowed is not None:
        return allowed[:, :, start:end, :end]
    q, kv = torch.arange(start, end, device=device), torch.arange(end, device=device)
    return (q[:, None] >= kv[None, :])[None, None]


@functools.cache
def _causal_rule(window: int | None):
    """Causal attention's rule, within `window` where given: one function per window, so the compiled kernel sees
    the same rule every call."""
    def rule(b, h, q, kv):
        return (q >= kv) & (q - kv < window) if window is not None else q >= kv
    return rule


def attend(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    """A transformers attention function: the backend the head prepared for this layer kind runs it (its
    `attention_mask` is a `backends.Prepared`, or a query tile's `query_tiles.Tile`, whose keys and values
    become those of every position up to the tile's end)."""
    if not hasattr(attention_mask, "backend"):
        raise TypeError(f"the {IMPLEMENTATION} attention runs what a Slide head prepared, got {type(attention_mask)}")
    if hasattr(attention_mask, "extend"):
        key, value = attention_mask.extend(key, value)
        attention_mask = attention_mask.prepared
    return attention_mask.backend.attend(module, query, key, value, attention_mask, scaling, softcap, **kwargs)


def register() -> str:
    """Make `attend` a transformers attention implementation; returns its name, for `config._attn_implementation`."""
    transformers.AttentionInterface.register(IMPLEMENTATION, attend)
    return IMPLEMENTATION
