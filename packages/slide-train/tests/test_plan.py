"""The memory plan: residency grows with the budget, and a budget that cannot hold the minimum is refused."""

from __future__ import annotations

import pytest

from slide_scheduler.engine import DEVICE_UPDATE_SHARE
from slide_train.errors import ConfigError
from slide_train.plan import GIB, check_fits, make_plan

# Llama-3.2-3B-like shapes (per-unit parameter counts as the engine lays them out).
SHAPE = dict(edge_numel=394_000_000, block_numel=100_700_000, num_blocks=28, hidden=3072, intermediate=8192,
             tokens_per_micro=8192, micro_batches=4, window=2, offload_activations=True, resident=None, cuda=True)


def test_residency_grows_with_the_budget_and_stays_under_it():
    counts = []
    for gib in (8, 16, 24, 48, 80):
        plan = make_plan(budget_bytes=gib * GIB, **SHAPE)
        counts.append(plan.resident)
        assert plan.device_total <= gib * GIB or plan.resident == 0
    assert counts == sorted(counts) and counts[0] < counts[-1]
    assert make_plan(budget_bytes=1000 * GIB, **SHAPE).resident == SHAPE["num_blocks"] + 1


def test_cpu_runs_keep_nothing_resident_unless_asked():
    assert make_plan(budget_bytes=None, **{**SHAPE, "cuda": False}).resident == 0
    assert make_plan(budget_bytes=None, **{**SHAPE, "cuda": False, "resident": 3}).resident == 3


def test_auto_window_takes_a_third_slot_only_where_it_costs_nothing_else():
    """engine.window null: the clipped 3B run under a 24 GiB cap has room for a third slot beside the same
    resident blocks; the clipped 8B run under 16 GiB would pay for it with gradients held on the device, and a
    CPU run or one with every block resident keeps two."""
    clipped = {**SHAPE, "window": None, "device_updates": True}
    budget = 0.92 * 24 * GIB
    auto, two = make_plan(budget_bytes=budget, **clipped), make_plan(budget_bytes=budget, **{**clipped, "window": 2})
    assert auto.window == 3 and (auto.resident, auto.held) == (two.resident, two.held) and auto.resident > 1
    assert auto.device_total <= budget and "through 3 slots" in auto.text()
    b8 = {**clipped, "edge_numel": 1_050_677_248, "block_numel": 218_112_000, "num_blocks": 32, "hidden": 4096,
          "intermediate": 14336, "tokens_per_micro": 4096, "micro_batches": 8}
    budget = 0.92 * 16 * GIB
    assert make_plan(budget_bytes=budget, **{**b8, "window": 3}).held < make_plan(
        budget_bytes=budget, **{**b8, "window": 2}).held
    assert make_plan(budget_bytes=budget, **b8).window == 2
    assert make_plan(budget_bytes=None, **{**clipped, "cuda": False}).window == 2
    assert make_plan(budget_bytes=1000 * GIB, **clipped).window == 2  # nothing slides


def test_a_budget_too_small_says_what_would_fit():
    """The refusal names a micro-batch that fits: planned with it, the run fits; a tenth more does not."""
    plan = make_plan(budget_bytes=2 * GIB, **SHAPE)
    with pytest.raises(ConfigError, match=r"cannot fit in engine.gpu_memory_limit_gb \(2.0 GiB usable\).*"
                                          r"need ~\d+\.\d GiB; even short micro-batches do not fit.*window=1"):
        check_fits(plan, "engine.gpu_memory_limit_gb", window=2)
    long = {**SHAPE, "tokens_per_micro": 4 * 32768}
    plan = make_plan(budget_bytes=8 * GIB, **long)
    with pytest.raises(ConfigError, match=r"at most ~(\d+) tokens per micro-batch fit: e.g. micro_batch_size=1 "
                                          r"with seq_len=(\d+)") as refusal:
        check_fits(plan, "the GPU's memory", micro_batch_size=4, seq_len=32768, window=1)
    tokens = int(refusal.value.args[0].split("at most ~")[1].split(" ")[0])
    assert make_plan(budget_bytes=8 * GIB, **{**long, "tokens_per_micro": tokens}).fixed <= 8 * GIB
    assert make_plan(budget_bytes=8 * GIB, **{**long, "tokens_per_micro": int(tokens * 1.1)}).fixed > 8 * GIB
    with pytest.raises(ConfigError, match=r"micro_batch_size=\d would fit"):
        check_fits(make_plan(budget_bytes=8 * GIB, **{**SHAPE, "tokens_per_micro": 16 * 2048}), "the GPU's memory",
                   micro_batch_size=16, seq_len=2048)


