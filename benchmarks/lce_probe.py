"""Where the fused linear cross-entropy spends its time on the GPU, by token-chunk size (issue 3's shape).

Times each piece of one chunk (the three matmuls, the fp32 accumulate of the weight gradient, the row kernel),
the final narrowing, and the whole op at several chunk sizes next to Liger-Kernel, in alternating rounds so
that clock drift hits every provider alike. Writes `lce-probe-<commit>.json` to --out.

    PYTHONPATH=packages/slide-kernels/src python3 benchmarks/lce_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib

import kernels  # the timing harness (and it puts the packages on the path)
import torch
from common import git_commit
from triton.testing import do_bench

import slide_kernels as sk

lce = importlib.import_module("slide_kernels.ops.linear_cross_entropy")  # the module, not the function

BT, H, V = 16384, 4096, 128256


def pieces(hidden, weight, labels, rows):
    x = hidden[:rows]
    g = torch.mm(x, weight.t())
    acc = torch.empty(V, H, device="cuda", dtype=torch.float32)
    loss = torch.empty(rows, device="cuda")
    scale = torch.ones((), device="cuda")
    flop = 2 * rows * H * V

    def ce():
        lce._ce_rows_kernel[(rows,)](g, g.stride(0), labels[:rows], loss, scale, 0, V, -100, 0.0, 1.0, 0.0,
                                     HAS_SOFTCAP=False, HAS_SMOOTHING=False, WRITE_GRAD=True, BLOCK_V=4096,
                                     num_warps=8)

    t = {
        "logits_mm": do_bench(lambda: torch.mm(x, weight.t(), out=g), return_mode="median"),
        "grad_h_mm": do_bench(lambda: torch.mm(g, weight), return_mode="median"),
        "grad_w_fp32_first": do_bench(lambda: torch.mm(g.t(), x, out_dtype=torch.float32, out=acc),
                                      return_mode="median"),
        "grad_w_fp32_accumulate": do_bench(
            lambda: torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc), return_mode="median"),
        "grad_w_bf16": do_bench(lambda: torch.mm(g.t(), x), return_mode="median"),
    }
    accT = acc.view(H, V)
    t["grad_wT_fp32_accumulate"] = do_bench(
        lambda: torch.addmm(accT, x.t(), g, out_dtype=torch.float32, out=accT), return_mode="median")
    out = {k: {"ms": round(v, 4), "tflops": round(flop / v / 1e9, 1)} for k, v in t.items()}
    ms = do_bench(ce, return_mode="median")
    out["ce_kernel"] = {"ms": round(ms, 4), "gbps": round(3 * rows * V * 2 / ms / 1e6, 1)}  # 2 reads, 1 write
    return out


def ceiling(hidden, weight):
    """What cuBLAS gives on the op's three matmuls done whole (no chunking: 4.2 GB of logits) and on a square
    8192^3 GEMM, the shape such peak figures are usually quoted for: the floor of any op built on them."""
    g = torch.mm(hidden, weight.t())
    sq = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    runs = {"logits_mm": (lambda: torch.mm(hidden, weight.t(), out=g), 2 * BT * H * V),
            "grad_h_mm": (lambda: torch.mm(g, weight), 2 * BT * H * V),
            "grad_w_mm": (lambda: torch.mm(g.t(), hidden), 2 * BT * H * V),
            "square_8192": (lambda: torch.mm(sq, sq), 2 * 8192**3)}
    out = {}
    for name, (fn, flop) in runs.items():
        ms = do_bench(fn, warmup=300, rep=1000, return_mode="median")
        out[name] = {"ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 1)}
    out["three_whole_ms"] = round(sum(out[k]["ms"] for k in ("logits_mm", "grad_h_mm", "grad_w_mm")), 3)
    return out


def narrowing(weight):
    """The backward's scaled narrowing of the fp32 weight-gradient sum to bf16 in place (the restoring copy that
    each run needs is timed alone and taken off)."""
    acc = lce._WeightGradCublas(weight)
    buf = acc.acc
    src = torch.randn_like(buf)
    s = torch.full((), 0.5, device="cuda")

    def current():
        buf.copy_(src)
        acc.acc = buf
        acc.result(s)

    base = do_bench(lambda: buf.copy_(src), return_mode="median")
    return {"restore_only": round(base, 4),
            "narrow_scaled_minus_restore": round(do_bench(current, return_mode="median") - base, 4)}


def whole(hidden, weight, labels, chunk_list, rounds):
    """The op at several chunk sizes (the env knob) next to Liger, through kernels.py's harness."""
    fns = {}
    if kernels.liger():
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        lg = LigerFusedLinearCrossEntropyLoss()
        fns["liger"] = lambda: lg(weight, hidden, labels)

    def slide(rows):
        def run():
            if rows:
                os.environ["SLIDE_LCE_CHUNK_TOKENS"] = str(rows)
            try:
                return sk.linear_cross_entropy(hidden, weight, labels)
            finally:
                os.environ.pop("SLIDE_LCE_CHUNK_TOKENS", None)
        return run
    for rows in chunk_list:
        fns[f"slide-{rows or 'default'}"] = slide(rows)
    kernels.ROUNDS = rounds
    return kernels.run_all(fns, [hidden, weight], None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--rows", default="2048,2560,3072,3328,3584,4096")  # "" skips the pieces
    p.add_argument("--whole", default="0,2560,3072,3584")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(0)
    hidden = (torch.randn(BT, H, device="cuda") * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, device="cuda") * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (BT,), device="cuda")
    labels[::17] = -100
    doc = {"benchmark": "benchmarks/lce_probe.py", "git_commit": git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [BT, H, V]}
    with torch.no_grad():
        doc["pieces"] = {}
        for r in filter(None, a.rows.split(",")):
            doc["pieces"][r] = pieces(hidden.detach(), weight.detach(), labels, int(r))
            print(r, doc["pieces"][r], flush=True)
        doc["narrowing"] = narrowing(weight.detach())
        doc["ceiling"] = ceiling(hidden.detach(), weight.detach())
        print("ceiling", doc["ceiling"], flush=True)
    torch.cuda.empty_cache()
    doc["whole"] = whole(hidden, weight, labels, [int(r) for r in a.whole.split(",")], a.rounds) if a.whole else {}
    path = pathlib.Path(a.out) / f"lce-probe-{doc['git_commit'][:7]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    for r, d in doc["pieces"].items():
        print(r, {k: v.get("tflops", v.get("gbps")) for k, v in d.items()},
              "sum ms", round(sum(v["ms"] for k, v in d.items() if k in (
                  "logits_mm", "grad_h_mm", "grad_w_fp32_accumulate", "ce_kernel")), 3))
    print(doc["narrowing"])
    for k, v in doc["whole"].items():
        print(k, v)


if __name__ == "__main__":
    main()
