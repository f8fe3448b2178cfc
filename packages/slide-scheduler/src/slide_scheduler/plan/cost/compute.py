"""The compute lane: each block's forward and backward over the step (its GEMMs, a mixture's routed experts,
its attention, the kernels' launches) and the tail's loss."""

from __future__ import annotations

from ..placement import GPU, Placement
from .rates import Rates
from .work import step_tokens

LAUNCH_S = 1.5e-4  # per block, micro-batch and pass: the fixed cost of launching its kernels


def attention_pairs(seq: int, window: int = 0) -> float:
    """(query, key) pairs of one row's causal attention, each query seeing itself and the `window` - 1 tokens
    before it (0: every token before it): S^2 / 2 for a whole row."""
    w = min(window or seq, seq)
    return seq * w - w * w / 2


def attention_s(p: Placement, r: Rates, unit: int) -> float:
    """Block `unit`'s causal attention forward over the step, in causal_attention_flops' count: 4 FLOPs per
    (query, key) pair and attention width, every row."""
    s, seq = p.shapes, p.step.seq_len or p.step.tokens_per_micro
    rows = step_tokens(p) / seq
    rate = r.block_attention[unit - 1] if r.block_attention else r.attention  # (on the block's backend)
    return 4 * attention_pairs(seq, s.window(unit)) * (s.attention_width or s.hidden) * rows / rate


def gemms_s(p: Placement, r: Rates, unit: int) -> float:
    """Block `unit`'s GEMMs forward over the step: 2 FLOPs per parameter a token computes with, and token."""
    return 2 * p.shapes.active(unit) * step_tokens(p) / r.gemms


def routed_experts_s(p: Placement, r: Rates, unit: int) -> float:
    """What a mixture's routed experts add to (or take from) block `unit`'s GEMMs where their own rate is
    measured: their share of the GEMMs' FLOPs at that rate instead."""
    if not r.experts:
        return 0.0
    return 2 * p.shapes.routed(unit) * step_tokens(p) * (1 / r.experts - 1 / r.gemms)


def forward_s(p: Placement, r: Rates, unit: int) -> float:
    return gemms_s(p, r, unit) + routed_experts_s(p, r, unit) + attention_s(p, r, unit)


def launches_s(p: Placement, r: Rates) -> float:
    """One block's kernel launches in one pass, every micro-batch and sequence tile (none to speak of on a CPU
    device)."""
    return LAUNCH_S * p.step.micro_batches * p.tiles if r.pcie else 0.0


def tiled_recompute_s(p: Placement, r: Rates, unit: int) -> float:
    """What sequence tiles add to block `unit`'s backward: the engine's recompute runs the tiles without keeping
    their graphs, and the backward runs each tile's forward again with one, so the tiled work runs forward once
    more: the MLP (but a mixture's routed experts, whose MLP stays whole), and with query tiles the attention
    half's projections and attention too."""
    if not p.tiled:
        return 0.0
    s = p.shapes
    projections = s.hidden * 2 * (s.queries + s.kv)  # (q, k, v and o)
    mlp = s.active(unit) - s.routed(unit) - projections
    if not p.query_tiles:
        return 2 * mlp * step_tokens(p) / r.gemms
    return 2 * (mlp + projections) * step_tokens(p) / r.gemms + attention_s(p, r, unit)


def block_compute(p: Placement, r: Rates) -> tuple[list[float], list[float]]:
    """Each block's compute seconds in the forward and in the backward, which recomputes the forward and runs
    back at twice its work (tiled: and runs each tile's forward once more). With one landing set of activation
    buffers the backward also waits for each block's boundary activations to cross (only once the block after it
    is done)."""
    offloaded = p.boundaries_in(GPU) < p.shapes.num_blocks
    fetch = p.boundary_bytes / r.h2d if r.pcie and offloaded and p.landing_sets == 1 else 0.0
    launch = launches_s(p, r)
    units = range(1, p.shapes.num_blocks + 1)
    forward = [forward_s(p, r, u) + launch for u in units]
    backward = [3 * forward_s(p, r, u) + tiled_recompute_s(p, r, u) + (3 if p.tiled else 2) * launch + fetch
                for u in units]
    return forward, backward


def tail_s(p: Placement, r: Rates) -> float:
    """The loss: the output projection forward and backward (6 FLOPs per parameter and token), and on a CPU
    device the hidden states it reads through host memory."""
    s, tokens = p.shapes, step_tokens(p)
    vocab_numel = s.vocab * s.hidden if s.vocab else s.unit_numels[0] // 2
    return 6 * vocab_numel * tokens / r.gemms + 2 * tokens * s.hidden * p.compute_bytes / r.memory * (not r.pcie)
