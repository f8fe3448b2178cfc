"""Export: an HF model directory that `transformers.AutoModelForCausalLM.from_pretrained` loads, of a trainer's
weights or of a run's checkpoint: config.json and the safetensors shards, with the base model directory's
generation config, tokenizer files and chat template copied byte for byte (a built-in preset's tokenizer is
written by its `save_pretrained`)."""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from slide_scheduler import DTYPES  # the one name -> dtype table

from .checkpoint import find_resumable, list_checkpoints, read_masters, unit_layouts, verify
from .config import load_config
from .errors import CheckpointError, DiskFullError, ExportError, size_text
from .models.adapter import block_hf_name, edge_hf_name
from .models.build import load_model, save_model_files, saved_model_source
from .models.files import CHAT_TEMPLATE_DIR, copy_model_files, model_files
from .models.presets import PRESETS
from .progress import bar
from .space import Size, files_size, safetensors_bytes, write_within

SHARD_BYTES = 5 * 2**30
MARKER = ".slide-export"  # marks a directory this module wrote: only such a directory is ever replaced
MARKER_TEXT = "written by slide-train export; a later export may replace this directory\n"
METADATA = {"format": "pt"}


def hf_tensors(masters: dict[str, dict[str, torch.Tensor]]):
    """Yield (HF name, fp32 master view) in checkpoint order: embedding, layers, final norm, lm head."""
    edges = masters["edges"]
    for name, t in edges.items():
        if name.startswith("embed_tokens."):
            yield edge_hf_name(name), t
    blocks = sorted((k for k in masters if k.startswith("block.")), key=lambda k: int(k.split(".")[1]))
    for key in blocks:
        index = int(key.split(".")[1])
        for name, t in masters[key].items():
            yield block_hf_name(index, name), t
    for name, t in edges.items():
        if not name.startswith("embed_tokens."):
            yield edge_hf_name(name), t


def base_dir(model: str) -> pathlib.Path | None:
    """The model directory whose files an export carries over; None for a built-in preset (it has none)."""
    return None if model in PRESETS else pathlib.Path(model).expanduser()


def save_base_files(bundle, directory: pathlib.Path) -> bool:
    """`save_model_files` (the base model's config and tokenizer, for `slide-train export` to read later), with
    the base directory's generation config, tokenizer and chat template files as byte copies: a tokenizer's
    `save_pretrained` rewrites them, and generation_config.json is not among them."""
    if not save_model_files(bundle, directory):
        return False
    source = base_dir(bundle.name)
    if source is not None and directory.is_dir():
        copy_model_files(source, directory, bundle.tokenizer)
    return True


def layout_tensors(layouts: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor an export of units with these `FlatLayout`s writes, in its order."""
    masters = {name: layout.views(torch.empty(layout.numel, device="meta")) for name, layout in layouts.items()}
    return [(name, tuple(t.shape)) for name, t in hf_tensors(masters)]


def _shards(tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> list[list[int]]:
    """Indices into `tensors`, shard by shard: a shard takes tensors in order until the next would pass
    SHARD_BYTES (one larger than that alone gets a shard of its own)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape) in enumerate(tensors):
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def export_held_bytes(tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> int:
    """The most host memory an export of `tensors` ((HF name, shape), in order) holds at once beside the masters
    it reads: one shard's copies in `dtype` (fp32 masters are written as they are, no copy)."""
    if dtype == torch.float32:
        return 0
    return max((sum(math.prod(tensors[i][1]) for i in shard) * dtype.itemsize for shard in _shards(tensors, dtype)),
               default=0)


def _shard_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}.safetensors"


def _index_text(tensors: list[tuple[str, tuple]], shards: list[list[int]], dtype: torch.dtype) -> str:
    weight_map = {tensors[i][0]: _shard_name(k, len(shards)) for k, shard in enumerate(shards) for i in shard}
    total = sum(math.prod(shape) for _, shape in tensors) * dtype.itemsize
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)


def _export_config(hf_config, dtype: torch.dtype):
    cfg = copy.deepcopy(hf_config)
    # transformers 5 calls it `dtype`, 4.x `torch_dtype`
    setattr(cfg, "dtype" if "dtype" in cfg.to_dict() else "torch_dtype", dtype)
    cfg.architectures = [type_name(cfg)]
    return cfg


def export_size(tensors: list[tuple[str, tuple[int, ...]]], hf_config, dtype: torch.dtype, tokenizer=None,
                source: pathlib.Path | None = None) -> Size:
    """What an export of `tensors` ((HF name, shape), in order) takes, from the bytes of its files: each shard
    with its safetensors header, the index of a sharded one, config.json, the files carried over from `source`
    (or, without one, those the tokenizer's `save_pretrained` writes) and the marker."""
    shards = _shards(tensors, dtype)
    size = Size(sum(safetensors_bytes([(tensors[i][0], dtype, tensors[i][1]) for i in shard], METADATA)
                    for shard in shards), len(shards))
    if len(shards) > 1:
        size += Size(len(_index_text(tensors, shards, dtype).encode()), 1)
    size += Size(len(_export_config(hf_config, dtype).to_json_string(use_diff=True).encode()), 1)
    if source is not None:
        carried = model_files(source, tokenizer)
        size += files_size(source / name for name in carried)
        size += Size(0, int(any(name.startswith(f"{CHAT_TEMPLATE_DIR}/") for name in carried)))  # its folder
    elif tokenizer is not None:  # a few kilobytes, written aside to count them
        with tempfile.TemporaryDirectory() as scratch:
            tokenizer.save_pretrained(scratch)
            size += files_size(pathlib.Path(scratch).iterdir())
    return size + Size(len(MARKER_TEXT.encode()), 2)  # the marker and the folder


