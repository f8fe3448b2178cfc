"""A run's plan: slide-scheduler's placement and cost model for this model, step, budgets and machine, in the
words of the config (what each tier holds, the predicted step, what would make a run that does not fit fit)."""

from __future__ import annotations

import dataclasses
import os

from slide_scheduler import (
    DISK,
    GPU,
    HOST,
    Budgets,
    Machine,
    Overrides,
    Plan,
    RunFacts,
    Shapes,
    StepShape,
    disk_share,
    place,
    run_facts,
    shapes_of,
)

from .config import TrainConfig
from .errors import ConfigError
from .models.families import family_of

GIB = 2**30
GPU_USABLE = 0.92  # of a card or a cap: the rest for the CUDA context and what the plan does not see
HOST_USABLE = 0.95  # of host memory: the rest for the operating system and the data pipeline


def params_text(count: int) -> str:
    """A parameter count as people say it: 0.8M, 124.4M, 8.03B."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def model_shapes(model, stack, ranks: int = 1) -> Shapes:
    hf = model.hf_config
    intermediate = getattr(hf, "moe_intermediate_size", None) or getattr(hf, "intermediate_size", 0) or 0
    # A mixture of experts: each token's MLP activations and FLOPs are those of the experts it is routed to
    routed = getattr(hf, "num_experts_per_tok", None) or 1
    intermediate *= routed
    shapes = shapes_of(stack, hidden=hf.hidden_size, intermediate=intermediate, vocab=hf.vocab_size, ranks=ranks)
    family = family_of(hf)
    if family.experts:
        experts = getattr(hf, family.experts)
        pooled = sum(t.numel() for name, t in stack.make_block().named_parameters() if ".experts." in name)
        active = shapes.block_numel - pooled + pooled * routed // experts
        shapes = dataclasses.replace(shapes, active_block_numel=active)
    return shapes


def unit_of(name: str) -> int:
    """'edges' -> 0, 'block.<i>' -> 1 + i."""
    return 0 if name == "edges" else 1 + int(name.removeprefix("block."))


def overrides_of(cfg: TrainConfig, num_blocks: int) -> Overrides:
    o = cfg.engine.placement
    resident = o.get("resident")
    if isinstance(resident, list):
        resident = tuple(sorted(unit_of(name) for name in resident))
        if resident and resident[-1] > num_blocks:
            raise ConfigError(f"engine.placement.resident names block.{resident[-1] - 1}, but this model has blocks "
                              f"0 to {num_blocks - 1}")
    elif resident is not None and resident > num_blocks + 1:
        raise ConfigError(f"engine.placement.resident={resident}, but this model has {num_blocks + 1} units (the "
                          f"edges and {num_blocks} blocks): use at most {num_blocks + 1}")
    fraction = cfg.engine.nvme.fraction
    return Overrides(window=o.get("window"), resident=resident, device_update_share=o.get("device_update_share"),
                     speculate=o.get("speculate"), nvme_fraction=None if fraction == "auto" else fraction)


def facts_of(cfg: TrainConfig, device: str, ranks: int = 1) -> RunFacts:
    """The run's facts from its config, for `device` (a name this machine need not have: `plan` prices another)."""
    e = cfg.engine
    return run_facts(device=device, compute_dtype=e.compute_dtype, states_dtype=e.states_dtype,
                     max_grad_norm=cfg.max_grad_norm, activation_offload=e.activation_offload, ranks=ranks,
                     here=False)


def budgets_for(machine: Machine, cuda: bool, cap_gib: float | None, card_gib: float | None = None,
                ranks_here: int = 1) -> Budgets:
    """Each budget is the smaller of the machine's figure and the config's cap (and, running, the card here); a
    GPU's is one rank's, the host's shared by the `ranks_here` ranks on it."""
    gpu = None
    if cuda:
        sizes = [x for x in (machine.gpu.memory_gib or None, cap_gib, card_gib) if x]
        gpu = GPU_USABLE * min(sizes) * GIB if sizes else None
    host = HOST_USABLE * machine.host.memory_gib * GIB / ranks_here if machine.host.memory_gib else None
    disk = machine.disk.free_gib * GIB if machine.disk.free_gib else None  # (0: not measured here)
    return Budgets(gpu=gpu, host=host, disk=disk)


