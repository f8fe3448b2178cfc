"""Measuring this machine: the sizes and rates of a machine file, taken from short runs of the operations a
training step is made of (bf16 GEMMs, pinned copies over PCIe, host memory copies, host AdamW, store I/O).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slide_io import NVMeStore, free_bytes
from slide_memory import AdamWConfig, HostAdamW, host_empty

from .machine import Disk, Gpu, Host, Machine, Pcie

GIB = 1 << 30
MIB = 1 << 20
PAGE = 4096  # O_DIRECT moves only page-aligned buffers: the disk probe's buffer starts on a page


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does: large enough to reach steady rates, small enough to be quick."""

    gemm_n: int
    gemm_reps: int
    pcie_bytes: int
    memory_bytes: int
    adamw_params: int
    disk_bytes: int
    reps: int


FULL = Sizes(gemm_n=8192, gemm_reps=20, pcie_bytes=512 * MIB, memory_bytes=512 * MIB, adamw_params=64 << 20,
             disk_bytes=512 * MIB, reps=5)
QUICK = Sizes(gemm_n=4096, gemm_reps=10, pcie_bytes=64 * MIB, memory_bytes=128 * MIB, adamw_params=16 << 20,
              disk_bytes=32 * MIB, reps=5)


def probe(disk_dir: str | os.PathLike[str] | None = None, device: torch.device | str | None = None,
          quick: bool = False) -> Machine:
    """Measure this machine: its GPU (`device`, by default the current CUDA device when there is one), PCIe,
    host memory and AdamW, and the disk under `disk_dir` (default: the current directory).

    Takes well under a minute; `quick` uses smaller sizes and takes a few seconds. Without a CUDA device the
    GPU and PCIe figures are 0.
    """
    sizes = QUICK if quick else FULL
    device = _device(device)
    gpu, pcie = (probe_gpu(device, sizes), probe_pcie(device, sizes)) if device.type == "cuda" else (Gpu(), Pcie())
    return Machine(gpu=gpu, host=probe_host(sizes), pcie=pcie, disk=probe_disk(disk_dir, quick=quick))


def probe_host(sizes: Sizes = FULL) -> Host:
    """Host memory and cores as the OS reports them, streaming copy bandwidth and fused AdamW throughput."""
    return Host(memory_gib=_figure(host_memory_bytes() / GIB), cores=host_cores(),
                memory_gbps=_figure(_memory_gbps(sizes)), adamw_gparams=_figure(_adamw_gparams(sizes)))


def probe_gpu(device: torch.device, sizes: Sizes = FULL) -> Gpu:
    """Total memory of `device` and its dense bf16 matmul rate."""
    total = torch.cuda.get_device_properties(device).total_memory
    return Gpu(memory_gib=_figure(total / GIB), bf16_tflops=_figure(_gemm_tflops(device, sizes)))


def probe_pcie(device: torch.device, sizes: Sizes = FULL) -> Pcie:
    """Pinned host<->device copy rates each way, and both ways at once on two streams (together)."""
    n = sizes.pcie_bytes
    with torch.cuda.device(device):
        host_in, host_out = host_empty(n, torch.uint8, pinned=True), host_empty(n, torch.uint8, pinned=True)
        host_in.fill_(1)
        dev_in = torch.empty(n, dtype=torch.uint8, device=device)
        dev_out = torch.ones(n, dtype=torch.uint8, device=device)
        up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def h2d() -> None:
            dev_in.copy_(host_in, non_blocking=True)

        def d2h() -> None:
            host_out.copy_(dev_out, non_blocking=True)

        h2d_s = _cuda_seconds([(up, h2d)], device, sizes.reps)
        d2h_s = _cuda_seconds([(down, d2h)], device, sizes.reps)
        both_s = _cuda_seconds([(up, h2d), (down, d2h)], device, sizes.reps)
    return Pcie(h2d_gbps=_figure(n / h2d_s / 1e9), d2h_gbps=_figure(n / d2h_s / 1e9),
                duplex_gbps=_figure(2 * n / both_s / 1e9))


