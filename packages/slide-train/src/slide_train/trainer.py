"""The trainer: a model bundle, a data pipeline and an engine, built from one `TrainConfig` and stepped.

    trainer = Trainer(load_config(overrides=["--steps=10"]))
    for _ in range(3):
        print(trainer.step())        # one optimizer step -> its metrics
    trainer.fit()                    # the rest of the run, with progress, checkpoints and export
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import sys
import time
import warnings

import torch
import yaml

from slide_io import free_bytes, prefer_path
from slide_scheduler import (
    DISK,
    HOST,
    EngineConfig,
    Machine,
    Plan,
    Ranks,
    SlidingEngine,
    host_memory_bytes,
    plot_timeline,
    write_trace,
)
from slide_scheduler import resolve_device as slide_resolve_device

from . import checkpoint as ckpt
from .batches import count_targets, prepare
from .config import TrainConfig, to_dict
from .data import build_data
from .disk_tier import (
    ACTIVATIONS_DIR,
    STATES_DIR,
    default_disk_folders,
    folders_text,
    leftovers,
    nvme_dir,
    nvme_dirs,
    on_drives,
    tier_wants,
)
from .distributed import join, rank_device, ranks_here
from .errors import ConfigError, DiskFullError, TrainingError, plural, size_text
from .export import base_dir, export_dtype, export_hf, export_size, layout_tensors, save_base_files
from .log import open_run_log, say
from .machines import resolve_machine
from .metrics import MetricsLog, gpu_peak_gib, host_rss_gib, plot_loss, read_metrics, step_figures
from .models.build import BASE_MODEL_DIR, check_fits, load_model, saved_model_source
from .plan import (
    advise,
    aux_loss_text,
    budgets_for,
    describe,
    facts_of,
    host_extras,
    host_limit_problem,
    make_plan,
    model_shapes,
    params_text,
    refuse,
)
from .preflight import check_nvme_dirs
from .progress import bar
from .resume import find_checkpoint, saved_config
from .run_folder import earlier_outputs, refuse_earlier_run
from .schedule import lr_at
from .space import Size, files_size, filesystem_of

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


def attention_flops_per_token(hf_config, seq_len: int) -> float:
    """Causal attention's FLOPs per token over forward and backward, as PaLM counts them with the causal half:
    6 x layers x (heads x head_dim) x the sequence length (rows of seq_len tokens; packed documents do less)."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 6 * hf_config.num_hidden_layers * heads * head_dim * seq_len


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


def engine_config(cfg: TrainConfig, machine: Machine | None = None) -> EngineConfig:
    """The engine's mechanism: its schedule, AdamW's hyperparameters and the folders of the disk tier, one per
    drive (what the run is and where everything lives is the plan's)."""
    folders = nvme_dirs(cfg, machine)

    def under(sub: str) -> str | list[str]:
        return str(folders[0] / sub) if len(folders) == 1 else [str(f / sub) for f in folders]

    return EngineConfig(optimizer=cfg.optimizer, pipeline=not cfg.engine.placement.get("synchronous", False),
                        nvme_dir=under(STATES_DIR), activation_dir=under(ACTIVATIONS_DIR))


