"""Measuring this machine: the sizes and rates of a machine file, taken from short runs of the operations a
training step is made of (bf16 GEMMs, causal attention at a long sequence, a mixture's routed MLP, pinned copies
over PCIe, host memory under a step's mix of copies and AdamW, host AdamW, store I/O through each path slide-io
can take).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slide_io import NVMeStore, PathRates, choose_path, free_bytes, kvikio_choice
from slide_memory import AdamWConfig, HostAdamW, host_empty

from ..plan.machine import Disk, Gpu, Host, Machine, Pcie, causal_attention_flops, routed_expert_flops
from .attention import attention_seconds, backend_rates
from .host import host_cores, host_memory_bytes, last_level_cache_bytes

GIB = 1 << 30
MIB = 1 << 20
PAGE = 4096  # O_DIRECT moves only page-aligned buffers: the disk probe's buffer starts on a page
MIX_RUNS = 3  # the host's mix of AdamW and copies, run this many times: the best of them counts


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does: large enough to reach steady rates, small enough to be quick."""

    gemm_n: int
    gemm_reps: int
    pcie_bytes: int  # each PCIe copy's, measured alone
    memory_bytes: int  # each copy's in the host memory mix
    adamw_params: int
    disk_bytes: int
    reps: int
    mix_seconds: float = 1.0  # how long the host memory mix runs, every lane at once
    disk_reps: int = 3  # timed writes and reads of `disk_bytes` per disk path
    attention_seq: int = 16384  # the row of the attention measurement (tokens; ATTENTION_HEADS' shape)
    attention_reps: int = 3  # timed forward + backward passes per kernel
    attention_flex: bool = True  # FlexAttention beside SDPA (its first call compiles it)
    experts_tokens: int = 4096  # the micro-batch of the routed experts' measurement (EXPERTS' shape)
    experts_reps: int = 3


# The disk moves 1 GiB per path: shorter transfers read faster than a step's states sustain.
FULL = Sizes(gemm_n=8192, gemm_reps=20, pcie_bytes=512 * MIB, memory_bytes=512 * MIB, adamw_params=64 << 20,
             disk_bytes=GIB, reps=5, mix_seconds=3.0, disk_reps=3)
# The quick probe (the one a run takes before its first step when it has no machine file) times SDPA alone:
# FlexAttention's first call compiles Triton kernels for its forward and backward, which that run should not wait
# for.
QUICK = Sizes(gemm_n=4096, gemm_reps=10, pcie_bytes=64 * MIB, memory_bytes=128 * MIB, adamw_params=16 << 20,
              disk_bytes=128 * MIB, reps=3, mix_seconds=1.0, disk_reps=3, attention_flex=False)
# Attention's shape: Llama-3.1-8B's heads (32 of 128, 8 key/value heads), one row (`Sizes.attention_seq`).
ATTENTION_HEADS = 32
ATTENTION_KV_HEADS = 8
ATTENTION_HEAD_DIM = 128
# The routed experts' shape: OLMoE-1B-7B's layer (hidden 2048, 64 experts of width 1024, 8 per token).
EXPERTS, EXPERTS_TOP_K, EXPERTS_HIDDEN, EXPERTS_WIDTH = 64, 8, 2048, 1024
# The AdamW's master, m, v and gradient (14 bytes a parameter) span at least this many times the machine's
# last-level caches: from a cache it runs several times faster than from memory (16 Mi parameters, 224 MB,
# measured 2.3x the rate of 64 Mi on an H100 host and 7x on a 2-core VM that reports 480 MB of L3).
PAST_CACHE = 2
ADAMW_FOOTPRINT = 14


def probe(disk_dir: str | os.PathLike[str] | None = None, device: torch.device | str | None = None,
          quick: bool = False) -> Machine:
    """Measure this machine: its GPU (`device`, by default the current CUDA device when there is one), PCIe,
    host memory and AdamW, and the disk under `disk_dir` (default: the current directory).

    Takes well under a minute; `quick` uses smaller sizes and takes a few seconds. Without a CUDA device the
    GPU and PCIe figures are 0.
    """
    sizes = past_cache(QUICK if quick else FULL)
    device = _device(device)
    gpu, pcie = (probe_gpu(device, sizes), probe_pcie(device, sizes)) if device.type == "cuda" else (Gpu(), Pcie())
    return Machine(gpu=gpu, host=probe_host(sizes, device), pcie=pcie, disk=probe_disk(disk_dir, quick=quick))