def test_plan_command_and_host_check(capsys):
    from slide_train.cli import main
    from slide_train.plan import check_host

    assert main(["plan", "--model=llama-3.2-1b", "--seq_len=2048", "--micro_batch_size=4", "--grad_accum=1",
                 "--gpu-gib=24"]) == 0
    out = capsys.readouterr().out
    assert "1.24 B params" in out and "17 of 17 units resident" in out
    assert main(["plan", "--model=llama-3.1-8b", "--seq_len=65536", "--micro_batch_size=8", "--gpu-gib=24"]) == 2
    assert "cannot fit in the GPU's memory" in capsys.readouterr().err
    plan = make_plan(budget_bytes=24 * GIB, **SHAPE)
    with pytest.raises(ConfigError, match=r"needs ~\d+ GiB of host memory.*has 16 GiB.*states_dtype=bf16"):
        check_host(plan, 16 * GIB)
    check_host(plan, 512 * GIB)
    with pytest.raises(ConfigError, match="has 16 GiB") as narrow:  # bf16 already: not offered again
        check_host(make_plan(budget_bytes=24 * GIB, **SHAPE, state_bytes=4), 16 * GIB)
    assert "states_dtype" not in str(narrow.value) and "max_grad_norm=null" in str(narrow.value)
    with pytest.raises(ConfigError, match="has 16 GiB") as unclipped:  # no clipping: nothing held to drop
        check_host(make_plan(budget_bytes=24 * GIB, **SHAPE, clip=False), 16 * GIB)
    assert "max_grad_norm" not in str(unclipped.value) and "states_dtype=bf16" in str(unclipped.value)


def test_host_plan_is_12_bytes_per_parameter_plus_gradient_staging():
    """fp32 master + m + v on the host (m, v only for units not resident); no bf16 copy. Gradients: a ring of
    three block buffers without clipping, every sliding block's with exact clipping, and the edges' own buffer
    when they slide and update on the host."""
    n = SHAPE["edge_numel"] + SHAPE["num_blocks"] * SHAPE["block_numel"]
    acts = SHAPE["num_blocks"] * SHAPE["micro_batches"] * SHAPE["tokens_per_micro"] * SHAPE["hidden"] * 2
    shape = {**SHAPE, "resident": 0}
    free = make_plan(budget_bytes=None, **shape, clip=False)
    assert free.host_total == 12 * n + 2 * (SHAPE["edge_numel"] + 3 * SHAPE["block_numel"]) + acts
    clipped = make_plan(budget_bytes=None, **shape, clip=True)
    assert clipped.host_total - free.host_total == 2 * (SHAPE["num_blocks"] - 3) * SHAPE["block_numel"]
    assert "held for exact clipping" in clipped.text()
    resident = make_plan(budget_bytes=None, **{**SHAPE, "resident": 5}, clip=True)  # edges + blocks 0..3
    on_device = SHAPE["edge_numel"] + 4 * SHAPE["block_numel"]  # their AdamW states live on the GPU
    assert resident.host_total == (12 * n - 8 * on_device + 2 * (SHAPE["num_blocks"] - 4) * SHAPE["block_numel"]
                                   + acts)
    bf16 = make_plan(budget_bytes=None, **shape, clip=False, state_bytes=4)
    assert free.host_total - bf16.host_total == 4 * n
    streamed = make_plan(budget_bytes=None, **shape, clip=False, device_updates=True)  # edges update on the GPU
    assert free.host_total - streamed.host_total == 2 * SHAPE["edge_numel"]


def test_spare_device_memory_keeps_gradients_for_device_updates():
    """With clipping and device updates, memory left under the budget keeps the gradients of the blocks updated
    on the device there (at most the engine's share of the sliding blocks): that much moves off the host."""
    shape = {**SHAPE, "resident": 0}
    streamed = int(SHAPE["num_blocks"] * DEVICE_UPDATE_SHARE)  # blocks the engine updates on the device (15 of 28)
    base = make_plan(budget_bytes=None, **shape, clip=True, device_updates=True)
    assert base.held == 0  # no budget, no GPU to plan for
    for gib in (6, 12, 1000):
        plan = make_plan(budget_bytes=gib * GIB, **shape, clip=True, device_updates=True)
        assert 0 <= plan.held <= streamed
        assert plan.device_total <= gib * GIB or plan.held == 0
        assert plan.host_total == pytest.approx(base.host_total - 2 * plan.held * SHAPE["block_numel"])
    assert plan.held == streamed and "gradients kept for device updates" in plan.text()
    half = make_plan(budget_bytes=1000 * GIB, **shape, clip=True, device_updates=True, device_share=0.5)
    assert half.held == SHAPE["num_blocks"] // 2
    assert make_plan(budget_bytes=1000 * GIB, **shape, clip=False, device_updates=True).held == 0


