"""The placement is what the engine allocates, and the cost model prices it: bytes counted independently of the
placement (the storages of every tensor the engine holds, the files it writes) against the placement's own
allocations; a hand-written placement the planner would never choose; bottlenecks that follow the machine."""

from __future__ import annotations

import copy
import dataclasses
import gc
import pathlib
import threading
import types

import pytest
import torch
from test_engine import DEPTH, DIM, Model, ToyStack, batches

from slide_memory import AdamWConfig
from slide_scheduler import (
    DISK,
    GPU,
    HOST,
    Budgets,
    EngineConfig,
    Machine,
    Placement,
    RunFacts,
    Shapes,
    SlidingEngine,
    StepShape,
    UnitPlacement,
    arrange,
    place,
    price,
    run_facts,
    shapes_of,
)
from slide_scheduler.plan import choices
from slide_scheduler.plan.machine import Disk, Gpu, Host, Pcie
from slide_scheduler.run import activations as activations_module

MICRO, ROWS, LENGTH = 3, 3, 10  # test_engine.batches: 3 rows of 10 tokens per micro-batch


def held_storages(root, skip) -> dict[str, int]:
    """Bytes per device type of every tensor storage reachable from `root` (not through `skip`), each storage
    once. 0-dim tensors (AdamW step counters, a few bytes per unit) are left out: the placement does not count
    them."""
    seen, storages, todo = {id(s) for s in skip}, {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and obj.dim() > 0:
                storage = obj.untyped_storage()
                storages[(obj.device.type, storage.data_ptr())] = storage.nbytes()
            continue
        if isinstance(obj, (type, types.ModuleType, str, bytes, int, float, threading.Thread)):
            continue
        if isinstance(obj, types.FunctionType):  # what it closes over, not its module's globals
            todo.extend(cell.cell_contents for cell in obj.__closure__ or () if cell.cell_contents is not None)
            todo.extend(obj.__defaults__ or ())
            continue
        todo.extend(gc.get_referents(obj))
    out: dict[str, int] = {}
    for (device, _), nbytes in storages.items():
        out[device] = out.get(device, 0) + nbytes
    return out


def files_bytes(*folders) -> int:
    return sum(f.stat().st_size for folder in folders if folder for f in pathlib.Path(folder).rglob("*")
               if f.is_file())


def measure(engine: SlidingEngine, stack, steps: int = 2) -> dict[str, int]:
    """The most each tier held during `steps` steps: tensors reachable from the engine (when backward fetches
    boundary activations, and after each step) and the engine's files."""
    folders = (engine.config.nvme_dir, engine.config.activation_dir)
    peak: dict[str, int] = {}

    def record():
        # (not through the lanes: work still queued there holds the step's own tensors, an activation on its way
        # out, for as long as the lane is behind, which depends on the machine's load, not on the placement)
        for device, nbytes in held_storages(engine, [stack, *engine.lanes]).items():
            tier = {"cpu": HOST, "cuda": GPU}[device]
            peak[tier] = max(peak.get(tier, 0), nbytes)
        peak[DISK] = max(peak.get(DISK, 0), files_bytes(*folders))

    fetch = activations_module.ActivationStore.fetch

    def fetch_and_record(self, *args, **kwargs):
        record()
        return fetch(self, *args, **kwargs)

    activations_module.ActivationStore.fetch = fetch_and_record
    try:
        for step in batches(seed=2, steps=steps, micro=MICRO):
            n = sum(int((b["targets"] != -100).sum()) for b in step)
            engine.step(step, lr=1e-2, normalizer=n)
            engine.synchronize()
            record()
    finally:
        activations_module.ActivationStore.fetch = fetch
    return peak


def facts_for(device: str, max_grad_norm: float | None = 0.05, **words) -> RunFacts:
    return run_facts(device=device, max_grad_norm=max_grad_norm, **words)


def test_the_activations_tiers_are_the_states_tiers_and_the_older_words_name_them():
    """A run's boundary activations wait in GPU, HOST or DISK, as states do; run_facts reads the older words of a
    config (none, cpu, nvme) as those tiers, and RunFacts itself takes only the tiers (or auto)."""
    for old, tier in (("none", GPU), ("cpu", HOST), ("nvme", DISK), (GPU, GPU), ("auto", "auto")):
        assert facts_for("cpu", activation_offload=old).activations == tier
    assert run_facts(device="cpu").activations == HOST == RunFacts().activations
    with pytest.raises(ValueError, match="older word for host"):
        RunFacts(activations="cpu")


def toy_shapes(stack) -> Shapes:
    return dataclasses.replace(shapes_of(stack), hidden=DIM, intermediate=3 * DIM)


STEP = StepShape(ROWS * LENGTH, MICRO, LENGTH)

# name: the run's facts (run_facts' words), then the placement's choices (arrange's keywords)
MIXES = {
    "sliding": ({}, {}),
    "resident": ({}, {"resident": range(3)}),
    "unclipped": ({"max_grad_norm": None}, {}),
    "pooled": ({}, {"shared": True}),
    "streamed, held": ({}, {"share": 0.5, "held": 1}),
    "streamed, unclipped": ({"max_grad_norm": None}, {"share": 1.0}),
    "streamed and pooled, unclipped": ({"max_grad_norm": None}, {"share": 0.5, "shared": True, "held": 1}),
    "deferred, unclipped": ({"max_grad_norm": None}, {"defer": True}),
    "moments on disk": ({}, {"nvme_fraction": 0.5}),
    "bf16 states on disk": ({"states_dtype": "bf16"}, {"nvme_fraction": 0.5}),
    "masters read from disk for loads": ({}, {"nvme_fraction": 1.0, "disk_loads": True}),
    "activations on disk": ({"activation_offload": DISK}, {"resident": range(2)}),
    "activations on the device": ({"activation_offload": GPU}, {"window": 3}),
    "the first blocks' activations on disk": ({}, {"disk_boundaries": 2}),
    "gradients on disk": ({}, {"nvme_fraction": 0.5, "disk_grads": True}),
    "three disk staging slots": ({}, {"nvme_fraction": 0.5, "staging": 3}),
    "gradients and masters on disk, loads from there": ({}, {"nvme_fraction": 1.0, "disk_grads": True,
                                                             "disk_loads": True}),
    "activations on disk and the device": ({"activation_offload": GPU}, {"disk_boundaries": 1, "landing": 1}),
    "speculating": ({}, {"speculate": True, "resident": range(2)}),
    "some speculating": ({}, {"speculate": 2, "share": 0.5}),
}


def build(tmp_path, device: str, config_keys: dict, choices: dict):
    torch.manual_seed(0)
    model = Model(tied=False)
    stack = ToyStack(model)
    config = EngineConfig(optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1), nvme_dir=str(tmp_path / "states"),
                          activation_dir=str(tmp_path / "activations"))
    placement = arrange(toy_shapes(stack), STEP, facts_for(device, **config_keys), **{"resident": (), "window": 2,
                        "share": 0.0, "shared": False, "held": 0} | choices)
    return model, stack, SlidingEngine(stack, placement, config)


