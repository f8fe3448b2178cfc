"""What slows the host-to-device lane in a clipped forward: one block's device update, alone and beside each of
the forward's other loads.

    python3 benchmarks/lane_probe.py --numel 218_112_000 --out benchmarks/results

In a clipped forward, half the sliding blocks update on the device as they load: master, m, v and the bf16
gradient cross PCIe (14 bytes per parameter) piece by piece through two device buffers, the new master goes back
on the device-to-host lane. The engine's timelines showed that lane at about two thirds of the PCIe rate that
`host_memory.py` measures. This times the engine's piece loop (`StreamedStep.load`, `_step_piece`,
`StreamedStep.store`; the engine's `STREAM_BUFFERS`) for one block of `--numel` parameters, with its kernels on
the copy stream (as before 2026-11-30) and on a land stream of their own (as now):
- the bare copies of the same bytes, nothing else (the lane's ceiling), alone and beside the rest below;
- the loop alone; beside bf16 GEMMs on another stream (the forward); beside GEMMs, the host AdamW's params part
  on another block (torch's threads, in a Python thread) and device-to-host copies (activations).
And a host-updated block's load (its fp32 master, narrowed on the device), both ways, alone and beside all that.
Each figure: median of 3, effective GB/s of the bytes the lane must carry in.
"""

from __future__ import annotations

import argparse
import contextlib
import threading

import common
import torch
from common import timed

from slide_memory import AdamWConfig, FlatAdamW, Slot, StreamedStep, host_empty, host_zeros
from slide_memory.layout import FlatLayout
from slide_scheduler.engine import STREAM_BUFFERS, STREAM_PIECE, _step_piece

GB = 1e9


class Busy:
    """Work that runs beside a measurement until the context exits: `gemm` (bf16 matmuls on their own stream),
    `adamw` (the host params part on a block of its own, in a thread), `d2h` (device-to-host copies)."""

    def __init__(self, kinds: set[str], numel: int):
        self.kinds, self.stop = kinds, threading.Event()
        self.threads, self.started = [], {kind: threading.Event() for kind in kinds}
        if "gemm" in kinds:
            self.a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
            self.b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
            self.gemm_stream = torch.cuda.Stream()
        if "adamw" in kinds:
            self.opt = FlatAdamW(torch.randn(numel) * 0.02, AdamWConfig(lr=1e-5))
            self.grad = (torch.randn(numel) * 1e-3).bfloat16()
        if "d2h" in kinds:
            self.acts = torch.randn(64 << 20, device="cuda", dtype=torch.bfloat16)
            self.acts_host = host_empty(64 << 20, torch.bfloat16)
            self.d2h_stream = torch.cuda.Stream()

    def _gemms(self):
        with torch.cuda.stream(self.gemm_stream):
            while not self.stop.is_set():
                for _ in range(8):
                    torch.matmul(self.a, self.b)
                self.gemm_stream.synchronize()  # keep the queue short, so stopping is prompt
                self.started["gemm"].set()  # (the first batch includes cuBLAS's set-up in this thread)

    def _adamw(self):
        while not self.stop.is_set():
            self.opt.step(self.grad, 1e-5, 0.5, part="params")
            self.started["adamw"].set()

    def _copies(self):
        with torch.cuda.stream(self.d2h_stream):
            while not self.stop.is_set():
                self.acts_host.copy_(self.acts, non_blocking=True)
                self.d2h_stream.synchronize()
                self.started["d2h"].set()

    def __enter__(self):
        for kind, fn in (("gemm", self._gemms), ("adamw", self._adamw), ("d2h", self._copies)):
            if kind in self.kinds:
                self.threads.append(threading.Thread(target=fn, daemon=True))
                self.threads[-1].start()
        for started in self.started.values():  # measure only once everything runs
            started.wait()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def device_update(opt: FlatAdamW, grad: torch.Tensor, bufs: list[StreamedStep], slot: Slot, h2d, d2h,
                  land=None) -> None:
    """The engine's `_update_on_device` piece loop for one whole unit, then wait for its last store. `land`: the
    stream the kernels run on (the engine's land lane); None: on the copy stream, between the copies (the
    engine before 2026-11-30)."""
    free = [None] * len(bufs)
    numel = bufs[0].numel
    for i, start in enumerate(range(0, opt.master.numel(), numel)):
        end, k = min(start + numel, opt.master.numel()), i % len(bufs)
        buf = bufs[k]
        if free[k] is not None:
            h2d.wait_event(free[k])
        with torch.cuda.stream(h2d):
            buf.load(opt, start, end, grad)
        if land is not None:
            land.wait_stream(h2d)
        with torch.cuda.stream(land or h2d):
            _step_piece(buf, start, end, grad, 1, 1e-5, 0.5, slot)
        d2h.wait_stream(land or h2d)
        with torch.cuda.stream(d2h):
            buf.store(opt, start, end, moments=False)
            free[k] = torch.cuda.Event()
            free[k].record(d2h)
    free[k].synchronize()


def bare_copies(opt: FlatAdamW, grad: torch.Tensor, bufs: list[StreamedStep], h2d) -> None:
    numel = bufs[0].numel
    with torch.cuda.stream(h2d):  # the update's copies in (StreamedStep.load), nothing else
        for i, start in enumerate(range(0, opt.master.numel(), numel)):
            bufs[i % len(bufs)].load(opt, start, min(start + numel, opt.master.numel()), grad)
    h2d.synchronize()


