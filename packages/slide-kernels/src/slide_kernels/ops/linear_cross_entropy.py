"""Fused linear + cross-entropy: the loss of `hidden @ weight.T` against labels without the [N, V] logits.

Tokens are processed in chunks. For each chunk the logits live in one reused buffer; a Triton kernel turns them,
in place, into d(loss)/d(logits) (log-sum-exp, label smoothing, soft-capping and z-loss folded in); two matmuls
then give the chunk's hidden gradient and its share of the weight gradient. With `reduction` mean or sum the
gradients are computed during the forward (the backward scales them by the upstream gradient); with "none" the
backward recomputes.

The weight gradient is accumulated across chunks in fp32 and kept so until the backward, which multiplies it by
the upstream gradient and rounds it to the weight's dtype in one pass. For a bf16 weight on the Triton path that
pass writes into the accumulator's own storage (fp32 accumulation for the memory of one fp32 copy): on CUDA
cuBLAS accumulates (fp32 output of bf16 products); otherwise a Triton GEMM stores the fp32 sum as two 16-bit
planes, the high half of each fp32 word (a bf16 number, which becomes the result) and the low half. An fp32
weight's gradient is the scaled sum itself; other dtypes, and the torch fallback, round into a new tensor.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch

from .._dispatch import interpreting, jit, tl, triton, use_triton

REDUCTIONS = ("mean", "sum", "none")


@jit
def _tanh(x):
    # tanh without libdevice (the interpreter and AMD builds lack some of its functions).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@jit
def _ce_rows_kernel(
    LOGITS, stride_row, LABELS, LOSS, SCALE, stride_scale, V, ignore_index,
    smoothing, softcap, z_coef,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    cols0 = tl.arange(0, BLOCK_V)

    # Pass 1: log-sum-exp with a running max, and the sum of logits for label smoothing.
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    z_sum = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    for start in range(0, V, BLOCK_V):
        cols = start + cols0
        mask = cols < V
        z = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)

    safe_label = tl.where(valid, label, 0)
    z_label = tl.load(ptr + safe_label).to(tl.float32)
    if HAS_SOFTCAP:
        z_label = softcap * _tanh(z_label / softcap)
    loss = lse - (1.0 - smoothing) * z_label + z_coef * lse * lse
    if HAS_SMOOTHING:
        loss -= smoothing * z_sum / V
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))

    if WRITE_GRAD:
        # Pass 2: d loss / d logit_j = p_j (1 + 2 z_coef lse) - smoothing / V - (1 - smoothing) [j == label],
        # times the soft-cap derivative and the row's scale (0 for ignored rows).
        scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
        scale = tl.where(valid, scale, 0.0)
        p_coef = 1.0 + 2.0 * z_coef * lse
        for start in range(0, V, BLOCK_V):
            cols = start + cols0
            mask = cols < V
            x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(x / softcap)
                z = softcap * t
            else:
                z = x
            g = tl.exp(z - lse) * p_coef - smoothing / V
            g = tl.where(cols == label, g - (1.0 - smoothing), g)
            if HAS_SOFTCAP:
                g = g * (1.0 - t * t)
            tl.store(ptr + cols, (g * scale).to(LOGITS.dtype.element_ty), mask=mask)


@jit
def _bf16_bits(y):
    # fp32 -> the nearest bf16 (ties to even) as int16 bits, computed on the bits (the interpreter's float cast
    # truncates); NaN stays NaN (rounding would carry a NaN's mantissa into the sign: -0).
    bits = y.to(tl.int32, bitcast=True)
    bits = tl.where(y != y, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
    return (bits >> 16).to(tl.int16)


@jit
def _planes_fp32(HI, LO, offs, mask):
    # The fp32 number whose high and low 16 bits are stored in the two int16 planes.
    hi = tl.load(HI + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    lo = tl.load(LO + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    return ((hi << 16) | lo).to(tl.float32, bitcast=True)


@jit
def _grad_weight_kernel(
    G, X, HI, LO, ACC, V, H, N, stride_gn, stride_gv, stride_xn, stride_xh,
    FIRST: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # C[v, h] (+)= sum_n G[n, v] X[n, h]: the weight gradient of one token chunk, added to the fp32 sum.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(V, BLOCK_M)
    grid_n = tl.cdiv(H, BLOCK_N)
    # Grouped order so that neighbouring programs share tiles of X in L2.
    per_group = GROUP_M * grid_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    mmask = offs_m < V
    nmask = offs_n < H
    a_ptrs = G + offs_k[None, :] * stride_gn + offs_m[:, None] * stride_gv
    b_ptrs = X + offs_k[:, None] * stride_xn + offs_n[None, :] * stride_xh
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(N, BLOCK_K)):
        kmask = offs_k < N - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:  # fp32 operands: full fp32 products, as torch's fp32 matmuls (not tf32)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_gn
        b_ptrs += BLOCK_K * stride_xn

    offs_c = offs_m[:, None] * H + offs_n[None, :]
    cmask = mmask[:, None] & nmask[None, :]
    if SPLIT:
        if not FIRST:
            acc += _planes_fp32(HI, LO, offs_c, cmask)
        bits = acc.to(tl.int32, bitcast=True)
        tl.store(HI + offs_c, (bits >> 16).to(tl.int16), mask=cmask)
        tl.store(LO + offs_c, (bits & 0xFFFF).to(tl.int16), mask=cmask)
    else:
        if not FIRST:
            acc += tl.load(ACC + offs_c, mask=cmask, other=0.0)
        tl.store(ACC + offs_c, acc, mask=cmask)


@jit
def _narrow_kernel(SRC, LO, DST, SCALE, start, end, PLANES: tl.constexpr, BLOCK: tl.constexpr):
    # DST[i] = bf16(x[i] * scale) for i in [start, end), DST viewed as int16; x is SRC (fp32), or with PLANES the
    # fp32 sum held as SRC (high halves, DST itself) and LO (each element read, then written, by one program).
    offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < end
    if PLANES:
        x = _planes_fp32(SRC, LO, offs, mask)
    else:
        x = tl.load(SRC + offs, mask=mask, other=0.0)
    tl.store(DST + offs, _bf16_bits(x * tl.load(SCALE)), mask=mask)


def _narrow(src, lo, dst, scale, start, end, planes=False):
    block = 4096
    _narrow_kernel[(triton.cdiv(end - start, block),)](src, lo, dst, scale, start, end, PLANES=planes, BLOCK=block,
                                                       num_warps=8)


def _scale_of(scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The upstream scale as a one-element fp32 tensor on `like`'s device (what the kernels read)."""
    return scale.to(device=like.device, dtype=torch.float32).reshape(1)


