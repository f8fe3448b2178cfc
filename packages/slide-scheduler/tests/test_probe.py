"""The machine probe: figures the OS reports are taken as reported, measured rates are positive, host memory is
measured under a step's mix with every lane's bytes counted, the disk is measured through each path slide-io can
take and the choice between them recorded, and the disk probe leaves nothing behind."""

import contextlib
import dataclasses
import os
import shutil
import threading
import time
import types

import pytest
import torch

import slide_io.kvikio_path as kvikio_path
import slide_scheduler.measure.probe as probe_module
from slide_io import PathChoice, PathRates, kvikio_choice
from slide_scheduler.measure.probe import (
    QUICK,
    Lane,
    LaneRun,
    attention_rates,
    last_level_cache_bytes,
    mix_lanes,
    past_cache,
    probe,
    probe_attention,
    probe_disk,
    probe_host,
    routed_mlp,
    run_mix,
)
from slide_scheduler.plan.machine import Gpu, Machine, Pcie, causal_attention_flops, routed_expert_flops

GIB = 1 << 30
MIB = 1 << 20


def test_quick_probe_on_the_host(tmp_path):
    # The host's figures: the default device where there is no CUDA, the CPU asked for where there is.
    device = "cpu" if torch.cuda.is_available() else None
    machine = probe(disk_dir=tmp_path, device=device, quick=True)
    assert isinstance(machine, Machine)
    assert machine.gpu == Gpu() and machine.pcie == Pcie()
    assert not machine.has_gpu
    assert machine.host.cores == len(os.sched_getaffinity(0))
    os_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    assert machine.host.memory_gib == pytest.approx(os_gib, rel=0.01)
    assert machine.host.memory_gbps > 0 and machine.host.adamw_gparams > 0
    assert machine.disk.read_gbps > 0 and machine.disk.write_gbps > 0
    assert machine.disk.free_gib == pytest.approx(shutil.disk_usage(tmp_path).free / GIB, rel=0.03)
    assert machine.disk.posix_read_gbps > 0 and machine.disk.posix_write_gbps > 0
    if kvikio_choice().kvikio is None:  # (CI: only posix can run, and the file says why)
        assert machine.disk.path == "posix" and "posix measured alone" in machine.disk.path_reason
        assert machine.disk.kvikio_read_gbps == machine.disk.kvikio_write_gbps == 0
        assert machine.disk.read_gbps == machine.disk.posix_read_gbps
    assert list(tmp_path.iterdir()) == []  # the probe's files and folder are gone
    assert Machine.from_dict(machine.to_dict()) == machine  # a machine file can hold what was measured


@pytest.fixture
def small_disk(monkeypatch):
    """A quick probe that moves 8 MiB through each disk path."""
    monkeypatch.setattr(probe_module, "QUICK", dataclasses.replace(QUICK, disk_bytes=8 * MIB))


def test_disk_probe_defaults_to_the_current_directory(tmp_path, monkeypatch, small_disk):
    monkeypatch.chdir(tmp_path)
    disk = probe_disk(quick=True)
    assert disk.read_gbps > 0 and disk.write_gbps > 0
    assert list(tmp_path.iterdir()) == []


def test_disk_probe_makes_a_missing_folder(tmp_path, small_disk):
    target = tmp_path / "not" / "yet"
    assert probe_disk(target, quick=True).write_gbps > 0
    assert target.is_dir() and list(target.iterdir()) == []


def test_disk_probe_cleans_up_after_a_failure(tmp_path, monkeypatch):
    def broken(directory, sizes, paths):
        assert os.listdir(directory) == [] and os.path.dirname(directory) == str(tmp_path)
        raise OSError("disk gone")

    monkeypatch.setattr(probe_module, "_disk_gbps", broken)
    with pytest.raises(OSError, match="disk gone"):
        probe_disk(tmp_path, quick=True)
    assert list(tmp_path.iterdir()) == []


# -- attention ---------------------------------------------------------------------------------------------------


def test_attention_is_not_measured_without_a_gpu():
    assert probe_attention("cpu", QUICK) == 0.0
    if not torch.cuda.is_available():
        assert probe_attention(None, QUICK) == 0.0