def make_plan(cfg: TrainConfig, shapes: Shapes, machine: Machine, run: RunFacts, budgets: Budgets,
              nvme_fraction: float | None = None, disk_loads: bool | None = None) -> Plan:
    """The run's plan (slide-scheduler's planner: with engine.nvme.fraction `auto`, the least share on disk that
    fits host memory); `nvme_fraction` and `disk_loads` replace the config's choice where given."""
    step = StepShape(cfg.micro_batch_size * cfg.seq_len, cfg.grad_accum, cfg.seq_len)
    overrides = overrides_of(cfg, shapes.num_blocks)
    if nvme_fraction is not None:
        overrides = dataclasses.replace(overrides, nvme_fraction=nvme_fraction)
    return place(shapes, step, run, budgets, machine, dataclasses.replace(overrides, disk_loads=disk_loads))


def checkpoint_cost(plan: Plan, machine: Machine) -> tuple[int, float | None]:
    """Bytes a checkpoint writes (every unit's fp32 master and AdamW moments) and its seconds on the machine
    file's disk: the write, plus reading back the share the NVMe tier holds (the same drive, taken as one); the
    files are hashed beside the writes. None for the seconds where the machine has no measured disk (no free
    space known, or no rates)."""
    p = plan.placement
    nbytes = sum(p.shapes.unit_numels) * (4 + 2 * p.state_bytes)
    disk = machine.disk
    if not (disk.free_gib and disk.write_gbps and disk.read_gbps):
        return nbytes, None
    return nbytes, nbytes / (disk.write_gbps * 1e9) + p.bytes(DISK) / (disk.read_gbps * 1e9)


def describe(plan: Plan, machine: Machine | None = None) -> str:
    """The plan as a user reads it: residency, each tier's contents, the prediction and its bottleneck, and with
    `machine` what a checkpoint costs."""
    p, b = plan.placement, plan.budgets
    sliding = len(p.sliding_blocks)
    tiers = p.tiers()

    def tier_line(tier: str, budget: float | None) -> str:
        parts = ", ".join(f"{kind} {nbytes / GIB:.2f}" for kind, nbytes in tiers[tier].items())
        cap = "" if budget is None else f" of {budget / GIB:.1f} usable"
        return f"  {tier} ~{p.bytes(tier) / GIB:.1f} GiB{cap}: {parts or 'nothing'}"

    device = "host memory (CPU run)" if p.device_is_host else "the GPU"
    lines = [f"plan: {len(p.resident)} of {len(p.units)} units resident on {device}, {sliding} sliding through "
             f"{p.window} slots; {len(p.streamed - {0})} sliding blocks update on the GPU, {len(p.held)} hold their "
             f"gradient there, {len(p.pooled)} share host memory with the boundary activations, "
             f"{len(p.masters_on_disk)} keep their master and AdamW moments on disk"
             + (f" ({len(p.loads_from_disk)} read their master from disk for each load)" if p.loads_from_disk
                else "")
             + (f", {len(p.on_disk - p.masters_on_disk)} only their moments" if p.on_disk - p.masters_on_disk else "")
             + (f", {len(p.speculated)} speculate" if p.speculated else "")]
    groups = p.describe()
    if len(groups) > 8:
        groups = [f"    ({len(groups)} runs of units placed alike: `plan --json` lists each unit)"]
    lines += groups
    if not p.device_is_host:
        lines.append(tier_line(GPU, b.gpu))
    lines.append(tier_line(HOST, b.host))
    if p.bytes(DISK):
        lines.append(tier_line(DISK, b.disk))
    e, u = plan.estimate, plan.estimate_unclipped
    clipped = f" (clipping acts; {u.step_s:.2f} s when it does not)" if p.clip else ""
    bound = "compute" if p.device_is_host and e.bottleneck == "gpu" else e.bottleneck  # (a CPU run's device)
    lines.append(f"  predicted step {e.step_s:.2f} s{clipped}, bound by {bound}: "
                 + ", ".join(f"{lane} {busy:.2f} s" for lane, busy in e.lanes.items()))
    nbytes, seconds = checkpoint_cost(plan, machine) if machine is not None else (0, None)
    if seconds is not None:
        lines.append(f"  a checkpoint writes ~{nbytes / GIB:.1f} GiB: ~{seconds:.0f} s at the disk's "
                     f"{machine.disk.write_gbps:g} GB/s" + (f", reading the tier's {p.bytes(DISK) / GIB:.1f} GiB "
                                                            f"at {machine.disk.read_gbps:g} GB/s" if p.bytes(DISK)
                                                            else ""))
    lines += [f"  does NOT fit: {problem}" for problem in plan.problems]
    return "\n".join(lines)


