"""The host optimizer thread beside a busy Python thread: how much the GIL costs it.

The engine's host optimizer is one Python thread calling torch ops, several per cache-sized block; each op lets
go of the GIL and must take it back afterwards. Meanwhile the training thread holds it while it launches kernels.
This times FlatAdamW's params part alone and beside a thread that issues small torch ops without pause (as a
kernel-launching thread does), at several `sys.setswitchinterval` values, on `--threads` torch threads:

    python3 benchmarks/optimizer_gil.py --threads 1 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import platform
import sys
import threading

import common
import torch
from common import timed

from slide_memory import AdamWConfig, FlatAdamW


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=16_000_000)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--intervals", default="0.005,0.001,0.0005", help="switch intervals (s) to try")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    n = a.numel
    opt = FlatAdamW(torch.randn(n) * 0.02, AdamWConfig(lr=1e-5))
    grad = (torch.randn(n) * 1e-3).bfloat16()

    def step_seconds() -> float:
        return timed(lambda: opt.step(grad, 1e-5, 0.5, part="params"))

    default = sys.getswitchinterval()
    out = {**common.header("optimizer_gil"), "cpu": platform.processor() or platform.machine(),
           "threads": a.threads, "numel": n,
           "alone_gparams_per_s": round(n / step_seconds() / 1e9, 3), "beside_busy_thread": {}}
    small = torch.zeros(8)
    for interval in (float(x) for x in a.intervals.split(",")):
        sys.setswitchinterval(interval)
        result = {}
        worker = threading.Thread(target=lambda result=result: result.setdefault("s", step_seconds()))
        worker.start()
        while worker.is_alive():  # the busy thread: small ops, mostly Python and dispatch time
            for _ in range(100):
                small.add_(1.0)
        worker.join()
        out["beside_busy_thread"][f"{interval * 1e3:g} ms"] = round(n / result["s"] / 1e9, 3)
    sys.setswitchinterval(default)
    common.write_result(out, a.out, f"optimizer-gil-{out['commit'][:7]}-{a.threads}threads.json")


if __name__ == "__main__":
    main()
