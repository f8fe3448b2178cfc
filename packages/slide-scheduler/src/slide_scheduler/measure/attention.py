"""Attention kernels' rates on a GPU: one timer for a fused kernel's forward and backward over a row, and each
attention backend's own rate at head_dim 256 (Gemma's heads, soft-capped where the backend can), the figures the
plan chooses a layer's backend by."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..plan.machine import causal_attention_flops

# The wide heads' shape: Gemma-2-9B's (16 query heads of 256, 8 key/value heads), its attention soft-cap
WIDE_HEADS, WIDE_KV_HEADS, WIDE_HEAD_DIM, WIDE_CAP = 16, 8, 256, 50.0
WIDE_SEQ = 4096
Kernel = Callable[[torch.device, int], Callable[..., torch.Tensor]]


def attention_seconds(kernel: Kernel, device: torch.device, seq: int, reps: int, heads: int, kv_heads: int,
                      head_dim: int) -> float:
    """Device seconds of one forward and backward of `kernel`'s attention over one row of `seq` tokens (the mean
    of `reps` after an untimed one, which picks or compiles the kernel); [B, H, S, D] views of [B, S, H, D]
    tensors, as transformers hands them over."""
    def tensor(h: int) -> torch.Tensor:
        return torch.randn(1, seq, h, head_dim, device=device, dtype=torch.bfloat16).transpose(1, 2)

    q, k, v = (tensor(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
    grad = tensor(heads)
    attend = kernel(device, seq)

    def step() -> None:
        torch.autograd.grad(attend(q, k, v), (q, k, v), grad)

    step()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    end.synchronize()
    return max(start.elapsed_time(end) / 1e3 / reps, 1e-9)


def _soft_cap(score, b, h, q, kv):
    return WIDE_CAP * torch.tanh(score / WIDE_CAP)


def _sdpa(device: torch.device, seq: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def run(q, k, v):  # (no soft-cap: SDPA has none)
        with sdpa_kernel(fused):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return run


def _flex(device: torch.device, seq: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seq, seq, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, score_mod=_soft_cap, block_mask=mask, enable_gqa=True)


def _fa4(device: torch.device, seq: int):
    from flash_attn.cute import flash_attn_func

    def run(q, k, v):
        out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, softcap=WIDE_CAP)[0]
        return out.transpose(1, 2)
    return run


BACKENDS: dict[str, Kernel] = {"sdpa": _sdpa, "fa4": _fa4, "flex": _flex}


def backend_rates(device: torch.device, reps: int = 3, seq: int = WIDE_SEQ) -> dict[str, float]:
    """Each attention backend's rate on `device` at the wide heads' shape, as the machine file's
    `<backend>_tflops`: TFLOP/s in `causal_attention_flops`' count; 0 for one that cannot run here (not installed,
    no kernel for this GPU, a failed compile, too little memory)."""
    flops = causal_attention_flops(seq, WIDE_HEADS, WIDE_HEAD_DIM)
    rates = {}
    with torch.cuda.device(device):
        for name, kernel in BACKENDS.items():
            try:
                seconds = attention_seconds(kernel, device, seq, reps, WIDE_HEADS, WIDE_KV_HEADS, WIDE_HEAD_DIM)
                rates[f"{name}_tflops"] = round(flops / seconds / 1e12, 1)
            except (RuntimeError, ImportError, TypeError, ValueError, AssertionError):
                rates[f"{name}_tflops"] = 0.0
            finally:
                torch.cuda.empty_cache()
    return rates