def measured_machine(cfg: TrainConfig) -> Machine:
    """This machine with the disk tier's folders measured, once a plan puts something there (folders the user
    named must take files)."""
    check_nvme_dirs(cfg)
    return resolve_machine(None, disk_dir=list(map(str, nvme_dirs(cfg))))


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
    card_gib = ram_gib = None
    if running:  # (a machine file may describe a larger host than this one)
        ram_gib = host_memory_bytes() / 2**30
        if e.host_memory_limit_gb is not None and e.host_memory_limit_gb > ram_gib:
            raise ConfigError(f"engine.host_memory_limit_gb={e.host_memory_limit_gb:g} is more than the "
                              f"{ram_gib:.1f} GiB this host has")
    if not running:
        cuda = machine.has_gpu and e.device != "cpu"
        device = (e.device if e.device.startswith("cuda") else "cuda") if cuda else "cpu"
    elif (device := resolve_device(rank_device(e.device, ranks))).type == "cuda":
        cuda = True
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        card_gib = total / 2**30
        if e.gpu_memory_limit_gb is not None:
            if e.gpu_memory_limit_gb * 2**30 > total:
                raise ConfigError(f"engine.gpu_memory_limit_gb={e.gpu_memory_limit_gb} is more than the "
                                  f"{total / 2**30:.1f} GiB this GPU has")
            torch.cuda.set_per_process_memory_fraction(e.gpu_memory_limit_gb * 2**30 / total, device)
    else:
        cuda = False
    run = facts_of(cfg, str(device), ranks)
    kernels = e.kernels == "on" or (e.kernels == "auto" and cuda)
    stack = model.stack(kernels=kernels, aux_loss_mean_of=cfg.grad_accum * ranks  # (every rank's micro-batches)
                        if cfg.router_aux_loss == "per_micro_batch" else 1)
    shapes = model_shapes(model, stack, ranks)
    run = dataclasses.replace(run, host_extras=host_extras(cfg, layout_tensors(ckpt.unit_layouts(stack)),
                                                           model.dtype))

    def planned(machine: Machine):
        budgets = budgets_for(machine, cuda, e.gpu_memory_limit_gb, card_gib,
                              ranks_here=min(ranks, ranks_here()) if running else ranks,
                              host_cap_gib=e.host_memory_limit_gb, ram_gib=ram_gib)
        return make_plan(cfg, shapes, machine, run, budgets), budgets

    plan, budgets = planned(machine)
    if ranks > 1 and plan.placement.bytes(DISK):  # (`auto` keeps everything in memory for them)
        raise ConfigError("data-parallel ranks keep every state in host memory and activations on the host or the "
                          "device: set engine.nvme.fraction=0 and engine.activation_offload to host or gpu")
    if measure_disk is not None and not machine.disk.free_gib and (plan.placement.bytes(DISK) or not plan.fits):
        # (`auto` found that RAM alone does not hold the run: its disk matters now)
        machine = on_drives(measure_disk(), nvme_dirs(cfg))
        plan, budgets = planned(machine)
    if (limit := host_limit_problem(plan, cfg)) is not None:
        plan.problems.append(limit)
    if budgets.host is not None and plan.placement.bytes(HOST) > budgets.host and ranks == 1:
        every = make_plan(cfg, shapes, machine, run, budgets, nvme_fraction=1.0)
        if every.placement.bytes(HOST) > budgets.host:
            plan.problems.append(
                f"even with every sliding block's master and AdamW moments on disk (engine.nvme.fraction=1) the "
                f"host needs ~{every.placement.bytes(HOST) / 2**30:.0f} GiB: "
                + ", ".join(f"{kind} {nbytes / 2**30:.0f}" for kind, nbytes in every.placement.tiers()[HOST].items()
                            if nbytes >= 2**30))
    advise(plan, cfg, shapes, machine, run, budgets)
    if running:
        refuse(plan, cfg)
        if e.placement.get("speculate") is True and not plan.placement.speculated:
            why = ("without clipping nothing waits for the norm" if not cfg.max_grad_norm else
                   "the host's memory budget has no room for it")
            warnings.warn(f"engine.placement.speculate=true, but no block speculates: {why}", stacklevel=2)
        if e.nvme.dir and not plan.placement.bytes(DISK):  # (a folder set for the disk tier, which the plan leaves)
            warnings.warn(f"{e.nvme.dir} is only used with engine.nvme.fraction > 0 or engine.activation_offload=disk"
                          ", or where `auto` puts something on disk: this run's plan puts nothing there",
                          stacklevel=2)
        if e.nvme.fraction not in (0, "auto") and not plan.placement.on_disk:  # the share rounds to no block
            sliding = len(plan.placement.sliding_blocks)
            warnings.warn(f"engine.nvme.fraction={e.nvme.fraction} puts no master or AdamW state on disk: " + (
                f"it is none of the {plural(sliding, 'sliding block')} (a share of {1 / sliding:.3g} keeps one "
                "block's states there)" if sliding else "every block is resident, its states on the device"),
                stacklevel=2)
    return plan, engine_config(cfg, machine), stack