def probe_disk(disk_dir: str | os.PathLike[str] | None = None, quick: bool = False) -> Disk:
    """Free space under `disk_dir` (default: the current directory) and the rates slide-io's disk store reaches
    there, from a file written and read in a temporary folder that is removed afterwards."""
    sizes = QUICK if quick else FULL
    directory = os.path.abspath(os.fspath(disk_dir if disk_dir is not None else os.curdir))
    free_gib = free_bytes(directory) / GIB  # before the probe's own file takes room
    os.makedirs(directory, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="slide-probe-", dir=directory)
    try:
        read_gbps, write_gbps = _disk_gbps(scratch, sizes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Disk(free_gib=_figure(free_gib), read_gbps=_figure(read_gbps), write_gbps=_figure(write_gbps))


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_cores() -> int:
    """Cores this process may run on (a container or taskset may allow fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not every platform has affinity masks
        return os.cpu_count() or 1


# -- measurements ---------------------------------------------------------------------------------------------


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _figure(value: float) -> float:
    """Three significant digits: more than the run-to-run noise of any of these rates, and a readable file."""
    return float(f"{value:.3g}")


def _wall_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of `fn` over `reps` runs, after `warmup` untimed ones (first-touch page faults, caches)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


def _cuda_seconds(work: list[tuple[torch.cuda.Stream, Callable[[], object]]], device: torch.device,
                  reps: int) -> float:
    """Median device time from a common start until the last of `work`'s streams is done (each entry runs
    its function on its own stream, all at once), after one untimed run."""
    times = []
    for rep in range(reps + 1):
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        for stream, fn in work:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                fn()
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record(stream)
        torch.cuda.synchronize(device)
        if rep:
            times.append(max(start.elapsed_time(end) for end in ends) / 1e3)
    return max(statistics.median(times), 1e-9)


def _gemm_tflops(device: torch.device, sizes: Sizes) -> float:
    n = sizes.gemm_n
    with torch.cuda.device(device):
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        for _ in range(3):  # warm-up: cuBLAS picks its kernel, clocks ramp up
            torch.matmul(a, b, out=out)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(sizes.gemm_reps):
            torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        seconds = max(start.elapsed_time(end) / 1e3, 1e-9)
    return 2 * n**3 * sizes.gemm_reps / seconds / 1e12


def _memory_gbps(sizes: Sizes) -> float:
    src = torch.ones(sizes.memory_bytes // 4)
    dst = torch.empty_like(src)
    seconds = _wall_seconds(lambda: dst.copy_(src), sizes.reps, warmup=2)
    # A copy reads every byte once and writes it once: 2 x size bytes of memory traffic.
    return 2 * sizes.memory_bytes / seconds / 1e9


def _adamw_gparams(sizes: Sizes) -> float:
    n = sizes.adamw_params
    master = torch.randn(n)
    grad = torch.randn(n, dtype=torch.bfloat16)  # gradients reach the host in the compute dtype
    optimizer = HostAdamW([master], AdamWConfig(lr=1e-4, weight_decay=0.01))
    # The first steps of a fresh optimizer run slower (its states and scratch settle in memory): two go untimed.
    seconds = _wall_seconds(lambda: optimizer.step_unit(0, grad, lr=1e-4), sizes.reps, warmup=2)
    return n / seconds / 1e9


def _aligned_bytes(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start : start + nbytes]


def _disk_gbps(directory: str, sizes: Sizes) -> tuple[float, float]:
    """(read, write) GB/s of the NVMe store under `directory`: one buffer in a few keys moved concurrently, as
    the store's workers move a step's states; rewrites of existing keys, as in the steady state."""
    pieces = 4
    piece = sizes.disk_bytes // pieces // PAGE * PAGE
    buffer = _aligned_bytes(piece * pieces)
    buffer.view(torch.float32).uniform_()  # random bytes: a compressing filesystem cannot shrink them
    parts = [buffer[i * piece : (i + 1) * piece] for i in range(pieces)]
    store = NVMeStore(directory)
    try:

        def write() -> None:
            for future in [store.write(f"probe-{i}", part) for i, part in enumerate(parts)]:
                future.result()

        def read() -> None:
            for future in [store.read(f"probe-{i}", part) for i, part in enumerate(parts)]:
                future.result()

        write_s = _wall_seconds(write, sizes.reps)  # the untimed first run makes the files
        read_s = _wall_seconds(read, sizes.reps)
    finally:
        store.close()
    total = piece * pieces
    return total / read_s / 1e9, total / write_s / 1e9