def test_causal_attention_flops_by_hand():
    # One row of 16,384 tokens, 32 heads of 128: the forward's two matmuls over the causal half of the scores,
    # 2 x 2 x 16384^2 x 32 x 128 / 2 = 2 x 268,435,456 x 4096 = 2,199,023,255,552; the backward twice that.
    assert causal_attention_flops(16384, 32, 128, backward=False) == 2199023255552.0
    assert causal_attention_flops(16384, 32, 128) == 6597069766656.0
    assert causal_attention_flops(16384, 32, 128, batch=2) == 2 * 6597069766656.0
    # The trainer's count per token and layer (6 x heads x head_dim x S), over the row's S tokens.
    assert causal_attention_flops(4096, 8, 64) == 6 * 8 * 64 * 4096 * 4096


def test_routed_expert_flops_by_hand():
    # OLMoE-1B-7B's layer: 8 of 64 experts of 3 x 2048 x 1024 parameters per token; 4096 tokens forward:
    # 2 x 4096 x 8 x 6,291,456 = 412,316,860,416; the backward twice that.
    assert routed_expert_flops(4096, 3 * 2048 * 1024, 8, backward=False) == 412316860416.0
    assert routed_expert_flops(4096, 3 * 2048 * 1024, 8) == 3 * 412316860416.0


def test_the_probes_routed_mlp_is_each_tokens_experts_weighted():
    """The routed MLP the probe times (sorted copies, grouped GEMMs, a weighted combine) is, token by token, the
    sum of its top-k experts' SwiGLU outputs weighted by their routing probabilities, forward and backward
    (float32 against a float64 loop)."""
    torch.manual_seed(0)
    n, hidden, width, experts, k = 37, 16, 8, 6, 2
    ours = [torch.randn(n, hidden), torch.randn(experts, hidden), torch.randn(experts, hidden, 2 * width),
            torch.randn(experts, width, hidden)]
    ours = [t.requires_grad_() for t in ours]
    ref = [t.detach().double().requires_grad_() for t in ours]
    x, router, gate_up, down = ref
    weights, chosen = torch.softmax(x @ router.t(), dim=-1).topk(k, dim=-1)
    want = torch.zeros_like(x)
    for t in range(n):
        for j in range(k):
            gate, up = (x[t] @ gate_up[chosen[t, j]]).chunk(2)
            want[t] += weights[t, j] * ((torch.nn.functional.silu(gate) * up) @ down[chosen[t, j]])
    got = routed_mlp(*ours, k)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(n, hidden)
    for a, b in zip(torch.autograd.grad(got, ours, grad), torch.autograd.grad(want, ref, grad.double())):
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("rate", ["attention_tflops", "experts_tflops"])
def test_attention_and_experts_rates_round_trip_through_machine_dicts(rate):
    """(Machine files are slide-train's: its test_machines.py writes and reads them.)"""
    machine = Machine(gpu=Gpu(memory_gib=79.2, bf16_tflops=612.0, **{rate: 301.0}))
    assert machine.to_dict()["gpu"][rate] == 301.0
    assert Machine.from_dict(machine.to_dict()) == machine
    assert getattr(Machine.from_dict({"gpu": {"memory_gib": 24, rate: 90}}).gpu, rate) == 90.0
    assert getattr(Machine.from_dict({"gpu": {"memory_gib": 24}}).gpu, rate) == 0.0  # an older file: not measured
    with pytest.raises(ValueError, match=f"gpu.{rate} must be a number"):
        Machine.from_dict({"gpu": {rate: -1}})


def test_attention_rate_is_the_faster_kernels(monkeypatch):
    monkeypatch.setattr(probe_module, "attention_rates", lambda device, sizes: {"sdpa": 312.3456, "flex": 287.0})
    monkeypatch.setattr(probe_module, "_device", lambda device: torch.device("cuda", 0))
    assert probe_attention("cuda", QUICK) == 312.0  # (three digits, as every figure)
    monkeypatch.setattr(probe_module, "attention_rates", lambda device, sizes: {"sdpa": 0.0, "flex": 0.0})
    assert probe_attention("cuda", QUICK) == 0.0  # no kernel ran: not measured


