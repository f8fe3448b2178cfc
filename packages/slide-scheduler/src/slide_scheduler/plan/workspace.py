"""What one block's recompute and backward hold on the device beside its parameters: whole rows, or tiles of the
sequence (attention by query tiles, the MLP by row tiles; slide-train's models/query_tiles.py and tiling.py).

Tiled, the whole-row tensors left are the block's output, its output's and input's gradients (the engine's), the
gradient of the residual after attention, the keys and values after rope (kept from the recompute's forward for the
backward), their gradients' accumulators (fp32 where the compute dtype is narrower) and the last tile's gradient
of the keys and values up to its end; the rest is one tile's intermediates, the attention half's or the MLP's,
never both at once.
"""

from __future__ import annotations

from .shapes import Shapes, StepShape

# One attention tile's intermediates per query, in units of the compute dtype, as widths: forward-saved input
# norm, projections, rope'd queries and keys, attention output, its reshaped copy and the output projection, and
# the backward's gradients of each (measured with saved-tensor hooks: test_query_tiles.py)
TILE_HIDDEN, TILE_QUERY, TILE_KV = 6, 8, 8


def block_workspace(shapes: Shapes, step: StepShape, sequence_tile: int, compute_bytes: int,
                    query_tiles: bool = True) -> int:
    """Device bytes of one block's recompute and backward over the step's micro-batches (tiled: the MLP by row
    tiles, and with `query_tiles` the attention by query tiles too)."""
    c, tokens, m = compute_bytes, step.tokens_per_micro, step.micro_batches
    act = tokens * shapes.hidden * c
    seq = step.seq_len or tokens
    rows = tokens // seq
    tile = rows * min(seq, sequence_tile or seq)  # (tokens of one tile over the micro-batch's rows)
    if not sequence_tile or seq <= sequence_tile or not query_tiles:  # (the attention half whole)
        return 3 * m * act + (tokens * 10 * shapes.hidden + tile * 4 * shapes.intermediate) * c
    kv = tokens * shapes.kv
    whole = (3 * m + 1) * act + kv * (2 * c + 2 * max(c, 4) + 2 * c)
    attention = tile * (TILE_HIDDEN * shapes.hidden + TILE_QUERY * shapes.queries + TILE_KV * shapes.kv) * c
    mlp = tile * 4 * shapes.intermediate * c
    return whole + max(attention, mlp)