def test_fp32_compute_counts_four_bytes_per_value():
    """Slots, edges, activations and kept gradients are in the compute dtype: fp32 compute needs twice bf16's."""
    shape = {**SHAPE, "resident": 0}
    bf16 = make_plan(budget_bytes=12 * GIB, **shape, clip=True, device_updates=True)
    fp32 = make_plan(budget_bytes=12 * GIB, **shape, clip=True, device_updates=True, compute_bytes=4)
    assert fp32.fixed > bf16.fixed and fp32.held <= bf16.held
    assert fp32.device_total <= 12 * GIB or fp32.held == 0


def test_a_cpu_run_counts_its_device_side_as_host_memory():
    """On the CPU the slots, activations and resident units live in host RAM: the host check counts them."""
    from slide_train.plan import check_host

    cpu = make_plan(budget_bytes=None, **{**SHAPE, "cuda": False, "tokens_per_micro": 2048 * 1024})
    gpu = make_plan(budget_bytes=1000 * GIB, **{**SHAPE, "tokens_per_micro": 2048 * 1024})
    assert cpu.device_total > 20 * GIB and cpu.ram_needed == cpu.host_total + cpu.device_total - 2 * GIB
    # the GPU-only headroom (loss chunk, allocator margin: 2 GiB) is not host memory
    assert gpu.ram_needed == gpu.host_total
    ram = cpu.host_total / 0.9  # room for the host side alone
    with pytest.raises(ConfigError, match="device side's buffers"):
        check_host(cpu, ram)


def test_forcing_more_residency_than_the_budget_holds_is_refused():
    plan = make_plan(budget_bytes=24 * GIB, **{**SHAPE, "resident": SHAPE["num_blocks"] + 1})
    assert plan.device_total > plan.budget
    with pytest.raises(ConfigError, match=r"engine.resident=29 keeps ~.* GiB on the device, more than"):
        check_fits(plan, "the GPU's memory")


