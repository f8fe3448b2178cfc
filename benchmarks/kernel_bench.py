"""Benchmark slide-kernels against torch eager, torch.compile and Liger-Kernel in one run (CUDA, bf16).

Forward+backward of each op: median time of `triton.testing.do_bench`, and extra peak memory (the rise of
`torch.cuda.max_memory_allocated` over what was allocated before the call, inputs excluded). Shapes and targets
are those of the fused loss, norm and MLP of a Llama-3.1-8B step at 16k tokens, and of OLMoE-1B-7B's experts
(`moe_experts`, against transformers' own experts module, also forward alone) at 4k and 32k tokens. Prints a
markdown table and, with --json, writes the figures (git commit, date, GPU, versions, config) there;
`run.py kernels` runs it that way. Without a CUDA GPU it times nothing and says so.

    python3 benchmarks/kernel_bench.py [--json FILE] [--ops rms_norm,rope] [--providers eager,liger,slide]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from attention_rows import bench_attention
from common import git_commit  # (first: puts the packages on the path)
from triton.testing import do_bench

import slide_kernels as sk

GIB = 1 << 30


def peak_of(fn, grad_to_none):
    """fn() runs forward+backward once. Returns its extra peak GiB (after a warm-up call that compiles)."""
    fn()
    torch.cuda.synchronize()
    for t in grad_to_none:
        t.grad = None
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    for t in grad_to_none:
        t.grad = None
    return peak


def time_of(fn, grad_to_none):
    # A long warm-up: sub-millisecond ops timed right after an idle moment ran at up to 1.7x their time on a
    # busy card (rounds of one run on an H200).
    return do_bench(fn, grad_to_none=grad_to_none, warmup=300, rep=300, return_mode="median")


def fwd_bwd(forward, grad_of=None):
    def run():
        out = forward()
        if isinstance(out, tuple):
            torch.autograd.backward(out, grad_of)
        elif out.dim() == 0:
            out.backward()
        else:
            out.backward(grad_of)
    return run


def liger():
    try:
        import liger_kernel  # noqa: F401
        return True
    except Exception:
        return False


# ---------------------------------------------------------------- linear cross-entropy
def bench_linear_ce(bt, h, v, providers):
    torch.manual_seed(0)
    hidden = (torch.randn(bt, h, device="cuda") * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (bt,), device="cuda")
    labels[::17] = -100

    def eager():
        return F.cross_entropy((hidden @ weight.t()).float(), labels)

    fns = {"eager": eager}
    if "compile" in providers:
        fns["compile"] = torch.compile(eager)
    if "liger" in providers and liger():
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        lg = LigerFusedLinearCrossEntropyLoss()
        fns["liger"] = lambda: lg(weight, hidden, labels)
    fns["slide"] = lambda: sk.linear_cross_entropy(hidden, weight, labels)
    # Chunk sizes and the pieces of one chunk: benchmarks/lce_probe.py.
    return run_all(fns, [hidden, weight], None, check=lambda f: f().item())


ROUNDS = 1  # --rounds: time the providers in turn this many times, so that clock drift hits each alike


def run_all(fns, leaves, grad, check=None):
    results = {}
    for name, f in fns.items():
        try:
            t0 = time.time()
            row = {"peak_gib": round(peak_of(fwd_bwd(f, grad), leaves), 4), "rounds_ms": []}
            if check is not None:
                with torch.no_grad():
                    row["value"] = check(f)
            row["setup_wall_s"] = round(time.time() - t0, 1)  # warm-up, peak and check; the rounds come after
            results[name] = row
        except Exception as e:  # a peer failing must not sink the run
            results[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            traceback.print_exc()
        torch.cuda.empty_cache()
    for _ in range(ROUNDS):
        for name, f in fns.items():
            if "error" in results[name]:
                continue
            try:
                results[name]["rounds_ms"].append(round(time_of(fwd_bwd(f, grad), leaves), 4))
            except Exception as e:
                results[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
                traceback.print_exc()
            torch.cuda.empty_cache()
    for name, row in results.items():
        if "rounds_ms" in row:
            row["ms"] = statistics.median(row["rounds_ms"])
        print(name, row, flush=True)
    return results


# ---------------------------------------------------------------- RMSNorm
def bench_rms_norm(m, h, providers):
    torch.manual_seed(0)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.rand(h, device="cuda") + 0.5).bfloat16().requires_grad_()
    dy = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)

    def eager():
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    fns = {"eager": eager}
    if "compile" in providers:
        fns["compile"] = torch.compile(eager)
    if "liger" in providers and liger():
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        mod = LigerRMSNorm(h, eps=1e-6).to("cuda", torch.bfloat16)
        with torch.no_grad():
            mod.weight.copy_(w)
        fns["liger"] = lambda: mod(x)
        leaves = [x, w, mod.weight]
    else:
        leaves = [x, w]
    fns["slide"] = lambda: sk.rms_norm(x, w, 1e-6)
    return run_all(fns, leaves, dy)


# ---------------------------------------------------------------- RoPE
def bench_rope(t, hq, hk, d, providers):
    torch.manual_seed(0)
    qb = torch.randn(1, t, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kb = torch.randn(1, t, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(t, device="cuda", dtype=torch.float32)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    emb = torch.cat([torch.outer(pos, inv)] * 2, -1)[None]
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    dq = torch.randn(1, hq, t, d, device="cuda", dtype=torch.bfloat16)
    dk = torch.randn(1, hk, t, d, device="cuda", dtype=torch.bfloat16)
    from slide_kernels.ops.rope import rope_torch

    def qk():  # HF's layout: view(B, T, H, D).transpose(1, 2)
        return qb.transpose(1, 2), kb.transpose(1, 2)

    fns = {"eager": lambda: rope_torch(*qk(), cos, sin)}
    if "compile" in providers:
        compiled = torch.compile(rope_torch)
        fns["compile"] = lambda: compiled(*qk(), cos, sin)
    if "liger" in providers and liger():
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        # Liger rotates in place: give it fresh non-leaf copies each call, as an attention layer would.
        fns["liger"] = lambda: liger_rotary_pos_emb(*(x * 1 for x in qk()), cos, sin)
        fns["slide-copy-inputs"] = lambda: sk.rope(*(x * 1 for x in qk()), cos, sin)
    fns["slide"] = lambda: sk.rope(*qk(), cos, sin)
    return run_all(fns, [qb, kb], (dq, dk))


# ---------------------------------------------------------------- SwiGLU
def bench_swiglu(t, h, i, providers):
    act = bench_swiglu_act(t, i, providers)
    torch.cuda.empty_cache()
    return {"act": act, "mlp": bench_swiglu_mlp(t, h, i, providers)}


def bench_swiglu_act(t, i, providers):
    torch.manual_seed(0)
    a = torch.randn(t, i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(t, i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dc = torch.randn(t, i, device="cuda", dtype=torch.bfloat16)

    def eager():
        return F.silu(a) * b

    fns = {"eager": eager}
    if "compile" in providers:
        fns["compile"] = torch.compile(eager)
    if "liger" in providers and liger():
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        # Liger writes its backward into the saved inputs: hand it non-leaf copies.
        fns["liger"] = lambda: LigerSiLUMulFunction.apply(a * 1, b * 1)
        fns["slide-copy-inputs"] = lambda: sk.swiglu(a * 1, b * 1)
    fns["slide"] = lambda: sk.swiglu(a, b)
    return run_all(fns, [a, b], dc)


def bench_swiglu_mlp(t, h, i, providers):
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    mlp = sk.SwiGLUMLP(h, i, device="cuda", dtype=torch.bfloat16)

    def mlp_eager():
        return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))

    fns = {"eager": mlp_eager, "slide": lambda: mlp(x)}
    if "liger" in providers and liger():
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        fns["liger"] = lambda: mlp.down_proj(LigerSiLUMulFunction.apply(mlp.gate_proj(x), mlp.up_proj(x)))
    return run_all(fns, [x, *mlp.parameters()], dy)


# ---------------------------------------------------------------- MoE experts
# OLMoE-1B-7B's sparse layer: hidden 2048, 64 experts, 8 per token, expert intermediate 1024.
OLMOE = dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8)


def bench_moe_experts(tokens, providers):
    """transformers' experts module as it runs on CUDA (the implementation transformers picks for the model,
    grouped_mm) against the same module after `slide_kernels.apply_to` (`moe_experts`). Routing from the layer's
    own router on the benchmark's tokens; the routing weights are a leaf, so both compute their gradient."""
    import copy

    import transformers

    config = transformers.AutoConfig.for_model("olmoe", **OLMOE, num_hidden_layers=1, vocab_size=1024,
                                               num_attention_heads=16, num_key_value_heads=16)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config).bfloat16()
    layer = model.model.layers[0].mlp
    ours_model = copy.deepcopy(model)
    patched = sk.apply_to(ours_model, rms_norm=False, rope=False, swiglu=False, cross_entropy=False)
    hf, ours = layer.experts, ours_model.model.layers[0].mlp.experts
    assert ours.forward.__func__ is sk.MoEExperts.forward and len(patched) == 1, patched
    x = torch.randn(tokens, OLMOE["hidden_size"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        _, weights, index = layer.gate(x)
    weights = weights.detach().requires_grad_()
    dy = torch.randn_like(x)

    fns = {"transformers": lambda: hf(x, index, weights), "slide": lambda: ours(x, index, weights)}
    with torch.no_grad():
        want = fns["transformers"]().float()
    rows = run_all(fns, [x, weights, *hf.parameters(), *ours.parameters()], dy,
                   check=lambda f: (f().float() - want).abs().max().item())
    for name, f in fns.items():  # the forward alone, recording for autograd as a training step does
        if "ms" in rows[name]:
            rows[name]["fwd_ms"] = round(time_of(f, [x, weights]), 4)
    load = torch.bincount(index.reshape(-1), minlength=OLMOE["num_experts"])
    rows["_routing"] = {"experts_implementation": hf.config._experts_implementation,
                        "rows_per_expert_min_max": [int(load.min()), int(load.max())]}
    print("moe_experts", tokens, rows["_routing"], flush=True)
    return rows


def table(res) -> str:
    lines = ["| op | shape | provider | fwd+bwd ms | fwd ms | extra peak GiB |", "|---|---|---|---|---|---|"]
    for op, (shape, rows) in res.items():
        for name, r in rows.items():
            if name.startswith("_"):
                continue
            if "error" in r:
                lines.append(f"| {op} | {shape} | {name} | error | | {r['error'][:60]} |")
            else:
                fwd = f"{r['fwd_ms']:.3f}" if "fwd_ms" in r else ""
                lines.append(f"| {op} | {shape} | {name} | {r['ms']:.3f} | {fwd} | {r['peak_gib']:.3f} |")
    return "\n".join(lines)


def targets(res) -> dict:
    out = {}
    lce = res.get("linear_cross_entropy", (None, {}))[1]
    if "ms" in lce.get("slide", {}):
        s = lce["slide"]
        if "ms" in lce.get("eager", {}):
            out["lce_peak_le_eager/8"] = s["peak_gib"] <= lce["eager"]["peak_gib"] / 8
        if "ms" in lce.get("liger", {}):
            out["lce_time_le_0.8_liger"] = s["ms"] <= 0.8 * lce["liger"]["ms"]
            out["lce_time_ratio_vs_liger"] = round(s["ms"] / lce["liger"]["ms"], 3)
    for op in ("rms_norm", "rope", "swiglu_act", "swiglu_mlp"):
        rows = res.get(op, (None, {}))[1]
        if "ms" in rows.get("slide", {}) and "ms" in rows.get("liger", {}):
            out[f"{op}_time_ratio_vs_liger"] = round(rows["slide"]["ms"] / rows["liger"]["ms"], 3)
    for op, (_, rows) in res.items():  # the experts kernel stays wired in only where it beats transformers'
        ours, theirs = rows.get("slide", {}), rows.get("transformers", {})
        if op.startswith("moe_experts") and "ms" in ours and "ms" in theirs:
            out[f"{op}_time_ratio_vs_transformers"] = round(ours["ms"] / theirs["ms"], 3)
            out[f"{op}_fwd_time_ratio_vs_transformers"] = round(ours["fwd_ms"] / theirs["fwd_ms"], 3)
            out[f"{op}_faster_than_transformers"] = ours["ms"] < theirs["ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=pathlib.Path, help="write the figures to this file")
    p.add_argument("--ops", default="linear_cross_entropy,rms_norm,rope,swiglu,moe_experts",
                   help="comma-separated; also `attention` (the attention suite's rows)")
    p.add_argument("--providers", default="eager,compile,liger,slide")
    p.add_argument("--rounds", type=int, default=1, help="time the providers in turn N times; report the median")
    args = p.parse_args()
    global ROUNDS
    ROUNDS = args.rounds
    if not torch.cuda.is_available():
        print("benchmarks/kernel_bench.py: no CUDA GPU here, nothing timed (skipped)")
        return
    providers = set(args.providers.split(","))
    ops = args.ops.split(",")
    res = {}
    jobs = {
        "linear_cross_entropy": lambda: {"linear_cross_entropy": (
            "BT=16384 H=4096 V=128256", bench_linear_ce(16384, 4096, 128256, providers))},
        "rms_norm": lambda: {"rms_norm": ("16384x4096", bench_rms_norm(16384, 4096, providers))},
        "rope": lambda: {"rope": ("T=16384 32q/8kv d=128", bench_rope(16384, 32, 8, 128, providers))},
        "swiglu": lambda: (lambda sw: {
            "swiglu_act": ("T=16384 I=14336 (silu(a)*b only)", sw["act"]),
            "swiglu_mlp": ("T=16384 4096->14336 (whole MLP)", sw["mlp"]),
        })(bench_swiglu(16384, 4096, 14336, providers)),
        "moe_experts": lambda: {
            f"moe_experts_{t // 1024}k": (f"OLMoE-1B-7B experts, T={t} H=2048 E=64 top-8 I=1024",
                                          bench_moe_experts(t, providers))
            for t in (4096, 32768)},
        "attention": lambda: bench_attention(providers, time_of),
    }
    for op in ops:
        try:  # one op failing must not lose the others' figures
            res.update(jobs[op]())
        except Exception as e:
            traceback.print_exc()
            res[op] = ("error", {"run": {"error": f"{type(e).__name__}: {e}"[:400]}})
        torch.cuda.empty_cache()
    now = datetime.datetime.now(datetime.timezone.utc)
    versions = {"torch": torch.__version__, "triton": triton.__version__}
    try:
        import importlib.metadata

        versions["flash_attn_4"] = importlib.metadata.version("flash-attn-4")
    except Exception:
        versions["flash_attn_4"] = None
    try:
        import liger_kernel
        versions["liger_kernel"] = getattr(liger_kernel, "__version__", "installed")
    except Exception:
        versions["liger_kernel"] = None
    doc = {
        "benchmark": "benchmarks/kernel_bench.py",
        "git_commit": git_commit(),
        "date": now.isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "versions": versions,
        "config": {"dtype": "bfloat16", "measure": "forward+backward; triton.testing.do_bench median (ms), the "
                   "median over --rounds rounds that take the providers in turn; "
                   "extra peak = max_memory_allocated - memory_allocated before the call (GiB); moe_experts rows "
                   "also time the forward alone (fwd_ms, recording for autograd)",
                   "providers": sorted(providers), "ops": ops, "rounds": ROUNDS},
        "results": {op: {"shape": shape, "providers": rows} for op, (shape, rows) in res.items()},
        "targets": targets(res),
    }
    print(table(res))
    print(json.dumps(doc["targets"], indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print("wrote", args.json)


if __name__ == "__main__":
    main()