def test_a_kernel_that_cannot_run_counts_zero(monkeypatch):
    seen = []

    def fake_seconds(kernel, device, seq, reps):
        seen.append((kernel, seq, reps))
        if kernel is probe_module._flex_causal:
            raise RuntimeError("no Triton here")
        return 0.5

    monkeypatch.setattr(probe_module, "_attention_seconds", fake_seconds)
    monkeypatch.setattr(probe_module.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(probe_module.torch.cuda, "empty_cache", lambda: None)
    sizes = dataclasses.replace(QUICK, attention_seq=2048, attention_reps=4, attention_flex=True)
    rates = attention_rates(torch.device("cuda", 0), sizes)
    assert rates == {"sdpa": causal_attention_flops(2048, 32, 128) / 0.5 / 1e12, "flex": 0.0}
    assert seen == [(probe_module._sdpa_causal, 2048, 4), (probe_module._flex_causal, 2048, 4)]
    seen.clear()
    assert set(attention_rates(torch.device("cuda", 0), dataclasses.replace(sizes, attention_flex=False))) == {"sdpa"}
    # The quick probe leaves out FlexAttention, whose compile would outlast it; the full one times both.
    assert not QUICK.attention_flex and probe_module.FULL.attention_flex


# -- host memory under a step's mix -------------------------------------------------------------------------


class ThreadClock:
    """A clock of its own for each thread, moved on only by the ops that thread runs (the mix's timing without
    waiting); a thread's clock starts where its maker's stood when it first read it."""

    def __init__(self):
        self._maker = threading.current_thread()
        self._main = 0.0
        self._local = threading.local()  # (per thread object: a new thread never inherits a finished one's time)

    def __call__(self) -> float:
        if threading.current_thread() is self._maker:
            return self._main
        if not hasattr(self._local, "now"):
            self._local.now = self._main
        return self._local.now

    def advance(self, seconds: float) -> None:
        if threading.current_thread() is self._maker:
            self._main += seconds
        else:
            self._local.now = self() + seconds


def test_the_mix_counts_each_lanes_ops_bytes_and_time():
    clock = ThreadClock()
    calls = {"a": 0, "b": 0}

    def op(name, seconds):
        def run():
            calls[name] += 1
            clock.advance(seconds)
        return run

    # (steps a binary fraction can hold exactly, so no rounding moves an op across the deadline)
    lanes = [Lane("a", op("a", 0.125), nbytes=1000, warmup=2), Lane("b", op("b", 0.375), nbytes=3000, warmup=0)]
    runs = {run.name: run for run in run_mix(lanes, seconds=1.0, clock=clock)}
    # (a's warm-up moves the clock to 0.25 first, so the mix runs from 0.25 to 1.25)
    # a: 8 ops end exactly at the deadline; b: its third op starts at 1.0 and is let finish, at 1.375
    assert runs["a"] == LaneRun("a", ops=8, nbytes=8000, seconds=1.0)
    assert runs["b"] == LaneRun("b", ops=3, nbytes=9000, seconds=1.125)
    assert calls == {"a": 2 + 8, "b": 3}  # warm-up calls are made but not counted
    assert runs["a"].gbps == pytest.approx(8000 / 1.0 / 1e9) and runs["b"].gbps == pytest.approx(9000 / 1.125 / 1e9)


def test_the_lanes_run_at_once():
    lock = threading.Lock()
    inside = {"now": 0, "most": 0}

    def op():
        with lock:
            inside["now"] += 1
            inside["most"] = max(inside["most"], inside["now"])
        time.sleep(0.01)
        with lock:
            inside["now"] -= 1

    runs = run_mix([Lane(name, op, nbytes=1, warmup=0) for name in ("x", "y")], seconds=0.2)
    assert [run.name for run in runs] == ["x", "y"] and all(run.ops >= 1 for run in runs)
    assert inside["most"] == 2  # one lane's op ran while the other's did


def test_a_failing_lane_stops_the_mix_and_raises():
    def broken():
        raise RuntimeError("copy engine gone")

    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="copy engine gone"):
        run_mix([Lane("ok", lambda: time.sleep(1e-3), nbytes=1, warmup=0), Lane("bad", broken, nbytes=1, warmup=0)],
                seconds=60)
    assert time.perf_counter() - start < 30  # the healthy lane stopped with it, long before its minute


