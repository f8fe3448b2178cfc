"""Mixture-of-experts experts (Qwen3-MoE, OLMoE, Mixtral): grouped Triton GEMMs with SwiGLU fused between them.

`moe_experts(x, top_k_index, top_k_weights, gate_up_proj, down_proj)` is what transformers' experts module
computes from the router's choice: each token's hidden row goes through each of its top-k experts,
`down[e] @ (silu(gate[e] @ x) * (up[e] @ x))`, and the k results are summed weighted by the routing weights.
The weights are transformers' 3-D parameters as they are stored: `gate_up_proj` [E, 2I, H] (gate rows, then up
rows) and `down_proj` [E, H, I].

The (token, k) pairs are sorted by expert once per call; each expert's pairs are then a run of consecutive
"rows", and every GEMM is one launch over all experts' runs (a program finds its expert and rows from the
per-expert offsets). Rows are never copied out: the GEMMs read the token's hidden row (and in the backward the
token's output gradient) where it lies. Forward: `_gate_up_kernel` gives `h = silu(x W_g^T) * (x W_u^T)` per
row; `_scatter_gemm_kernel` multiplies by `down_proj`, scales by the routing weight and stores each row at its
(token, k) slot, and the k slots of a token are summed. Pair ids outside [0, E) (transformers' expert-parallel
sentinels) contribute nothing.

Nothing but the inputs is saved for the backward, which sorts the pairs again and recomputes the gate and up
projections in the same program that multiplies the output gradient by `down_proj` (one pass over H for three
products), giving the SwiGLU gradient, the routing weights' gradient and `h` (scaled) for the down weights'
gradient. The input gradient is one more scatter GEMM; the weight gradients are one launch each over
(expert, tile), each summing over its expert's rows. All sums are fp32 and every output is written by one
program: the results are deterministic.
"""

from __future__ import annotations

import torch

from .._dispatch import interpreting, jit, tl, triton, use_triton

# Tiles on CUDA: (rows, columns, reduction step, warps, pipeline stages).
GATE_UP_TILES = (128, 64, 64, 8, 3)  # two fp32 accumulators (gate, up)
GATE_UP_BWD_TILES = (64, 64, 64, 4, 3)  # three (gate, up, output gradient times down)
SCATTER_TILES = (128, 128, 64, 8, 3)
WGRAD_TILES = (128, 128, 64, 8, 3)
INTERPRETER_TILES = (16, 16, 16, 1, 1)  # tiny, so that the interpreter's tests take seconds
# The backward recomputes the gate/up projections (False), or reads them as the forward wrote them (True: 2I
# values per (token, k) pair kept from the forward to the backward, for one GEMM less).
SAVE_GATE_UP = False


@jit
def _tile_of(pid_m, OFFS, groups, BM: tl.constexpr, G_P2: tl.constexpr):
    """(group, first row, end row) of row tile `pid_m` of the tiles of BM rows that cover each group's run
    [OFFS[g], OFFS[g + 1]); a tile past the last one gets an empty range."""
    g = tl.arange(0, G_P2)
    live = g < groups
    lo = tl.load(OFFS + g, mask=live, other=0)
    hi = tl.load(OFFS + g + 1, mask=live, other=0)
    tiles = (hi - lo + BM - 1) // BM
    last = tl.cumsum(tiles, 0)  # tiles of groups 0..g
    group = tl.sum((last <= pid_m).to(tl.int32), 0)
    here = g == group
    first_tile = tl.sum(tl.where(here, last - tiles, 0), 0)
    start = tl.sum(tl.where(here, lo, 0), 0) + (pid_m - first_tile) * BM
    end = tl.sum(tl.where(here, hi, 0), 0)
    return group, start, end


