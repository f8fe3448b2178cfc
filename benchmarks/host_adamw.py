"""Host optimizer throughput: where a sliding block's CPU update spends its time.

    python benchmarks/host_adamw.py --numel 100_000_000

Times, for one unit of `numel` parameters: widening its bf16 gradient to fp32, the fused AdamW step over the fp32
master, and writing the fresh bf16 copy; prints G params/s for each and for the whole update (median of runs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import common  # noqa: F401 (puts the packages on the path)
import torch

from slide_memory import AdamWConfig, FlatAdamW


def timed(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=100_000_000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    n = args.numel
    master = torch.randn(n) * 0.02
    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    compute = torch.empty(n, dtype=torch.bfloat16)
    opt = FlatAdamW(master, AdamWConfig(lr=1e-5))
    scratch = torch.empty(n)
    results = {
        "threads": torch.get_num_threads(),
        "widen_s": timed(lambda: scratch.copy_(grad), args.runs),
        "refresh_s": timed(lambda: compute.copy_(master), args.runs),
        "update_s": timed(lambda: opt.step(grad, 1e-5, 0.5), args.runs),
    }
    whole = timed(lambda: (opt.step(grad, 1e-5, 0.5), compute.copy_(master)), args.runs)
    results["whole_s"] = whole
    results.update({k.replace("_s", "_gparams_per_s"): n / v / 1e9 for k, v in list(results.items()) if k != "threads"})
    print(json.dumps(results, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"benchmark": "host_adamw", "numel": n, **results}, indent=1))


if __name__ == "__main__":
    main()