NARROW_FIRST = 1 << 20  # elements narrowed through a temporary before the in-place doubling ranges


def narrow_in_place(acc: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    first: int = NARROW_FIRST) -> torch.Tensor:
    """`acc * scale` (fp32) as bf16 in acc's own storage; returns the bf16 view.

    Elements [a, 2a) land on bytes that only elements below a occupied, already narrowed: each such range is
    one launch, in order on the stream (about 10 for a 128k x 4k gradient). The first range, [0, `first`),
    overlaps its own source and goes through a small temporary.
    """
    if acc.dtype != torch.float32 or dtype != torch.bfloat16:
        raise TypeError(f"narrow_in_place takes fp32 to bf16, not {acc.dtype} to {dtype}")
    if first < 1:
        raise ValueError(f"first must be at least 1, got {first}")
    n = acc.numel()
    src = acc.view(-1)
    dst = src.view(dtype)[:n]
    scale = _scale_of(scale, acc)
    a = min(n, first)
    dst[:a].copy_(src[:a] * scale)
    while a < n:
        b = min(n, 2 * a)
        _narrow(src, src, dst.view(torch.int16), scale, a, b)  # (LO unused)
        a = b
    return dst.view(acc.shape)


GEMM_TILES = (128, 256, 64, 8, 3)  # BM, BN, BK, warps, stages of the Triton weight-gradient GEMM