def build_engine(cfg: TrainConfig, model, machine: Machine, progress: bool = False,
                 before_load=None, ranks: Ranks | None = None, measure_disk=None) -> tuple[SlidingEngine, Plan]:
    """The engine of the run's placement. Loading an 8B model's weights takes minutes: with `progress`, a bar
    counts the blocks as they are read; `before_load(plan, engine_cfg)` runs first (checks that can refuse the
    run without that wait). `ranks`: this process's data-parallel group; `measure_disk`: as for `plan_run`."""
    ranks = ranks or Ranks()
    plan, engine_cfg, stack = plan_run(cfg, model, machine, ranks=ranks.size, measure_disk=measure_disk)
    for folder in default_disk_folders(cfg):  # a killed run's files (before the checks count them)
        shutil.rmtree(folder, ignore_errors=True)
    if left := leftovers(cfg, machine):  # the user's own folders: said, not removed
        folders = nvme_dirs(cfg, machine)
        warnings.warn(f"{folders_text(folders)} {'holds' if len(folders) == 1 else 'hold'} {len(left)} scratch "
                      f"folder(s) an earlier run left when it was stopped ({size_text(files_size(left).nbytes)}: "
                      f"{', '.join(p.name for p in left)}); this run leaves them alone: delete them to free the space",
                      stacklevel=2)
    if before_load is not None:
        before_load(plan, engine_cfg)
    if not plan.placement.device_is_host:  # a training run's process (not `slide-train plan`), before its first
        use_expandable_segments()           # segment
    with bar(total=stack.num_blocks, desc="loading weights", unit="block", show=None if progress else False) \
            as loading:
        return SlidingEngine(stack, plan.placement, engine_cfg, ranks, loaded=lambda index: loading.update(1)), plan


