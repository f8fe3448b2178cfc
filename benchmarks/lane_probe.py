"""What slows the host-to-device lane in a clipped forward: one block's device update, alone and beside each of
the forward's other loads.

    python3 benchmarks/lane_probe.py --numel 218_112_000 --out benchmarks/results

In a clipped forward, half the sliding blocks update on the device as they load: master, m, v and the bf16
gradient cross PCIe (14 bytes per parameter) piece by piece through two device buffers, the new master goes back
on the device-to-host lane. The engine's timelines show that lane running at about two thirds of the PCIe rate
that `host_memory.py` measures. This times the engine's own piece loop (`_stream_in` and `StreamedStep.store`,
two buffers) for one block of `--numel` parameters:
- the bare copies of the same bytes, nothing else (the lane's ceiling);
- the engine's loop alone;
- beside bf16 GEMMs on a compute stream (the forward), with the h2d stream at normal and at high priority;
- beside the host AdamW's params part on another block (torch's threads, in a Python thread);
- beside both, and device-to-host copies of activations.
Also a host-updated block's load (`Slot.load`: its fp32 master, narrowed on the device) alone and beside both.
Each figure: median of 3, effective GB/s of the bytes the lane must carry in.
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import types

import common
import torch
from common import timed

from slide_memory import AdamWConfig, FlatAdamW, Slot, StreamedStep, host_empty, host_zeros
from slide_memory.layout import FlatLayout
from slide_scheduler.engine import STREAM_PIECE, _stream_in

GB = 1e9


class Busy:
    """Work that runs beside a measurement until the context exits: `gemm` (bf16 matmuls on their own stream),
    `adamw` (the host params part on a block of its own, in a thread), `d2h` (device-to-host copies)."""

    def __init__(self, kinds: set[str], numel: int):
        self.kinds, self.stop = kinds, threading.Event()
        self.threads = []
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

    def _adamw(self):
        while not self.stop.is_set():
            self.opt.step(self.grad, 1e-5, 0.5, part="params")

    def _copies(self):
        with torch.cuda.stream(self.d2h_stream):
            while not self.stop.is_set():
                self.acts_host.copy_(self.acts, non_blocking=True)
                self.d2h_stream.synchronize()

    def __enter__(self):
        for kind, fn in (("gemm", self._gemms), ("adamw", self._adamw), ("d2h", self._copies)):
            if kind in self.kinds:
                self.threads.append(threading.Thread(target=fn, daemon=True))
                self.threads[-1].start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def device_update(opt: FlatAdamW, grad: torch.Tensor, bufs: list[StreamedStep], slot, h2d, d2h) -> None:
    """The engine's `_update_on_device` piece loop for one whole unit, then wait for its last store."""
    free = [None, None]
    numel = bufs[0].numel
    for i, start in enumerate(range(0, opt.master.numel(), numel)):
        end = min(start + numel, opt.master.numel())
        buf = bufs[i % 2]
        if free[i % 2] is not None:
            h2d.wait_event(free[i % 2])
        with torch.cuda.stream(h2d):
            _stream_in(buf, opt, start, end, grad, 1, 1e-5, 0.5, slot)
            loaded = torch.cuda.Event()
            loaded.record(h2d)
        d2h.wait_event(loaded)
        with torch.cuda.stream(d2h):
            buf.store(opt, start, end, moments=False)
            free[i % 2] = torch.cuda.Event()
            free[i % 2].record(d2h)
    free[i % 2].synchronize()


def bare_copies(opt: FlatAdamW, grad: torch.Tensor, bufs: list[StreamedStep], h2d) -> None:
    numel = bufs[0].numel
    with torch.cuda.stream(h2d):
        for i, start in enumerate(range(0, opt.master.numel(), numel)):
            end, buf = min(start + numel, opt.master.numel()), bufs[i % 2]
            for dst, src in ((buf.param, opt.master), (buf.exp_avg, opt.exp_avg), (buf.exp_avg_sq, opt.exp_avg_sq),
                             (buf.grad_in, grad)):
                dst[: end - start].copy_(src[start:end], non_blocking=True)
    h2d.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=218_112_000, help="parameters of the block (Llama-3.1-8B's)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    n = a.numel
    config = AdamWConfig(lr=1e-5)
    opt = FlatAdamW(host_zeros(n, torch.float32).normal_(0, 0.02), config, pinned_states=True)  # as a unit's
    grad = host_zeros(n, torch.bfloat16).normal_(0, 1e-3)
    bufs = [StreamedStep(STREAM_PIECE, config, torch.device("cuda"), torch.bfloat16) for _ in range(2)]
    slot = types.SimpleNamespace(params=torch.zeros(n, device="cuda", dtype=torch.bfloat16))
    module = torch.nn.Linear(n, 1, bias=False, device="meta")  # a slot of n parameters
    block = Slot(FlatLayout(module), module, torch.device("cuda"), torch.bfloat16)
    streams = {prio: (torch.cuda.Stream(priority=prio), torch.cuda.Stream(priority=prio)) for prio in (0, -1)}
    update_bytes, load_bytes = 14 * n, 4 * n
    out = {**common.header("lane_probe"), "numel": n, "piece": STREAM_PIECE, "threads": torch.get_num_threads(),
           "gbps": {}}

    def rate(name: str, fn, nbytes: int, busy: set[str] = frozenset()):
        with Busy(set(busy), n) if busy else contextlib.nullcontext():
            seconds = timed(fn, runs=3)
        out["gbps"][name] = round(nbytes / seconds / GB, 1)
        print(f"{name:40s} {nbytes / seconds / GB:6.1f} GB/s  ({seconds * 1e3:.1f} ms)", flush=True)

    h2d, d2h = streams[0]
    rate("bare copies", lambda: bare_copies(opt, grad, bufs, h2d), update_bytes)
    rate("update alone", lambda: device_update(opt, grad, bufs, slot, h2d, d2h), update_bytes)
    for prio in (0, -1):
        h, d = streams[prio]
        rate(f"update + gemm, priority {prio}", lambda h=h, d=d: device_update(opt, grad, bufs, slot, h, d),
             update_bytes, {"gemm"})
    rate("update + host adamw", lambda: device_update(opt, grad, bufs, slot, h2d, d2h), update_bytes, {"adamw"})
    rate("bare copies + host adamw", lambda: bare_copies(opt, grad, bufs, h2d), update_bytes, {"adamw"})
    for prio in (0, -1):
        h, d = streams[prio]
        rate(f"update + gemm + adamw + d2h, priority {prio}",
             lambda h=h, d=d: device_update(opt, grad, bufs, slot, h, d), update_bytes, {"gemm", "adamw", "d2h"})

    def load():
        with torch.cuda.stream(h2d):
            block.load(opt.master, non_blocking=True)
        h2d.synchronize()

    rate("host block load alone", load, load_bytes)
    rate("host block load + gemm + adamw + d2h", load, load_bytes, {"gemm", "adamw", "d2h"})
    common.write_result(out, a.out, f"lane-probe-{out['commit'][:7]}.json")


if __name__ == "__main__":
    main()