@pytest.mark.parametrize("mix", MIXES)
def test_the_placements_bytes_are_what_the_engine_allocates(tmp_path, mix):
    model, stack, engine = build(tmp_path, "cpu", *MIXES[mix])
    p = engine.placement
    try:
        held = measure(engine, stack)
    finally:
        engine.close()
    assert p.bytes(GPU) == 0  # a CPU run: its device side is host memory, and counted there
    assert held[HOST] == p.bytes(HOST, transient=False), p.tiers()[HOST]
    assert held[DISK] == p.bytes(DISK), p.tiers()[DISK]
    if mix in ("moments on disk", "bf16 states on disk", "activations on disk", "masters read from disk for loads"):
        assert held[DISK] > 0


def hand_written(stack, run: RunFacts) -> Placement:
    """A placement the planner never makes: block 1 resident between sliding blocks 0 and 2, block 2's moments on
    disk, block 3 updated on the device with its gradient held there, the edges sliding and updated on the host."""
    units = (
        UnitPlacement(False, "host", "own", HOST, split=True),  # the edges
        UnitPlacement(False, "host", "ring", HOST, split=True),  # block 0
        UnitPlacement(True, "device", "slot", GPU),  # block 1
        UnitPlacement(False, "host", "ring", DISK),  # block 2
        UnitPlacement(False, "stream", "held", HOST),  # block 3
    )
    assert len(units) == DEPTH + 1
    return Placement(toy_shapes(stack), STEP, units, window=2, run=run)