class _WeightGradTriton:
    """fp32 sum of per-chunk weight gradients: split bf16 planes for a bf16 weight, one fp32 tensor otherwise."""

    def __init__(self, weight: torch.Tensor):
        self.dtype, self.first = weight.dtype, True
        self.upcast = interpreting()  # the interpreter computes bf16 dots wrongly; tiny tiles keep it quick
        self.tiles = (16, 16, 16, 4, 1) if self.upcast else GEMM_TILES
        v, h = weight.shape
        self.split = weight.dtype == torch.bfloat16
        if self.split:
            self.hi = torch.empty((v, h), dtype=torch.bfloat16, device=weight.device)
            self.lo = torch.empty((v, h), dtype=torch.int16, device=weight.device)
            self.acc = self.lo  # unused pointer
        else:
            self.acc = torch.empty((v, h), dtype=torch.float32, device=weight.device)
            self.hi = self.lo = self.acc  # unused pointers

    def add(self, g: torch.Tensor, x: torch.Tensor) -> None:
        n, v = g.shape
        h = x.shape[1]
        bm, bn, bk, warps, stages = self.tiles
        grid = (triton.cdiv(v, bm) * triton.cdiv(h, bn),)
        hi = self.hi.view(torch.int16) if self.split else self.hi
        _grad_weight_kernel[grid](
            g, x, hi, self.lo, self.acc, v, h, n, g.stride(0), g.stride(1), x.stride(0), x.stride(1),
            FIRST=self.first, SPLIT=self.split, UPCAST=self.upcast, IEEE=self.upcast or g.dtype == torch.float32,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
            num_warps=warps, num_stages=stages,
        )
        self.first = False

    def result(self, scale: torch.Tensor) -> torch.Tensor:
        """The sum times `scale` (fp32), rounded once to the weight's dtype."""
        if not self.split:
            out, self.acc = _scaled(self.acc, scale, self.dtype), None
            return out
        hi = self.hi.view(torch.int16)
        _narrow(hi, self.lo, hi, _scale_of(scale, hi), 0, hi.numel(), planes=True)
        out, self.hi = self.hi, None
        self.lo = self.acc = None
        return out


class _WeightGradCublas:
    """fp32 sum of per-chunk weight gradients by cuBLAS (bf16 inputs, fp32 accumulator), narrowed to bf16 in place.

    The accumulator's storage is reused for the bf16 result, so the extra memory is that of one fp32 gradient,
    as with the split planes of `_WeightGradTriton`, while the products run at cuBLAS speed.
    """

    def __init__(self, weight: torch.Tensor):
        self.dtype = weight.dtype
        self.acc = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        self.first = True

    def add(self, g: torch.Tensor, x: torch.Tensor) -> None:
        if self.first:
            torch.mm(g.t(), x, out_dtype=torch.float32, out=self.acc)
            self.first = False
        else:
            torch.addmm(self.acc, g.t(), x, out_dtype=torch.float32, out=self.acc)

    def result(self, scale: torch.Tensor) -> torch.Tensor:
        """The sum times `scale`, narrowed in place (one pass over it)."""
        out, self.acc = narrow_in_place(self.acc, scale, self.dtype), None
        return out


@functools.cache
def _cublas_fp32_accumulation(device: torch.device) -> bool:
    """Whether this build's cuBLAS path takes bf16 inputs with an fp32 output in place (checked once, exactly)."""
    try:
        rng = torch.Generator(device=device).manual_seed(0)  # leaves the run's random stream alone (resume)
        g = torch.randn(64, 3000, device=device, generator=rng).to(torch.bfloat16)
        x = torch.randn(64, 40, device=device, generator=rng).to(torch.bfloat16)
        acc = _WeightGradCublas(torch.empty(3000, 40, dtype=torch.bfloat16, device=device))
        acc.add(g, x)
        acc.add(g, x)
        want = (2 * (g.t().double() @ x.double())).to(torch.bfloat16)
        got = narrow_in_place(acc.acc, torch.ones((), device=device), torch.bfloat16, first=1024).double()
        return bool((got - want.double()).abs().max() <= 1e-2 * want.double().abs().max())
    except torch.OutOfMemoryError:  # a transient state of this run, not of the build: raised, and not cached
        raise
    except Exception as e:  # noqa: BLE001 - any other failure (no out_dtype, a kernel that does not build)
        warnings.warn(f"linear_cross_entropy: cuBLAS's fp32-output path failed its check ({type(e).__name__}: {e}); "
                      "using the slower Triton weight-gradient sum in this process", stacklevel=2)
        return False