def export_bytes(tensors: list[tuple[str, tuple[int, ...]]], hf_config, dtype: torch.dtype, tokenizer=None,
                 source: pathlib.Path | None = None) -> int:
    """The free bytes an export asks for: `export_size` and its margin."""
    return export_size(tensors, hf_config, dtype, tokenizer, source).needed


def export_hf(directory: str | os.PathLike, hf_config, masters, tokenizer, dtype: torch.dtype,
              source: str | os.PathLike | None = None, hint: str | None = None) -> pathlib.Path:
    """Write the model in HF layout, one shard at a time (at most SHARD_BYTES of tensors in memory), with the
    files `model_files` finds in the base model directory `source` (None: a preset, whose `tokenizer` is saved).
    A disk too small for it raises DiskFullError before anything is written (or after removing the partial
    files); `hint` says there what to do instead."""
    out = pathlib.Path(directory).resolve()
    _check_replaceable(out)
    tmp = out.with_name(out.name + ".partial")
    source = pathlib.Path(source) if source is not None else None
    tensors = list(hf_tensors(masters))  # (name, view): walked once for the size, once more to write
    shapes = [(name, tuple(t.shape)) for name, t in tensors]
    needed = export_bytes(shapes, hf_config, dtype, tokenizer, source)
    return write_within(out.parent, needed, tmp,
                        lambda: _write(out, tmp, hf_config, tensors, _shards(shapes, dtype), tokenizer, source,
                                       dtype),
                        lambda free: _disk_full(out, needed, free, hint))


def export_run(run_dir: str | os.PathLike, step: int | None = None, out: str | None = None) -> pathlib.Path:
    """Export a run's checkpoint (the newest, or `step`) as an HF model directory, with the generation config,
    tokenizer and chat template files of its base model (as the run saved them, or from its model directory)."""
    run = pathlib.Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise CheckpointError(f"{run} is not a run directory (no config.yaml)")
    cfg = load_config(run / "config.yaml")
    root = run / "checkpoints"
    if step is None:  # find_resumable verifies what it returns
        path = find_resumable(root)
        if path is None:
            why = " (the run had checkpoint.keep=0: its export, if it made one, is in its export/ directory)" \
                if cfg.checkpoint.keep == 0 else ""
            raise CheckpointError(f"{root} holds no usable checkpoint to export{why}")
    else:
        path = root / f"step-{step}"
        if not path.is_dir():
            have = ", ".join(p.name for p in list_checkpoints(root)) or "none"
            raise CheckpointError(f"no checkpoint for step {step} in {root} (have: {have})")
        verify(path)
    source = saved_model_source(run, cfg.model)
    model = load_model(source, cfg.seed, need_tokenizer=False, need_weights=False)
    dtype = export_dtype(cfg.export_dtype, model.dtype)
    hint = f"free some space there or choose another --out; {path} is unchanged"
    return export_hf(out or run / "export", model.hf_config, read_masters(path, unit_layouts(model.stack())),
                     model.tokenizer, dtype, source=base_dir(source), hint=hint)


def is_earlier_export(out: pathlib.Path) -> bool:
    """Whether the folder `out` may be replaced by an export: it is empty, or an earlier export (holds MARKER)."""
    return (out / MARKER).is_file() or not any(out.iterdir())


def _check_replaceable(out: pathlib.Path) -> None:
    """An existing `out` is replaced only when it is empty or an earlier export (it holds MARKER): never a run
    directory, a user's folder or a model directory that came from elsewhere."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"export: {out} exists and is not a directory; choose another --out")
    if not is_earlier_export(out):
        entries = list(out.iterdir())
        shown = ", ".join(sorted(p.name for p in entries)[:5]) + (", ..." if len(entries) > 5 else "")
        raise ExportError(f"export: {out} exists and is not an earlier export (it holds {shown}); an export "
                          "replaces its directory, so choose a new or empty --out")


def _disk_full(out: pathlib.Path, needed: int, free: int, hint: str | None) -> DiskFullError:
    hint = hint or ("free some space or export elsewhere (`slide-train export RUN_DIR --out DIR` exports any "
                    "checkpoint later)")
    return DiskFullError(f"the export to {out} needs about {size_text(needed)}, but only {size_text(free)} "
                         f"are free there: {hint}. Nothing of the export was left behind")


def _write(out: pathlib.Path, tmp: pathlib.Path, hf_config, tensors: list, shards: list[list[int]], tokenizer,
           source: pathlib.Path | None, dtype: torch.dtype) -> pathlib.Path:
    if tmp.exists():  # left by an export that crashed: none of it may leak into this one
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    last = {shard[-1]: k for k, shard in enumerate(shards) if shard}  # a shard's last tensor -> the shard
    part: dict[str, torch.Tensor] = {}  # the export dtype's copies of one shard are all that is held
    for i, (name, tensor) in enumerate(bar(tensors, desc=f"exporting to {out.name}", unit="tensor")):
        part[name] = tensor.to(dtype).contiguous()
        if i in last:
            save_file(part, str(tmp / _shard_name(last[i], len(shards))), metadata=METADATA)
            part = {}
    if len(shards) > 1:
        (tmp / "model.safetensors.index.json").write_text(
            _index_text([(name, tuple(t.shape)) for name, t in tensors], shards, dtype))
    _export_config(hf_config, dtype).save_pretrained(tmp)
    if source is not None:
        copy_model_files(source, tmp, tokenizer)
    elif tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(MARKER_TEXT)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def export_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The config's `export_dtype` ('auto': the dtype the weights came in)."""
    return model_dtype if name == "auto" else DTYPES[name]


def type_name(hf_config) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type]