def probe_host(sizes: Sizes = FULL, device: torch.device | str | None = None) -> Host:
    """Host memory and cores as the OS reports them, fused AdamW throughput alone, and what host memory moves
    under a step's mix: copies to and from `device` beside the AdamW threads, the sum of what each moves
    (`mix_lanes`, `run_mix`). One streaming copy alone understates the mix: DMA engines and cores each reach only
    part of the memory's bandwidth."""
    lanes = mix_lanes(sizes, device)
    adamw = lanes[0]  # timed alone first, on the buffers the mix then uses (one allocation for both)
    # (a slow host's steps over a buffer past its cache take long: the timed ones stop after the mix's time)
    alone_s = _wall_seconds(adamw.op, sizes.reps, warmup=adamw.warmup, budget=sizes.mix_seconds)
    # the mix, best of MIX_RUNS: what the host moves, and the AdamW's rate beside the copies as a share of its own
    mixes = [run_mix([dataclasses.replace(lane, warmup=0) if lane is adamw else lane for lane in lanes],
                     sizes.mix_seconds) for _ in range(MIX_RUNS)]
    moved = max(sum(run.gbps for run in runs) for runs in mixes)
    beside_s = min(run.seconds / max(run.ops, 1) for runs in mixes for run in runs if run.name == "adamw")
    return Host(memory_gib=_figure(host_memory_bytes() / GIB), cores=host_cores(), memory_gbps=_figure(moved),
                adamw_gparams=_figure(sizes.adamw_params / alone_s / 1e9),
                adamw_beside_copies=_figure(min(1.0, alone_s / beside_s)))


def probe_gpu(device: torch.device, sizes: Sizes = FULL) -> Gpu:
    """Total memory of `device`, its dense bf16 matmul rate, its causal attention rate (`probe_attention`) and its
    routed-experts rate (`probe_experts`)."""
    total = torch.cuda.get_device_properties(device).total_memory
    return Gpu(
        memory_gib=_figure(total / GIB),
        bf16_tflops=_figure(_gemm_tflops(device, sizes)),
        attention_tflops=probe_attention(device, sizes),
        **(backend_rates(device, sizes.attention_reps) if sizes.attention_flex else {}),
        experts_tflops=probe_experts(device, sizes),
    )


def probe_attention(device: torch.device | str | None = None, sizes: Sizes = FULL) -> float:
    """Causal attention's rate on `device` (default: the current CUDA device), forward and backward, the faster
    of the kernels `attention_rates` measures, in TFLOP/s as `causal_attention_flops` counts them. 0 without a
    CUDA device, or where no kernel ran."""
    device = _device(device)
    if device.type != "cuda":
        return 0.0
    return _figure(max(attention_rates(device, sizes).values(), default=0.0))


def attention_rates(device: torch.device, sizes: Sizes = FULL) -> dict[str, float]:
    """Each fused attention kernel's rate on `device`, by name ("sdpa", and "flex" where `sizes.attention_flex`):
    causal bf16 attention, one row of `sizes.attention_seq` tokens with ATTENTION_HEADS query heads of
    ATTENTION_HEAD_DIM and ATTENTION_KV_HEADS key/value heads, forward and backward (the gradients of query, key
    and value). TFLOP/s in `causal_attention_flops`' count (the backward at 2x the forward); 0 for a kernel that
    cannot run here (no flash kernel for this GPU, no Triton for FlexAttention, too little free memory).

    sdpa is torch's scaled_dot_product_attention with is_causal=True and grouped key/value heads, as the trainer
    calls it for causal rows, held to its fused kernels (flash, cuDNN, memory-efficient): the math kernel, which
    builds the S x S scores, is left out. flex is FlexAttention, compiled as the trainer compiles it, with a
    causal BlockMask."""
    seq, reps = sizes.attention_seq, sizes.attention_reps
    flops = causal_attention_flops(seq, ATTENTION_HEADS, ATTENTION_HEAD_DIM)
    kernels = {"sdpa": _sdpa_causal}
    if sizes.attention_flex:
        kernels["flex"] = _flex_causal
    rates = {}
    with torch.cuda.device(device):
        for name, kernel in kernels.items():
            try:
                rates[name] = flops / _attention_seconds(kernel, device, seq, reps) / 1e12
            # (a kernel this GPU or torch has not: no kernel, a failed compile, out of memory, no enable_gqa)
            except (RuntimeError, ImportError, TypeError):
                rates[name] = 0.0
            finally:
                torch.cuda.empty_cache()
    return rates


