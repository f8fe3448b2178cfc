"""Host optimizer throughput: one sliding block's CPU AdamW update, by the size of the blocks it works through.

    python benchmarks/host_adamw.py --numel 100_000_000 --out benchmarks/results/host-adamw-<where>.json

Times, for one unit of `numel` parameters with a bf16 gradient, `FlatAdamW.step` working through cache-sized
blocks (`BLOCK_PER_THREAD` elements per thread, the default) and through whole 32M-element chunks (the widened
gradient then goes to memory and back), for fp32 and bf16 states, and in cache-sized blocks the two parts of a
split update (`part="params"`, `part="moments"`); prints G params/s (median of runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import platform
from unittest import mock

import common
import torch
from common import timed
from host_memory import Streaming

from slide_memory import AdamWConfig, FlatAdamW, adamw


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=100_000_000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", default=None, help="comma-separated log2 block sizes per thread: time whole updates "
                   "and both split parts (fp32 states) at each, instead of the default table")
    args = p.parse_args()
    n = args.numel
    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    results = {"threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}
    if args.sweep:
        sweep(results, grad, [int(x) for x in args.sweep.split(",")], args.runs)
    else:
        table(results, grad, args.runs)
    print(json.dumps(results, indent=1))
    if args.out:
        record = {"benchmark": "host_adamw", "commit": common.git_commit(), "numel": n, **results}
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1))


def sweep(results: dict, grad: torch.Tensor, log2s: list[int], runs: int) -> None:
    """Whole updates and both split parts, fp32 states, at each block size per thread (2**log2 elements); on a
    CUDA machine also beside pinned copies streaming both ways without pause (host_memory.Streaming), as the
    clipped forward's device updates keep them."""
    n = grad.numel()
    beside = [False, True] if torch.cuda.is_available() else [False]
    for log2 in log2s:
        with mock.patch.object(adamw, "BLOCK_PER_THREAD", 1 << log2):
            for part in ("all", "params", "moments"):
                opt = FlatAdamW(torch.randn(n) * 0.02, AdamWConfig(lr=1e-5))
                for pcie in beside:
                    with Streaming(256 << 20) if pcie else contextlib.nullcontext():
                        seconds = timed(lambda opt=opt, part=part: opt.step(grad, 1e-5, 0.5, part=part), runs)
                    key = f"block_2^{log2}_{part}{'_beside_pcie' if pcie else ''}_gparams_per_s"
                    results[key] = round(n / seconds / 1e9, 3)
                    print(key, results[key], flush=True)


def table(results: dict, grad: torch.Tensor, runs: int) -> None:
    """Whole updates in cache-sized blocks and in whole chunks, fp32 and bf16 states; the two split parts."""
    n = grad.numel()
    for states in (torch.float32, torch.bfloat16):
        for name, per_thread in (("blocks", adamw.BLOCK_PER_THREAD), ("whole_chunks", adamw.CHUNK)):
            with mock.patch.object(adamw, "BLOCK_PER_THREAD", per_thread):  # whole chunks: blocks are chunks
                opt = FlatAdamW(torch.randn(n) * 0.02, AdamWConfig(lr=1e-5), states_dtype=states)
                seconds = timed(lambda opt=opt: opt.step(grad, 1e-5, 0.5), runs)
            key = f"{str(states).removeprefix('torch.')}_states_{name}"
            results[key + "_s"] = seconds
            results[key + "_gparams_per_s"] = n / seconds / 1e9
        for part in ("params", "moments"):
            opt = FlatAdamW(torch.randn(n) * 0.02, AdamWConfig(lr=1e-5), states_dtype=states)
            seconds = timed(lambda opt=opt, part=part: opt.step(grad, 1e-5, 0.5, part=part), runs)
            key = f"{str(states).removeprefix('torch.')}_states_{part}_part"
            results[key + "_s"] = seconds
            results[key + "_gparams_per_s"] = n / seconds / 1e9


if __name__ == "__main__":
    main()