def test_host_lanes_count_the_bytes_they_move():
    sizes = dataclasses.replace(QUICK, adamw_params=1 << 16, memory_bytes=1 * MIB, mix_seconds=0.2)
    lanes = {lane.name: lane for lane in mix_lanes(sizes, "cpu")}
    assert set(lanes) == {"adamw", "to_device", "from_device"}
    # AdamW with fp32 master, m and v and a bf16 gradient: reads 4 + 4 + 4 + 2, writes 4 + 4 + 4 bytes a parameter
    assert lanes["adamw"].nbytes == 26 * sizes.adamw_params
    # a host copy stands in for each DMA direction: every byte read once and written once
    assert lanes["to_device"].nbytes == lanes["from_device"].nbytes == 2 * sizes.memory_bytes
    counts = dict.fromkeys(lanes, 0)

    def counting(lane):
        def op():
            counts[lane.name] += 1
            return lane.op()
        return dataclasses.replace(lane, op=op)

    runs = run_mix([counting(lane) for lane in lanes.values()], sizes.mix_seconds)
    for run in runs:
        lane = lanes[run.name]
        assert run.ops == counts[run.name] - lane.warmup >= 1
        assert run.nbytes == run.ops * lane.nbytes and 0 < run.seconds < 10 * sizes.mix_seconds


def test_host_memory_is_the_sum_of_the_lanes(monkeypatch):
    """Of MIX_RUNS runs of the mix, the best: the most host memory moved, and the AdamW's fastest call beside the
    copies, as a share of its time alone (the machine file's `adamw_beside_copies`)."""
    seen = {"runs": 0}
    adamw_s = [1.0, 0.8, 1.2]  # ten AdamW calls in each run of the mix

    def fake_run_mix(lanes, seconds):
        seen["lanes"] = [(lane.name, lane.warmup) for lane in lanes]
        seen["seconds"] = seconds
        k = seen["runs"]
        seen["runs"] += 1
        return [LaneRun("adamw", 10, 52e9 * (k + 1) / 3, adamw_s[k]), LaneRun("to_device", 20, 40e9, 1.0),
                LaneRun("from_device", 20, 40e9, 0.8)]

    def fake_wall_seconds(fn, reps, warmup, budget):
        seen["alone"] = (reps, warmup, budget)
        return 0.05

    sizes = dataclasses.replace(QUICK, adamw_params=1 << 20, memory_bytes=4096)
    monkeypatch.setattr(probe_module, "run_mix", fake_run_mix)
    monkeypatch.setattr(probe_module, "_wall_seconds", fake_wall_seconds)
    host = probe_host(sizes, "cpu")
    assert seen["runs"] == probe_module.MIX_RUNS == 3
    # every lane's bytes over its own time, summed: the best run's
    assert host.memory_gbps == float(f"{52 / 1.2 + 40 + 50:.3g}")
    assert host.adamw_gparams == float(f"{(1 << 20) / 0.05 / 1e9:.3g}")  # AdamW timed alone, before the mix
    assert host.adamw_beside_copies == float(f"{0.05 / 0.08:.3g}")  # its fastest call in the mix: 0.8 s / 10
    # The AdamW warmed up when it was timed alone; the copies warm up in the mix.
    assert {k: seen[k] for k in ("alone", "seconds", "lanes")} == {
        "alone": (sizes.reps, 2, sizes.mix_seconds), "seconds": sizes.mix_seconds,
        "lanes": [("adamw", 0), ("to_device", 1), ("from_device", 1)]}


def test_timing_alone_stops_at_its_budget(monkeypatch):
    now = {"t": 0.0}
    monkeypatch.setattr(probe_module.time, "perf_counter", lambda: now["t"])
    calls = []

    def step(seconds):
        def run():
            calls.append(seconds)
            now["t"] += seconds
        return run

    # (binary fractions: the clock's differences come out exact)
    assert probe_module._wall_seconds(step(0.375), reps=5, warmup=2, budget=1.0) == 0.375
    assert len(calls) == 2 + 3  # timed runs until 1.125 s had passed, not five
    calls.clear()
    assert probe_module._wall_seconds(step(0.125), reps=5, warmup=1, budget=1.0) == 0.125
    assert len(calls) == 1 + 5