def carveout_cases(a, out, opt, grad, bufs, block, h2d, d2h, land, busy, rate) -> None:
    """The forward's GEMMs leaving SMs free for the land lane's kernels: the GEMM's own time (does the carveout
    apply, and what does it cost) and the device update in the full mix, per carveout."""
    n = a.numel
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    out["gemm_ms"] = {}
    def gemms():
        for _ in range(20):
            torch.matmul(x, w)
        torch.cuda.synchronize()

    for backend in ("cublas", "cublaslt"):  # which BLAS path torch's matmul takes (the carveout may apply to one)
        torch.backends.cuda.preferred_blas_library(backend)
        for carveout in (int(c) for c in a.carveouts.split(",")):
            torch._C._set_sm_carveout_experimental(carveout or None)
            seconds = timed(gemms, runs=3)
            out["gemm_ms"][f"{backend} {carveout}"] = round(seconds / 20 * 1e3, 3)
            print(f"gemm 8192x4096x14336, {backend}, carveout {carveout}: {seconds / 20 * 1e3:.3f} ms", flush=True)
            rate(f"update + gemm + adamw + d2h, {backend}, carveout {carveout}",
                 lambda: device_update(opt, grad, bufs, block, h2d, d2h, land), 14 * n, busy)
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("cublas")
    common.write_result(out, a.out, f"lane-probe-carveout-{out['commit'][:7]}.json")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=218_112_000, help="parameters of the block (Llama-3.1-8B's)")
    p.add_argument("--out", default=None)
    p.add_argument("--carveouts", default="",
                   help="e.g. 0,8,16: only time the GEMM and the update and load in the full mix with the forward's "
                        "GEMMs leaving that many SMs free (torch._C._set_sm_carveout_experimental)")
    a = p.parse_args()
    n = a.numel
    config = AdamWConfig(lr=1e-5)
    opt = FlatAdamW(host_zeros(n, torch.float32).normal_(0, 0.02), config, pinned_states=True)  # as a unit's
    grad = host_zeros(n, torch.bfloat16).normal_(0, 1e-3)
    bufs = [StreamedStep(STREAM_PIECE, config, torch.device("cuda"), torch.bfloat16) for _ in range(STREAM_BUFFERS)]
    module = torch.nn.Linear(n, 1, bias=False, device="meta")  # a slot of n parameters
    block = Slot(FlatLayout(module), module, torch.device("cuda"), torch.bfloat16)
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    update_bytes, load_bytes = 14 * n, 4 * n
    out = {**common.header("lane_probe"), "numel": n, "piece": STREAM_PIECE, "threads": torch.get_num_threads(),
           "gbps": {}}

    def rate(name: str, fn, nbytes: int, busy: set[str] = frozenset()):
        with Busy(set(busy), n) if busy else contextlib.nullcontext():
            seconds = timed(fn, runs=3)
        out["gbps"][name] = round(nbytes / seconds / GB, 1)
        print(f"{name:40s} {nbytes / seconds / GB:6.1f} GB/s  ({seconds * 1e3:.1f} ms)", flush=True)

    land = torch.cuda.Stream(priority=-1)
    busy = {"gemm", "adamw", "d2h"}
    if a.carveouts:
        carveout_cases(a, out, opt, grad, bufs, block, h2d, d2h, land, busy, rate)
        return
    rate("bare copies", lambda: bare_copies(opt, grad, bufs, h2d), update_bytes)
    for name, kernels in (("kernels on the copy stream", None), ("kernels on a land stream", land)):
        def fn(kernels=kernels):
            device_update(opt, grad, bufs, block, h2d, d2h, kernels)

        rate(f"update alone, {name}", fn, update_bytes)
        rate(f"update + gemm, {name}", fn, update_bytes, {"gemm"})
        rate(f"update + gemm + adamw + d2h, {name}", fn, update_bytes, busy)
    rate("bare copies + gemm + adamw + d2h", lambda: bare_copies(opt, grad, bufs, h2d), update_bytes, busy)

    def load_in_one_stream():  # Slot.load: copy and narrow each piece on one stream
        with torch.cuda.stream(h2d):
            block.load(opt.master, non_blocking=True)
        h2d.synchronize()

    def load_landed():  # the engine's _load: copies on h2d, narrowing on land, alternating landing halves
        narrowed = {}
        for start, end, k, landing in block.pieces(n):
            if k in narrowed:
                h2d.wait_event(narrowed[k])
            with torch.cuda.stream(h2d):
                landing.copy_(opt.master[start:end], non_blocking=True)
            land.wait_stream(h2d)
            with torch.cuda.stream(land):
                block.params[start:end].copy_(landing)
                narrowed[k] = torch.cuda.Event()
                narrowed[k].record(land)
        land.synchronize()

    for name, fn in (("one stream", load_in_one_stream), ("copies and land streams", load_landed)):
        rate(f"host block load alone, {name}", fn, load_bytes)
        rate(f"host block load + gemm + adamw + d2h, {name}", fn, load_bytes, busy)
    common.write_result(out, a.out, f"lane-probe-{out['commit'][:7]}.json")


if __name__ == "__main__":
    main()
