"""A resumed run's config: the run's own (its checkpoint's), with the keys given now over it, and one warning line
for each given key that changes what the run trains."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import warnings
from typing import Any

import yaml

from . import checkpoint as ckpt
from .config import TrainConfig, load_config, to_dict
from .errors import ConfigError, ModelError
from .log import say
from .models.build import BASE_MODEL_DIR, MODEL_FILES_MARKER
from .models.presets import PRESETS

# What a run was told about its folder, not what it trains: never taken from the run being resumed.
RUN_CONTROL = ("resume", "overwrite")
# Keys (or sections) whose change makes the resumed steps differ from the run's own course.
TRAINING = ("steps", "epochs", "schedule", "model", "data", "seq_len", "micro_batch_size", "grad_accum", "optimizer",
            "max_grad_norm", "seed", "engine.states_dtype")


def saved_config(cfg: TrainConfig) -> dict[str, Any]:
    """The config a checkpoint keeps: every key, its paths absolute, so a resume from another folder finds them."""
    values = to_dict(cfg)
    if values["model"] not in PRESETS:
        values["model"] = _absolute(values["model"])
    values["output_dir"] = _absolute(values["output_dir"])
    data, nvme = values["data"], values["engine"]["nvme"]
    if data["path"] is not None:
        data["path"] = _absolute(data["path"])
    if nvme["dir"] is not None:  # (a folder, or one per drive)
        nvme["dir"] = _absolute(nvme["dir"]) if isinstance(nvme["dir"], str) else list(map(_absolute, nvme["dir"]))
    return values


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def resumed_config(config: str | None, overrides: list[str]) -> tuple[TrainConfig, pathlib.Path | None]:
    """The config of `slide-train finetune [CONFIG | RUN_DIR] overrides`, and the verified checkpoint it resumes
    from (None: a new run, or resume=auto with nothing saved yet). With `resume`, the base is the run's own config
    (its checkpoint's, else its config.yaml), without run-control keys; the YAML file's keys and the overrides
    go over it."""
    run = pathlib.Path(config) if config is not None and pathlib.Path(config).is_dir() else None
    if run is not None:  # a run's folder in place of a config file
        if not (run / "config.yaml").is_file() and not (run / "checkpoints").is_dir():
            raise ConfigError(f"{run} is a folder, not a config file, and holds no run (no config.yaml): give a "
                              "YAML file, or a run's folder with --resume=auto")
        if any(a.startswith("--output_dir=") for a in overrides):
            raise ConfigError(f"{run} is the run's folder, its output_dir: give one or the other, not both")
        config, overrides = None, [f"--output_dir={run}", *overrides]
    try:
        given = load_config(config, overrides)
    except ConfigError:  # a key that needs the run's others (--eval_every: its data.eval_fraction) is checked below
        given = load_config(config, overrides, checked=False)
        if given.resume is None:
            raise
        load_config(None, [f"--resume={given.resume}", f"--overwrite={given.overwrite}"])  # (their own checks)
        given.output_dir = os.path.expanduser(given.output_dir)
        given.resume = given.resume if given.resume == "auto" else os.path.expanduser(given.resume)
    if given.resume is None:
        if run is not None:
            raise ConfigError(f"{run} is a run's folder: continue it with --resume=auto, or start afresh from its "
                              f"config with `slide-train finetune {run / 'config.yaml'} --overwrite=true`")
        return given, None
    checkpoint = find_checkpoint(given)
    if checkpoint is not None:
        source = checkpoint / "trainer.json"
        saved = json.loads(source.read_text())
        values, step = saved.get("config"), saved["step"]
        home = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    else:  # resume=auto before the first checkpoint: the run's config.yaml, if it got that far
        home = pathlib.Path(given.output_dir)
        source = home / "config.yaml"
        values, step = _read_yaml(source), 0
    if not isinstance(values, dict):  # (no config kept: the config as given)
        return given, checkpoint
    values = {k: v for k, v in values.items() if k not in RUN_CONTROL}
    if home is not None:
        values["output_dir"] = str(home.absolute())
    was = _build(values, source)
    base = {k: v for k, v in saved_config(was).items() if k not in RUN_CONTROL}
    cfg = load_config(config, overrides, base=base)
    _check_model(cfg, base, home)
    for key, old, new in changes(was, cfg):
        warnings.warn(f"resume: {key}={new} replaces the run's {old} from step {step} on", stacklevel=2)
    return cfg, checkpoint


def find_checkpoint(cfg: TrainConfig) -> pathlib.Path | None:
    """The verified checkpoint `cfg.resume` names (auto: the newest intact one in output_dir; None: none saved)."""
    if cfg.resume == "auto":  # find_resumable returns a verified checkpoint
        return ckpt.find_resumable(pathlib.Path(cfg.output_dir) / "checkpoints")
    path = pathlib.Path(cfg.resume)
    if not path.is_dir():
        raise ckpt.CheckpointError(f"resume: checkpoint {path} does not exist")
    ckpt.verify(path)
    return path


def _read_yaml(path: pathlib.Path) -> dict | None:
    try:
        return yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):  # (then the config as given; the run's folder is checked later)
        return None


def _build(values: dict, source: pathlib.Path) -> TrainConfig:
    try:
        return load_config(None, [], base=values)
    except ConfigError as e:
        raise ConfigError(f"the config kept in {source} does not load ({e}): give the run's keys in a YAML file "
                          "(`slide-train finetune FILE --resume=auto`)") from e


def _check_model(cfg: TrainConfig, base: dict, home: pathlib.Path | None) -> None:
    """The run's local model, moved or deleted since, is named with where the run keeps its own copy."""
    model = cfg.model
    if model != base["model"] or model in PRESETS or pathlib.Path(model).exists():
        return
    copy = home / BASE_MODEL_DIR if home is not None else None
    kept = (f"; the run keeps its own copy of the model's config.json and tokenizer (not its weights) in {copy}"
            if copy is not None and (copy / MODEL_FILES_MARKER).is_file() else "")
    raise ModelError(f"the run's model {model} is not there any more (moved or deleted?): resume with "
                     f"--model=DIR, where it is now{kept}")


def _flat(values: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and key not in ("roles", "placement"):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


def _text(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def changes(was: TrainConfig, now: TrainConfig) -> list[tuple[str, str, str]]:
    """(key, the run's value, the value now) of each training key that differs; paths compared resolved."""
    old, new = _flat(saved_config(was)), _flat(saved_config(now))
    return [(k, _text(old[k]), _text(new[k])) for k in new
            if any(k == t or k.startswith(t + ".") for t in TRAINING) and old.get(k) != new[k]]


def keep_global_batch(cfg: TrainConfig, path: pathlib.Path, ranks) -> TrainConfig:
    """A checkpoint of a run with another rank count resumes with the rows per step it had: grad_accum
    changes, or the resume is refused where no whole grad_accum gives them (`ranks`: this run's group)."""
    saved = json.loads((path / "trainer.json").read_text())
    was_ranks, was = saved.get("ranks", 1), saved.get("config", {})
    if was_ranks == ranks.size:
        return cfg
    rows = was.get("micro_batch_size", cfg.micro_batch_size) * was.get("grad_accum", cfg.grad_accum) * was_ranks
    per_accum = cfg.micro_batch_size * ranks.size
    if rows % per_accum:
        raise ConfigError(f"{path} is of a run with {was_ranks} rank(s) and {rows} rows per step; with "
                          f"{ranks.size} rank(s) of micro_batch_size {cfg.micro_batch_size} no whole "
                          f"grad_accum gives {rows} rows: resume with a rank count or micro_batch_size that "
                          f"divides {rows}")
    if rows // per_accum != cfg.grad_accum:
        say(f"resuming a run of {was_ranks} rank(s) on {ranks.size}: grad_accum {rows // per_accum} keeps its "
            f"{rows} rows per step")
    return dataclasses.replace(cfg, grad_accum=rows // per_accum)
