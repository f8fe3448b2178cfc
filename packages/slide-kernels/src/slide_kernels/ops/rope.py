"""Rotary position embedding with HF's `apply_rotary_pos_emb` semantics (rotate-half layout).

`rope` rotates the whole head, as Llama's function does; `partial_rope` rotates only the first `cos.shape[-1]`
dims of each head and passes the rest through, as Phi-3's does (`partial_rotary_factor` < 1).
One program handles one (batch, position) pair for every q and k head, so cos/sin are read once per pair.
Outputs are fresh tensors in the inputs' layout; the backward applies the transposed rotation.
"""

from __future__ import annotations

import torch

from .._dispatch import jit, tl, triton, use_triton


@jit
def _rotate(ptr_in, ptr_out, base_in, base_out, s_in_h, s_in_d, s_out_h, s_out_d, n_heads, half, n_pass,
            c1, c2, s1, s2, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    h_in = base_in + heads[:, None].to(tl.int64) * s_in_h
    h_out = base_out + heads[:, None].to(tl.int64) * s_out_h
    d = tl.arange(0, BLOCK_D)
    mask = hmask[:, None] & (d < half)[None, :]
    off_in = h_in + d[None, :] * s_in_d
    off_out = h_out + d[None, :] * s_out_d
    x1 = tl.load(ptr_in + off_in, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr_in + off_in + half * s_in_d, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(ptr_out + off_out, o1.to(ptr_out.dtype.element_ty), mask=mask)
    tl.store(ptr_out + off_out + half * s_out_d, o2.to(ptr_out.dtype.element_ty), mask=mask)
    if BLOCK_P > 0:
        # The dims past the rotary ones pass unchanged (the outputs are fresh tensors, so they are copied).
        p = 2 * half + tl.arange(0, BLOCK_P)
        pmask = hmask[:, None] & (p < 2 * half + n_pass)[None, :]
        x = tl.load(ptr_in + h_in + p[None, :] * s_in_d, mask=pmask, other=0.0)
        tl.store(ptr_out + h_out + p[None, :] * s_out_d, x.to(ptr_out.dtype.element_ty), mask=pmask)


@jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, T, HQ, HK, half, n_pass,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d,
    sqo_b, sqo_h, sqo_t, sqo_d, sko_b, sko_h, sko_t, sko_d,
    sc_b, sc_t, sc_d,
    BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    c_off = b * sc_b + t * sc_t + d * sc_d
    c1 = tl.load(COS + c_off, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + c_off + half * sc_d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + c_off, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + c_off + half * sc_d, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:
        # The rotation [[c1, -s1], [s2, c2]] transposed is [[c1, s2], [-s1, c2]].
        s1, s2 = -s2, -s1
    _rotate(Q, QO, b * sq_b + t * sq_t, b * sqo_b + t * sqo_t, sq_h, sq_d, sqo_h, sqo_d, HQ, half, n_pass,
            c1, c2, s1, s2, BLOCK_HQ, BLOCK_D, BLOCK_P)
    _rotate(K, KO, b * sk_b + t * sk_t, b * sko_b + t * sko_t, sk_h, sk_d, sko_h, sko_d, HK, half, n_pass,
            c1, c2, s1, s2, BLOCK_HK, BLOCK_D, BLOCK_P)


def _as_bhtd(x: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """A [batch, heads, tokens, dim] view of q or k, whichever axis holds the heads."""
    if x.dim() != 4:
        raise ValueError(f"rope expects 4-d q and k, got shape {tuple(x.shape)}")
    if unsqueeze_dim in (1, -3):
        return x
    if unsqueeze_dim in (2, -2):
        return x.transpose(1, 2)
    raise ValueError(f"unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")


def _as_btd(c: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
    if c.dim() == 2:
        c = c.unsqueeze(0)
    return c.expand(batch, tokens, c.shape[-1])


def rope_apply(q, k, cos, sin, unsqueeze_dim: int, backward: bool = False):
    """Rotate the first cos.shape[-1] dims of q and k (or, with backward=True, of their gradients) into fresh
    tensors; the other dims are copied."""
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    q4, k4 = _as_bhtd(q, unsqueeze_dim), _as_bhtd(k, unsqueeze_dim)
    qo4, ko4 = _as_bhtd(qo, unsqueeze_dim), _as_bhtd(ko, unsqueeze_dim)
    bsz, hq, t, dim = q4.shape
    hk = k4.shape[1]
    cos3, sin3 = _as_btd(cos, bsz, t), _as_btd(sin, bsz, t)
    if sin3.stride() != cos3.stride():
        sin3 = sin3.contiguous()
        cos3 = cos3.contiguous()
    half = cos3.shape[-1] // 2
    n_pass = dim - 2 * half
    num_warps = 4 if hq * half <= 2048 else 8
    _rope_kernel[(bsz * t,)](
        q4, k4, qo4, ko4, cos3, sin3, t, hq, hk, half, n_pass,
        *q4.stride(), *k4.stride(), *qo4.stride(), *ko4.stride(), *cos3.stride(),
        BACKWARD=backward, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
        BLOCK_D=triton.next_power_of_2(half), BLOCK_P=triton.next_power_of_2(n_pass) if n_pass else 0,
        num_warps=num_warps,
    )
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        return rope_apply(q, k, cos, sin, unsqueeze_dim)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_apply(dq, dk, cos, sin, ctx.unsqueeze_dim, backward=True)
        return dq, dk, None, None, None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # HF's split (an odd dim gives the second half the extra element)
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_torch(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def partial_rope_torch(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    rot = cos.shape[-1]
    qr, kr = rope_torch(q[..., :rot], k[..., :rot], cos, sin, position_ids, unsqueeze_dim)
    return torch.cat([qr, q[..., rot:]], dim=-1), torch.cat([kr, k[..., rot:]], dim=-1)


def _kernel_takes(q, k, cos, sin, rotary_dim_ok: bool) -> bool:
    # One dtype, an even rotary width and constant tables; anything else goes the torch way, as HF's does.
    same = q.dtype == k.dtype == cos.dtype == sin.dtype and q.shape[-1] == k.shape[-1]
    return (use_triton(q, k, cos, sin) and same and rotary_dim_ok and cos.shape[-1] % 2 == 0
            and not (cos.requires_grad or sin.requires_grad))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """HF `apply_rotary_pos_emb`: returns `(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`.

    q, k: [batch, heads, tokens, dim] (unsqueeze_dim=1) or [batch, tokens, heads, dim] (unsqueeze_dim=2);
    cos, sin: [batch or 1, tokens, dim] or [tokens, dim]. `position_ids` is accepted and unused, as in HF.
    Gradients flow to q and k; cos/sin that require grad take the torch path.
    """
    # cos/sin as wide as the heads only: a width mismatch raises in the torch path, as in HF's function.
    if _kernel_takes(q, k, cos, sin, q.shape[-1] == cos.shape[-1]):
        return RoPEFunction.apply(q, k, cos, sin, unsqueeze_dim)
    return rope_torch(q, k, cos, sin, position_ids, unsqueeze_dim)


def partial_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 position_ids: torch.Tensor | None = None,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Phi-3's `apply_rotary_pos_emb`: the first `cos.shape[-1]` dims of each head rotate as in `rope`, the
    rest pass unchanged. Same shapes and arguments as `rope`; cos/sin may be narrower than the heads."""
    if _kernel_takes(q, k, cos, sin, cos.shape[-1] <= q.shape[-1]):
        return RoPEFunction.apply(q, k, cos, sin, unsqueeze_dim)
    return partial_rope_torch(q, k, cos, sin, position_ids, unsqueeze_dim)


def rope_cast_back(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   position_ids: torch.Tensor | None = None,
                   unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """HF OLMo 2/3's `apply_rotary_pos_emb`: as `rope`, the results in q's and k's own dtypes (their rotary tables
    stay fp32 beside bf16 heads: computed at the wider dtype, then cast back)."""
    q_out, k_out = rope(q, k, cos, sin, position_ids, unsqueeze_dim)
    return q_out.to(q.dtype), k_out.to(k.dtype)
