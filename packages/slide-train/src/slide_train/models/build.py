"""From the config's `model` key to what the engine needs: the HF config, a weight source and a tokenizer."""

from __future__ import annotations

import json
import pathlib
import shutil
from dataclasses import dataclass

import torch
import transformers

from ..data import builtin_tokenizer
from ..errors import ConfigError, ModelError
from .adapter import HFStack, check_supported
from .families import FAMILIES, REFUSED, supported_text
from .files import no_tokenizer_files, tokenizer_files
from .presets import PRESETS, preset_config
from .random_init import RandomWeights
from .weights import SafetensorsWeights


@dataclass
class ModelBundle:
    name: str
    hf_config: transformers.PretrainedConfig
    weights: object
    tokenizer: object | None
    dtype: torch.dtype  # the dtype the weights came in (the default export dtype)

    @property
    def identity(self) -> str:
        """What names this model however it was typed: a preset's name, or its directory's resolved path."""
        return self.name if self.name in PRESETS else str(pathlib.Path(self.name).resolve())

    def stack(self, kernels: bool = False, aux_loss_mean_of: int = 1) -> HFStack:
        """`aux_loss_mean_of`: a mixture of experts' load-balancing term is the mean over this many micro-batches
        (1: each micro-batch's whole, as transformers.Trainer adds it)."""
        return HFStack(self.hf_config, self.weights, kernels=kernels, aux_loss_mean_of=aux_loss_mean_of)


def load_model(name: str, seed: int = 0, need_tokenizer: bool = True, need_weights: bool = True) -> ModelBundle:
    """A preset or a local HF directory. `need_weights=False`: config and tokenizer only (an export reads
    the weights from a checkpoint; a run directory's `base-model/` holds no weights)."""
    if name in PRESETS:
        tokenizer = builtin_tokenizer()  # bytes: fits any vocabulary, so public shapes train on text too
        vocab = -(-len(tokenizer) // 64) * 64 if name.startswith("tiny-") else None
        config = preset_config(name, vocab)
        return ModelBundle(name, config, RandomWeights(config, seed), tokenizer, torch.float32)
    path = pathlib.Path(name).expanduser()
    if not path.exists():
        raise ModelError(f"model {name!r} is neither a built-in preset ({', '.join(PRESETS)}) nor an existing "
                         "directory; give the path of a local HF model directory")
    if path.is_file():  # (a model directory's config.json or weights file, given for the directory)
        raise ModelError(f"model {name!r} is a file: give the Hugging Face model directory that holds config.json, "
                         f"the weights (*.safetensors) and the tokenizer files (perhaps {path.parent})")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} has no config.json: is it a Hugging Face model directory?")
    refuse_remote_code(path / "config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path / 'config.json'}: {e}") from e
    check_supported(config)
    weights = SafetensorsWeights(path) if need_weights else None
    tokenizer = None
    if not tokenizer_files(path):  # (transformers may build an empty tokenizer rather than fail)
        if need_tokenizer:
            raise no_tokenizer_files(path)
    else:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        except (OSError, ValueError) as e:
            if need_tokenizer:
                raise ModelError(f"cannot load the tokenizer of {path}: {e}. Put the tokenizer files next to the "
                                 "weights, or use data.format=tokens with pre-tokenized data") from e
    dtype = getattr(config, "dtype", None) or torch.float32  # (transformers maps an older torch_dtype here)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return ModelBundle(str(path), config, weights, tokenizer, dtype)


def refuse_remote_code(config_json: pathlib.Path) -> None:
    """A config.json is read here before transformers reads it, so that a model this project cannot train is
    refused in its words. One whose `auto_map` points at Python code shipped with the checkpoint, for a model_type
    without a family here, is refused: no code from a model directory is run. A supported model_type that also
    carries an `auto_map` (early Phi-3 uploads) loads with transformers' own classes, as `from_pretrained` does by
    default. A model_type without a family is refused with the list of those supported, whether or not
    transformers knows it."""
    try:
        raw = json.loads(config_json.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {config_json}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelError(f"{config_json} is not a JSON object of a model's settings: is it a Hugging Face config?")
    model_type = raw.get("model_type")
    if model_type in FAMILIES or model_type in REFUSED or model_type is None:  # (None: transformers' message)
        return
    if raw.get("auto_map"):
        raise ModelError(f"{config_json} names its own modeling code (auto_map, model_type {model_type!r}): models "
                         "that need remote code are not supported, and no code from a model directory is run. "
                         f"Supported families: {supported_text()}")
    raise ModelError(unsupported_type(config_json, model_type))


def unsupported_type(config_json: pathlib.Path, model_type) -> str:
    """The message for a model_type without a family: what is supported, and how a family is asked for."""
    return (f"{config_json}: model_type {model_type!r} has no adapter yet; supported: {supported_text()}. To ask "
            "for this family, open an issue with the model's config.json; docs/models.md (Adding a family) says "
            "what an adapter needs")


def check_fits(bundle: ModelBundle, seq_len: int) -> None:
    limit = getattr(bundle.hf_config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"seq_len={seq_len} is larger than the model's max_position_embeddings={limit}; "
                          f"use seq_len <= {limit}")
    tok = bundle.tokenizer
    if tok is not None and len(tok) > bundle.hf_config.vocab_size:
        raise ModelError(f"the tokenizer has {len(tok)} tokens but the model's vocab_size is "
                         f"{bundle.hf_config.vocab_size}: they do not belong together")


BASE_MODEL_DIR = "base-model"  # a run directory's copy of its model's config and tokenizer
MODEL_FILES_MARKER = ".slide-base-model"


def saved_model_source(run_dir: pathlib.Path, fallback: str) -> str:
    """What to build a run's model from for an export: its saved copy if it has one, else `fallback` (its
    config's `model`: a preset, or a run from before the copy existed)."""
    saved = run_dir / BASE_MODEL_DIR
    return str(saved) if (saved / MODEL_FILES_MARKER).is_file() else fallback


def save_model_files(bundle: ModelBundle, directory: pathlib.Path) -> bool:
    """The model's config and tokenizer (no weights) into `directory`, so that a run can be exported after its
    base model has moved or changed; False when `directory` exists and was not written here (left alone). A
    preset needs none: its name rebuilds it."""
    if directory.exists():
        if not (directory / MODEL_FILES_MARKER).is_file():
            return False
        shutil.rmtree(directory)
    if bundle.name in PRESETS:
        return True
    bundle.hf_config.save_pretrained(directory)
    if bundle.tokenizer is not None:
        bundle.tokenizer.save_pretrained(directory)
    (directory / MODEL_FILES_MARKER).write_text(f"config and tokenizer of {bundle.name}, for slide-train export\n")
    return True