def run_hand_written(tmp_path, device: str):
    torch.manual_seed(0)
    model = Model(tied=False)
    ref = copy.deepcopy(model).to(device)
    stack = ToyStack(model)
    opt = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    config = EngineConfig(optimizer=opt, nvme_dir=str(tmp_path / "states"))
    placement = hand_written(stack, facts_for(device))
    engine = SlidingEngine(stack, placement, config)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    return model, ref, stack, engine, torch_opt


def test_a_hand_written_placement_runs_and_matches_plain_pytorch(tmp_path):
    _, ref, stack, engine, opt = run_hand_written(tmp_path, "cpu")
    p = engine.placement
    assert p.resident == {2} and p.on_disk == {3} and p.streamed == {4} and p.held == {4}
    assert engine.resident == {2} and engine.on_disk == {3} and set(engine.homes.held) == {4}
    losses, ref_losses = [], []
    for step in batches(seed=3, steps=3, micro=MICRO):
        n = sum(int((b["targets"] != -100).sum()) for b in step)
        losses.append(engine.step(step, lr=1e-2, normalizer=n).loss)
        opt.zero_grad()
        loss = sum(ref(b, n) for b in step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert norm > 0.05  # clipping acts
        opt.step()
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    ours = engine.named_masters()
    theirs = dict(ref.named_parameters())
    for i in range(DEPTH):
        for name, t in ours[f"block.{i}"].items():
            torch.testing.assert_close(t, theirs[f"blocks.{i}.{name}"].detach(), rtol=1e-4, atol=1e-6)
    for name, t in ours["edges"].items():
        torch.testing.assert_close(t, theirs[f"edges.{name}"].detach(), rtol=1e-4, atol=1e-6)
    held = measure(engine, stack, steps=1)
    engine.close()
    assert held[HOST] == p.bytes(HOST, transient=False) and held[DISK] == p.bytes(DISK) > 0


def test_a_placement_the_engine_cannot_run_is_refused_naming_the_unit():
    stack = ToyStack(Model(tied=False))
    good = hand_written(stack, facts_for("cpu"))
    cases = {
        2: (UnitPlacement(False, "stream", "ring", DISK), "block 1: moments on disk are for sliding blocks updated "
                                                          "on the host"),
        1: (UnitPlacement(False, "host", "held", HOST), "block 0: only a block updated on the device holds"),
        3: (UnitPlacement(True, "device", "ring", GPU), "block 2: a resident unit's gradient stays in its slot"),
    }
    for unit, (bad, message) in cases.items():
        units = list(good.units)
        units[unit] = bad
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(good, units=tuple(units))
    with pytest.raises(ValueError, match="one entry per unit"):
        dataclasses.replace(good, units=good.units[:-1])
    with pytest.raises(ValueError, match="for 2 data-parallel rank"):  # (this process group has one)
        SlidingEngine(stack, arrange(shapes_of(stack, ranks=2), STEP, facts_for("cpu", ranks=2), resident=(), window=2,
                                     share=0.0, shared=False, held=0))
    with pytest.raises(ValueError, match="moments on disk: set nvme_dir"):
        SlidingEngine(stack, good, EngineConfig())


# -- the cost model --------------------------------------------------------------------------------------------

LLAMA_3B = Shapes((394_000_000,) + (100_700_000,) * 28, hidden=3072, intermediate=8192, vocab=128256)
FAST = Machine(gpu=Gpu(memory_gib=80, bf16_tflops=800), host=Host(memory_gib=512, cores=32, memory_gbps=200,
                                                                   adamw_gparams=8.0),
               pcie=Pcie(h2d_gbps=55, d2h_gbps=55, duplex_gbps=100), disk=Disk(free_gib=2000, read_gbps=20.0,
                                                                             write_gbps=20.0))


def with_rates(machine: Machine, **sections) -> Machine:
    return dataclasses.replace(machine, **{k: dataclasses.replace(getattr(machine, k), **v)
                                           for k, v in sections.items()})


def test_the_bottleneck_follows_the_machines_rates():
    """The same 3B placement (every block sliding, 32k tokens per step, the moments of a quarter of the blocks
    on a striped NVMe array): compute-bound on the fast machine; halve PCIe until it binds; a single slow drive
    binds instead; so does a weak host optimizer."""
    step = StepShape(8192, 4, 8192)
    p = arrange(LLAMA_3B, step, RunFacts(clip=None), nvme_fraction=0.25, resident=(), window=2, share=0.0,
                shared=False, held=0)
    assert len(p.on_disk) == 7
    fast = price(p, FAST)
    assert fast.bottleneck == "gpu" and fast.step_s == pytest.approx(max(fast.lanes.values()), rel=0.5)
    halved = FAST
    for _ in range(6):
        halved = with_rates(halved, pcie={"h2d_gbps": halved.pcie.h2d_gbps / 2, "d2h_gbps": halved.pcie.d2h_gbps / 2,
                                          "duplex_gbps": halved.pcie.duplex_gbps / 2})
        slower = price(p, halved)
        if slower.bottleneck.startswith("pcie"):
            break
    assert slower.bottleneck.startswith("pcie") and slower.step_s > fast.step_s
    assert price(p, with_rates(halved, pcie=dataclasses.asdict(FAST.pcie))).bottleneck == "gpu"
    slow_disk = price(p, with_rates(FAST, disk={"read_gbps": 2.0, "write_gbps": 1.5}))
    assert slow_disk.bottleneck == "disk" and slow_disk.step_s > fast.step_s
    weak_host = price(p, with_rates(FAST, host={"adamw_gparams": 0.2}))
    assert weak_host.bottleneck == "host_adamw"


def test_loads_that_read_the_master_from_disk_cost_two_fp32_reads_a_step_and_save_the_copy():
    """Blocks whose master is on disk without a copy of their parameters in RAM: the disk lane reads each such
    master twice a step (forward and backward loads; the last block's once, its backward finds it still in its
    slot), the host holds two load buffers instead of the copies."""
    step = StepShape(8192, 4, 8192)
    copies, lean = (arrange(LLAMA_3B, step, RunFacts(clip=None), resident=(), window=2, share=0.0,
                            shared=False, held=0, nvme_fraction=0.25, disk_loads=loads) for loads in (False, True))
    assert lean.loads_from_disk == lean.masters_on_disk == copies.masters_on_disk and not copies.loads_from_disk
    numel = sum(LLAMA_3B.unit_numels[u] for u in lean.loads_from_disk)
    reads = sum((1 if u == LLAMA_3B.num_blocks else 2) * LLAMA_3B.unit_numels[u] for u in lean.loads_from_disk)
    slow = with_rates(FAST, disk={"read_gbps": 2.0, "write_gbps": 1.5})
    assert price(lean, slow).lanes["disk"] == pytest.approx(price(copies, slow).lanes["disk"] + 4 * reads / 2e9)
    assert lean.bytes(HOST) == copies.bytes(HOST) - copies.compute_bytes * numel + 2 * 4 * LLAMA_3B.block_numel
    assert lean.bytes(DISK) == copies.bytes(DISK)


@pytest.mark.parametrize("clip", [True, False])
def test_each_rank_prices_its_shard_over_pcie_and_the_rest_over_the_gpus_link(clip):
    """Two data-parallel ranks of the same placement, priced per rank: its PCIe link carries half of every unit's
    bytes, the GPUs' link the rest of each load (all-gathered) and of each gradient (reduce-scattered), and the
    host's memory and cores, which the ranks share, carry what one process of the whole does. The link's rate is
    the machine's (PCIe's where not measured)."""
    step = StepShape(8192, 4, 8192)
    one, two = (arrange(LLAMA_3B, step, RunFacts(clip=1.0 if clip else None, activations=GPU, ranks=r),
                        resident=(), window=2, share=0.0, shared=False, held=0) for r in (1, 2))
    link = with_rates(FAST, gpu={"link_gbps": 400})
    single, ranked = price(one, link), price(two, link)
    assert "gpu_link" not in single.lanes
    for lane in ("pcie_h2d", "pcie_d2h"):
        assert ranked.lanes[lane] == pytest.approx(single.lanes[lane] / 2)
    for lane in ("host_memory", "host_adamw", "gpu"):
        assert ranked.lanes[lane] == pytest.approx(single.lanes[lane])
    blocks, edges, last = sum(LLAMA_3B.unit_numels[1:]), LLAMA_3B.unit_numels[0], LLAMA_3B.unit_numels[-1]
    # bf16, half from the other rank: two loads and a gradient per block (the last block loads once: its backward
    # finds it still in its slot)
    gathered = (3 * blocks - last + 2 * edges) * 2 / 2
    assert ranked.lanes["gpu_link"] == pytest.approx(gathered / 400e9)
    assert price(two, FAST).lanes["gpu_link"] == pytest.approx(gathered / 55e9)
    assert ranked.step_s <= single.step_s * 1.001


def test_the_planner_takes_the_cheapest_candidate_that_fits():
    """Among windows and device-update shares, what `place` returns is priced no higher (beyond its tie margin)
    than any candidate that fits, and it fits."""
    step = StepShape(8192, 4, 8192)
    options = RunFacts(clip=1.0)
    budgets = Budgets(gpu=0.92 * 24 * 2**30, host=None)
    plan = place(LLAMA_3B, step, options, budgets, FAST)
    assert plan.fits and plan.placement.bytes(GPU) <= budgets.gpu
    from slide_scheduler.plan.planner import SHARES, TIE, WINDOWS

    for window in WINDOWS:
        for share in SHARES:
            p = choices.size_for_budget(LLAMA_3B, step, options, budgets.gpu, window=window, share=share,
                                                 shared=True)
            if p.bytes(GPU) <= budgets.gpu:
                assert plan.estimate.step_s <= price(p, FAST).step_s * (1 + TIE)
    # a slower PCIe moves the choice toward fewer bytes over it (fewer updates streamed through the device)
    slow = place(LLAMA_3B, step, options, budgets, with_rates(FAST, pcie={"h2d_gbps": 6, "d2h_gbps": 6,
                                                                        "duplex_gbps": 10}))
    assert len(slow.placement.streamed) <= len(plan.placement.streamed)


# -- on the GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["sliding", "resident", "pooled", "streamed, held", "moments on disk",
                                 "activations on the device", "speculating"])
