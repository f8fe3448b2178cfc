"""What a run writes, checked at launch before anything loads: the export folder, the checkpoints, the disk
tier's folders, none of them the base model's folder; and the space all of it needs once the plan is known."""

from __future__ import annotations

import os
import pathlib

from slide_io import free_bytes
from slide_scheduler import DISK, EngineConfig, Plan, activation_tier

from . import checkpoint as ckpt
from .config import TrainConfig
from .disk_tier import NVME_DIR, check_folders, nvme_dirs, tier_wants
from .errors import ConfigError, DiskFullError, size_text
from .export import MARKER as EXPORT_MARKER
from .export import base_dir, export_dtype, export_size, is_earlier_export, layout_tensors
from .models.build import BASE_MODEL_DIR
from .resume import saved_config
from .space import Size, files_size, filesystem_of

# Folders under output_dir that a run fills and replaces whole (the run's files sit in output_dir itself)
RUN_FOLDERS = ("checkpoints", "export", BASE_MODEL_DIR, NVME_DIR, "tensorboard")


def check_outputs(cfg: TrainConfig) -> None:
    """Everything the run will write, refused now rather than after training: an export folder that holds a
    user's files, a `checkpoints` or `export` path that is a file, any of it in the base model's folder, and the
    disk tier's folders where the config itself puts something there (where `auto` decides, the launch checks
    them once the plan does)."""
    run_dir = pathlib.Path(cfg.output_dir)
    for name in ("checkpoints", "export"):
        if (run_dir / name).exists() and not (run_dir / name).is_dir():
            raise ConfigError(f"output_dir: {run_dir / name} is a file, where the run writes its {name} folder: move "
                              "it away, or choose another output_dir")
    export = run_dir / "export"
    if cfg.export and export.is_dir() and not is_earlier_export(export):
        entries = sorted(p.name for p in export.iterdir())
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ConfigError(f"output_dir: {export} holds files slide-train did not write ({shown}; no {EXPORT_MARKER}),"
                          " and the run's export replaces that folder at the end: move them away, choose another "
                          "output_dir, or set export=false")
    check_base_model(cfg)
    if cfg.engine.nvme.fraction not in (0, "auto") or activation_tier(cfg.engine.activation_offload) == DISK:
        check_folders(cfg)


def _real(path: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(os.path.realpath(os.path.expanduser(path)))


def _overlap(a: pathlib.Path, b: pathlib.Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def check_base_model(cfg: TrainConfig) -> None:
    """A run never writes into its base model's folder: output_dir may not be that folder or inside it, and no
    folder the run fills (its export, checkpoints, the disk tier's folders) may be it, hold it or lie in it. A
    copied export keeps its marker, so without this a run from it into its parent would replace its weights."""
    model = base_dir(cfg.model)
    if model is None or not model.is_dir():
        return
    model = _real(model)
    run_dir = _real(cfg.output_dir)
    written = {f"output_dir ({run_dir})": run_dir} if run_dir == model or run_dir.is_relative_to(model) else {}
    written |= {f"the run's {name} folder ({run_dir / name})": run_dir / name for name in RUN_FOLDERS
                if _overlap(run_dir / name, model)}
    if cfg.engine.nvme.dir:
        written |= {f"engine.nvme.dir ({folder})": _real(folder) for folder in nvme_dirs(cfg)
                    if _overlap(_real(folder), model)}
    if written:
        raise ConfigError(f"model: {cfg.model} is the folder this run would write into: {', '.join(written)}; a run "
                          "never writes into its base model's folder, whose weights it would replace: set "
                          "output_dir (and engine.nvme.dir) outside it, or train from a copy of the model")


def check_space(cfg: TrainConfig, plan: Plan, engine_cfg: EngineConfig, model, data,
                outputs: list[pathlib.Path]) -> None:
    """Disks too small for what the run will write are refused before the weights load, not after training:
    the last checkpoint and the export in output_dir, and the NVMe tier's files (boundary activations, AdamW
    states), summed where they share a filesystem (`outputs`: an earlier run's, which --overwrite is about to
    delete: their space counts). Checkpoint and export are counted from the bytes of their files."""
    run_dir = pathlib.Path(cfg.output_dir)
    numels = plan.placement.shapes.unit_numels
    checkpoint = export = Size(0)
    if cfg.checkpoint.keep:
        state = {"step": cfg.steps, "total_steps": cfg.steps, "data": data.train.state_dict(),
                 "model": model.identity, "config": saved_config(cfg)}  # a checkpoint's trainer.json
        checkpoint = ckpt.checkpoint_size(numels, plan.placement.resident, cfg.engine.states_dtype, state, cfg.steps)
    if cfg.export:
        export = export_size(layout_tensors(ckpt.unit_layouts(model.stack())), model.hf_config,
                             export_dtype(cfg.export_dtype, model.dtype), model.tokenizer, base_dir(model.name))
    wants = [(what, folder, size) for what, folder, size in (
        ("checkpoint", run_dir, checkpoint),
        ("export", run_dir, export),
        *tier_wants(plan.placement, engine_cfg)) if size.nbytes]
    disks: dict[int, list] = {}
    for want in wants:
        disks.setdefault(filesystem_of(want[1]), []).append(want)
    for disk, group in disks.items():
        needed, folder = sum((size for *_, size in group), Size(0)).needed, group[0][1]
        free = free_bytes(folder)
        if needed > free and disk == filesystem_of(run_dir):  # only then walk what --overwrite frees
            free += files_size(outputs).nbytes
        if needed > free:
            raise _disk_full(run_dir, group, needed, free)


def _disk_full(run_dir: pathlib.Path, group: list, needed: int, free: int) -> DiskFullError:
    folders = list(dict.fromkeys(str(f) for _, f, _ in group))
    where = folders[0] if len(folders) == 1 else f"the disk of {' and '.join(folders)}"
    later = ""
    if len(group) > 1 and sum((s for w, _, s in group if w != "export"), Size(0)).needed <= free:
        later = (f", or set export=false and export the last checkpoint to another disk after the run "
                 f"(`slide-train export {run_dir} --out DIR`)")
    return DiskFullError(
        f"{where} has {size_text(free)} free, but this run's {' and '.join(w for w, *_ in group)} "
        f"need about {size_text(needed)}: free some space or set output_dir (or the folder named) on "
        f"a larger disk{later}")
