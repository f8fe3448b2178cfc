"""Checks a command runs before any real work: the config file, the model's tokenizer files and every folder the
run reads or writes, each refused in one line that names the key or file at fault."""

from __future__ import annotations

import os
import pathlib

from .data import FORMATS
from .data.config import DataError
from .data.sources import check_file
from .models.files import no_tokenizer_files, tokenizer_files
from .models.presets import PRESETS
from .outputs import check_outputs
from .space import check_writable

# The formats whose rows are text for the model's tokenizer; `tokens` rows are ids already.
TEXT_FORMATS = tuple(f for f in FORMATS if f != "tokens")


def check_tokenizer_files(model: str, fmt: str) -> None:
    """A local model trained on text needs its tokenizer's files; presets bring a tokenizer of their own."""
    if fmt not in TEXT_FORMATS or model in PRESETS:
        return
    model_dir = pathlib.Path(model).expanduser()
    if not (model_dir / "config.json").is_file():
        return  # (load_model says what the directory lacks)
    if not tokenizer_files(model_dir):
        raise no_tokenizer_files(model_dir, fmt)


def check_data_path(path: str | None) -> None:
    """data.path exists and can be read (None: the built-in corpus)."""
    if path is None:
        return
    path = pathlib.Path(path)
    check_file(path)
    try:
        if path.is_dir():
            os.listdir(path)
        else:
            with open(path, "rb") as file:
                file.read(1)
    except OSError as e:
        raise DataError(f"data.path: cannot read {path} ({e.strerror or e}): check its permissions") from e


def check_finetune(cfg) -> None:
    """What `slide-train finetune` refuses before it loads the model or reads the data: then what the run will
    write (the launch's check, which a Trainer made in Python runs too)."""
    check_tokenizer_files(cfg.model, cfg.data.format)
    check_data_path(cfg.data.path)
    check_writable("output_dir", cfg.output_dir)
    check_outputs(cfg)


def check_data(cfg) -> None:
    """What `slide-train data` refuses before it loads the model or reads the data (it writes nothing)."""
    check_tokenizer_files(cfg.model, cfg.data.format)
    check_data_path(cfg.data.path)