class Trainer:
    def __init__(self, cfg: TrainConfig, progress: bool = True, machine: Machine | None = None,
                 checkpoint: pathlib.Path | None = None):  # (one `resumed_config` found and verified)
        self.cfg = cfg
        self.progress = progress
        self.run_dir = pathlib.Path(cfg.output_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        refuse_earlier_run(cfg)  # before anything is loaded or written
        resolve_device(cfg.engine.device)  # before minutes of loading
        self.ranks = join(cfg.engine.device)
        self._resume_path = checkpoint or (find_checkpoint(cfg) if cfg.resume else None)
        if self._resume_path is not None:
            self.cfg = cfg = self._keep_global_batch(cfg, self._resume_path)
        torch.manual_seed(cfg.seed)
        self.model = load_model(cfg.model, cfg.seed, need_tokenizer=cfg.data.format != "tokens")
        check_fits(self.model, cfg.seq_len)
        self.data = build_data(cfg.data, self.model.tokenizer, cfg.seq_len, cfg.micro_batch_size, cfg.seed,
                               vocab_size=self.model.hf_config.vocab_size, progress=None if progress else False)
        outputs = earlier_outputs(self.run_dir) if cfg.overwrite and not cfg.resume else []
        if not cfg.checkpoint.keep:
            warnings.warn("checkpoint.keep=0: this run writes no checkpoint; a stopped run (Ctrl-C) keeps only its "
                          "metrics" + (", and the export is written at the end" if cfg.export else ""), stacklevel=2)
        # The disk tier's folders are measured once the plan puts something there (most runs fit in RAM, and need
        # no probe of a folder they never write)
        self.machine = machine if machine is not None else resolve_machine(None)
        measure = self._measure_disk if machine is None else None
        prefer_path(self.machine.disk.path, self.machine.disk.path_reason)  # (the path the probe measured faster)
        self.engine, self.memory_plan = build_engine(cfg, self.model, self.machine, progress and self.lead,
                                                     before_load=lambda plan, e: self._check_disk(plan, e, outputs),
                                                     ranks=self.ranks, measure_disk=measure)
        self.num_params = sum(u.layout.base_numel for u in self.engine.units)
        shapes = self.memory_plan.placement.shapes  # (a mixture of experts computes with its routed experts only)
        self.active_params = shapes.unit_numels[0] + sum(shapes.active(u) for u in range(1, shapes.num_blocks + 1))
        self.attention_flops = attention_flops_per_token(self.model.hf_config, cfg.seq_len)
        per_step = cfg.micro_batch_size * cfg.grad_accum * self.ranks.size
        self.total_steps = math.ceil(self.data.train.rows_in(cfg.epochs) / per_step) if cfg.epochs else cfg.steps
        self.step_index = 0
        self._disk_warned = False  # (the warning that the disk is slower than the machine file says, given once)
        self.ranks.share(0)  # (every rank has looked for an earlier run before the first clears it)
        if self.lead:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for path in outputs:  # --overwrite: cleared only now that the new run could be built
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            open_run_log(self.run_dir)  # (the command line's: what it said so far, then the rest)
        self.resumed_from = self._resume() if cfg.resume else None
        # Checkpoints after the one resumed from belong to a course this run replaces: deleted at its first save.
        self._replaces_after = ckpt.step_of(self.resumed_from) if self.resumed_from is not None else None
        # Written once the run is known to go ahead: a refused resume leaves the run's config as it was.
        if self.lead:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            if not save_base_files(self.model, self.run_dir / BASE_MODEL_DIR):  # what `slide-train export` reads
                warnings.warn(f"{self.run_dir / BASE_MODEL_DIR} was not written by slide-train: left alone; "
                              f"`slide-train export` will read {cfg.model} instead", stacklevel=2)
        self.log = MetricsLog(self.run_dir, first_step=self.step_index + 1, writes=self.lead)
        self._stop_signal: int | None = None
        self._eval: tuple[list, int] | None = None
        self._finite_at: int | None = None  # the step whose weights were last checked finite

    def _measure_disk(self) -> Machine:
        """This machine with the disk tier's folders measured (the plan puts something there), its I/O path
        taken."""
        self.machine = measured_machine(self.cfg)
        prefer_path(self.machine.disk.path, self.machine.disk.path_reason)
        return self.machine

    def _check_disk(self, plan: Plan, engine_cfg: EngineConfig, outputs: list[pathlib.Path]) -> None:
        """Disks too small for what the run will write are refused before the weights load, not after training:
        the last checkpoint and the export in output_dir, and the NVMe tier's files (boundary activations, AdamW
        states), summed where they share a filesystem (`outputs`: an earlier run's, which --overwrite is about to
        delete: their space counts). Checkpoint and export are counted from the bytes of their files."""
        cfg = self.cfg
        numels = plan.placement.shapes.unit_numels
        checkpoint = export = Size(0)
        if cfg.checkpoint.keep:
            state = {"step": cfg.steps, "total_steps": cfg.steps, "data": self.data.train.state_dict(),
                     "model": self.model.identity, "config": saved_config(cfg)}  # a checkpoint's trainer.json
            checkpoint = ckpt.checkpoint_size(numels, plan.placement.resident, cfg.engine.states_dtype, state,
                                              cfg.steps)
        if cfg.export:
            export = export_size(layout_tensors(ckpt.unit_layouts(self.model.stack())), self.model.hf_config,
                                 export_dtype(cfg.export_dtype, self.model.dtype), self.model.tokenizer,
                                 base_dir(self.model.name))
        wants = [(what, folder, size) for what, folder, size in (
            ("checkpoint", self.run_dir, checkpoint),
            ("export", self.run_dir, export),
            *tier_wants(plan.placement, engine_cfg)) if size.nbytes]
        disks: dict[int, list] = {}
        for want in wants:
            disks.setdefault(filesystem_of(want[1]), []).append(want)
        run_disk = filesystem_of(self.run_dir)
        for disk, group in disks.items():
            needed, folder = sum((size for *_, size in group), Size(0)).needed, group[0][1]
            free = free_bytes(folder)
            if needed > free and disk == run_disk:  # only then walk what --overwrite frees
                free += files_size(outputs).nbytes
            if needed > free:
                folders = list(dict.fromkeys(str(f) for _, f, _ in group))
                where = folders[0] if len(folders) == 1 else f"the disk of {' and '.join(folders)}"
                later = ""
                if len(group) > 1 and sum((s for w, _, s in group if w != "export"), Size(0)).needed <= free:
                    later = (f", or set export=false and export the last checkpoint to another disk after the run "
                             f"(`slide-train export {self.run_dir} --out DIR`)")
                raise DiskFullError(
                    f"{where} has {size_text(free)} free, but this run's {' and '.join(w for w, *_ in group)} "
                    f"need about {size_text(needed)}: free some space or set output_dir (or the folder named) on "
                    f"a larger disk{later}")

    # -- checkpoints ----------------------------------------------------------------------------------------------

    @property
    def lead(self) -> bool:
        """Whether this process writes the run's files (the first rank; every rank computes)."""
        return self.ranks.lead

    def _keep_global_batch(self, cfg: TrainConfig, path: pathlib.Path) -> TrainConfig:
        """A checkpoint of a run with another rank count resumes with the rows per step it had: grad_accum
        changes, or the resume is refused where no whole grad_accum gives them."""
        saved = json.loads((path / "trainer.json").read_text())
        ranks, was = saved.get("ranks", 1), saved.get("config", {})
        if ranks == self.ranks.size:
            return cfg
        rows = was.get("micro_batch_size", cfg.micro_batch_size) * was.get("grad_accum", cfg.grad_accum) * ranks
        per_accum = cfg.micro_batch_size * self.ranks.size
        if rows % per_accum:
            raise ConfigError(f"{path} is of a run with {ranks} rank(s) and {rows} rows per step; with "
                              f"{self.ranks.size} rank(s) of micro_batch_size {cfg.micro_batch_size} no whole "
                              f"grad_accum gives {rows} rows: resume with a rank count or micro_batch_size that "
                              f"divides {rows}")
        if rows // per_accum != cfg.grad_accum:
            say(f"resuming a run of {ranks} rank(s) on {self.ranks.size}: grad_accum {rows // per_accum} keeps its "
                f"{rows} rows per step")
        return dataclasses.replace(cfg, grad_accum=rows // per_accum)

    def _resume(self) -> pathlib.Path | None:
        path = self._resume_path
        if path is not None:
            state = ckpt.load_checkpoint(path, self.engine)
            self.step_index = state["step"]
            self.data.train.load_state_dict(state["data"])
            if state.get("total_steps") != self.total_steps:
                warnings.warn(f"resuming a run planned for {state.get('total_steps')} steps as a run of "
                              f"{self.total_steps}: the learning-rate schedule changes from here on", stacklevel=2)
            started = state.get("model")  # (checkpoints from before it was saved: nothing to compare)
            if started is not None and started != self.model.identity:  # same shapes: the load checked those
                warnings.warn(f"resuming {path} of a run that started from model {started}, now given "
                              f"{self.model.identity}: its weights come from the checkpoint, not from that model",
                              stacklevel=2)
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.is_file() and self.lead:  # drop records of steps after the checkpoint: they will be redone
            kept = [r for r in read_metrics(metrics) if r["step"] <= self.step_index]
            metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return path

    def _check_weights(self, what: str) -> None:
        """Non-finite weights (an update that overflowed) never reach a checkpoint or an export. Once per step:
        the last checkpoint (which checks each master as it writes it) and the export read the same weights."""
        if self._finite_at == self.step_index:
            return
        self.engine.synchronize()
        error = None
        for k, name in enumerate(self.engine.unit_names()):
            master = self.engine.master(k)  # (data-parallel: gathered on the first rank, which checks it)
            if error is None and master is not None:
                try:
                    self._check_master(what, name, master)
                except TrainingError as e:
                    error = e
        if self.ranks.share(float(error is not None)) and error is None:
            error = TrainingError(f"after step {self.step_index} the weights are not finite (the first rank's "
                                  f"message names them): no {what} is written")
        if error is not None:
            raise error
        self._finite_at = self.step_index

    def _check_master(self, what: str, name: str, master: torch.Tensor) -> None:
        if not bool(torch.isfinite(master).all()):
            raise TrainingError(f"after step {self.step_index} the weights of {name} are not finite: no {what} is "
                                f"written. Lower optimizer.lr (now {self.cfg.optimizer.lr}) or keep max_grad_norm "
                                "set")

    def save_checkpoint(self, required: bool = True) -> pathlib.Path | None:
        """Checkpoint the current step. A periodic one (`required=False`) that does not fit on the disk is
        skipped with a warning, and training goes on; a final or stopping one raises. None with
        checkpoint.keep=0 (no checkpoints)."""
        if not self.cfg.checkpoint.keep:
            return None
        state = {"step": self.step_index, "total_steps": self.total_steps, "data": self.data.train.state_dict(),
                 "model": self.model.identity, "config": saved_config(self.cfg), "ranks": self.ranks.size}
        checked = self._finite_at == self.step_index
        check = None if checked else lambda name, master: self._check_master("checkpoint", name, master)
        while True:
            try:
                path = ckpt.save_checkpoint(self.checkpoints, self.step_index, self.engine, state, check=check)
                self._finite_at = self.step_index
                break
            except ckpt.DiskFullError as e:
                if not required:
                    warnings.warn(f"{e}. Training goes on; the next checkpoint tries again.", stacklevel=2)
                    return None
                # The last (or stopping) checkpoint holds the run's final weights: others make room for it, once
                # those weights are known to be worth it.
                self._check_weights("checkpoint")
                spare = ckpt.spare(self.checkpoints, self._replaces_after, self.step_index)
                if not self.ranks.share(float(bool(spare))):  # (the first rank's files decide)
                    raise
                if self.lead:
                    warnings.warn(f"{e}. Deleting {spare[0].name} to make room for this one", stacklevel=2)
                    shutil.rmtree(spare[0])
        replaced = ckpt.replaced(self.checkpoints, self._replaces_after, self.step_index) if self.lead else []
        for old in replaced:
            shutil.rmtree(old)
        if replaced:
            warnings.warn(f"deleted {', '.join(p.name for p in replaced)}: checkpoints of the course this run "
                          f"replaced when it resumed from step-{self._replaces_after}", stacklevel=2)
        self._replaces_after = None
        if self.lead:
            ckpt.prune(self.checkpoints, self.cfg.checkpoint.keep)
        return path

    def _on_signal(self, signum, frame) -> None:
        self._stop_signal = signum  # finish the step in flight, then checkpoint and stop

    # -- stepping -----------------------------------------------------------------------------------------------

    def step(self) -> dict:
        cfg = self.cfg
        start = time.perf_counter()  # throughput counts the step from its data to the engine's figures
        # Every rank reads the step's rows and runs its share of the micro-batches (distributed.py)
        r = self.ranks
        batches = [self.data.train.next_micro_batch() for _ in range(cfg.grad_accum * r.size)]
        micro = [prepare(b) for b in batches]
        targets = count_targets(micro)
        tokens = sum(int((b["document_ids"] >= 0).sum()) for b in batches)
        s = cfg.schedule
        lr = lr_at(self.step_index, self.total_steps, cfg.optimizer.lr, s.warmup_steps, s.decay, s.min_lr_ratio)
        stats = self.engine.step(micro[r.rank::r.size], lr=lr, normalizer=max(targets, 1))
        if not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)):
            last = ckpt.list_checkpoints(self.checkpoints)
            kept = f"the latest, {last[-1].name}, is intact" if last else "none was written"
            raise TrainingError(
                f"step {self.step_index + 1}: loss {stats.loss}, gradient norm {stats.grad_norm}: training stops "
                f"before non-finite weights reach a checkpoint ({kept}). Lower optimizer.lr (now "
                f"{cfg.optimizer.lr}), keep max_grad_norm set, or check the data")
        self.step_index += 1
        # (not the profile, diagnostics written once, nor the metrics line: a few milliseconds after this)
        seconds = time.perf_counter() - start
        if cfg.profile and self.step_index == min(3, self.total_steps) and self.lead:
            self.write_profile(stats)
        record = {
            "step": self.step_index,
            "loss": stats.loss,
            "lr": lr,
            "grad_norm": stats.grad_norm,
            "speculation": stats.speculation,
            "tokens": tokens,
            "target_tokens": targets,
            "step_s": seconds,
            "predicted_step_s": (self.memory_plan.estimate_unclipped if stats.speculation == "held"
                                 else self.memory_plan.estimate).step_s,
            "tokens_per_s": tokens / seconds,
            # Model FLOPs only (6 per active parameter per token), as peers and papers count them: no recompute.
            "tflops": 6 * self.active_params * tokens / seconds / 1e12,
            # ... and with causal attention's own work, which grows with the sequence (DESIGN section 8)
            "tflops_attn": (6 * self.active_params + self.attention_flops) * tokens / seconds / 1e12,
            # The engine's own step, and the rest of the step (the GPU idles then): preparing the data,
            # reading the step's timeline.
            "engine_step_s": stats.seconds,
            "outside_engine_s": seconds - stats.seconds,
            "gpu_peak_gib": gpu_peak_gib(self.engine.device),
            "host_rss_gib": host_rss_gib(),
            "epoch": self.data.train.epoch,
            **{f"{k}_s": v for k, v in stats.phases.items()},
            **stats.timeline,
        }
        # A mixture of experts: the experts' least and most load (and its load-balancing loss where on)
        routing = getattr(self.engine.edges, "routing_summary", None)
        record |= (routing() if routing else None) or {}
        self.log.write(record)
        self._check_disk_rate(record)
        return record

    def _check_disk_rate(self, record: dict) -> None:
        """Warn once where the NVMe tier moved its bytes much slower than the machine file's disk figures: the
        plan's prediction, and every step, rest on them."""
        busy, read, written = (record.get(k, 0.0) for k in ("disk_busy_s", "disk_read_gb", "disk_written_gb"))
        if self._disk_warned or not busy or not (read or written):
            return
        disk = self.machine.disk
        if not (disk.read_gbps and disk.write_gbps):  # (a machine file without disk figures promises nothing)
            return
        expected = read / disk.read_gbps + written / disk.write_gbps
        if busy > 1.5 * expected and busy - expected > 0.5:
            self._disk_warned = True
            warnings.warn(
                f"step {record['step']}: the NVMe tier under {nvme_dir(self.cfg)} moved {read:.2f} GB in and "
                f"{written:.2f} GB out in {busy:.1f} s ({(read + written) / busy:.2f} GB/s); the machine file says "
                f"{disk.read_gbps:g} GB/s read and {disk.write_gbps:g} GB/s write ({expected:.1f} s), so steps run "
                f"slower than the plan's {record['predicted_step_s']:.1f} s. `slide-train probe --disk "
                f"{nvme_dir(self.cfg)}` measures this disk, or set engine.nvme.dir on a faster one", stacklevel=2)

    def write_profile(self, stats) -> None:
        """timeline.png and trace.json of one engine step (`stats`: what `engine.step` returned) in the run dir."""
        write_trace(stats.spans, self.run_dir / "trace.json")
        t = stats.timeline
        title = (f"step {self.step_index}: {stats.seconds * 1e3:.0f} ms, GPU busy {t['gpu_busy_s'] * 1e3:.0f} ms, "
                 f"exposed {t['exposed_s'] * 1e3:.0f} ms")
        try:
            plot_timeline(stats.spans, self.run_dir / "timeline.png", title)
        except ImportError as e:
            warnings.warn(f"no timeline.png: {e}", stacklevel=2)

    def evaluate(self) -> dict:
        """Validation loss (mean over label tokens) and perplexity on the held-out micro-batches."""
        if self._eval is None:  # the held-out micro-batches are fixed: prepared and counted once
            micro = [prepare(b) for b in self.data.eval]
            self._eval = micro, count_targets(micro)
        micro, targets = self._eval
        r = self.ranks  # (each rank its share of them: the engine sums the loss over ranks)
        group = self.cfg.grad_accum * r.size  # as many micro-batches at once as a training step holds
        loss = sum(self.engine.evaluate(micro[i : i + group][r.rank::r.size], normalizer=max(targets, 1))
                   for i in range(0, len(micro), group))
        record = {"step": self.step_index, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
        self.log.write(record)
        return record

    # -- the whole run --------------------------------------------------------------------------------------------

    def plan(self) -> str:
        cfg, e = self.cfg, self.engine
        ranks = self.ranks.size
        tokens = cfg.micro_batch_size * cfg.grad_accum * cfg.seq_len * ranks
        return (f"model: {self.model.name} ({self.model.hf_config.model_type}, {params_text(self.num_params)} "
                f"params, {e.num_blocks} blocks){aux_loss_text(cfg, self.model.hf_config)}\n{self.data.summary()}\n"
                f"steps: {self.total_steps} x {cfg.grad_accum} micro-batches of {cfg.micro_batch_size} x "
                f"{cfg.seq_len}{f' on each of {ranks} ranks' if ranks > 1 else ''} = {tokens} tokens per step"
                f"{' (host memory below: one rank)' if ranks > 1 else ''}\n"
                f"engine: {e.device} {str(e.dtype).removeprefix('torch.')} compute, "
                f"{'pipelined' if e.config.pipeline else 'synchronous'}\n"
                f"{describe(self.memory_plan, on_drives(self.machine, nvme_dirs(cfg, self.machine)), cfg)}\n"
                + "".join(f"NVMe tier: {s.directory}, {s.path} ({s.path_reason}), page cache "
                          f"{'bypassed' if s.direct else 'used'}\n" for s in e.disk_stores())
                + f"run dir: {self.run_dir}")

    def fit(self) -> dict | None:
        say(self.plan())
        if self.resumed_from is not None:
            say(f"resumed from {self.resumed_from} at step {self.step_index}")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()

    def _loop(self) -> dict | None:
        from tqdm.auto import tqdm

        cfg = self.cfg
        last = None
        # A bar on a terminal; elsewhere (a log file, CI) a plain line every `line_every` steps, first and last too.
        bar_shown = self.progress and sys.stderr.isatty() and self.lead
        steps = tqdm(total=self.total_steps, initial=self.step_index, disable=not bar_shown, unit="step",
                     dynamic_ncols=True)
        line_every = max(1, self.total_steps // 20)
        start = time.perf_counter()
        while self.step_index < self.total_steps:
            last = self.step()
            steps.update(1)
            figures = step_figures(last, on_gpu=self.engine.device.type == "cuda")
            steps.set_postfix_str(figures)
            i = self.step_index
            if i % line_every == 0 or i == self.total_steps or i == 1:  # log.txt keeps each, bar or --no-progress
                say(f"step {i}/{self.total_steps}: {figures}", screen=self.progress and not bar_shown)
            if cfg.eval_every and self.step_index % cfg.eval_every == 0:
                ev = self.evaluate()
                say(f"step {self.step_index}: validation loss {ev['eval_loss']:.4f} (ppl {ev['eval_ppl']:.2f})")
            # (a signal reaches the ranks at different times: all stop after the step any of them was told to)
            every, stop = cfg.checkpoint.every, self.ranks.any(self._stop_signal is not None)
            if stop or (every and self.step_index % every == 0 and self.step_index < self.total_steps):
                path = self.save_checkpoint(required=stop)  # a periodic one may be skipped; the last one below
                if stop:
                    steps.close()
                    self.log.close()
                    self._stop_signal = self._stop_signal or signal.SIGTERM
                    name = signal.Signals(self._stop_signal).name
                    saved = "no checkpoint (checkpoint.keep=0)" if not cfg.checkpoint.keep else \
                        f"checkpoint {path} (continue with --resume=auto)"
                    say(f"{name}: stopped after step {self.step_index}; {saved}")
                    raise SystemExit(128 + self._stop_signal)
        steps.close()
        self.save_checkpoint()
        if self.data.eval is not None and (not cfg.eval_every or self.step_index % cfg.eval_every):
            self.evaluate()
        self.log.close()
        if self.lead:
            plot_loss(self.log.path, self.run_dir / "loss.png")
        say(f"done: {plural(self.step_index, 'step')} in {time.perf_counter() - start:.1f}s; metrics in "
            f"{self.log.path}")
        if cfg.export:
            out = self.export()
            say(f"exported to {out}")
        return last

    def close(self) -> None:
        """Finish pending updates and stop the engine's worker threads (which removes the state files it kept
        on disk); the NVMe tier's folders are removed once empty, the user's own engine.nvme.dir kept."""
        self.engine.close()
        if self.memory_plan.placement.bytes(DISK):
            folders = nvme_dirs(self.cfg, self.machine)
            for empty in [*(f / sub for f in folders for sub in (STATES_DIR, ACTIVATIONS_DIR)),
                          *map(pathlib.Path, default_disk_folders(self.cfg))]:
                with contextlib.suppress(OSError):
                    os.rmdir(empty)

    def export(self, directory: str | pathlib.Path | None = None) -> pathlib.Path:
        """The current weights as an HF model directory (default RUN_DIR/export), with the base model's generation
        config, tokenizer and chat template files (from the run's copy of them)."""
        dtype = export_dtype(self.cfg.export_dtype, self.model.dtype)
        directory = pathlib.Path(directory or self.run_dir / "export")
        self._check_weights("export")
        if not self.lead:  # its shards gathered for the first rank's files
            self.engine.named_masters()
            return directory
        # On a disk too small for the export the checkpoints stay as they are: say how to finish it elsewhere.
        latest = ckpt.list_checkpoints(self.checkpoints)
        later = f"`slide-train export {self.run_dir} --out DIR`"
        if latest and ckpt.step_of(latest[-1]) == self.step_index:
            hint = (f"checkpoint {latest[-1]} holds these weights and is intact: finish the export on a disk with "
                    f"room with {later}")
        elif self.cfg.checkpoint.keep:
            hint = f"free some space, export elsewhere, or save a checkpoint and export it with {later}"
        else:
            hint = ("free some space or export elsewhere: this run keeps no checkpoint (checkpoint.keep=0) for "
                    f"{later} to read")
        source = base_dir(saved_model_source(self.run_dir, self.model.name))
        return export_hf(directory, self.model.hf_config, self.engine.named_masters(), self.model.tokenizer, dtype,
                         source=source, hint=hint)