def test_the_placements_bytes_are_what_the_engine_allocates_on_cuda(tmp_path, mix):
    """On CUDA the device side is counted twice: the storages the engine holds, and the allocator's own count
    of what stays allocated after the steps (transient work freed)."""
    gc.collect()  # (what earlier tests left for the collector is not this engine's)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model, stack, engine = build(tmp_path, "cuda", *MIXES[mix])
    p = engine.placement
    try:
        held = measure(engine, stack)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() - before
    finally:
        engine.close()
    assert held[GPU] == p.bytes(GPU, transient=False), p.tiers()[GPU]
    assert held[HOST] == p.bytes(HOST, transient=False), p.tiers()[HOST]
    assert held[DISK] == p.bytes(DISK)
    # the allocator rounds each block up to 512 bytes; scalars (step counters) are the rest
    assert p.bytes(GPU, transient=False) <= allocated <= p.bytes(GPU, transient=False) + 64 * 1024


@pytest.mark.gpu
def test_a_hand_written_placement_runs_on_cuda(tmp_path):
    _, ref, stack, engine, opt = run_hand_written(tmp_path, "cuda")
    p = engine.placement
    held = measure(engine, stack, steps=2)
    engine.close()
    assert held[GPU] == p.bytes(GPU, transient=False) and held[HOST] == p.bytes(HOST, transient=False)