def _scaled(acc: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An fp32 (or fp64) sum times `scale`, in `dtype`: in place for the sum's own dtype (an fp32 weight makes no
    second copy), else in one pass into the narrower result (the product in fp32, rounded once, as before)."""
    if dtype == acc.dtype:
        return acc.mul_(scale)
    return torch.mul(acc, scale, out=torch.empty(acc.shape, dtype=dtype, device=acc.device))


class _WeightGradTorch:
    def __init__(self, weight: torch.Tensor):
        self.dtype = weight.dtype
        self.acc = torch.zeros(weight.shape, dtype=_acc_dtype(weight), device=weight.device)

    def add(self, g: torch.Tensor, x: torch.Tensor) -> None:
        self.acc.addmm_(g.t().to(self.acc.dtype), x.to(self.acc.dtype))

    def result(self, scale: torch.Tensor) -> torch.Tensor:
        out, self.acc = _scaled(self.acc, scale, self.dtype), None
        return out


class _NoWeightGrad:
    """An empty batch's weight gradient: zeros, made only when asked for."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def result(self, scale: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(self.weight)


def _ce_rows_torch(logits, labels, loss_out, scale, ignore_index, smoothing, softcap, z_coef, write_grad):
    """The torch twin of `_ce_rows_kernel` (fp32 math on one chunk)."""
    z = logits.to(loss_out.dtype)
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z = softcap * t
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0).unsqueeze(1)
    lse = torch.logsumexp(z, dim=-1)
    loss = lse - (1.0 - smoothing) * z.gather(1, safe).squeeze(1) + z_coef * lse * lse
    if smoothing:
        loss = loss - smoothing * z.mean(-1)
    loss_out.copy_(torch.where(valid, loss, 0.0))
    if write_grad:
        g = torch.exp(z - lse.unsqueeze(1)) * (1.0 + 2.0 * z_coef * lse).unsqueeze(1) - smoothing / z.shape[1]
        g.scatter_add_(1, safe, torch.full_like(lse, smoothing - 1.0).unsqueeze(1))
        if softcap is not None:
            g = g * (1.0 - t * t)
        g = g * torch.where(valid, scale.expand_as(lse), 0.0).unsqueeze(1)
        logits.copy_(g)


