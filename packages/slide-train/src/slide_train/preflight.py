"""Checks a command runs before any real work: the config file, the model's tokenizer files and every folder the
run reads or writes, each refused in one line that names the key or file at fault."""

from __future__ import annotations

import os
import pathlib
import tempfile

from slide_scheduler import DISK, activation_tier

from .data import FORMATS
from .data.config import DataError
from .data.sources import check_file
from .disk_tier import nvme_dirs
from .errors import ConfigError
from .models.files import no_tokenizer_files, tokenizer_files
from .models.presets import PRESETS

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


def check_writable(key: str, folder: str | os.PathLike) -> None:
    """`folder` is, or can be made, a folder that takes files: a file is created and removed in it, or in the
    nearest folder above it that exists (which is left as it was)."""
    folder = pathlib.Path(folder).absolute()
    existing = folder
    try:
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(f"{key}: {existing} is a file, so {folder} cannot be a folder: choose another path")
        fd, probe = tempfile.mkstemp(prefix=".slide-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{key}: cannot create files in {existing} ({e.strerror or e}): set {key} to a folder on "
                          "a disk this user can write") from e


def check_finetune(cfg) -> None:
    """What `slide-train finetune` refuses before it loads the model or reads the data."""
    check_tokenizer_files(cfg.model, cfg.data.format)
    check_data_path(cfg.data.path)
    check_writable("output_dir", cfg.output_dir)
    # Folders the config itself puts something in are refused now; where `auto` decides, once the plan puts
    # something there (its default folder is under output_dir, checked above)
    if cfg.engine.nvme.fraction not in (0, "auto") or activation_tier(cfg.engine.activation_offload) == DISK:
        check_nvme_dirs(cfg)


def check_nvme_dirs(cfg) -> None:
    """The disk tier's folders the user named (engine.nvme.dir) take files."""
    if cfg.engine.nvme.dir:
        for folder in nvme_dirs(cfg):
            check_writable("engine.nvme.dir", folder)


def check_data(cfg) -> None:
    """What `slide-train data` refuses before it loads the model or reads the data (it writes nothing)."""
    check_tokenizer_files(cfg.model, cfg.data.format)
    check_data_path(cfg.data.path)
