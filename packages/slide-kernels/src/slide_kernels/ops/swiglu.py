"""SwiGLU gating `silu(gate) * up`: elementwise Triton kernels, autograd Function and torch fallback.

`swiglu` takes gate and up as two tensors (Llama's MLP); `swiglu_gate_up` takes them as the two halves of one
tensor's last dim, the output of a fused `gate_up_proj` (Phi-3's MLP), read and written in place of a split
and a concatenation. The backward recomputes the sigmoid from `gate` rather than saving it, and writes fresh
gradient tensors (never into the saved inputs, which autograd may still hold elsewhere).
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


@jit
def _swiglu_gate_up_fwd_kernel(X, C, n, stride_x, stride_c, BLOCK: tl.constexpr):
    # Program (row, column tile): gate is x[row, :n], up is x[row, n:].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    a = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    tl.store(C + row * stride_c + cols, (a * sig * b).to(C.dtype.element_ty), mask=mask)


@jit
def _swiglu_gate_up_bwd_kernel(DC, X, DX, n, stride_dc, stride_x, stride_dx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dc = tl.load(DC + row * stride_dc + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    tl.store(DX + row * stride_dx + n + cols, (dc * a * sig).to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * stride_dx + cols, (dc * b * sig * (1.0 + a * (1.0 - sig))).to(DX.dtype.element_ty),
             mask=mask)


def gated_forward(kernel, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Launch an elementwise gating kernel `c = f(a) * b` over contiguous tensors (SwiGLU's, GeGLU's)."""
    c = torch.empty_like(a)
    n = a.numel()
    kernel[(triton.cdiv(n, BLOCK),)](a, b, c, n, BLOCK=BLOCK, num_warps=4)
    return c


def gated_backward(kernel, dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """Launch a gating kernel's backward: (da, db) from dc and the inputs, recomputing f(a)."""
    dc = dc.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    kernel[(triton.cdiv(n, BLOCK),)](dc, a, b, da, db, n, BLOCK=BLOCK, num_warps=4)
    return da, db


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return gated_forward(_swiglu_fwd_kernel, a, b)


def swiglu_backward(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    return gated_backward(_swiglu_bwd_kernel, dc, a, b)


def _gate_up_block(n: int) -> int:
    return min(BLOCK, triton.next_power_of_2(n))


def swiglu_gate_up_forward(x2d: torch.Tensor) -> torch.Tensor:
    m, n = x2d.shape[0], x2d.shape[1] // 2
    c = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    if c.numel():
        block = _gate_up_block(n)
        _swiglu_gate_up_fwd_kernel[(m, triton.cdiv(n, block))](x2d, c, n, x2d.stride(0), c.stride(0), BLOCK=block,
                                                              num_warps=4)
    return c


def swiglu_gate_up_backward(dc2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    dc2d = dc2d.contiguous()
    m, n = dc2d.shape
    dx = torch.empty_like(x2d)
    if dx.numel():
        block = _gate_up_block(n)
        _swiglu_gate_up_bwd_kernel[(m, triton.cdiv(n, block))](dc2d, x2d, dx, n, dc2d.stride(0), x2d.stride(0),
                                                              dx.stride(0), BLOCK=block, num_warps=4)
    return dx


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


class SwiGLUGateUpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        shape = gate_up.shape
        x2d = gate_up.reshape(-1, shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        ctx.save_for_backward(x2d)
        ctx.shape = shape
        return swiglu_gate_up_forward(x2d).view(*shape[:-1], shape[-1] // 2)

    @staticmethod
    def backward(ctx, dc):
        (x2d,) = ctx.saved_tensors
        return swiglu_gate_up_backward(dc.reshape(x2d.shape[0], -1), x2d).view(ctx.shape)


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


def swiglu_gate_up_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return up * torch.nn.functional.silu(gate)


def swiglu_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where `gate, up = gate_up.chunk(2, dim=-1)` (HF Phi-3's MLP); the last dim must be even."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_gate_up needs an even last dim (gate and up halves), got {tuple(gate_up.shape)}")
    if use_triton(gate_up):
        return SwiGLUGateUpFunction.apply(gate_up)
    return swiglu_gate_up_torch(gate_up)
