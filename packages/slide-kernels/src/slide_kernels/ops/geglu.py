"""GeGLU gating `gelu_tanh(gate) * up` (Gemma's MLP): elementwise Triton kernels, autograd Function, fallback.

GELU is the tanh approximation (HF's `gelu_pytorch_tanh`), `0.5 x (1 + tanh(u))` with
`u = sqrt(2/pi) (x + 0.044715 x^3)`. The kernels use the identity `0.5 (1 + tanh(u)) = sigmoid(2u)`: one exp,
no libdevice tanh, and no cancellation in `1 + tanh(u)` for very negative inputs. The backward recomputes from
`gate` and writes fresh gradient tensors.
"""

from __future__ import annotations

import torch

from .._dispatch import jit, tl, use_triton
from .swiglu import gated_backward, gated_forward


@jit
def _gelu_tanh_parts(a):
    """(gelu_tanh(a), its derivative) in fp32. Literals: a kernel reads no Python globals but constexprs."""
    # 1.5957691216057308 = 2 * sqrt(2 / pi); 0.044715 is the cubic term's coefficient.
    u2 = 1.5957691216057308 * (a + 0.044715 * a * a * a)
    # sigmoid(u2) from exp(-|u2|), which cannot overflow: the cubic term reaches exp's limit already at x = -10.
    e = tl.exp(-tl.abs(u2))
    sig = tl.where(u2 >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    du2 = 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * a * a)
    return a * sig, sig + a * sig * (1.0 - sig) * du2


@jit
def _geglu_fwd_kernel(A, B, C, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    g, _ = _gelu_tanh_parts(a)
    tl.store(C + offs, (g * b).to(C.dtype.element_ty), mask=mask)


@jit
def _geglu_bwd_kernel(DC, A, B, DA, DB, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dc = tl.load(DC + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    g, dg = _gelu_tanh_parts(a)
    tl.store(DB + offs, (dc * g).to(DB.dtype.element_ty), mask=mask)
    tl.store(DA + offs, (dc * b * dg).to(DA.dtype.element_ty), mask=mask)


def geglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return gated_forward(_geglu_fwd_kernel, a, b)


def geglu_backward(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    return gated_backward(_geglu_bwd_kernel, dc, a, b)


class GeGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return geglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dc):
        gate, up = ctx.saved_tensors
        return geglu_backward(dc, gate, up)


def geglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`gelu(gate, approximate="tanh") * up` for two tensors of the same shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"geglu needs gate and up of one shape and dtype, got {gate.shape}/{gate.dtype} "
                         f"and {up.shape}/{up.dtype}")
    if use_triton(gate, up):
        return GeGLUFunction.apply(gate, up)
    return geglu_torch(gate, up)
