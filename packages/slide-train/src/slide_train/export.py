"""Export: an HF model directory (config.json, safetensors shards, tokenizer files) that
`transformers.AutoModelForCausalLM.from_pretrained` loads."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import shutil

import torch
from safetensors.torch import save_file

from slide_scheduler import DTYPES  # the one name -> dtype table

from .errors import DiskFullError, ExportError, size_text
from .models.adapter import block_hf_name, edge_hf_name
from .progress import bar
from .space import write_within

SHARD_BYTES = 5 * 2**30
MARKER = ".slide-export"  # marks a directory this module wrote: only such a directory is ever replaced


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


def export_bytes(numel: int, dtype: torch.dtype) -> int:
    """About what an export of `numel` parameters in `dtype` takes: the tensors, config and tokenizer files."""
    return numel * dtype.itemsize + (16 << 20)


def export_hf(directory: str | os.PathLike, hf_config, masters, tokenizer, dtype: torch.dtype) -> pathlib.Path:
    """Write the model in HF layout, one shard at a time (at most SHARD_BYTES of tensors in memory). A disk too
    small for it raises DiskFullError before anything is written (or after removing the partial files)."""
    out = pathlib.Path(directory).resolve()
    _check_replaceable(out)
    tmp = out.with_name(out.name + ".partial")
    tensors = list(hf_tensors(masters))  # (name, view): walked once for the size, once more to write
    numel = sum(t.numel() for _, t in tensors)
    tensor_bytes, needed = numel * dtype.itemsize, export_bytes(numel, dtype)
    return write_within(out.parent, needed, tmp,
                        lambda: _write(out, tmp, hf_config, tensors, tokenizer, dtype, tensor_bytes),
                        lambda free: _disk_full(out, needed, free))


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


def _disk_full(out: pathlib.Path, needed: int, free: int) -> DiskFullError:
    return DiskFullError(f"the export to {out} needs about {size_text(needed)}, but only {size_text(free)} "
                         "are free there: free some space or export elsewhere (`slide-train export RUN_DIR --out "
                         "DIR` exports any checkpoint later). Nothing of the export was left behind")


def _write(out: pathlib.Path, tmp: pathlib.Path, hf_config, tensors: list, tokenizer, dtype: torch.dtype,
           total: int) -> pathlib.Path:
    if tmp.exists():  # left by an export that crashed: none of it may leak into this one
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    weight_map = {}
    names = []

    def flush():
        index = len(names) + 1
        name = f"model-{index:05d}.safetensors"
        save_file(shards[-1], str(tmp / name), metadata={"format": "pt"})
        for key in shards[-1]:
            weight_map[key] = name
        names.append(name)
        shards[-1] = {}

    for hf_name, tensor in bar(tensors, desc=f"exporting to {out.name}", unit="tensor"):
        nbytes = tensor.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            flush()
            size = 0
        shards[-1][hf_name] = tensor.to(dtype).contiguous()
        size += nbytes
    flush()
    if len(names) == 1:
        (tmp / names[0]).rename(tmp / "model.safetensors")
    else:
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg = copy.deepcopy(hf_config)
    # transformers 5 calls it `dtype`, 4.x `torch_dtype`
    setattr(cfg, "dtype" if "dtype" in cfg.to_dict() else "torch_dtype", dtype)
    cfg.architectures = [type_name(cfg)]
    cfg.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text("written by slide-train export; a later export may replace this directory\n")
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