def test_asked_to_speculate_the_planner_speculates_where_it_pays_and_the_host_has_room(monkeypatch):
    """On an H200-like host, clipped 3B updates the forward waits for: speculating, the step where clipping does
    not act is priced a little faster. `auto` takes it only where it wins by more than the planner's margin (the
    price's error on measured speculating steps): not here, unless the margin is smaller. On a host fast enough
    that the GPU binds anyway it does not speculate, `true` does all the same, and where the host's budget cannot
    hold what speculation needs it speculates less (and still fits)."""
    from slide_scheduler import Overrides
    from slide_scheduler.plan import planner

    step, gib = StepShape(8192, 4, 4096), 2**30
    h200 = with_rates(FAST, host={"memory_gbps": 132, "adamw_gparams": 3.68, "cores": 16})
    budgets = Budgets(gpu=0.92 * 24 * gib)
    plain = place(LLAMA_3B, step, RunFacts(clip=1.0), budgets, h200)
    asked = place(LLAMA_3B, step, RunFacts(clip=1.0), budgets, h200, Overrides(speculate="auto"))
    assert not plain.placement.speculated and not asked.placement.speculated
    monkeypatch.setattr(planner, "SPECULATION_MARGIN", 0.0)
    asked = place(LLAMA_3B, step, RunFacts(clip=1.0), budgets, h200, Overrides(speculate="auto"))
    assert asked.placement.speculated
    assert asked.estimate_unclipped.step_s < plain.estimate_unclipped.step_s
    assert asked.estimate_unclipped.step_s * 1.15 > plain.estimate_unclipped.step_s  # (by less than the margin)
    assert asked.placement.bytes(HOST) > plain.placement.bytes(HOST)
    # where it prices no faster, `auto` does not speculate, and `true` does all the same
    fast = {how: place(LLAMA_3B, step, RunFacts(clip=1.0), budgets, FAST, Overrides(speculate=how)).placement
            for how in ("auto", True)}
    assert not fast["auto"].speculated and fast[True].speculated
    tight = Budgets(gpu=budgets.gpu, host=(plain.placement.bytes(HOST) + asked.placement.bytes(HOST)) / 2)
    fallback = place(LLAMA_3B, step, RunFacts(clip=1.0), tight, h200, Overrides(speculate=True))
    assert fallback.fits and fallback.placement.bytes(HOST) <= tight.host


