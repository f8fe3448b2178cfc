"""Attention rows of kernel_bench.py: each backend at Gemma-2-9B's shape, forward and backward, in one process.

The shape is one row of 4096 tokens, 16 query and 8 key/value heads of 256, scale 256**-0.5, soft-cap 50, as
Gemma-2-9B's layers run it; cases: causal (the global layers, and the local ones where the row is no longer than
their window of 4096), a window of 1024, packed documents, and plain causal without a cap (where SDPA's kernels
apply). Each backend's out, dq, dk and dv are checked against a float32 reference, beside HF eager's own bf16
error; its time is counted in `causal_attention_flops`, the count the machine file's `attention_tflops` uses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SEQ, HEADS, KV_HEADS, HEAD_DIM, CAP = 4096, 16, 8, 256, 50.0
DOCUMENTS = 4  # equal documents packed in the row

CASES = {
    "causal cap 50": dict(window=None, cap=CAP, documents=False),
    "window 1024 cap 50": dict(window=1024, cap=CAP, documents=False),
    "4 documents cap 50": dict(window=None, cap=CAP, documents=True),
    "causal no cap": dict(window=None, cap=None, documents=False),
}


def causal_flops(backward: bool = True) -> float:
    from slide_scheduler import causal_attention_flops

    return causal_attention_flops(SEQ, HEADS, HEAD_DIM, backward=backward)


def document_ids(device) -> torch.Tensor:
    return (torch.arange(SEQ, device=device) // (SEQ // DOCUMENTS))[None]


def allowed(window, documents, device) -> torch.Tensor:
    q = torch.arange(SEQ, device=device)
    ok = q[:, None] >= q[None, :]
    if window is not None:
        ok &= q[:, None] - q[None, :] < window
    if documents:
        ids = document_ids(device)[0]
        ok &= ids[:, None] == ids[None, :]
    return ok


def dense(q, k, v, scale, window, cap, documents, dtype):
    """HF eager attention's arithmetic in `dtype` (float32: the reference), on [B, H, S, D] tensors."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~allowed(window, documents, q.device), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    return probs @ v.to(dtype)


def flex(window, cap, documents, flash: bool):
    from torch.nn.attention.flex_attention import flex_attention

    from slide_train.models import attention as at
    from slide_train.models import backends

    compiled = torch.compile(flex_attention, dynamic=False)
    mask = at.block_mask(document_ids("cuda") if documents else None, window, SEQ, "cuda")
    score_mod = backends._soft_cap(cap) if cap is not None else None
    options = {"BACKEND": "FLASH"} if flash else None

    def run(q, k, v, scale):
        return compiled(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=True,
                        kernel_options=options)
    return run


def fa4(window, cap, documents):
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    left = None if window is None else window - 1  # HF's window holds q - kv < window
    cu = torch.arange(0, SEQ + 1, SEQ // DOCUMENTS, device="cuda", dtype=torch.int32)

    def run(q, k, v, scale):  # [B, H, S, D] views of [B, S, H, D] tensors: FA's layout is free
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if documents:
            out = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=SEQ //
                                         DOCUMENTS, max_seqlen_k=SEQ // DOCUMENTS, softmax_scale=scale, causal=True,
                                         window_size=(left, 0), softcap=cap or 0.0)[0][None]
        else:
            out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=(left, 0),
                                  softcap=cap or 0.0)[0]
        return out.transpose(1, 2)
    return run


def sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def run(q, k, v, scale):
        with sdpa_kernel(which):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return run


def providers_for(case: dict) -> dict:
    out = {"flex": lambda: flex(**case, flash=False), "flex-flash": lambda: flex(**case, flash=True),
           "fa4": lambda: fa4(**case)}
    if case["cap"] is None and case["window"] is None and not case["documents"]:
        out.update({"sdpa-cudnn": lambda: sdpa("cudnn"), "sdpa-flash": lambda: sdpa("flash")})
    return out


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_case(case: dict, wanted: set, time_of) -> dict:
    torch.manual_seed(0)
    base = [torch.randn(1, SEQ, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS)]
    leaves = [t.requires_grad_() for t in base]
    q, k, v = (t.transpose(1, 2) for t in leaves)  # [B, H, S, D], as transformers hands them over
    scale = HEAD_DIM ** -0.5
    grad = torch.randn(1, HEADS, SEQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def grads_of(fn):
        for t in leaves:
            t.grad = None
        out = fn(q, k, v, scale)
        out.backward(grad)
        got = [out.detach()] + [t.grad.detach().clone() for t in leaves]
        for t in leaves:
            t.grad = None
        return got

    ref = grads_of(lambda *a: dense(*a, case["window"], case["cap"], case["documents"], torch.float32))
    eager = grads_of(lambda *a: dense(*a, case["window"], case["cap"], case["documents"], torch.bfloat16))
    names = ("out", "dq", "dk", "dv")
    rows = {"_eager_bf16_error": {n: rel(e, r) for n, e, r in zip(names, eager, ref)}}
    flops, flops_fwd = causal_flops(), causal_flops(backward=False)
    for name, make in providers_for(case).items():
        if name not in wanted:
            continue
        try:
            fn = make()
            got = grads_of(fn)
            error = {n: rel(g, r) for n, g, r in zip(names, got, ref)}
            ok = all(error[n] <= 2 * rows["_eager_bf16_error"][n] + 1e-4 and math.isfinite(error[n]) for n in names)

            def full(fn=fn):
                fn(q, k, v, scale).backward(grad)

            def forward(fn=fn):
                with torch.no_grad():
                    fn(q, k, v, scale)

            ms, fwd_ms = time_of(full, leaves), time_of(forward, [])
            rows[name] = {"ms": round(ms, 4), "fwd_ms": round(fwd_ms, 4), "peak_gib": 0.0,
                          "tflops": round(flops / ms / 1e9, 1), "fwd_tflops": round(flops_fwd / fwd_ms / 1e9, 1),
                          "rel_error": {n: round(e, 6) for n, e in error.items()},
                          "within_2x_eager": ok}
        except Exception as e:  # a backend missing or refusing the case must not sink the others
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(name, case, rows[name], flush=True)
        torch.cuda.empty_cache()
    return rows


def bench_attention(providers: set, time_of) -> dict:
    wanted = providers if providers & {"flex", "flex-flash", "fa4", "sdpa-cudnn", "sdpa-flash"} else \
        {"flex", "flex-flash", "fa4", "sdpa-cudnn", "sdpa-flash"}
    shape = f"Gemma-2-9B 1x{SEQ} {HEADS}q/{KV_HEADS}kv d={HEAD_DIM}"
    return {f"attention {name}": (shape, bench_case(case, wanted, time_of)) for name, case in CASES.items()}