def probe_experts(device: torch.device | str | None = None, sizes: Sizes = FULL) -> float:
    """A mixture's routed MLP's rate on `device` (default: the current CUDA device), forward and backward, in
    TFLOP/s as `routed_expert_flops` counts them: `routed_mlp` over `sizes.experts_tokens` tokens at EXPERTS'
    shape in bf16. 0 without a CUDA device, or where torch has no grouped GEMM for it."""
    device = _device(device)
    if device.type != "cuda" or _grouped_mm() is None:
        return 0.0
    n, reps = sizes.experts_tokens, sizes.experts_reps
    g = torch.Generator(device).manual_seed(0)

    def param(*shape: int, scale: float) -> torch.Tensor:
        t = torch.randn(*shape, device=device, generator=g) * scale
        return t.bfloat16().requires_grad_()

    x = param(n, EXPERTS_HIDDEN, scale=1.0)
    router = param(EXPERTS, EXPERTS_HIDDEN, scale=EXPERTS_HIDDEN ** -0.5)
    gate_up = param(EXPERTS, EXPERTS_HIDDEN, 2 * EXPERTS_WIDTH, scale=EXPERTS_HIDDEN ** -0.5)
    down = param(EXPERTS, EXPERTS_WIDTH, EXPERTS_HIDDEN, scale=EXPERTS_WIDTH ** -0.5)
    grad = torch.randn(n, EXPERTS_HIDDEN, device=device, generator=g).bfloat16()
    inputs = (x, router, gate_up, down)
    try:
        with torch.cuda.device(device):
            torch.autograd.grad(routed_mlp(x, router, gate_up, down, EXPERTS_TOP_K), inputs, grad)  # (untimed)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                torch.autograd.grad(routed_mlp(x, router, gate_up, down, EXPERTS_TOP_K), inputs, grad)
            end.record()
            end.synchronize()
    except (RuntimeError, TypeError):  # (a grouped GEMM this GPU or torch has not, out of memory)
        return 0.0
    seconds = max(start.elapsed_time(end) / 1e3 / reps, 1e-9)
    flops = routed_expert_flops(n, 3 * EXPERTS_HIDDEN * EXPERTS_WIDTH, EXPERTS_TOP_K)
    return _figure(flops / seconds / 1e12)