def test_auto_puts_the_first_blocks_activations_on_disk_where_host_memory_holds_only_the_others():
    """`activations: auto` on a host that holds the states and most of the boundary activations: the plan keeps
    them in host memory but the fewest first blocks', which go to disk; one block fewer on disk does not fit,
    and the disk tier's bytes and traffic count exactly those."""
    from slide_scheduler import Overrides, disk_traffic

    step, gib = StepShape(32768, 2, 32768), 2**30
    run = RunFacts(clip=1.0, activations=HOST)
    whole = place(LLAMA_3B, step, run, Budgets(gpu=70 * gib), FAST).placement
    act = step.tokens_per_micro * LLAMA_3B.hidden * 2 * step.micro_batches
    budgets = Budgets(gpu=70 * gib, host=whole.bytes(HOST) - 4.5 * act, disk=1000 * gib)
    plan = place(LLAMA_3B, step, dataclasses.replace(run, activations="auto"), budgets, FAST)
    p = plan.placement
    k = p.boundaries_in(DISK)
    assert plan.fits and 0 < k < LLAMA_3B.num_blocks and p.boundary_tiers == (DISK,) * k + (HOST,) * (28 - k)
    fewer = place(LLAMA_3B, step, run, budgets, FAST, Overrides(disk_boundaries=k - 1))
    assert not fewer.fits
    assert p.tiers()[DISK]["boundary activations"] == k * act
    assert disk_traffic(p) == (k * act, k * act)


def test_attention_is_priced_at_the_machines_attention_rate_with_its_window():
    """Each block's attention FLOPs (the probe's count: causal_attention_flops, a window cutting each query's
    keys) run at gpu.attention_tflops where the machine file has it: the GPU's compute moves by exactly those
    FLOPs over the two rates (a forward, and a backward that recomputes it and runs back at twice its work)."""
    from slide_scheduler.plan.cost import attention_pairs
    from slide_scheduler.plan.machine import causal_attention_flops

    seq, heads, head_dim = 32768, 24, 128
    assert 4 * attention_pairs(seq) * heads * head_dim == causal_attention_flops(seq, heads, head_dim, backward=False)
    assert attention_pairs(seq, 4096) == seq * 4096 - 4096**2 / 2 and attention_pairs(seq, 10**6) == seq**2 / 2
    step = StepShape(2 * seq, 2, seq)
    p = arrange(LLAMA_3B, step, RunFacts(clip=None), resident=range(29))  # (all resident: compute alone)
    windowed = arrange(dataclasses.replace(LLAMA_3B, windows=(4096, 0) * 14), step, RunFacts(clip=None),
                       resident=range(29))
    rates = (100.0, 400.0)
    gpu = {(q, r): price(q, with_rates(FAST, gpu={"attention_tflops": r})).lanes["gpu"]
           for q in (p, windowed) for r in rates}
    rows = step.tokens_per_micro * step.micro_batches / seq
    half = 14 * (attention_pairs(seq) + attention_pairs(seq, 4096))  # (every other block windowed)
    for q, pairs in ((p, 28 * attention_pairs(seq)), (windowed, half)):
        flops = 4 * (4 * pairs * LLAMA_3B.hidden * rows)  # forward, and the backward's three
        assert gpu[q, 100.0] - gpu[q, 400.0] == pytest.approx(flops / 1e12 * (1 / 100 - 1 / 400), rel=1e-9)


