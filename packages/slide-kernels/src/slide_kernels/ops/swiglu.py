"""SwiGLU gating `silu(gate) * up`: elementwise Triton kernels, autograd Function and torch fallback.

The backward recomputes the sigmoid from `gate` rather than saving it, and writes fresh gradient tensors (never
into the saved inputs, which autograd may still hold elsewhere).
"""

from __future__ import annotations

import torch

from .._dispatch import jit, tl, triton, use_triton

BLOCK = 2048


@jit
def _swiglu_fwd_kernel(A, B, C, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    tl.store(C + offs, (a * sig * b).to(C.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd_kernel(DC, A, B, DA, DB, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dc = tl.load(DC + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    silu = a * sig
    tl.store(DB + offs, (dc * silu).to(DB.dtype.element_ty), mask=mask)
    # d silu / da = sig * (1 + a * (1 - sig))
    tl.store(DA + offs, (dc * b * sig * (1.0 + a * (1.0 - sig))).to(DA.dtype.element_ty), mask=mask)


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = torch.empty_like(a)
    n = a.numel()
    _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](a, b, c, n, BLOCK=BLOCK, num_warps=4)
    return c


def swiglu_backward(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    dc = dc.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](dc, a, b, da, db, n, BLOCK=BLOCK, num_warps=4)
    return da, db


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dc):
        gate, up = ctx.saved_tensors
        return swiglu_backward(dc, gate, up)


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for two tensors of the same shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu needs gate and up of one shape and dtype, got {gate.shape}/{gate.dtype} "
                         f"and {up.shape}/{up.dtype}")
    if use_triton(gate, up):
        return SwiGLUFunction.apply(gate, up)
    return swiglu_torch(gate, up)
