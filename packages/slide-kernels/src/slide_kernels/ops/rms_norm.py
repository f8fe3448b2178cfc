"""RMSNorm: Triton forward/backward kernels, their launchers, the autograd Function and the torch fallback.

Casting modes follow the HF models: "llama" normalizes in fp32, rounds the normalized row to the input dtype,
then multiplies by the weight (Llama, Qwen2/3, Mistral); "gemma" does everything in fp32 and rounds once at the
end (Gemma, with offset=1.0 for its `1 + weight` scale).
"""

from __future__ import annotations

import torch

from .._dispatch import jit, sm_count, tl, triton, use_triton

MODES = {"llama": 0, "gemma": 1}


@jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, M, N, stride_x, stride_y, eps, offset,
    MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    normed = x * rstd[:, None]
    if MODE == 0:
        # Llama rounds the normalized row to the input dtype before the weight multiply.
        normed = normed.to(X.dtype.element_ty).to(tl.float32)
    y = normed * w[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL, M, N, stride_dy, stride_x, stride_dx, offset, tiles_per_program,
    MODE: tl.constexpr, WANT_DX: tl.constexpr, WANT_DW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Each program walks a strided set of row tiles and keeps its share of dW in registers (fp32).
    # WANT_DX / WANT_DW: the gradients autograd asked for; DX or DW_PARTIAL is not touched without its flag.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if WANT_DX:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, tiles_per_program):
        rows = (pid + i * n_prog) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        normed = x * rstd[:, None]
        if WANT_DW:
            if MODE == 0:
                dw += tl.sum(dy * normed.to(X.dtype.element_ty).to(tl.float32), axis=0)
            else:
                dw += tl.sum(dy * normed, axis=0)
        if WANT_DX:
            dn = dy * w[None, :]
            proj = tl.sum(dn * normed, axis=1) / N
            dx = (dn - normed * proj[:, None]) * rstd[:, None]
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if WANT_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw, mask=cmask)


def _launch_shape(n: int) -> tuple[int, int, int]:
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(16, 4096 // block_n))
    num_warps = 8 if block_n * block_m >= 4096 else 4
    return block_m, block_n, num_warps


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, mode: str) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype) if mode == "llama" else x.dtype


def rms_norm_forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, mode: str):
    m, n = x2d.shape
    y = torch.empty((m, n), dtype=_out_dtype(x2d, weight, mode), device=x2d.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x2d.device)
    block_m, block_n, num_warps = _launch_shape(n)
    _rms_norm_fwd_kernel[(triton.cdiv(m, block_m),)](
        x2d, weight, y, rstd, m, n, x2d.stride(0), y.stride(0), float(eps), float(offset),
        MODE=MODES[mode], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y, rstd


def rms_norm_backward(dy2d, x2d, weight, rstd, offset: float, mode: str, want_dx: bool, want_dw: bool):
    """(dx, dw), with None in place of a gradient not wanted (it is then neither computed nor allocated)."""
    m, n = x2d.shape
    dy2d = dy2d.contiguous()
    block_m, block_n, num_warps = _launch_shape(n)
    programs = max(1, min(triton.cdiv(m, block_m), sm_count(x2d.device) * 4))
    dx = torch.empty_like(x2d) if want_dx else None
    dw_partial = torch.empty((programs, n), dtype=torch.float32, device=x2d.device) if want_dw else None
    # An output not wanted gets dy2d as a stand-in pointer: the kernel never writes through it.
    dx_ptr, dw_ptr = (dy2d if t is None else t for t in (dx, dw_partial))
    tiles_per_program = triton.cdiv(triton.cdiv(m, block_m), programs)
    _rms_norm_bwd_kernel[(programs,)](
        dy2d, x2d, weight, rstd, dx_ptr, dw_ptr, m, n, dy2d.stride(0), x2d.stride(0), dx_ptr.stride(0),
        float(offset), tiles_per_program, MODE=MODES[mode], WANT_DX=want_dx, WANT_DW=want_dw,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return dx, None if dw_partial is None else dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, mode):
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        y, rstd = rms_norm_forward(x2d, weight, eps, offset, mode)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.offset, ctx.mode, ctx.shape = offset, mode, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        want_dx, want_dw = ctx.needs_input_grad[:2]
        dx, dw = rms_norm_backward(dy.reshape(x2d.shape), x2d, weight, rstd, ctx.offset, ctx.mode, want_dx, want_dw)
        return None if dx is None else dx.view(ctx.shape), dw, None, None, None


def rms_norm_torch(x, weight, eps=1e-6, offset=0.0, casting_mode="llama"):
    """Plain torch RMSNorm with the same casting modes; differentiable through autograd."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "llama":
        scale = weight + offset if offset else weight
        return scale * normed.to(x.dtype)
    return (normed * (weight.float() + offset)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
             casting_mode: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * (weight + offset)`."""
    if casting_mode not in MODES:
        raise ValueError(f"casting_mode must be one of {sorted(MODES)}, got {casting_mode!r}")
    if use_triton(x, weight):  # the kernel reads the weight densely (a no-op for a parameter)
        return RMSNormFunction.apply(x, weight.contiguous(), eps, offset, casting_mode)
    return rms_norm_torch(x, weight, eps, offset, casting_mode)