def _acc_dtype(weight: torch.Tensor) -> torch.dtype:
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def _chunk_rows(n: int, v: int, itemsize: int, on_triton: bool) -> int:
    env = os.environ.get("SLIDE_LCE_CHUNK_TOKENS")
    if env:
        return max(1, min(n, int(env)))
    # On the GPU the logits buffer is the knob between memory and time: fewer, longer chunks make the weight-
    # gradient GEMM longer along its reduction axis and cut the fp32 read-modify-writes of the accumulator.
    # 820 MiB keeps a 16k-token, 128k-vocab step under 1/8 of the eager peak (benchmarks/results/kernels.md).
    budget = (820 << 20) if on_triton else (64 << 20)
    chunks = max(1, math.ceil(n * v * itemsize / budget))
    rows = math.ceil(n / chunks)
    return min(n, (rows + 127) // 128 * 128)


def _run(h2d, weight, bias, labels, scale, ignore_index, smoothing, softcap, z_coef, want, on_triton):
    """One pass over all token chunks. `want` = (grad_hidden, grad_weight, grad_bias) flags.

    Returns per-token losses (fp32, 0 where ignored) and the requested gradients, each multiplied by `scale`
    (a 0-d or [N] fp32 tensor): the hidden gradient, the weight gradient's fp32 sum (`.result(s)` gives it
    times `s` in the weight's dtype) and the bias gradient in the accumulation dtype (fp32, fp64 for fp64).
    """
    n, h = h2d.shape
    v = weight.shape[0]
    dtype = weight.dtype
    losses = torch.empty(n, dtype=_acc_dtype(weight), device=h2d.device)
    grad_h = torch.empty((n, h), dtype=dtype, device=h2d.device) if want[0] else None
    grad_b = torch.zeros(v, dtype=_acc_dtype(weight), device=h2d.device) if want[2] else None
    if n == 0:  # an empty batch: nothing to launch, zero gradients
        return losses, grad_h, _NoWeightGrad(weight) if want[1] else None, grad_b
    write_grad = any(want)
    rows = _chunk_rows(n, v, weight.element_size(), on_triton)
    n_chunks = math.ceil(n / rows)
    buf = torch.empty((rows, v), dtype=dtype, device=h2d.device)
    if on_triton and weight.dtype == torch.bfloat16 and weight.is_cuda and _cublas_fp32_accumulation(weight.device):
        kind = _WeightGradCublas
    else:
        kind = _WeightGradTriton if on_triton else _WeightGradTorch
    acc = kind(weight) if want[1] else None
    scale_stride = 1 if scale.dim() == 1 else 0
    bias_c = None if bias is None else bias.to(dtype)  # once, not per chunk
    for i in range(n_chunks):
        s, e = i * rows, min(n, (i + 1) * rows)
        x = h2d[s:e].to(dtype)
        logits = buf[: e - s]
        if bias_c is None:
            torch.mm(x, weight.t(), out=logits)
        else:
            torch.addmm(bias_c, x, weight.t(), out=logits)
        chunk_scale = scale[s:e] if scale_stride else scale
        if on_triton:
            _ce_rows_kernel[(e - s,)](
                logits, logits.stride(0), labels[s:e], losses[s:e], chunk_scale, scale_stride, v, ignore_index,
                float(smoothing), float(softcap or 1.0), float(z_coef),
                HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=smoothing != 0.0, WRITE_GRAD=write_grad,
                BLOCK_V=min(4096, triton.next_power_of_2(v)) if not interpreting() else 64,
                num_warps=8 if not interpreting() else 1,
            )
        else:
            _ce_rows_torch(logits, labels[s:e], losses[s:e], chunk_scale, ignore_index, smoothing, softcap,
                           z_coef, write_grad)
        if want[0]:
            torch.mm(logits, weight, out=grad_h[s:e])
        if want[1]:
            acc.add(logits, x)
        if want[2]:
            grad_b += logits.sum(0, dtype=grad_b.dtype)
    return losses, grad_h, acc, grad_b


def _finish(grad_h, acc, grad_b, bias_dtype, g, applied=False):
    """The gradients of `_run` in the inputs' dtypes, times the upstream gradient `g`; with `applied` (reduction
    "none", whose `_run` took it per row) `g` is 1 and only narrows the weight gradient. The weight gradient is
    narrowed from its fp32 sum only here, with `g` folded into that one pass. A bf16 hidden gradient is
    multiplied by `g` rounded to bf16 (exact for g = 1, a plain `loss.backward()`); an fp16 one in fp32, a block
    of rows at a time, since a loss scale such as GradScaler's 65536 is out of fp16's range."""
    gw = None if acc is None else acc.result(g)
    if not applied and grad_h is not None:
        if grad_h.dtype == torch.float16:
            for r in range(0, grad_h.shape[0], FP16_ROWS):
                grad_h[r : r + FP16_ROWS].copy_(grad_h[r : r + FP16_ROWS].float().mul_(g))
        else:
            grad_h.mul_(g.to(grad_h.dtype))
    if grad_b is not None:
        grad_b = (grad_b if applied else grad_b * g).to(bias_dtype)
    return grad_h, gw, grad_b


FP16_ROWS = 4096  # rows of an fp16 hidden gradient scaled per fp32 temporary


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, normalizer, ignore_index, reduction, smoothing, softcap,
                z_coef, on_triton, grad_enabled):
        h2d = hidden.reshape(-1, hidden.shape[-1])
        lab = labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
        if lab.numel() != h2d.shape[0]:
            raise ValueError(f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
        kept = lab != ignore_index  # the labels that count (the mean's default normalizer, the check below)
        if on_triton:  # the kernel reads the logit a label names: an out-of-range label stops the run (no host sync)
            v = weight.shape[0]
            torch._assert_async((~kept | ((lab >= 0) & (lab < v))).all(),
                                f"linear_cross_entropy: a label is outside [0, {v}) and is not ignore_index")
        # Gradients are made in the forward: none when no backward can follow (no_grad, inference_mode).
        want = ctx.want = tuple(grad_enabled and w for w in (
            ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]))
        fp32 = dict(dtype=_acc_dtype(weight), device=hidden.device)
        if reduction == "none":
            losses, *_ = _run(h2d, weight, bias, lab, torch.ones((), **fp32), ignore_index, smoothing, softcap,
                              z_coef, (False, False, False), on_triton)
            ctx.save_for_backward(hidden, weight, bias, lab)
            ctx.grads = None
        else:
            if reduction == "sum":
                scale = torch.ones((), **fp32)
            else:
                count = kept.sum() if normalizer is None else normalizer
                denom = torch.as_tensor(count, **fp32).reshape(())
                # An all-ignored batch has loss 0 and zero gradients, never 0/0.
                scale = 1.0 / torch.where(denom == 0, torch.ones_like(denom), denom)
            losses, *grads = _run(h2d, weight, bias, lab, scale, ignore_index, smoothing, softcap, z_coef,
                                  want, on_triton)
            ctx.grads = grads
        ctx.hidden_dtype, ctx.acc_dtype = hidden.dtype, fp32["dtype"]
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.cfg = (ignore_index, reduction, smoothing, softcap, z_coef, on_triton, hidden.shape)
        if reduction == "none":
            return losses.view(labels.shape)
        return losses.sum() * scale

    @staticmethod
    def backward(ctx, grad_out):
        ignore_index, reduction, smoothing, softcap, z_coef, on_triton, shape = ctx.cfg
        if reduction == "none":
            hidden, weight, bias, lab = ctx.saved_tensors
            scale = grad_out.reshape(-1).to(ctx.acc_dtype).contiguous()
            _, *grads = _run(hidden.reshape(-1, shape[-1]), weight, bias, lab, scale, ignore_index,
                             smoothing, softcap, z_coef, ctx.want, on_triton)
            gh, gw, gb = _finish(*grads, ctx.bias_dtype, scale.new_ones(()), applied=True)
        else:
            if ctx.grads is None:
                raise RuntimeError("linear_cross_entropy: backward through the same graph twice is not supported")
            grads, ctx.grads = ctx.grads, None
            # The gradients were made in the forward for a unit upstream gradient: scale them. Always, rather
            # than test grad_out == 1 (a host sync every backward); times 1.0 changes no bit.
            gh, gw, gb = _finish(*grads, ctx.bias_dtype, grad_out.to(ctx.acc_dtype))
        if gh is not None:
            gh = gh.view(shape).to(ctx.hidden_dtype)
        return gh, gw, gb, None, None, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                         normalizer: float | torch.Tensor | None = None, label_smoothing: float = 0.0,
                         softcap: float | None = None, z_loss: float = 0.0) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T (+ bias)` against `labels`, without materializing the logits.

    hidden: [..., H]; weight: [V, H]; labels: [...], already aligned with hidden (no shift inside).
    reduction "mean" divides the summed loss by `normalizer` when given (e.g. HF's num_items_in_batch, for
    gradient accumulation), else by the number of non-ignored labels (an all-ignored batch gives 0).
    `softcap` c applies c * tanh(logits / c) first; `z_loss` adds z_loss * logsumexp(logits)^2 per token.
    The loss is fp32 (fp64 for fp64 inputs).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden's last dim {hidden.shape[-1]} != weight's in_features {weight.shape[1]}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    on_triton = use_triton(hidden, weight) and weight.dtype != torch.float64
    return LinearCrossEntropyFunction.apply(hidden, weight, bias, labels, normalizer, ignore_index, reduction,
                                            float(label_smoothing), softcap, float(z_loss), on_triton,
                                            torch.is_grad_enabled())