def routed_mlp(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               top_k: int) -> torch.Tensor:
    """A mixture's routed SwiGLU MLP over tokens `x` [n, hidden], as transformers' grouped experts run it:
    softmax routing to the `top_k` best of the experts (`router` [experts, hidden]), the tokens' copies sorted by
    expert, one grouped GEMM through each expert's gate and up projections (`gate_up` [experts, hidden, 2 x
    width]) and one through its down projection (`down` [experts, width, hidden]), and each copy added back into
    its token weighted by its routing probability."""
    probs = torch.softmax((x @ router.t()).float(), dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    order = chosen.flatten().argsort(stable=True)
    token = order // top_k
    experts = router.shape[0]  # (histc, not bincount: no read back to the host, as transformers counts them)
    ends = torch.histc(chosen.flatten().float(), bins=experts, min=0, max=experts - 1).cumsum(0).to(torch.int32)
    mm = _grouped_mm()
    gate, up = mm(x[token], gate_up, offs=ends).chunk(2, dim=-1)
    out = mm(torch.nn.functional.silu(gate) * up, down, offs=ends)
    out = out * weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add(0, token, out)


def _grouped_mm() -> Callable[..., torch.Tensor] | None:
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


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

        # The link's rates: the best timed copy, since anything else on the link (another process's copies)
        # only slows one down.
        h2d_s = _cuda_seconds([(up, h2d)], device, sizes.reps, best=True)
        d2h_s = _cuda_seconds([(down, d2h)], device, sizes.reps, best=True)
        both_s = _cuda_seconds([(up, h2d), (down, d2h)], device, sizes.reps, best=True)
    return Pcie(h2d_gbps=_figure(n / h2d_s / 1e9), d2h_gbps=_figure(n / d2h_s / 1e9),
                duplex_gbps=_figure(2 * n / both_s / 1e9))


def probe_disk(disk_dir: str | os.PathLike[str] | None = None, quick: bool = False) -> Disk:
    """Free space under `disk_dir` (default: the current directory) and the rates slide-io's disk store reaches
    there through each path it can take (posix, and kvikio where it runs), from files written and read in a
    temporary folder that is removed afterwards. The disk's rates are those of the path `slide_io.choose_path`
    takes from the two measurements; the machine file keeps both and why."""
    sizes = QUICK if quick else FULL
    directory = os.path.abspath(os.fspath(disk_dir if disk_dir is not None else os.curdir))
    free_gib = free_bytes(directory) / GIB  # before the probe's own files take room
    kvikio = kvikio_choice()
    paths = ["posix"] + ([kvikio.path] if kvikio.kvikio is not None else [])
    os.makedirs(directory, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="slide-probe-", dir=directory)
    try:
        runs = _disk_gbps(scratch, sizes, paths)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    posix = runs["posix"]
    other = runs[kvikio.path] if kvikio.kvikio is not None else None
    choice = choose_path(posix.rates, other.rates if other else None, kvikio_path=kvikio.path,
                         unavailable=kvikio.reason)
    reason = choice.reason + ("" if posix.direct else "; posix went through the page cache (no O_DIRECT here)")
    chosen = runs[choice.path]
    return Disk(free_gib=_figure(free_gib), read_gbps=_figure(chosen.rates.read_gbps),
                write_gbps=_figure(chosen.rates.write_gbps), path=choice.path, path_reason=reason,
                posix_read_gbps=_figure(posix.rates.read_gbps), posix_write_gbps=_figure(posix.rates.write_gbps),
                kvikio_read_gbps=_figure(other.rates.read_gbps) if other else 0.0,
                kvikio_write_gbps=_figure(other.rates.write_gbps) if other else 0.0)


def past_cache(sizes: Sizes, cache_bytes: int | None = None) -> Sizes:
    """`sizes` with the AdamW's buffers spanning at least PAST_CACHE times the last-level caches (`cache_bytes`,
    by default this machine's), so that the host figures are of memory, not of a cache."""
    cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    needed = math.ceil(PAST_CACHE * cache_bytes / ADAMW_FOOTPRINT / MIB) * MIB  # (whole Mi of parameters)
    return dataclasses.replace(sizes, adamw_params=max(sizes.adamw_params, needed))


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


def _wall_seconds(fn: Callable[[], object], reps: int, warmup: int = 1, budget: float = math.inf) -> float:
    """Median wall time of `fn` over `reps` runs, after `warmup` untimed ones (first-touch page faults, caches);
    fewer runs (at least one) once the timed ones have taken `budget` seconds."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < max(reps, 1) and (not times or sum(times) < budget):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


def _cuda_seconds(work: list[tuple[torch.cuda.Stream, Callable[[], object]]], device: torch.device,
                  reps: int, best: bool = False) -> float:
    """Median (or, with `best`, least) device time from a common start until the last of `work`'s streams is
    done (each entry runs its function on its own stream, all at once), after one untimed run."""
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
    return max(min(times) if best else statistics.median(times), 1e-9)


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


def _sdpa_causal(device: torch.device, seq: int) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(fused):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return run


def _flex_causal(device: torch.device, seq: int) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return q >= kv

    mask = create_block_mask(causal, None, None, seq, seq, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k, v, block_mask=mask, enable_gqa=True)

    return run


def _attention_seconds(
    kernel: Callable[[torch.device, int], Callable[..., torch.Tensor]], device: torch.device, seq: int, reps: int
) -> float:
    """Device seconds of one forward and backward of `kernel`'s attention over one row of `seq` tokens at
    ATTENTION_HEADS' shape."""
    return attention_seconds(kernel, device, seq, reps, ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM)


# -- host memory under a step's mix ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Lane:
    """One kind of traffic in the host memory mix: each call of `op` does one piece of it, which moves `nbytes`
    bytes through host memory (a byte read and a byte written count as two)."""

    name: str
    op: Callable[[], object]
    nbytes: int
    warmup: int = 1  # untimed calls first (page faults, a fresh optimizer settling)


@dataclass(frozen=True)
class LaneRun:
    """What a lane did in the mix: `ops` calls, `nbytes` in all, over `seconds` from its first call's start to
    its last one's end."""

    name: str
    ops: int
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


def run_mix(lanes: list[Lane], seconds: float, clock: Callable[[], float] = time.perf_counter) -> list[LaneRun]:
    """Every lane's op called over and over, each lane on its own thread and all at once, until `seconds` have
    passed; a call under way then finishes. The lanes' warm-up calls run first, one lane after another."""
    for lane in lanes:
        for _ in range(lane.warmup):
            lane.op()
    runs: list[LaneRun | None] = [None] * len(lanes)
    errors: list[BaseException] = []
    stop = threading.Event()  # set by a lane that failed: the others stop too
    deadline = clock() + seconds

    def work(index: int, lane: Lane) -> None:
        try:
            begin = now = clock()
            ops = 0
            while now < deadline and not stop.is_set():
                lane.op()
                ops += 1
                now = clock()
            runs[index] = LaneRun(lane.name, ops, ops * lane.nbytes, now - begin)
        except BaseException as error:  # (raised again on the calling thread)
            errors.append(error)
            stop.set()

    threads = [threading.Thread(target=work, args=(i, lane), name=f"slide-probe-{lane.name}")
               for i, lane in enumerate(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [run for run in runs if run is not None]


def mix_lanes(sizes: Sizes, device: torch.device | str | None = None) -> list[Lane]:
    """The lanes of a step's host traffic, the AdamW's first: the host AdamW over a flat fp32 master with a bf16
    gradient, which reads master, m, v and the gradient and writes master, m and v (26 bytes per parameter). With a
    CUDA `device`, pinned host->device and device->host copies on a stream each (a byte crossing reads or writes
    host memory once). Without one, a host copy in each direction stands in for them, on one core each, as a DMA
    engine takes no cores from the update (a byte copied is read and written: twice)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    lanes = [_adamw_lane(sizes.adamw_params)]
    if device.type == "cuda":
        lanes += _dma_lanes(device, sizes.memory_bytes)
    else:
        lanes += [_host_copy_lane("to_device", sizes.memory_bytes), _host_copy_lane("from_device", sizes.memory_bytes)]
    return lanes


def _adamw_lane(numel: int) -> Lane:
    # (the kernel's time does not depend on the values, and filling is quicker than drawing random numbers)
    master = torch.full((numel,), 0.5)
    grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
    optimizer = HostAdamW([master], AdamWConfig(lr=1e-4, weight_decay=0.01))
    moved = numel * (3 * 2 * master.element_size() + grad.element_size())
    return Lane("adamw", lambda: optimizer.step_unit(0, grad, lr=1e-4), moved, warmup=2)


def _host_copy_lane(name: str, nbytes: int) -> Lane:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    # memmove runs on the calling thread alone and without the GIL (ctypes lets it go), as one engine would.
    return Lane(name, lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes), 2 * nbytes)


def _dma_lanes(device: torch.device, nbytes: int, copies: int = 4) -> list[Lane]:
    """A lane per direction: `copies` copies of a pinned buffer queued on its own stream, then waited for (a
    few per call keep the copy engine busy while the thread comes back for more)."""
    lanes = []
    for name, up in (("to_device", True), ("from_device", False)):
        host = host_empty(nbytes, torch.uint8, pinned=True)
        host.fill_(1)
        dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)
        dst, src = (dev, host) if up else (host, dev)

        def op(dst: torch.Tensor = dst, src: torch.Tensor = src, stream: torch.cuda.Stream = stream) -> None:
            with torch.cuda.stream(stream):
                for _ in range(copies):
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()

        lanes.append(Lane(name, op, copies * nbytes))
    return lanes


def _aligned_bytes(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start : start + nbytes]


@dataclass(frozen=True)
class _DiskRun:
    rates: PathRates
    direct: bool  # the store moved whole blocks with O_DIRECT (else through the page cache)


def _disk_gbps(directory: str, sizes: Sizes, paths: list[str]) -> dict[str, _DiskRun]:
    """The NVMe store's rates under `directory` through each of `paths` (slide-io path names): one buffer in a
    few keys moved concurrently, as the store's workers move a step's states; rewrites of existing keys, as in
    the steady state. The paths take turns, each rep, so that a drive slowing down (its cache filling, heat)
    weighs on all of them alike."""
    pieces = 4
    piece = sizes.disk_bytes // pieces // PAGE * PAGE
    buffer = _aligned_bytes(piece * pieces)
    buffer.view(torch.float32).uniform_()  # random bytes: a compressing filesystem cannot shrink them
    parts = [buffer[i * piece : (i + 1) * piece] for i in range(pieces)]
    stores: dict[str, NVMeStore] = {}
    try:
        for path in paths:
            stores[path] = NVMeStore(directory, path="posix" if path == "posix" else "kvikio")

        def move(store: NVMeStore, op: str) -> float:
            start = time.perf_counter()
            for future in [getattr(store, op)(f"probe-{i}", part) for i, part in enumerate(parts)]:
                future.result()
            return time.perf_counter() - start

        times: dict[tuple[str, str], list[float]] = {(path, op): [] for path in paths for op in ("write", "read")}
        for op in ("write", "read"):
            for rep in range(sizes.disk_reps + 1):  # the untimed first write makes the files
                for path, store in stores.items():
                    seconds = move(store, op)
                    if rep:
                        times[path, op].append(seconds)
    finally:
        for store in stores.values():
            store.close()
    total = piece * pieces
    return {path: _DiskRun(PathRates(read_gbps=total / max(statistics.median(times[path, "read"]), 1e-9) / 1e9,
                                     write_gbps=total / max(statistics.median(times[path, "write"]), 1e-9) / 1e9),
                           stores[path].direct)
            for path in paths}
