"""Launch: from a config to a placement, an engine config and a stack (`plan_run`), and to the engine that
executes them (`build_engine`). The device, the budgets, the run's facts, the expert overrides and the disk tier's
folders are read here, each once; what a run writes is checked before anything loads (outputs.py)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import warnings

import torch

from slide_io import prefer_path
from slide_scheduler import (
    DISK,
    HOST,
    SEQUENCE_TILES,
    Budgets,
    EngineConfig,
    Machine,
    Overrides,
    Plan,
    Ranks,
    RunFacts,
    Shapes,
    SlidingEngine,
    StepShape,
    compute_bound_step,
    host_memory_bytes,
    place,
    run_facts,
    shapes_of,
    suggest,
)
from slide_scheduler import resolve_device as slide_resolve_device

from . import checkpoint as ckpt
from .budgets import budgets_for, host_limit_problem
from .config import TrainConfig, expert_fields
from .data import build_data
from .disk_tier import (
    ACTIVATIONS_DIR,
    STATES_DIR,
    check_folders,
    default_disk_folders,
    existing_parent,
    folders_text,
    leftovers,
    nvme_dirs,
    on_drives,
)
from .distributed import join, rank_device, ranks_here
from .errors import ConfigError, plural, size_text
from .export import export_dtype, export_held_bytes, layout_tensors
from .machines import resolve_machine
from .models import backends
from .models.build import check_fits, load_model
from .outputs import check_outputs, check_space
from .plan import MORE_TOKENS, refusal
from .progress import bar
from .resume import find_checkpoint, keep_global_batch
from .run_folder import earlier_outputs, refuse_earlier_run
from .space import files_size

ALLOC_CONF = "expandable_segments:True"
ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the user's settings


def use_expandable_segments() -> bool:
    """Let the CUDA caching allocator grow segments in place, unless the user configured the allocator
    (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF or PYTORCH_ALLOC_CONF). With fixed segments, clipped B3
    under a 24 GiB cap made new segments and an allocator retry in steady steps; with expandable ones it had no
    retry and ran 1% faster (H200, benchmarks/results/engine.md). It applies to segments made from then on.
    Returns whether it was set."""
    if any(k in os.environ for k in ALLOC_ENV):
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
    if setter is None:  # a torch without either entry point: the default allocator, as before
        return False
    setter(ALLOC_CONF)
    return True


def resolve_device(name: str) -> torch.device:
    """`engine.device` as a device, or a ConfigError saying why it cannot be used here."""
    try:
        device = torch.device(slide_resolve_device(name))
    except RuntimeError as e:
        raise ConfigError(f"engine.device={name}, but no CUDA device is available; use engine.device=cpu") from e
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"engine.device={name}, but this machine has {torch.cuda.device_count()} CUDA device(s): "
                          f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


# -- the config's words as the planner's ----------------------------------------------------------------------------


def attention_candidates(cfg: TrainConfig, stack, cuda: bool, compute_bytes: int,
                         tile: int = 0) -> tuple[tuple[str, ...], ...]:
    """Each block's attention backends that compute its layer exactly on the run's device (rows of seq_len,
    packed documents where data.pack is on; `tile`: by query tiles of that many positions), in the backends'
    order: the plan chooses among them."""
    if not hasattr(stack, "attention_needs"):
        return ()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if compute_bytes == 2 else torch.float32
    needs = stack.attention_needs(cfg.seq_len, documents=cfg.data.pack, tile=tile)
    per_kind = {kind: backends.candidates(n, device, dtype) for kind, n in needs.items()}
    return tuple(per_kind[kind] for kind in stack.layer_types)


def model_shapes(model, stack, ranks: int = 1, attention: tuple[tuple[str, ...], ...] = (),
                 tiled: tuple[tuple[str, ...], ...] = ()) -> Shapes:
    hf = model.hf_config
    intermediate = getattr(hf, "moe_intermediate_size", None) or getattr(hf, "intermediate_size", 0) or 0
    # A mixture of experts: each token's MLP activations and FLOPs are those of the experts it is routed to
    routed = getattr(hf, "num_experts_per_tok", None) or 1
    intermediate *= routed
    # (a mixture's active parameters per block are the adapter's word: HFStack.active_numel)
    shapes = shapes_of(stack, hidden=hf.hidden_size, intermediate=intermediate, vocab=hf.vocab_size, ranks=ranks)
    # Attention's width (query heads x head dim) and each layer's window, for its FLOPs
    heads = getattr(hf, "num_attention_heads", 0) or 0
    head_dim = getattr(hf, "head_dim", None) or (hf.hidden_size // heads if heads else 0)
    windows = getattr(stack, "windows", None)
    kinds = getattr(stack, "layer_types", None)
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    return dataclasses.replace(
        shapes, attention_width=heads * head_dim, kv_width=kv_heads * head_dim, head_dim=head_dim,
        attention_backends=attention, tile_backends=tiled,
        windows=tuple(int(windows.get(kind) or 0) for kind in kinds) if windows and kinds else ())


def unit_of(name: str) -> int:
    """'edges' -> 0, 'block.<i>' -> 1 + i."""
    return 0 if name == "edges" else 1 + int(name.removeprefix("block."))


def overrides_of(cfg: TrainConfig, num_blocks: int) -> Overrides:
    """The config's expert keys as slide-scheduler's `Overrides`: engine.placement's, each to its field of that
    name (resident's unit names as units), and engine.nvme.fraction's share."""
    o = {key: value for key, value in cfg.engine.placement.items() if key in expert_fields()}
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
    return Overrides(**{**o, "resident": resident, "nvme_fraction": None if fraction == "auto" else fraction})


def facts_of(cfg: TrainConfig, device: str, ranks: int = 1) -> RunFacts:
    """The run's facts from its config, for `device` (a name this machine need not have: `plan` prices another)."""
    e = cfg.engine
    return run_facts(device=device, compute_dtype=e.compute_dtype, states_dtype=e.states_dtype,
                     max_grad_norm=cfg.max_grad_norm, activation_offload=e.activation_offload, ranks=ranks,
                     here=False)


def host_extras(cfg: TrainConfig, tensors: list[tuple[str, tuple[int, ...]]], model_dtype) -> tuple:
    """What the run holds in host memory besides the engine's buffers and the runtime, by name, for the plan to
    count with them: at the end, while the engine still holds everything, the export's copies of one shard in its
    dtype (`tensors`: what it writes, (HF name, shape) in order). Loading the weights holds one tensor as read,
    but before the engine allocates its gradients, moments and activations, so never at the peak."""
    held = export_held_bytes(tensors, export_dtype(cfg.export_dtype, model_dtype)) if cfg.export else 0
    return (("export shard", held),) if held else ()


def step_of(cfg: TrainConfig) -> StepShape:
    return StepShape(cfg.micro_batch_size * cfg.seq_len, cfg.grad_accum, cfg.seq_len)


def make_plan(cfg: TrainConfig, shapes: Shapes, machine: Machine, run: RunFacts, budgets: Budgets,
              nvme_fraction: float | None = None, disk_loads: bool | None = None) -> Plan:
    """The run's plan (slide-scheduler's planner: with engine.nvme.fraction `auto`, the least share on disk that
    fits host memory); `nvme_fraction` and `disk_loads` replace the config's choice where given."""
    step = step_of(cfg)
    overrides = overrides_of(cfg, shapes.num_blocks)
    if nvme_fraction is not None:
        overrides = dataclasses.replace(overrides, nvme_fraction=nvme_fraction)
    return place(shapes, step, run, budgets, machine, dataclasses.replace(overrides, disk_loads=disk_loads))


def advise(plan: Plan, cfg: TrainConfig, shapes: Shapes, machine: Machine, run: RunFacts, budgets: Budgets) -> Plan:
    """What the plan advises, from the planner: where it does not fit, the settings near it that do; where it
    fits but another lane than the compute binds it, the grad_accum at which the compute would."""
    step, overrides = step_of(cfg), overrides_of(cfg, shapes.num_blocks)
    if not plan.fits:
        plan.suggestions = suggest(shapes, step, run, budgets, machine, overrides)
    elif plan.estimate.bottleneck not in ("gpu", "compute"):
        plan.compute_bound = compute_bound_step(shapes, step, run, budgets, machine, overrides, most=MORE_TOKENS)
    return plan


def refuse(plan: Plan, cfg: TrainConfig) -> None:
    """Raise a ConfigError naming what does not fit and the settings near it that would (`advise` found them)."""
    if not plan.fits:
        raise ConfigError(refusal(plan, cfg))


# -- the disk tier's folders and this machine -----------------------------------------------------------------------


def engine_config(cfg: TrainConfig, machine: Machine | None = None) -> EngineConfig:
    """The engine's mechanism: its schedule, AdamW's hyperparameters and the disk tier's folders, one per drive,
    each with a folder for the states and one for the boundary activations (what the run is and where
    everything lives is the plan's)."""
    folders = nvme_dirs(cfg, machine)

    def under(sub: str) -> str | list[str]:
        return str(folders[0] / sub) if len(folders) == 1 else [str(f / sub) for f in folders]

    return EngineConfig(optimizer=cfg.optimizer, pipeline=not cfg.engine.placement.get("synchronous", False),
                        nvme_dir=under(STATES_DIR), activation_dir=under(ACTIVATIONS_DIR))


def measured_machine(cfg: TrainConfig, machine: Machine | None = None) -> Machine:
    """This machine with the disk tier's folders measured, once a plan puts something there. The folders are
    checked first; the run's own folder under output_dir, made only once the run starts, is measured where it
    will be (its nearest folder that exists: the probe leaves nothing behind)."""
    folders = check_folders(cfg, machine)
    return resolve_machine(None, disk_dir=[str(existing_parent(f)) for f in folders])


# -- the plan of a run ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Device:
    """Where a run computes, and what its budgets take from this machine (None: not running here)."""

    name: str
    cuda: bool
    card_gib: float | None = None  # the card's memory, running on CUDA
    ram_gib: float | None = None  # this host's memory, running


def run_device(cfg: TrainConfig, machine: Machine, running: bool, ranks: int) -> Device:
    """Running, this process's device (`engine.device`), capped to engine.gpu_memory_limit_gb on CUDA, and this
    host's memory; planning only (`slide-train plan`), the machine file's GPU, wherever this runs."""
    e = cfg.engine
    if not running:
        cuda = machine.has_gpu and e.device != "cpu"
        return Device((e.device if e.device.startswith("cuda") else "cuda") if cuda else "cpu", cuda)
    ram_gib = host_memory_bytes() / 2**30  # (a machine file may describe a larger host than this one)
    if e.host_memory_limit_gb is not None and e.host_memory_limit_gb > ram_gib:
        raise ConfigError(f"engine.host_memory_limit_gb={e.host_memory_limit_gb:g} is more than the "
                          f"{ram_gib:.1f} GiB this host has")
    device = resolve_device(rank_device(e.device, ranks))
    if device.type != "cuda":
        return Device(str(device), False, ram_gib=ram_gib)
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    if e.gpu_memory_limit_gb is not None:
        if e.gpu_memory_limit_gb * 2**30 > total:
            raise ConfigError(f"engine.gpu_memory_limit_gb={e.gpu_memory_limit_gb} is more than the "
                              f"{total / 2**30:.1f} GiB this GPU has")
        torch.cuda.set_per_process_memory_fraction(e.gpu_memory_limit_gb * 2**30 / total, device)
    return Device(str(device), True, total / 2**30, ram_gib)


def host_problems(plan: Plan, cfg: TrainConfig, shapes: Shapes, machine: Machine, run: RunFacts,
                  ranks: int) -> None:
    """Where host memory does not hold the plan: the cap that set its budget, and what it would need even with
    every sliding block's states on disk, added to the plan's problems."""
    budgets = plan.budgets
    if (limit := host_limit_problem(plan, cfg)) is not None:
        plan.problems.append(limit)
    if budgets.host is None or plan.placement.bytes(HOST) <= budgets.host or ranks > 1:
        return
    every = make_plan(cfg, shapes, machine, run, budgets, nvme_fraction=1.0)
    if every.placement.bytes(HOST) > budgets.host:
        big = [f"{kind} {nbytes / 2**30:.0f}" for kind, nbytes in every.placement.tiers()[HOST].items()
               if nbytes >= 2**30]
        plan.problems.append(
            f"even with every sliding block's master and AdamW moments on disk (engine.nvme.fraction=1) the "
            f"host needs ~{every.placement.bytes(HOST) / 2**30:.0f} GiB" + (": " + ", ".join(big) if big else ""))


def warn_unused(plan: Plan, cfg: TrainConfig) -> None:
    """Keys a running plan leaves without effect, each said once: speculation that no block does, a disk folder
    nothing goes to, a share of states on disk that rounds to no block."""
    e = cfg.engine
    if e.placement.get("speculate") is True and not plan.placement.speculated:
        why = ("without clipping nothing waits for the norm" if not cfg.max_grad_norm else
               "the host's memory budget has no room for it")
        warnings.warn(f"engine.placement.speculate=true, but no block speculates: {why}", stacklevel=3)
    if e.nvme.dir and not plan.placement.bytes(DISK):  # (a folder set for the disk tier, which the plan leaves)
        warnings.warn(f"{e.nvme.dir} is only used with engine.nvme.fraction > 0 or engine.activation_offload=disk"
                      ", or where `auto` puts something on disk: this run's plan puts nothing there", stacklevel=3)
    if e.nvme.fraction not in (0, "auto") and not plan.placement.on_disk:  # the share rounds to no block
        sliding = len(plan.placement.sliding_blocks)
        warnings.warn(f"engine.nvme.fraction={e.nvme.fraction} puts no master or AdamW state on disk: " + (
            f"it is none of the {plural(sliding, 'sliding block')} (a share of {1 / sliding:.3g} keeps one "
            "block's states there)" if sliding else "every block is resident, its states on the device"),
            stacklevel=3)


def plan_run(cfg: TrainConfig, model, machine: Machine, running: bool = True, ranks: int = 1,
             measure_disk=None) -> tuple[Plan, EngineConfig, object]:
    """The plan of a run on `machine`, the engine config it implies and the stack to build it on.

    Running, the device is this process's (`engine.device`): on CUDA the budget is the smallest of the card, the
    machine file's GPU and `engine.gpu_memory_limit_gb` (the process is capped to that), and a run that does not
    fit is refused, naming the settings near it that would. Not running (`slide-train plan`), the machine file's
    GPU is planned for, wherever this runs. With data-parallel `ranks`, the plan is one rank's, and the ranks on
    this host share its memory. `measure_disk()`, where given, returns the machine with the disk tier's folder
    measured: a plan that puts something on a disk not measured yet is made again with it. The tier's folders
    (engine.nvme.dir, or the machine file's drives') are planned at the rates of the drives they are on.
    """
    e = cfg.engine
    machine = on_drives(machine, nvme_dirs(cfg, machine))
    device = run_device(cfg, machine, running, ranks)
    kernels = e.kernels == "on" or (e.kernels == "auto" and device.cuda)
    stack = model.stack(kernels=kernels, aux_loss_mean_of=cfg.grad_accum * ranks  # (every rank's micro-batches)
                        if cfg.router_aux_loss == "per_micro_batch" else 1)
    run = dataclasses.replace(facts_of(cfg, device.name, ranks), host_extras=host_extras(
        cfg, layout_tensors(ckpt.unit_layouts(stack)), model.dtype))
    # (the planner's tiles are multiples of its smallest; an expert's tile as given)
    tile = cfg.engine.placement.get("sequence_tile") or min(SEQUENCE_TILES)
    shapes = model_shapes(model, stack, ranks, attention_candidates(cfg, stack, run.cuda, run.compute_bytes),
                          attention_candidates(cfg, stack, run.cuda, run.compute_bytes, tile))

    def planned(machine: Machine) -> Plan:
        budgets = budgets_for(machine, device.cuda, e.gpu_memory_limit_gb, device.card_gib,
                              ranks_here=min(ranks, ranks_here()) if running else ranks,
                              host_cap_gib=e.host_memory_limit_gb, ram_gib=device.ram_gib)
        return make_plan(cfg, shapes, machine, run, budgets)

    plan = planned(machine)
    if ranks > 1 and plan.placement.bytes(DISK):  # (`auto` keeps everything in memory for them)
        raise ConfigError("data-parallel ranks keep every state in host memory and activations on the host or the "
                          "device: set engine.nvme.fraction=0 and engine.activation_offload to host or gpu")
    if measure_disk is not None and not machine.disk.free_gib and (plan.placement.bytes(DISK) or not plan.fits):
        # (`auto` found that RAM alone does not hold the run: its disk matters now)
        machine = on_drives(measure_disk(), nvme_dirs(cfg))
        plan = planned(machine)
    host_problems(plan, cfg, shapes, machine, run, ranks)
    advise(plan, cfg, shapes, machine, run, plan.budgets)
    if plan.attention:  # the blocks run the backend the plan chose for their layer type
        stack.attention = dict(zip(stack.layer_types, plan.attention))
    if running:
        refuse(plan, cfg)
        warn_unused(plan, cfg)
    return plan, engine_config(cfg, machine), stack


# -- the engine -------------------------------------------------------------------------------------------------------


def clear_scratch(cfg: TrainConfig, machine: Machine) -> None:
    """The run's own scratch folder under output_dir is cleared (a killed run's files, before the checks count
    them); what a stopped run left in the user's own folders is said, and left alone."""
    for folder in default_disk_folders(cfg):
        shutil.rmtree(folder, ignore_errors=True)
    if left := leftovers(cfg, machine):
        folders = nvme_dirs(cfg, machine)
        warnings.warn(f"{folders_text(folders)} {'holds' if len(folders) == 1 else 'hold'} {len(left)} scratch "
                      f"folder(s) an earlier run left when it was stopped ({size_text(files_size(left).nbytes)}: "
                      f"{', '.join(p.name for p in left)}); this run leaves them alone: delete them to free the space",
                      stacklevel=3)


def build_engine(cfg: TrainConfig, model, machine: Machine, progress: bool = False,
                 before_load=None, ranks: Ranks | None = None, measure_disk=None) -> tuple[SlidingEngine, Plan]:
    """The engine of the run's placement. Loading an 8B model's weights takes minutes: with `progress`, a bar
    counts the blocks as they are read; `before_load(plan, engine_cfg)` runs first (checks that can refuse the
    run without that wait). `ranks`: this process's data-parallel group; `measure_disk`: as for `plan_run`."""
    ranks = ranks or Ranks()
    plan, engine_cfg, stack = plan_run(cfg, model, machine, ranks=ranks.size, measure_disk=measure_disk)
    if plan.placement.bytes(DISK):  # (the folders `auto` chose are checked where the plan chose them)
        check_folders(cfg, machine)
    clear_scratch(cfg, machine)
    if before_load is not None:
        before_load(plan, engine_cfg)
    if not plan.placement.device_is_host:  # a training run's process (not `slide-train plan`), before its first
        use_expandable_segments()           # segment
    with bar(total=stack.num_blocks, desc="loading weights", unit="block", show=None if progress else False) \
            as loading:
        return SlidingEngine(stack, plan.placement, engine_cfg, ranks, loaded=lambda index: loading.update(1)), plan


class RunMachine:
    """The machine a run plans for: a machine file given is taken as it is; else this machine, resolved without
    its disk (most runs fit in RAM and need no probe of a folder they never write) and measured once the plan
    puts something there (`measure`). Its I/O path is the one its figures are of."""

    def __init__(self, cfg: TrainConfig, given: Machine | None):
        self.cfg = cfg
        self.machine = given if given is not None else resolve_machine(None)
        self.measure = self._measure if given is None else None
        prefer_path(self.machine.disk.path, self.machine.disk.path_reason)

    def _measure(self) -> Machine:
        self.machine = measured_machine(self.cfg)
        prefer_path(self.machine.disk.path, self.machine.disk.path_reason)
        return self.machine


@dataclasses.dataclass
class Launched:
    """A run ready for its first step: its config (as a resume from another rank count changed it), its ranks,
    model, data, machine, engine and plan; the checkpoint it resumes from, and an earlier run's files that
    --overwrite deletes once the run is built."""

    cfg: TrainConfig
    ranks: Ranks
    model: object
    data: object
    machine: Machine
    engine: SlidingEngine
    plan: Plan
    resume_path: pathlib.Path | None
    outputs: list[pathlib.Path]


def launch(cfg: TrainConfig, progress: bool = True, machine: Machine | None = None,
           checkpoint: pathlib.Path | None = None) -> Launched:
    """Everything a run is refused for, before what it costs: an earlier run in output_dir, what it will write,
    the device; then the model's config and the data, the plan (refused where it does not fit) and the disks'
    space; then the weights load into the engine. Nothing is written to output_dir here."""
    refuse_earlier_run(cfg)
    check_outputs(cfg)
    resolve_device(cfg.engine.device)  # before minutes of loading
    ranks = join(cfg.engine.device)
    resume_path = checkpoint or (find_checkpoint(cfg) if cfg.resume else None)
    if resume_path is not None:
        cfg = keep_global_batch(cfg, resume_path, ranks)
    torch.manual_seed(cfg.seed)
    model = load_model(cfg.model, cfg.seed, need_tokenizer=cfg.data.format != "tokens")
    check_fits(model, cfg.seq_len)
    data = build_data(cfg.data, model.tokenizer, cfg.seq_len, cfg.micro_batch_size, cfg.seed,
                      vocab_size=model.hf_config.vocab_size, progress=None if progress else False)
    outputs = earlier_outputs(pathlib.Path(cfg.output_dir)) if cfg.overwrite and not cfg.resume else []
    if not cfg.checkpoint.keep:
        warnings.warn("checkpoint.keep=0: this run writes no checkpoint; a stopped run (Ctrl-C) keeps only its "
                      "metrics" + (", and the export is written at the end" if cfg.export else ""), stacklevel=3)
    here = RunMachine(cfg, machine)
    engine, plan = build_engine(cfg, model, here.machine, progress and ranks.lead,
                                before_load=lambda plan, e: check_space(cfg, plan, e, model, data, outputs),
                                ranks=ranks, measure_disk=here.measure)
    return Launched(cfg, ranks, model, data, here.machine, engine, plan, resume_path, outputs)