def test_a_mixtures_routed_experts_are_priced_at_the_machines_experts_rate():
    """Each block's routed experts (Shapes.routed_numels; the probe's count: routed_expert_flops) run at
    gpu.experts_tflops where the machine file has it: the GPU's compute moves by exactly those FLOPs over the two
    rates. Without it, or for a dense model, the price is the dense GEMMs' as before."""
    from slide_scheduler.plan.machine import routed_expert_flops

    step = StepShape(8192, 2, 4096)
    routed = tuple(4_000_000 * (b % 3) for b in range(28))  # (some blocks dense)
    mixture = dataclasses.replace(LLAMA_3B, routed_numels=routed)
    p = arrange(mixture, step, RunFacts(clip=None), resident=range(29))
    dense = arrange(LLAMA_3B, step, RunFacts(clip=None), resident=range(29))
    gpu = {r: price(p, with_rates(FAST, gpu={"experts_tflops": r})).lanes["gpu"] for r in (0.0, 100.0, 400.0)}
    assert gpu[0.0] == price(dense, FAST).lanes["gpu"]
    tokens = step.tokens_per_micro * step.micro_batches
    flops = sum(routed_expert_flops(tokens, numel, 1) for numel in routed) * 4 / 3  # (the forward's recompute too)
    assert gpu[100.0] - gpu[400.0] == pytest.approx(flops / 1e12 * (1 / 100 - 1 / 400), rel=1e-9)
    rate = FAST.gpu.bf16_tflops * 0.71  # (cost.BLOCK_EFFICIENCY)
    assert gpu[100.0] - gpu[0.0] == pytest.approx(flops / 1e12 * (1 / 100 - 1 / rate), rel=1e-9)


def test_the_planner_reads_the_disk_tier_further_ahead_where_that_prices_faster():
    """Four staging slots of the disk tier's states instead of two (more of a clipped step's reads under the
    backward) where the cost model prices that faster by more than the planner's tie, and their host memory
    counted; on a slow disk, busy the whole step either way, two."""
    from slide_scheduler import Overrides
    from slide_scheduler.plan.planner import DEEP_STAGING, TIE

    step, gib = StepShape(8192, 4, 4096), 2**30
    picked = {}
    for rate in (2.0, 8.0, 40.0):
        machine = with_rates(FAST, disk={"read_gbps": rate, "write_gbps": rate, "free_gib": 1000},
                             host={"memory_gbps": 132, "adamw_gparams": 3.68, "cores": 16})
        budgets = Budgets(gpu=0.92 * 16 * gib)
        forced = {k: place(LLAMA_3B, step, RunFacts(clip=1.0), budgets, machine,
                           Overrides(nvme_fraction=0.5, disk_staging=k)) for k in (2, DEEP_STAGING)}
        auto = place(LLAMA_3B, step, RunFacts(clip=1.0), budgets, machine, Overrides(nvme_fraction=0.5))
        faster = forced[DEEP_STAGING].estimate.step_s < forced[2].estimate.step_s * (1 - TIE)
        picked[rate] = auto.placement.staging_slots
        assert picked[rate] == (DEEP_STAGING if faster else 2), rate
        staged = forced[DEEP_STAGING].placement.tiers()[HOST]["moments staging"]
        assert staged == 2 * forced[2].placement.tiers()[HOST]["moments staging"]
    assert picked[2.0] == 2 and DEEP_STAGING in picked.values()
