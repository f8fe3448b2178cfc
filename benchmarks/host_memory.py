"""The host's memory bandwidth, alone and shared with PCIe copies: the ceiling that clipped updates run against.

With exact clipping, every sliding block's update runs after the last gradient, under the next forward, and each
one moves its master and AdamW states through host memory, whether the host's AdamW reads them or the copy
engines stream them to the device. This measures, on the lent machine, what those two ways get alone and at once:

    python3 benchmarks/host_memory.py --out $OUT

  copy        a 2 GiB fp32 host copy (bytes read + written per second)
  adamw       FlatAdamW over 256M fp32 parameters, whole update and the split update's params part
  pcie        pinned host -> device and device -> host, 1 GiB each, alone and both ways at once
  shared      the AdamW params part while both PCIe directions stream without pause (each side's rate over the
              same window), on all threads and, as a control, on one thread fewer
  handoff     (`--handoff`) the params part's new master on its way to the device, per block: written to the
              master, then copied (the engine today: the next block's update beside this one's copy); copied
              chunk by chunk right after each is written (the read may find it in the 300 MiB shared cache);
              written only to a small pinned staging ring that is copied from (the master itself left for the
              moments part to write, which a whole-step kernel can do in the backward)
"""

from __future__ import annotations

import argparse
import threading
import time

import common
import torch
from common import timed

from slide_memory import AdamWConfig, FlatAdamW, host_empty
from slide_memory.adamw import _adamw_kernel, host_block

GB = 1e9


class Streaming:
    """Copies in both PCIe directions, queued back to back on two streams until stopped; counts the bytes.

    The thread sleeps on blocking events (no spinning core), so it takes no CPU time from what runs beside it."""

    def __init__(self, nbytes: int):
        self.src, self.dst = host_empty(nbytes, torch.uint8), host_empty(nbytes, torch.uint8)
        self.dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.h2d, self.d2h = torch.cuda.Stream(), torch.cuda.Stream()
        self.stop, self.moved = threading.Event(), 0

    def _loop(self) -> None:
        while not self.stop.is_set():
            done = []
            for stream, dst, src in ((self.h2d, self.dev_in, self.src), (self.d2h, self.dst, self.dev_out)):
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream)
                    done.append(event)
            for event in done:
                event.synchronize()
            self.moved += 2 * self.src.numel()

    def __enter__(self):
        self.thread = threading.Thread(target=self._loop)
        self.thread.start()
        time.sleep(0.3)  # both directions streaming before anything is timed
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def rate_during(self, fn) -> tuple[float, float]:
        """(seconds fn took, PCIe bytes per second moved meanwhile), from whole copies completed in that window."""
        moved, start = self.moved, time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        return seconds, (self.moved - moved) / seconds


def params_part(opt: FlatAdamW, grad: torch.Tensor, start: int, end: int, out: torch.Tensor, scale: float) -> None:
    """The split update's params part over [start, end) in cache-sized blocks, its new master written to `out`
    (a view of the master itself, or a staging buffer: then the master is only read)."""
    block = host_block(end - start)
    step = torch.ones(())
    for a in range(start, end, block):
        b = min(a + block, end)
        n = b - a
        g = opt.scratch[:n].copy_(grad[a:b]).mul_(scale)
        m, v = opt._wide[0, :n].copy_(opt.exp_avg[a:b]), opt._wide[1, :n].copy_(opt.exp_avg_sq[a:b])
        p = out[a - start:b - start]
        if p.data_ptr() != opt.master[a:b].data_ptr():
            p.copy_(opt.master[a:b])
        _adamw_kernel(p, g, m, v, step, 1e-5, opt.config)