def write_cache(root, cpu, index, level, kind, size, shared):
    folder = root / f"cpu{cpu}" / "cache" / f"index{index}"
    folder.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (folder / name).write_text(f"{value}\n")


def test_last_level_caches_are_summed_once_each(tmp_path):
    # Two sockets of two cores: an L3 of 32 MiB per socket (listed by each of its cores), an L2 per core.
    for cpu in range(4):
        socket = "0-1" if cpu < 2 else "2-3"
        write_cache(tmp_path, cpu, 0, 1, "Data", "48K", str(cpu))
        write_cache(tmp_path, cpu, 1, 1, "Instruction", "64K", str(cpu))
        write_cache(tmp_path, cpu, 2, 2, "Unified", "2048K", str(cpu))
        write_cache(tmp_path, cpu, 3, 3, "Unified", "32768K", socket)
    assert last_level_cache_bytes(str(tmp_path)) == 64 * MIB
    assert last_level_cache_bytes(str(tmp_path / "nothing")) == 0


def test_the_adamw_spans_past_the_caches():
    sizes = dataclasses.replace(QUICK, adamw_params=16 << 20)
    assert past_cache(sizes, cache_bytes=0) == sizes  # no cache reported: the sizes as they are
    assert past_cache(sizes, cache_bytes=32 * MIB).adamw_params == 16 << 20  # 224 MB already spans 64 MiB
    grown = past_cache(sizes, cache_bytes=480 * MIB).adamw_params
    assert grown % MIB == 0 and grown * 14 >= 2 * 480 * MIB > (grown - MIB) * 14


def test_the_quick_mix_stays_short():
    assert QUICK.mix_seconds <= 1.0 and probe_module.FULL.mix_seconds <= 5.0


# -- the disk's paths -------------------------------------------------------------------------------------------


def kvikio_here(monkeypatch):
    """kvikio in compat mode as far as the probe can tell (the measurement itself is stood in for)."""
    monkeypatch.setattr(probe_module, "kvikio_choice",
                        lambda: PathChoice("kvikio-compat", "kvikio in compat mode", kvikio=object()))


def measured(posix: PathRates, kvikio: PathRates | None, direct: bool = True):
    def fake(directory, sizes, paths):
        assert paths == (["posix", "kvikio-compat"] if kvikio else ["posix"])
        runs = {"posix": probe_module._DiskRun(posix, direct)}
        if kvikio:
            runs["kvikio-compat"] = probe_module._DiskRun(kvikio, True)
        return runs
    return fake


KVIKIO = PathRates(read_gbps=1.74, write_gbps=2.01)


def test_the_disk_takes_posix_where_it_is_much_faster(tmp_path, monkeypatch):
    kvikio_here(monkeypatch)
    monkeypatch.setattr(probe_module, "_disk_gbps", measured(PathRates(2.16, 2.65), KVIKIO))
    disk = probe_disk(tmp_path, quick=True)
    assert disk.path == "posix" and "1.28x kvikio-compat" in disk.path_reason
    assert (disk.read_gbps, disk.write_gbps) == (2.16, 2.65)  # the rates of the path taken
    assert (disk.posix_read_gbps, disk.posix_write_gbps) == (2.16, 2.65)
    assert (disk.kvikio_read_gbps, disk.kvikio_write_gbps) == (1.74, 2.01)


def test_the_disk_keeps_kvikio_where_posix_is_barely_faster(tmp_path, monkeypatch):
    kvikio_here(monkeypatch)
    monkeypatch.setattr(probe_module, "_disk_gbps", measured(PathRates(1.74 * 1.05, 2.01 * 1.05), KVIKIO))
    disk = probe_disk(tmp_path, quick=True)
    assert disk.path == "kvikio-compat" and "1.05x" in disk.path_reason
    assert (disk.read_gbps, disk.write_gbps) == (1.74, 2.01)
    assert (disk.posix_read_gbps, disk.posix_write_gbps) == (1.83, 2.11)


