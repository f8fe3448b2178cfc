"""The host's memory bandwidth, alone and shared with PCIe copies: the ceiling that clipped updates run against.

With exact clipping, every sliding block's update runs after the last gradient, under the next forward, and each
one moves its master and AdamW states through host memory, whether the host's AdamW reads them or the copy
engines stream them to the device. This measures, on the lent machine, what those two ways get alone and at once:

    python3 benchmarks/host_memory.py --out $OUT

  copy        a 2 GiB fp32 host copy (bytes read + written per second)
  adamw       FlatAdamW over 256M fp32 parameters, whole update and the split update's params part
  pcie        pinned host -> device and device -> host, 1 GiB each, alone and both ways at once
  shared      the AdamW params part while both PCIe directions stream without pause (each side's rate)
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import threading
import time

import common
import torch

from slide_memory import AdamWConfig, FlatAdamW, host_empty

GB = 1e9


def timed(fn, runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Streaming:
    """Copies in both PCIe directions, queued back to back on two streams until stopped; counts the bytes."""

    def __init__(self, nbytes: int):
        self.src, self.dst = host_empty(nbytes, torch.uint8), host_empty(nbytes, torch.uint8)
        self.dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.h2d, self.d2h = torch.cuda.Stream(), torch.cuda.Stream()
        self.stop, self.moved, self.seconds = threading.Event(), 0, 0.0

    def _loop(self) -> None:
        start = time.perf_counter()
        while not self.stop.is_set():
            with torch.cuda.stream(self.h2d):
                self.dev_in.copy_(self.src, non_blocking=True)
            with torch.cuda.stream(self.d2h):
                self.dst.copy_(self.dev_out, non_blocking=True)
            self.h2d.synchronize()
            self.d2h.synchronize()
            self.moved += 2 * self.src.numel()
        self.seconds = time.perf_counter() - start

    def __enter__(self):
        self.thread = threading.Thread(target=self._loop)
        self.thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--numel", type=int, default=256 << 20)
    a = p.parse_args()
    n = a.numel
    out = {"benchmark": "host_memory", "commit": common.git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "threads": torch.get_num_threads(), "numel": n}

    src, dst = torch.ones(512 << 20), torch.empty(512 << 20)
    s = timed(lambda src=src, dst=dst: dst.copy_(src))
    out["copy_gbps"] = round(2 * src.nbytes / s / GB, 1)

    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    opt = FlatAdamW(torch.randn(n) * 0.02, AdamWConfig(lr=1e-5))
    # bytes through host memory per parameter: whole = p, m, v read and written + bf16 gradient read;
    # params part = p, m, v, gradient read + p written
    for part, per_param in (("all", 26), ("params", 18)):
        s = timed(lambda part=part: opt.step(grad, 1e-5, 0.5, part=part))
        out[f"adamw_{part}_gparams_per_s"] = round(n / s / 1e9, 3)
        out[f"adamw_{part}_gbps"] = round(n * per_param / s / GB, 1)

    if torch.cuda.is_available():
        nbytes = 1 << 30
        with Streaming(nbytes) as both:
            time.sleep(2.0)
        out["pcie_both_gbps"] = round(both.moved / both.seconds / GB, 1)
        h = host_empty(nbytes, torch.uint8)
        d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        for name, fn in (("pcie_h2d_gbps", lambda: d.copy_(h, non_blocking=True)),
                         ("pcie_d2h_gbps", lambda: h.copy_(d, non_blocking=True))):
            s = timed(lambda fn=fn: (fn(), torch.cuda.synchronize()))
            out[name] = round(nbytes / s / GB, 1)
        del h, d
        with Streaming(nbytes) as both:
            s = timed(lambda: opt.step(grad, 1e-5, 0.5, part="params"), runs=4)
        out["shared_adamw_params_gparams_per_s"] = round(n / s / 1e9, 3)
        out["shared_adamw_params_gbps"] = round(n * 18 / s / GB, 1)
        out["shared_pcie_both_gbps"] = round(both.moved / both.seconds / GB, 1)
        out["shared_total_gbps"] = round(out["shared_adamw_params_gbps"] + out["shared_pcie_both_gbps"], 1)
    print(json.dumps(out, indent=1))
    if a.out:
        path = pathlib.Path(a.out) / f"host-memory-{out['commit'][:7]}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