def handoff(n: int, blocks: int, chunk: int) -> dict:
    """Seconds per block of `n` parameters for the params part and its master's copy to the device, three ways
    (module notes), `blocks` blocks in a row over two units (each one's copy beside the other's update)."""
    # pinned masters and pageable states, as the engine keeps a host-updated block
    units = [FlatAdamW(host_empty(n, torch.float32).normal_(0, 0.02), AdamWConfig(lr=1e-5), pinned_states=False)
             for _ in range(2)]
    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    device = torch.empty(n, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    ring = [host_empty(chunk, torch.float32) for _ in range(4)]
    ring_free = [None] * len(ring)

    def copy(src: torch.Tensor, start: int) -> torch.cuda.Event:
        with torch.cuda.stream(stream):
            device[start:start + src.numel()].copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def after():  # the engine now: the whole part, then the master's copy (overlapping the next block's part)
        for k in range(blocks):
            opt = units[k % 2]
            params_part(opt, grad, 0, n, opt.master, 0.5)
            copy(opt.master, 0)
        torch.cuda.synchronize()

    def chunked(staged: bool):
        r = 0
        for k in range(blocks):
            opt = units[k % 2]
            for a in range(0, n, chunk):
                b = min(a + chunk, n)
                if staged:
                    if ring_free[r] is not None:
                        ring_free[r].synchronize()
                    out = ring[r][: b - a]
                    params_part(opt, grad, a, b, out, 0.5)
                    ring_free[r] = copy(out, a)
                    r = (r + 1) % len(ring)
                else:
                    params_part(opt, grad, a, b, opt.master[a:b], 0.5)
                    copy(opt.master[a:b], a)
        torch.cuda.synchronize()

    result = {"numel": n, "blocks": blocks, "chunk": chunk, "ring": len(ring)}
    for name, fn in (("alone", lambda: [params_part(units[k % 2], grad, 0, n, units[k % 2].master, 0.5)
                                        for k in range(blocks)]),
                     ("after", after), ("chunked", lambda: chunked(False)), ("staged", lambda: chunked(True))):
        s = timed(fn, runs=3) / blocks
        result[name] = {"s_per_block": round(s, 4), "gparams_per_s": round(n / s / 1e9, 3)}
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--numel", type=int, default=256 << 20)
    p.add_argument("--handoff", action="store_true", help="only the handoff measurement (module notes)")
    a = p.parse_args()
    if a.handoff:  # an 8B block's parameters, 4 M-element (16 MB) chunks
        out = {**common.header("host_memory_handoff"), "threads": torch.get_num_threads(),
               **handoff(218_112_000, 6, 4 << 20)}
        common.write_result(out, a.out, f"host-handoff-{out['commit'][:7]}.json")
        return
    n = a.numel
    out = {**common.header("host_memory"), "threads": torch.get_num_threads(), "numel": n}

    src, dst = torch.ones(512 << 20), torch.empty(512 << 20)
    s = timed(lambda src=src, dst=dst: dst.copy_(src))
    out["copy_gbps"] = round(2 * src.nbytes / s / GB, 1)

    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    opt = FlatAdamW(torch.randn(n) * 0.02, AdamWConfig(lr=1e-5))
    # Nominal bytes through host memory per parameter (what the update must move; the kernel's scratch copies
    # in cache-sized blocks come on top): whole = p, m, v read and written + bf16 gradient read; params part =
    # p, m, v, gradient read + p written
    for part, per_param in (("all", 26), ("params", 18)):
        s = timed(lambda part=part: opt.step(grad, 1e-5, 0.5, part=part))
        out[f"adamw_{part}_gparams_per_s"] = round(n / s / 1e9, 3)
        out[f"adamw_{part}_nominal_gbps"] = round(n * per_param / s / GB, 1)

    if torch.cuda.is_available():
        nbytes = 1 << 30
        streamed = 256 << 20  # per copy while streaming: short copies, so a window's count is not coarse
        with Streaming(streamed) as both:
            out["pcie_both_gbps"] = round(both.rate_during(lambda: time.sleep(2.0))[1] / GB, 1)
        h = host_empty(nbytes, torch.uint8)
        d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        for name, fn in (("pcie_h2d_gbps", lambda: d.copy_(h, non_blocking=True)),
                         ("pcie_d2h_gbps", lambda: h.copy_(d, non_blocking=True))):
            s = timed(lambda fn=fn: (fn(), torch.cuda.synchronize()))
            out[name] = round(nbytes / s / GB, 1)
        del h, d
        # AdamW beside the copies, on all threads and on one thread fewer (a control for the copy thread's share
        # of the CPU); both rates over the same window, from the run of median AdamW time of 3.
        threads = torch.get_num_threads()
        for key, n_threads in (("shared", threads), ("shared_one_thread_fewer", threads - 1)):
            torch.set_num_threads(n_threads)
            alone = timed(lambda: opt.step(grad, 1e-5, 0.5, part="params"), runs=3)
            runs = []
            with Streaming(streamed) as both:
                for _ in range(3):
                    runs.append(both.rate_during(lambda: opt.step(grad, 1e-5, 0.5, part="params")))
            seconds, pcie = sorted(runs)[1]
            out[key] = {"threads": n_threads, "adamw_params_alone_gparams_per_s": round(n / alone / 1e9, 3),
                        "adamw_params_gparams_per_s": round(n / seconds / 1e9, 3),
                        "adamw_params_nominal_gbps": round(n * 18 / seconds / GB, 1),
                        "pcie_both_gbps": round(pcie / GB, 1)}
        torch.set_num_threads(threads)
    common.write_result(out, a.out, f"host-memory-{out['commit'][:7]}.json")


if __name__ == "__main__":
    main()