def test_the_disk_without_kvikio_measures_posix_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_module, "kvikio_choice", lambda: PathChoice("posix", "kvikio is not installed"))
    monkeypatch.setattr(probe_module, "_disk_gbps", measured(PathRates(1.5, 1.2), None, direct=False))
    disk = probe_disk(tmp_path, quick=True)
    assert (disk.path, disk.read_gbps, disk.write_gbps) == ("posix", 1.5, 1.2)
    assert disk.path_reason.startswith("kvikio is not installed") and "page cache" in disk.path_reason
    assert disk.kvikio_read_gbps == disk.kvikio_write_gbps == 0


class _Done:
    def __init__(self, n):
        self._n = n

    def get(self):
        return self._n


class FakeCuFile:
    """kvikio's CuFile on os calls: the probe's two-path measurement runs through two real stores."""

    def __init__(self, path, flags):
        self._fd = os.open(path, os.O_RDWR)

    def pwrite(self, buf, size, file_offset=0):
        return _Done(os.pwrite(self._fd, memoryview(buf)[:size], file_offset))

    def pread(self, buf, size, file_offset=0):
        return _Done(os.preadv(self._fd, [memoryview(buf)[:size]], file_offset))

    def close(self):
        os.close(self._fd)


def test_the_probe_measures_both_paths_through_the_store(tmp_path, monkeypatch, small_disk):
    fake = types.SimpleNamespace(defaults=types.SimpleNamespace(is_compat_mode_preferred=lambda: True),
                                 CuFile=FakeCuFile)
    monkeypatch.setattr(kvikio_path, "_import_kvikio", lambda: fake)
    monkeypatch.setattr(kvikio_path, "_cuda_driver", lambda: True)
    disk = probe_disk(tmp_path, quick=True)
    assert min(disk.posix_read_gbps, disk.posix_write_gbps, disk.kvikio_read_gbps, disk.kvikio_write_gbps) > 0
    assert disk.path in ("posix", "kvikio-compat") and "kvikio-compat's rate" in disk.path_reason
    rates = {"posix": (disk.posix_read_gbps, disk.posix_write_gbps),
             "kvikio-compat": (disk.kvikio_read_gbps, disk.kvikio_write_gbps)}
    assert (disk.read_gbps, disk.write_gbps) == rates[disk.path]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_quick_probe_on_a_gpu(tmp_path):
    machine = probe(disk_dir=tmp_path, quick=True)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    assert machine.gpu.memory_gib == pytest.approx(total / GIB, rel=0.01)
    assert machine.gpu.bf16_tflops > 0
    # Causal attention forward + backward runs, slower than dense matrix products (softmax, the causal edge,
    # a backward that does more than the count says).
    assert 0 < machine.gpu.attention_tflops < machine.gpu.bf16_tflops
    # A mixture's routed MLP forward + backward runs, slower than dense matrix products (routing, dispatch,
    # grouped GEMMs of a few hundred rows each)
    assert 0 < machine.gpu.experts_tflops < machine.gpu.bf16_tflops
    pcie = machine.pcie
    assert pcie.h2d_gbps > 0 and pcie.d2h_gbps > 0 and pcie.duplex_gbps > 0
    # Both ways at once move at least as much as the faster single direction, up to measurement noise.
    assert pcie.duplex_gbps >= 0.8 * max(pcie.h2d_gbps, pcie.d2h_gbps), pcie
    # Host memory under the mix carries at least what the copies alone move across PCIe.
    assert machine.host.memory_gbps >= 0.8 * pcie.duplex_gbps
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_dma_lanes_count_the_bytes_that_cross():
    sizes = dataclasses.replace(QUICK, adamw_params=1 << 16, memory_bytes=4 * MIB, mix_seconds=0.2)
    lanes = {lane.name: lane for lane in mix_lanes(sizes, "cuda")}
    assert lanes["to_device"].nbytes == lanes["from_device"].nbytes == 4 * sizes.memory_bytes  # four copies a call
    runs = run_mix(list(lanes.values()), sizes.mix_seconds)
    assert all(run.ops >= 1 and run.gbps > 0 for run in runs)