def test_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch):
    import torch

    from slide_train import trainer
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(k, raising=False)
    assert trainer.use_expandable_segments() and calls == ["expandable_segments:True"]
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(k, "max_split_size_mb:128")
        assert not trainer.use_expandable_segments() and len(calls) == 1  # the user's setting stands
        monkeypatch.delenv(k)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_plan_for_a_cuda_device_on_a_machine_without_one_is_a_config_error(capsys):
    """Exit 2 with the fix in one line (it was a traceback), before any model is built."""
    from slide_train.cli import main

    assert main(["plan", "--model=llama-3.2-1b", "--engine.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device is available; use engine.device=cpu" in err and "Traceback" not in err


def test_plan_checks_the_data_settings_too(capsys):
    """`slide-train plan` reads no data, and accepted data.eval_fraction=1.5 (found by a review)."""
    from slide_train.cli import main

    assert main(["plan", "--data.eval_fraction=1.5"]) == 2
    assert "data.eval_fraction: must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_activations_kept_on_the_gpu_plan_as_a_buffer_each():
    """With the activations on the GPU there is nothing for held gradients to share: null plans as false does
    (the engine's device share, and so the gradients kept on the device for it, are those of a buffer each)."""
    from slide_train.config import load_config
    from slide_train.trainer import load_model, plan_run

    def plan(shared):
        cfg = load_config(None, ["--model=llama-3.2-3b", "--seq_len=4096", "--micro_batch_size=2", "--grad_accum=4",
                                 "--engine.activation_offload=none", "--engine.resident=1",
                                 f"--engine.grads_share_activations={shared}"])
        plan, engine_cfg, _ = plan_run(cfg, load_model(cfg.model, 0, need_tokenizer=False), assume_gpu_gib=1000)
        return plan, engine_cfg.resolve_device_update_share(True)

    (auto, auto_share), (off, off_share) = plan("null"), plan("false")
    assert not auto.shared and auto.held == off.held > 0
    assert auto_share == off_share == DEVICE_UPDATE_SHARE


def test_states_on_disk_leave_host_memory_and_the_refusal_says_how_many_would_fit():
    """engine.optimizer_offload.nvme_fraction: the last sliding blocks' m and v (8 bytes per parameter) leave
    host memory for two staging slots; such blocks update on the host, so none of them keeps a gradient on the
    device. A run that does not fit in RAM is told the share of blocks on disk that would make it fit."""
    import re

    from slide_train.plan import check_host

    block, shape = SHAPE["block_numel"], {**SHAPE, "resident": 0}
    free = make_plan(budget_bytes=None, **shape, clip=False)
    disk = make_plan(budget_bytes=None, **shape, clip=False, nvme_fraction=0.25)
    assert free.host_total - disk.host_total == 8 * 7 * block - 16 * block  # round(0.25 * 28) = 7 blocks
    assert f"disk ~{8 * 7 * block / GIB:.1f} GiB: AdamW states of 7 sliding blocks" in disk.text()
    # bf16 states: 4 bytes per parameter on disk, and in the staging slots
    narrow = {**shape, "state_bytes": 4}
    narrow_disk = make_plan(budget_bytes=None, **narrow, clip=False, nvme_fraction=0.25)
    assert make_plan(budget_bytes=None, **narrow, clip=False).host_total - narrow_disk.host_total == \
        4 * 7 * block - 8 * block
    assert narrow_disk.disk_states == 4 * 7 * block
    held = make_plan(budget_bytes=1000 * GIB, **{**shape, "resident": 0}, clip=True, device_updates=True)
    all_on_disk = make_plan(budget_bytes=1000 * GIB, **{**shape, "resident": 0}, clip=True, device_updates=True,
                            nvme_fraction=1.0)
    assert held.held > 0 and all_on_disk.held == 0
    # too little RAM by about 20 blocks' states: unclipped, and clipped with gradients kept on the GPU for device
    # updates (blocks moved to disk update on the host, so their gradients come back to host memory)
    for run in (dict(clip=False), dict(clip=True, device_updates=True, device_share=0.5, budget_bytes=60 * GIB)):
        run = {"budget_bytes": None, **run}
        base = make_plan(**shape, **run)
        ram = base.ram_needed / 0.95 - 20 * block * 8
        with pytest.raises(ConfigError, match="states_dtype=bf16") as plain:
            check_host(base, ram)
        assert "nvme_fraction" not in str(plain.value)  # without a way to replan, no share offered
        with pytest.raises(ConfigError, match="nvme_fraction=") as refusal:
            check_host(base, ram, replan=lambda f, run=run: make_plan(**shape, **run, nvme_fraction=f))
        fraction = float(re.search(r"nvme_fraction=([0-9.]+)", str(refusal.value)).group(1))
        check_host(make_plan(**shape, **run, nvme_fraction=fraction), ram)  # now it fits
        assert not make_plan(**shape, **run, nvme_fraction=fraction - 0.04).fits_host(ram)


@pytest.mark.parametrize("clip", [True, False])
def test_activations_on_disk_leave_host_memory_for_two_rings(clip):
    """engine.activation_offload=nvme: the boundary activations (every block's input, per micro-batch) go to
    disk, and host memory keeps two rings of SLOTS_PER_MICRO buffers per micro-batch; the device side is the
    cpu tier's, and no gradient shares the activations' memory."""
    from slide_scheduler.disk_activations import SLOTS_PER_MICRO

    shape = {**SHAPE, "resident": 0, "offload_activations": True}
    one = shape["tokens_per_micro"] * shape["hidden"] * 2  # a micro-batch's boundary, bf16
    acts = shape["num_blocks"] * shape["micro_batches"] * one
    ram = make_plan(budget_bytes=None, **shape, clip=clip)
    disk = make_plan(budget_bytes=None, **shape, clip=clip, activations_on_disk=True)
    assert ram.host_total - disk.host_total == acts - 2 * SLOTS_PER_MICRO * shape["micro_batches"] * one
    assert disk.device_total == ram.device_total and disk.disk_activations == acts and ram.disk_activations == 0
    assert f"disk ~{acts / GIB:.1f} GiB: boundary activations" in disk.text()
    assert not make_plan(budget_bytes=None, **shape, clip=clip, activations_on_disk=True, shared=True).shared


def test_no_device_update_buffers_when_every_sliding_block_keeps_its_states_on_disk():
    """Blocks whose moments are on disk update on the host, so with the edges resident and every sliding block
    on disk nothing streams through the device: the plan counts no device-update buffers (the engine makes
    none), and is the plan without device updates, residency included."""
    shape = {**SHAPE, "resident": 3}
    streamed = make_plan(budget_bytes=80 * GIB, **shape, clip=True, device_updates=True, nvme_fraction=1.0)
    host_only = make_plan(budget_bytes=80 * GIB, **shape, clip=True, device_updates=False, nvme_fraction=1.0)
    assert streamed.device_total == host_only.device_total and "device-update buffers" not in streamed.text()
    some = make_plan(budget_bytes=80 * GIB, **shape, clip=True, device_updates=True, nvme_fraction=0.5)
    assert "device-update buffers" in some.text()