def share_on_disk(cfg: TrainConfig, shapes: Shapes, machine: Machine, run: RunFacts,
                  budgets: Budgets) -> tuple[float, int, bool] | None:
    """The share `auto` takes (the least engine.nvme.fraction that fits), the blocks it puts on disk and whether
    their loads read from disk; None where no share fits."""
    step = StepShape(cfg.micro_batch_size * cfg.seq_len, cfg.grad_accum, cfg.seq_len)
    return disk_share(shapes, step, run, budgets, machine, overrides_of(cfg, shapes.num_blocks))


def refuse(plan: Plan, cfg: TrainConfig, share=None) -> None:
    """Raise a ConfigError naming what does not fit and what would. `share()` is `share_on_disk` for the run: the
    share on disk `auto` would take is offered."""
    if plan.fits:
        return
    p, b = plan.placement, plan.budgets
    fixes = []
    if b.gpu is not None and p.bytes(GPU) > b.gpu:
        key = "engine.gpu_memory_limit_gb" if cfg.engine.gpu_memory_limit_gb else "the GPU's memory"
        fixes.append(f"it does not fit in {key}: fewer tokens per micro-batch (micro_batch_size, seq_len) shrink "
                     "the activations"
                     + (", engine.placement.window=1 leaves one slot" if p.window > 1 else ""))
    if b.host is not None and p.bytes(HOST) > b.host:
        host = []
        found = share() if share is not None and cfg.engine.nvme.fraction != "auto" else None
        if found:
            fraction, blocks, _ = found
            host.append(f"engine.nvme.fraction={fraction} (or auto) keeps the fp32 masters and AdamW moments of "
                        f"{blocks} of the {len(p.sliding_blocks)} sliding blocks on disk (engine.nvme.dir: a fast "
                        "local NVMe drive; each step reads and writes them)")
        if p.speculated:
            host.append("engine.placement.speculate=false saves the speculated parameters and lets gradients "
                        "share the activations' memory")
        if p.state_bytes > 2:
            host.append("engine.states_dtype=bf16 saves 4 bytes per parameter")
        if p.clip and p.sliding_blocks:
            host.append("max_grad_norm=null saves the gradients exact clipping holds")
        if p.activations == "cpu":
            host.append("engine.activation_offload=nvme keeps the boundary activations on disk")
        fixes.append("host memory: " + "; ".join(host or ["a machine with more RAM"]))
    if b.disk is not None and p.bytes(DISK) > b.disk:
        fixes.append("disk: a lower engine.nvme.fraction, or engine.nvme.dir on a larger drive")
    raise ConfigError("this run cannot fit: " + "; ".join(plan.problems) + ". What would: " + ". ".join(fixes))


def host_memory() -> float | None:
    """Bytes of RAM on this machine (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