@jit
def _row_tile(PERM, OFFS, groups, width, BM: tl.constexpr, BN: tl.constexpr, G_P2: tl.constexpr):
    """This program's tile of a grid of (row tiles of each group's run) x (column tiles of `width`): whether it
    has no rows, its group, its rows (their mask and their (token, k) slots), its column tile and its columns."""
    n_tiles = tl.cdiv(width, BN)
    pid_n = tl.program_id(0) % n_tiles
    group, start, end = _tile_of(tl.program_id(0) // n_tiles, OFFS, groups, BM, G_P2)
    rows = start + tl.arange(0, BM)
    rmask = rows < end
    slot = tl.load(PERM + rows, mask=rmask, other=0)
    cols = pid_n * BN + tl.arange(0, BN)
    return start >= end, group, rows, rmask, slot, pid_n, cols, cols < width


@jit
def _dot(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:  # the interpreter computes 16-bit dots wrongly
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:  # fp32 operands: full fp32 products, as torch's fp32 matmuls (not tf32)
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@jit
def _gate_up_kernel(
    X,
    W1,
    PERM,
    OFFS,
    RW,
    DY,
    W2,
    H_OUT,
    DGU,
    DW_PART,
    GU,
    experts,
    topk,
    hidden,
    inter,
    stride_x,
    stride_w1e,
    stride_w1n,
    stride_dy,
    stride_w2e,
    stride_w2h,
    BACKWARD: tl.constexpr,
    STORE_GU: tl.constexpr,
    LOAD_GU: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    G_P2: tl.constexpr,
):
    # Program (row tile, column tile of I). gate = x W1[e, :I]^T and up = x W1[e, I:]^T over H, x the rows'
    # tokens' hidden rows. Forward: H_OUT = silu(gate) * up. Backward: also d = dy W2[e] (dy the rows' tokens'
    # output gradients); then DGU = [dgate, dup] of dh = w d, H_OUT = w h (for the down weights' gradient) and
    # DW_PART[row, column tile] = sum over the tile's columns of d * h (the routing weight's gradient, in parts).
    # STORE_GU: the forward also writes [gate, up] to GU; LOAD_GU: the backward reads them there instead.
    empty, e, rows, rmask, slot, pid_n, cols, cmask = _row_tile(PERM, OFFS, experts, inter, BM, BN, G_P2)
    if empty:
        return
    token = (slot // topk).to(tl.int64)
    ks = tl.arange(0, BK)
    x_ptrs = X + token[:, None] * stride_x + ks[None, :]
    wg_ptrs = W1 + e.to(tl.int64) * stride_w1e + cols[None, :].to(tl.int64) * stride_w1n + ks[:, None]
    wu_ptrs = wg_ptrs + inter * stride_w1n
    dy_ptrs = DY + token[:, None] * stride_dy + ks[None, :]
    w2_ptrs = W2 + e.to(tl.int64) * stride_w2e + ks[:, None].to(tl.int64) * stride_w2h + cols[None, :]
    gate = tl.zeros([BM, BN], dtype=tl.float32)
    up = tl.zeros([BM, BN], dtype=tl.float32)
    d = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        kmask = ks < hidden - k0
        amask = rmask[:, None] & kmask[None, :]
        bmask = kmask[:, None] & cmask[None, :]
        if not LOAD_GU:
            x = tl.load(x_ptrs, mask=amask, other=0.0)
            gate = _dot(x, tl.load(wg_ptrs, mask=bmask, other=0.0), gate, UPCAST, IEEE)
            up = _dot(x, tl.load(wu_ptrs, mask=bmask, other=0.0), up, UPCAST, IEEE)
        if BACKWARD:
            dy = tl.load(dy_ptrs, mask=amask, other=0.0)
            d = _dot(dy, tl.load(w2_ptrs, mask=bmask, other=0.0), d, UPCAST, IEEE)
            dy_ptrs += BK
            w2_ptrs += BK * stride_w2h
        x_ptrs += BK
        wg_ptrs += BK
        wu_ptrs += BK
    out = rows[:, None].to(tl.int64) * inter + cols[None, :]
    omask = rmask[:, None] & cmask[None, :]
    gu = rows[:, None].to(tl.int64) * (2 * inter) + cols[None, :]
    if LOAD_GU:
        gate = tl.load(GU + gu, mask=omask, other=0.0).to(tl.float32)
        up = tl.load(GU + gu + inter, mask=omask, other=0.0).to(tl.float32)
    if STORE_GU:
        tl.store(GU + gu, gate.to(GU.dtype.element_ty), mask=omask)
        tl.store(GU + gu + inter, up.to(GU.dtype.element_ty), mask=omask)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    h = silu * up
    if BACKWARD:
        w = tl.load(RW + slot, mask=rmask, other=0.0).to(tl.float32)
        tl.store(DW_PART + rows.to(tl.int64) * tl.cdiv(inter, BN) + pid_n, tl.sum(d * h, 1), mask=rmask)
        dh = d * w[:, None]
        tl.store(H_OUT + out, (h * w[:, None]).to(H_OUT.dtype.element_ty), mask=omask)
        # d silu(g) / dg = sig * (1 + g * (1 - sig))
        tl.store(DGU + gu, (dh * up * sig * (1.0 + gate * (1.0 - sig))).to(DGU.dtype.element_ty), mask=omask)
        tl.store(DGU + gu + inter, (dh * silu).to(DGU.dtype.element_ty), mask=omask)
    else:
        tl.store(H_OUT + out, h.to(H_OUT.dtype.element_ty), mask=omask)


@jit
def _scatter_gemm_kernel(
    A,
    B,
    PERM,
    OFFS,
    RW,
    OUT,
    experts,
    n,
    k,
    stride_a,
    stride_be,
    stride_bk,
    stride_bn,
    SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    G_P2: tl.constexpr,
):
    # OUT[slot of row r] = A[r] @ B[e] (times the routing weight of that slot with SCALE), for the rows r of each
    # expert e, B[e] read as [k, n] through its strides. Rows past the experts' (sentinel pairs) get zeros.
    empty, e, rows, rmask, slot, _, cols, cmask = _row_tile(PERM, OFFS, experts + 1, n, BM, BN, G_P2)
    if empty:
        return
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if e < experts:
        ks = tl.arange(0, BK)
        a_ptrs = A + rows[:, None].to(tl.int64) * stride_a + ks[None, :]
        b_ptrs = (
            B
            + e.to(tl.int64) * stride_be
            + ks[:, None].to(tl.int64) * stride_bk
            + cols[None, :].to(tl.int64) * stride_bn
        )
        for k0 in range(0, k, BK):
            kmask = ks < k - k0
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = _dot(a, b, acc, UPCAST, IEEE)
            a_ptrs += BK
            b_ptrs += BK * stride_bk
        if SCALE:
            acc = acc * tl.load(RW + slot, mask=rmask, other=0.0).to(tl.float32)[:, None]
    out = OUT + slot[:, None].to(tl.int64) * n + cols[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@jit
def _wgrad_kernel(
    A,
    B,
    PERM,
    OFFS,
    OUT,
    topk,
    m,
    n,
    stride_a,
    stride_b,
    GATHER_A: tl.constexpr,
    GATHER_B: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # OUT[e] [m, n] = sum over expert e's rows r of A[r, :m]^T B[r, :n]; a GATHER_ operand is read at the row's
    # token instead (a hidden row or an output gradient). An expert without rows gets zeros.
    n_tiles = tl.cdiv(n, BN)
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    e = tl.program_id(1)
    lo = tl.load(OFFS + e)
    hi = tl.load(OFFS + e + 1)
    ms = pid_m * BM + tl.arange(0, BM)
    ns = pid_n * BN + tl.arange(0, BN)
    mmask = ms < m
    nmask = ns < n
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for r0 in range(lo, hi, BK):
        rows = r0 + ks
        kmask = rows < hi
        token = (tl.load(PERM + rows, mask=kmask, other=0) // topk).to(tl.int64)
        a_rows = rows.to(tl.int64)
        b_rows = rows.to(tl.int64)
        if GATHER_A:
            a_rows = token
        if GATHER_B:
            b_rows = token
        a = tl.load(A + a_rows[:, None] * stride_a + ms[None, :], mask=kmask[:, None] & mmask[None, :], other=0.0)
        b = tl.load(B + b_rows[:, None] * stride_b + ns[None, :], mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = _dot(tl.trans(a), b, acc, UPCAST, IEEE)
    out = OUT + e.to(tl.int64) * m * n + ms[:, None].to(tl.int64) * n + ns[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


class Routing:
    """The (token, k) pairs sorted by expert: `perm[r]` is row r's pair (token * k + j), rows
    [offsets[e], offsets[e + 1]) are expert e's, and [offsets[E], offsets[E + 1]) the pairs of no expert."""

    def __init__(self, top_k_index: torch.Tensor, experts: int):
        ids = top_k_index.reshape(-1)
        ids = ids.masked_fill((ids < 0) | (ids >= experts), experts)
        sorted_ids, perm = torch.sort(ids, stable=True)
        bounds = torch.arange(experts + 2, device=ids.device, dtype=sorted_ids.dtype)
        self.perm = perm.to(torch.int32)
        self.offsets = torch.searchsorted(sorted_ids, bounds).to(torch.int32)
        self.experts, self.topk, self.rows = experts, top_k_index.shape[-1], ids.numel()


def _tiles(kind):
    return INTERPRETER_TILES if interpreting() else kind


def _flags(x: torch.Tensor) -> dict:
    upcast = interpreting()
    return dict(UPCAST=upcast, IEEE=upcast or x.dtype == torch.float32)


def _gate_up(x, w1, routing, rw=None, dy=None, w2=None, gate_up=None, save=False):
    """Forward: h [rows, I], and with `save` ([gate, up] [rows, 2I], h). Backward (rw, dy, w2 given; the saved
    [gate, up] as `gate_up`, or None to recompute them): (w h, [dgate, dup], routing weights' gradient)."""
    backward = dy is not None
    store, load = save and not backward, backward and gate_up is not None
    inter = w1.shape[1] // 2
    bm, bn, bk, warps, stages = _tiles(GATE_UP_BWD_TILES if backward else GATE_UP_TILES)
    h = torch.empty((routing.rows, inter), dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(inter, bn)
    if backward:
        dgu = torch.empty((routing.rows, 2 * inter), dtype=x.dtype, device=x.device)
        dw_part = torch.zeros((routing.rows, n_tiles), dtype=torch.float32, device=x.device)
    else:
        dgu = dw_part = h  # unused
        rw, dy, w2 = h, x, w1  # unused
    if store:
        gate_up = torch.empty((routing.rows, 2 * inter), dtype=x.dtype, device=x.device)
    grid = ((triton.cdiv(routing.rows, bm) + routing.experts) * n_tiles,)
    _gate_up_kernel[grid](
        x,
        w1,
        routing.perm,
        routing.offsets,
        rw,
        dy,
        w2,
        h,
        dgu,
        dw_part,
        h if gate_up is None else gate_up,
        routing.experts,
        routing.topk,
        x.shape[1],
        inter,
        x.stride(0),
        w1.stride(0),
        w1.stride(1),
        dy.stride(0),
        w2.stride(0),
        w2.stride(1),
        BACKWARD=backward,
        STORE_GU=store,
        LOAD_GU=load,
        **_flags(x),
        BM=bm,
        BN=bn,
        BK=bk,
        G_P2=triton.next_power_of_2(routing.experts + 1),
        num_warps=warps,
        num_stages=stages,
    )
    if backward:
        return h, dgu, dw_part.sum(1)
    return (gate_up, h) if store else h


def _scatter_gemm(a, b, b_strides, n, routing, rw=None):
    """[tokens, k, n]: row r's `a[r] @ b[e]` (times its routing weight if `rw`) at row r's (token, k) slot."""
    bm, bn, bk, warps, stages = _tiles(SCATTER_TILES)
    out = torch.empty((routing.rows, n), dtype=a.dtype, device=a.device)
    grid = ((triton.cdiv(routing.rows, bm) + routing.experts + 1) * triton.cdiv(n, bn),)
    _scatter_gemm_kernel[grid](
        a,
        b,
        routing.perm,
        routing.offsets,
        a if rw is None else rw,
        out,
        routing.experts,
        n,
        a.shape[1],
        a.stride(0),
        b.stride(0),
        *b_strides,
        SCALE=rw is not None,
        **_flags(a),
        BM=bm,
        BN=bn,
        BK=bk,
        G_P2=triton.next_power_of_2(routing.experts + 2),
        num_warps=warps,
        num_stages=stages,
    )
    return out.view(-1, routing.topk, n)


def _wgrad(a, b, routing, out_like, gather_a=False, gather_b=False):
    """[E, m, n]: per expert, the sum over its rows of a[row]^T b[row] (a gathered operand read at the token)."""
    bm, bn, bk, warps, stages = _tiles(WGRAD_TILES)
    m, n = out_like.shape[1:]
    out = torch.empty_like(out_like)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), routing.experts)
    _wgrad_kernel[grid](
        a,
        b,
        routing.perm,
        routing.offsets,
        out,
        routing.topk,
        m,
        n,
        a.stride(0),
        b.stride(0),
        GATHER_A=gather_a,
        GATHER_B=gather_b,
        **_flags(a),
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def moe_experts_forward(x, top_k_index, top_k_weights, w1, w2, save=False):
    """y [tokens, H] (x's dtype) for contiguous x [tokens, H], w1 [E, 2I, H], w2 [E, H, I] of x's dtype; with
    `save`, (y, the pairs' [gate, up] projections in sorted order) for the backward."""
    routing = Routing(top_k_index, w1.shape[0])
    gate_up, h = _gate_up(x, w1, routing, save=True) if save else (None, _gate_up(x, w1, routing))
    slots = _scatter_gemm(h, w2, (w2.stride(2), w2.stride(1)), w2.shape[1], routing, rw=top_k_weights.reshape(-1))
    return (slots.sum(1), gate_up) if save else slots.sum(1)


def moe_experts_backward(dy, x, top_k_index, top_k_weights, w1, w2, needs=(True, True, True, True), gate_up=None):
    """(dx, d top_k_weights, dw1, dw2), each None where `needs` (in that order) says it is not wanted. The
    routing is sorted again and the gate/up projections recomputed (or read from `gate_up`, as the forward
    saved them)."""
    routing = Routing(top_k_index, w1.shape[0])
    dy = dy.reshape(x.shape).to(x.dtype).contiguous()
    rw = top_k_weights.reshape(-1)
    hw, dgu, dw_sorted = _gate_up(x, w1, routing, rw=rw, dy=dy, w2=w2, gate_up=gate_up)
    dx = dweights = dw1 = dw2 = None
    if needs[0]:
        slots = _scatter_gemm(dgu, w1, (w1.stride(1), w1.stride(2)), x.shape[1], routing)
        dx = slots.sum(1)
    if needs[1]:
        dweights = torch.empty(routing.rows, dtype=torch.float32, device=x.device)
        dweights[routing.perm.long()] = dw_sorted
        dweights = dweights.view(top_k_weights.shape).to(top_k_weights.dtype)
    if needs[2]:
        dw1 = _wgrad(dgu, x, routing, w1, gather_b=True)
    if needs[3]:
        dw2 = _wgrad(dy, hw, routing, w2, gather_a=True)
    return dx, dweights, dw1, dw2


class MoEExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, w1, w2):
        gate_up = None
        if SAVE_GATE_UP and any(ctx.needs_input_grad):
            y, gate_up = moe_experts_forward(x, top_k_index, top_k_weights, w1, w2, save=True)
        else:
            y = moe_experts_forward(x, top_k_index, top_k_weights, w1, w2)
        ctx.save_for_backward(x, top_k_index, top_k_weights, w1, w2, gate_up)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, top_k_index, top_k_weights, w1, w2, gate_up = ctx.saved_tensors
        g = ctx.needs_input_grad
        dx, dweights, dw1, dw2 = moe_experts_backward(
            dy, x, top_k_index, top_k_weights, w1, w2, needs=(g[0], g[2], g[3], g[4]), gate_up=gate_up
        )
        return dx, None, dweights, dw1, dw2


def moe_experts_torch(x, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """The same in plain torch: the pairs sorted by expert, one matmul pair per expert that has any."""
    experts, inter = gate_up_proj.shape[0], down_proj.shape[2]
    topk = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    ids = ids.masked_fill((ids < 0) | (ids >= experts), experts)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=experts + 1).tolist()
    rows = x.to(gate_up_proj.dtype)[order // topk]
    outs, start = [], 0
    for e, count in enumerate(counts[:experts]):
        part = rows[start : start + count]
        gate, up = (part @ gate_up_proj[e].t()).split(inter, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up) @ down_proj[e].t())
        start += count
    outs.append(rows.new_zeros((counts[experts], x.shape[-1])))
    out = torch.cat(outs) * top_k_weights.reshape(-1)[order, None]
    slots = torch.empty_like(out).index_copy(0, order, out)
    return slots.view(-1, topk, x.shape[-1]).sum(1).to(x.dtype)


def moe_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """`sum_j top_k_weights[t, j] * down[e] @ (silu(gate[e] @ x_t) * (up[e] @ x_t))`, e = top_k_index[t, j].

    The arguments of transformers' experts forward, `hidden_states` [tokens, H], `top_k_index` and
    `top_k_weights` [tokens, k], and its parameters `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj`
    [E, H, I]. Indices outside [0, E) contribute nothing. As transformers' grouped experts do, the products run in
    the weights' dtype and the result comes back in `hidden_states`'s.
    """
    experts, two_inter, hidden = gate_up_proj.shape
    if (
        gate_up_proj.dim() != 3
        or two_inter % 2
        or down_proj.shape != (experts, hidden, two_inter // 2)
        or hidden_states.shape[-1] != hidden
        or top_k_index.shape != top_k_weights.shape
        or top_k_index.shape[:-1] != hidden_states.shape[:-1]
    ):
        raise ValueError(
            f"moe_experts needs hidden_states [..., H], top_k_index and top_k_weights [..., k], gate_up_proj "
            f"[E, 2I, H] and down_proj [E, H, I]; got {tuple(hidden_states.shape)}, {tuple(top_k_index.shape)}, "
            f"{tuple(top_k_weights.shape)}, {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
        )
    if gate_up_proj.dtype != down_proj.dtype:
        raise ValueError(
            f"moe_experts needs gate_up_proj and down_proj of one dtype, got {gate_up_proj.dtype} and {down_proj.dtype}"
        )
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, hidden)
    index, weights = top_k_index.reshape(x.shape[0], -1), top_k_weights.reshape(x.shape[0], -1)
    if not use_triton(x, gate_up_proj, down_proj):
        return moe_experts_torch(x, index, weights, gate_up_proj, down_proj).view(shape)
    if x.shape[0] == 0:
        return hidden_states * 0
    xw = x.to(gate_up_proj.dtype).contiguous()
    y = MoEExpertsFunction.apply(
        xw, index.contiguous(), weights.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous()
    )
    return y.to(hidden_states.dtype).view(shape)
