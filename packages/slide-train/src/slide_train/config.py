"""The run configuration: nested dataclasses loaded from YAML plus `--dot.key=value` overrides, validated up
front so that a typo fails in the first second, not after an hour of training."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import math
import os
import pathlib
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from slide_memory import AdamWConfig
from slide_scheduler import DISK, GPU, HOST, Overrides, activation_tier

from .data import FORMATS, DataConfig
from .data.config import check_config as check_data_config
from .errors import ConfigError


@dataclass
class ScheduleConfig:
    warmup_steps: int = 0
    decay: str = "cosine"  # constant | cosine | linear
    min_lr_ratio: float = 0.1  # lr at the last step, as a share of optimizer.lr (cosine / linear)


@dataclass
class NvmeConfig:
    # Scratch folder of the NVMe tier: masters, AdamW moments and boundary activations placed on disk (null: the
    # machine file's drives' folders where it lists several, else <output_dir>/nvme). Point it at a fast local
    # NVMe drive, or give a list of folders, one per drive, to stripe the tier over them; its files are removed at
    # the end
    dir: str | list[str] | None = None
    # Share of the sliding blocks (the last ones) whose fp32 master and AdamW m and v live on disk, a bf16 copy
    # of their parameters in RAM: 10 bytes per parameter less host memory (6 with bf16 states), read and
    # written by every step; auto: the least share that fits (none where RAM holds the run; always none with
    # data-parallel ranks, which do not run the disk tier)
    fraction: float | str = "auto"


@dataclass
class EngineSection:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    gpu_memory_limit_gb: float | None = None  # cap this process's GPU memory (e.g. 24 to act as a 24 GB card)
    # cap the host memory this run's plan may count on (e.g. 64 to leave the rest of a larger host to other work)
    host_memory_limit_gb: float | None = None
    compute_dtype: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32
    states_dtype: str = "fp32"  # fp32 | bf16 (opt-in: AdamW m and v on the host in bf16, half their memory)
    kernels: str = "auto"  # auto (slide-kernels' Triton RMSNorm/RoPE/SwiGLU on CUDA) | on | off
    # Boundary activations (each block's input, per micro-batch) kept for backward: gpu | host (pinned host
    # memory) | disk (files in nvme.dir, through two small rings of host buffers) | auto (the plan's choice); the
    # older words none, cpu and nvme still name gpu, host and disk
    activation_offload: str = HOST
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    # Expert overrides of the placement: window, resident, device_update_share, speculate, synchronous
    # (docs/placement.md)
    placement: dict = field(default_factory=dict)


def expert_fields(cls=None) -> dict[str, tuple[object, dict]]:
    """engine.placement's keys, from slide-scheduler's one declaration of them (its `Overrides` fields but those
    the planner alone sets): name -> (its type, its metadata), in declaration order."""
    cls = cls or Overrides
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls)
            if "planner_only" not in f.metadata}


def placement_keys(cls=None) -> dict[str, str]:
    """engine.placement's keys -> what each does."""
    return {name: meta.get("expert", "") for name, (_, meta) in expert_fields(cls).items()}


# Keys that were renamed or removed, with what replaces them.
MOVED = {
    "engine.window": "engine.placement.window",
    "engine.resident": "engine.placement.resident",
    "engine.device_update_share": "engine.placement.device_update_share",
    "engine.pipeline": "engine.placement.synchronous (its opposite)",
    "engine.optimizer_offload": "engine.nvme (fraction and dir)",
    "engine.optimizer_offload.nvme_fraction": "engine.nvme.fraction",
    "engine.optimizer_offload.dir": "engine.nvme.dir",
    "engine.activation_dir": "engine.nvme.dir",
    "engine.split_update": "nothing: the placement splits clipped updates wherever that is exact",
    "engine.grads_share_activations": "nothing: the placement shares that memory wherever clipping holds gradients",
    "engine.held_grads": "nothing: the placement holds what the GPU budget has room for",
}


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2  # the newest checkpoints kept; 0 = write none (a throwaway run, a benchmark)


@dataclass
class TrainConfig:
    model: str = "tiny-llama"  # a local HF model directory, or a built-in preset (see `slide-train presets`)
    data: DataConfig = field(default_factory=DataConfig)
    seq_len: int = 128
    micro_batch_size: int = 8
    grad_accum: int = 2
    steps: int = 60
    epochs: float | None = None  # when set, overrides `steps`
    optimizer: AdamWConfig = field(default_factory=AdamWConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    max_grad_norm: float | None = 1.0
    # A mixture of experts' load-balancing loss (output_router_logits): trainer | per_micro_batch
    router_aux_loss: str = "trainer"
    seed: int = 0
    output_dir: str = "runs/default"
    engine: EngineSection = field(default_factory=EngineSection)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: str | None = None  # auto (newest good checkpoint in output_dir, if any) | PATH of a checkpoint
    overwrite: bool = False  # start afresh in an output_dir that holds an earlier run (its checkpoints are deleted)
    eval_every: int = 0
    profile: bool = False  # write timeline.png and trace.json (Perfetto / chrome://tracing) of step 3
    export: bool = True  # write an HF model directory to output_dir/export at the end
    export_dtype: str = "auto"  # auto (the source model's dtype) | bf16 | fp16 | fp32


CHOICES = {
    "data.format": FORMATS,
    "router_aux_loss": ("trainer", "per_micro_batch"),
    "schedule.decay": ("constant", "cosine", "linear"),
    "engine.compute_dtype": ("auto", "bf16", "fp32"),
    "engine.activation_offload": ("auto", GPU, HOST, DISK),  # (validate maps the older none, cpu, nvme)
    "engine.states_dtype": ("fp32", "bf16"),
    "engine.kernels": ("auto", "on", "off"),
    "export_dtype": ("auto", "bf16", "fp16", "fp32"),
}


# One line per key for `finetune --help` (allowed values come from CHOICES); a test checks every key has one.
KEY_HELP = {
    "model": "a local HF model directory, or a built-in preset (`slide-train presets`)",
    "data.path": "a dataset file (.jsonl, .json, .parquet, .arrow) or a datasets save_to_disk folder; "
                 "null: the built-in corpus",
    "data.format": "the rows' layout",
    "data.text_key": "the field holding the text, for text and jsonl rows",
    "data.roles": "other role names mapped to user, assistant, system or tool, e.g. {usr: user}, for chat and "
                  "sharegpt rows (a role of the model's own template maps to itself)",
    "data.shuffle": "shuffle the examples (seeded by `seed`)",
    "data.pack": "pack short examples into seq_len rows (attention stays within each document); text, and tokens "
                 "rows without labels, are cut at a row's end and continue in the next, other examples stay whole",
    "data.eval_fraction": "share of the examples held out for the validation loss, in [0, 1)",
    "data.eval_batches": "micro-batches of held-out examples per validation",
    "data.allow_unknown_tokens": "train even where over half the tokens of the data's first 1,000 examples are "
                                 "unknown to the tokenizer (over 5% warns)",
    "seq_len": "tokens per row",
    "micro_batch_size": "rows per micro-batch",
    "grad_accum": "micro-batches per optimizer step",
    "steps": "optimizer steps",
    "epochs": "passes over the data; when set, replaces steps",
    "optimizer.lr": "peak learning rate of AdamW",
    "optimizer.betas": "AdamW's beta1 and beta2, each in [0, 1)",
    "optimizer.eps": "AdamW's epsilon",
    "optimizer.weight_decay": "decoupled weight decay",
    "schedule.warmup_steps": "steps of linear warm-up from 0",
    "schedule.decay": "the learning rate after warm-up",
    "schedule.min_lr_ratio": "the last step's learning rate as a share of optimizer.lr, in [0, 1]",
    "max_grad_norm": "clip the global gradient norm to this (exactly); null: no clipping",
    "router_aux_loss": "a mixture of experts' load-balancing loss (output_router_logits) in the step: trainer: each "
                       "micro-batch's term whole, as transformers.Trainer adds it; per_micro_batch: their mean, as "
                       "a loop of model(ids, labels=ids).loss / grad_accum has it",
    "seed": "seed of the data order and of random initialization",
    "output_dir": "the run's folder: config, metrics.jsonl, log.txt, checkpoints, export",
    "engine.device": "auto, cpu, cuda or cuda:N",
    "engine.gpu_memory_limit_gb": "cap this process's GPU memory (24: plan and run as on a 24 GB card); null: all",
    "engine.host_memory_limit_gb": "cap the host memory the run counts on (64: plan and run as on a host of 64 GB, "
                                   "the rest on disk or refused); null: the machine's",
    "engine.compute_dtype": "parameters and activations on the device; auto: bf16 on CUDA, fp32 on the CPU",
    "engine.states_dtype": "AdamW m and v on the host; bf16 halves their memory and is no longer exact AdamW",
    "engine.kernels": "slide-kernels' Triton kernels; auto: on CUDA",
    "engine.activation_offload": "where boundary activations wait for the backward: gpu, host (pinned memory), disk "
                                 "(files); auto: the fastest that fits, as the plan prices them (the older words "
                                 "none, cpu, nvme still name gpu, host, disk)",
    "engine.nvme.dir": "scratch folder for what the placement puts on disk, or a list of folders (one per drive) "
                       "to stripe it over, each an existing folder (a run never makes it); null: the machine file's "
                       "drives' folders (disks:), else <output_dir>/nvme",
    "engine.nvme.fraction": "share of the sliding blocks whose masters and AdamW moments live on disk, in [0, 1]; "
                            "auto: the least share that fits the host's memory (0 where it holds the run, and with "
                            "data-parallel ranks)",
    "engine.placement": f"expert overrides: {', '.join(placement_keys())} (docs/placement.md)",
    "checkpoint.every": "steps between checkpoints; 0: only at the end",
    "checkpoint.keep": "the newest checkpoints kept; 0: write none",
    "resume": "auto (the newest good checkpoint in output_dir) or a checkpoint's path; null: a new run",
    "overwrite": "start afresh in an output_dir that holds an earlier run (deletes its checkpoints)",
    "eval_every": "steps between validation losses (needs data.eval_fraction); 0: only at the end",
    "profile": "write timeline.png and trace.json of step 3",
    "export": "write an HF model directory to output_dir/export at the end",
    "export_dtype": "the export's weights; auto: the source model's dtype",
}


def _build(cls, values: dict[str, Any], prefix: str = ""):
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if not isinstance(key, str):  # YAML reads `1:` or `on:` as a number or a boolean
            raise ConfigError(f"config key {prefix}{key!r} is not a name: quote it, or check the YAML's indentation")
        if f"{prefix}{key}" in MOVED:
            raise ConfigError(f"config key '{prefix}{key}' was replaced by {MOVED[prefix + key]}")
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            near = prefix + near[0] if near else nearest_key(prefix + key)
            hint = f"; did you mean {near}?" if near else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
        kwargs[key] = _coerce(hints[key], value, prefix + key)
    return cls(**kwargs)


# Names other trainers (transformers' TrainingArguments, torchtune, axolotl) give these keys: a key typed that
# way, in any section, is pointed at ours.
ALIASES = {
    "learning_rate": "optimizer.lr", "lr": "optimizer.lr", "beta1": "optimizer.betas", "beta2": "optimizer.betas",
    "adam_beta1": "optimizer.betas", "adam_beta2": "optimizer.betas", "adam_epsilon": "optimizer.eps",
    "weight_decay": "optimizer.weight_decay", "warmup_steps": "schedule.warmup_steps",
    "warmup": "schedule.warmup_steps", "lr_scheduler_type": "schedule.decay", "lr_scheduler": "schedule.decay",
    "max_steps": "steps", "num_steps": "steps", "num_train_epochs": "epochs", "batch_size": "micro_batch_size",
    "per_device_train_batch_size": "micro_batch_size", "gradient_accumulation_steps": "grad_accum",
    "max_seq_length": "seq_len", "max_length": "seq_len", "seq_length": "seq_len", "sequence_len": "seq_len",
    "block_size": "seq_len", "clip_grad_norm": "max_grad_norm",
    "model_name_or_path": "model", "base_model": "model", "dataset": "data.path", "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep", "resume_from_checkpoint": "resume", "device": "engine.device",
}


def nearest_key(dotted: str) -> str | None:
    """The config key nearest an unknown one, by its last part: a key of that name (or of an `ALIASES` name) in
    another section, then the closest such name (`lerning_rate` -> optimizer.lr), then the closest whole key."""
    keys = [k for k, _, _ in describe_keys()]
    names = {k.rsplit(".", 1)[-1]: k for k in reversed(keys)} | ALIASES  # (a shared last part: the first key)
    last = dotted.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(last, names, n=1, cutoff=0.75)
    if near:
        return names[near[0]]
    near = difflib.get_close_matches(dotted, keys, n=1)
    return near[0] if near else None


@dataclasses.dataclass(frozen=True)
class _Typed:
    """A `--key=value` override as typed: a string key takes the text itself (`--output_dir=007` is "007",
    not 7), any other key the text read as YAML (3, 1e-4, true, null, [0.9, 0.95])."""

    arg: str
    raw: str

    def parsed(self):
        try:
            return yaml.safe_load(self.raw) if self.raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"cannot read the value of {self.arg!r}: {e}") from e


def _coerce(kind, value, key: str):
    if isinstance(value, _Typed):
        text = kind is str or (typing.get_origin(kind) in (typing.Union, types.UnionType)
                               and str in typing.get_args(kind))
        # (a key that takes a list too reads `[a, b]` as one)
        listed = any(typing.get_origin(a) is list for a in typing.get_args(kind)) and value.raw.lstrip()[:1] == "["
        text = text and not listed
        value = value.raw if text and value.raw not in ("null", "Null", "NULL") else value.parsed()
    if dataclasses.is_dataclass(kind):
        return _build(kind, value or {}, key + ".")
    if kind is dict:  # a free mapping (engine.placement): its values read as YAML, checked by `validate`
        if not isinstance(value or {}, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return {k: v.parsed() if isinstance(v, _Typed) else v for k, v in (value or {}).items()}
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for kind in inner[:-1]:  # a number or a word (`0.25` or `auto`): the first reading that works
            with contextlib.suppress(ConfigError):
                return _coerce(kind, value, key)
        return _coerce(inner[-1], value, key)
    if origin is list:  # (engine.nvme.dir: a list of folders)
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{key} must be a string or a non-empty list of strings, got {value!r}")
        return [_coerce(args[0], v, key) for v in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} numbers, got {value!r}")
        return tuple(_coerce(a, v, key) for a, v in zip(args, value))
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if kind in (int, float):
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if not math.isfinite(value):  # every number of the config passes here (int(nan) would raise)
            raise ConfigError(f"{key} must be a finite number, got {value}")
        if kind is int and value != int(value):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return kind(value)
    if kind is str:
        if isinstance(value, bool) and {"on", "off"} <= set(CHOICES.get(key, ())):  # YAML 1.1: `on` is true
            return "on" if value else "off"
        if not isinstance(value, str):  # `007`, `12:30`, `yes` or a date: YAML has changed what was written
            raise ConfigError(f"{key} must be a string, but the YAML read it as {type(value).__name__} {value!r}: "
                              f"put it in quotes")
        return value
    return value


def parse_folders(value: str | list[str]) -> str | list[str]:
    """engine.nvme.dir as given, `~` expanded: one folder, or a list of folders, one per drive (each named once)."""
    folders = [value] if isinstance(value, str) else value
    if not folders or any(not isinstance(f, str) or not f.strip() for f in folders):
        raise ConfigError(f"engine.nvme.dir must be a folder or a list of folders (one per drive), got {value!r}")
    folders = [os.path.expanduser(f) for f in folders]
    if len({os.path.normpath(f) for f in folders}) < len(folders):
        raise ConfigError(f"engine.nvme.dir names a folder twice: {', '.join(folders)} (one folder per drive)")
    return folders[0] if isinstance(value, str) else folders


def validate(cfg: TrainConfig) -> TrainConfig:
    # Paths: a leading ~ is the home directory, as for `model` (a shell leaves `--key=~/x` unexpanded).
    cfg.output_dir = os.path.expanduser(cfg.output_dir)
    if cfg.data.path is not None:
        cfg.data.path = os.path.expanduser(cfg.data.path)
    if cfg.resume not in (None, "auto"):
        cfg.resume = os.path.expanduser(cfg.resume)
    if cfg.engine.nvme.dir is not None:
        cfg.engine.nvme.dir = parse_folders(cfg.engine.nvme.dir)
    # The activations' tier in the states' words: a config (or a checkpoint's saved one) may give the older none,
    # cpu or nvme
    cfg.engine.activation_offload = activation_tier(cfg.engine.activation_offload)
    _check_values(cfg)
    check_placement(cfg.engine.placement, cfg.engine.states_dtype)
    _check_combinations(cfg)
    check_data_config(cfg.data, cfg.seq_len, cfg.micro_batch_size)  # also for `slide-train plan`, which reads no data
    return cfg


def _check_values(cfg: TrainConfig) -> None:
    """Each key's value alone: one of its choices, or within its range."""
    for key, allowed in CHOICES.items():
        value = get_key(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")
    positive = ["seq_len", "micro_batch_size", "grad_accum", "steps"]
    for key in positive:
        value = get_key(cfg, key)
        if value < 1:
            raise ConfigError(f"{key} must be at least 1, got {value}")
    not_negative = ["checkpoint.every", "checkpoint.keep", "schedule.warmup_steps", "eval_every",
                    "optimizer.weight_decay"]
    for key in not_negative:
        if get_key(cfg, key) < 0:
            raise ConfigError(f"{key} must be 0 or more, got {get_key(cfg, key)}")
    if cfg.optimizer.lr <= 0:
        raise ConfigError(f"optimizer.lr must be positive, got {cfg.optimizer.lr}")
    if cfg.optimizer.eps <= 0:
        raise ConfigError(f"optimizer.eps must be positive, got {cfg.optimizer.eps}")
    if not 0 <= cfg.schedule.min_lr_ratio <= 1:
        raise ConfigError(f"schedule.min_lr_ratio must be in [0, 1], got {cfg.schedule.min_lr_ratio}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.engine.device):
        raise ConfigError(f"engine.device must be auto, cpu, cuda or cuda:N; got {cfg.engine.device!r}")
    if not all(0 <= b < 1 for b in cfg.optimizer.betas):
        raise ConfigError(f"optimizer.betas must be in [0, 1), got {cfg.optimizer.betas}")
    if cfg.max_grad_norm is not None and cfg.max_grad_norm <= 0:
        raise ConfigError("max_grad_norm must be positive, or null to disable clipping")
    if cfg.epochs is not None and cfg.epochs <= 0:
        raise ConfigError(f"epochs must be positive, got {cfg.epochs}")
    fraction = cfg.engine.nvme.fraction
    if fraction != "auto" and (isinstance(fraction, str) or not 0.0 <= fraction <= 1.0):
        raise ConfigError("engine.nvme.fraction is the share of sliding blocks whose masters and AdamW states live on "
                          f"disk: it must be in [0, 1], or auto, got {fraction}")
    if cfg.engine.gpu_memory_limit_gb is not None and cfg.engine.gpu_memory_limit_gb <= 0:
        raise ConfigError("engine.gpu_memory_limit_gb must be positive, or null for no cap")
    if cfg.engine.host_memory_limit_gb is not None and cfg.engine.host_memory_limit_gb <= 0:
        raise ConfigError("engine.host_memory_limit_gb must be positive, or null for no cap")


def _check_combinations(cfg: TrainConfig) -> None:
    """Keys that contradict each other."""
    if cfg.overwrite and cfg.resume is not None:
        raise ConfigError(f"overwrite=true deletes the run that resume={cfg.resume} would continue: choose one")
    if cfg.resume is not None and cfg.resume.lower() in ("on", "off", "true", "false", "yes", "no", ""):
        raise ConfigError("resume must be 'auto' or the path of a checkpoint directory (or null)")
    if cfg.checkpoint.keep == 0 and cfg.resume is not None:
        raise ConfigError("checkpoint.keep=0 writes no checkpoint, so a resumed run would leave the one it started "
                          "from as the run's newest, behind its metrics: keep at least 1 to resume")
    if cfg.checkpoint.keep == 0 and cfg.checkpoint.every:
        raise ConfigError(f"checkpoint.every={cfg.checkpoint.every} with checkpoint.keep=0 (no checkpoints): set "
                          "keep to 1 or more, or every to 0")
    if cfg.eval_every and cfg.data.eval_fraction <= 0:
        raise ConfigError("eval_every needs a validation split: set data.eval_fraction (e.g. 0.05)")


def check_placement(overrides: dict, states_dtype: str, cls=None) -> None:
    """engine.placement: known keys, each of the type and range its `Overrides` field declares."""
    fields = expert_fields(cls)
    for key in overrides:
        if key not in fields:
            raise ConfigError(f"unknown key engine.placement.{key}; the expert overrides are "
                              + "; ".join(f"{k}: {what}" for k, what in placement_keys(cls).items()))
    for key, value in overrides.items():
        if value is not None:
            kind, meta = fields[key]
            if not _fits_field(kind, meta, value):
                raise ConfigError(f"engine.placement.{key} must be {_must(kind, meta)}, got {value!r}")
    if overrides.get("device_update_share") and states_dtype != "fp32":
        raise ConfigError("engine.placement.device_update_share streams fp32 AdamW states: set it to 0 with "
                          "engine.states_dtype=bf16")


def _kinds(kind) -> set:
    """The types a field's annotation allows, None aside."""
    args = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
    return {typing.get_origin(a) or a for a in args} - {type(None)}


def _fits_field(kind, meta: dict, value) -> bool:
    """Whether a config value is one its `Overrides` field takes: a unit list (resident) as unit names."""
    kinds, least, most = _kinds(kind), meta.get("least", 0), meta.get("most")
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, str):
        return value in meta.get("words", ())
    if isinstance(value, list):
        return tuple in kinds and all(isinstance(u, str) and re.fullmatch(r"edges|block\.\d+", u) for u in value)
    number = int if float not in kinds else (int, float)
    return (int in kinds or float in kinds) and isinstance(value, number) and value >= least \
        and (most is None or value <= most)


def _must(kind, meta: dict) -> str:
    """What a wrong value of the field is told it must be."""
    if meta.get("must"):
        return meta["must"]
    kinds, least, most = _kinds(kind), meta.get("least", 0), meta.get("most")
    if kinds == {bool}:
        return "true or false"
    if bool in kinds:
        return "true, false or " + " or ".join(meta.get("words", ()))
    if float in kinds:
        return f"in [{least:g}, {most:g}]" if most is not None else f"a number of at least {least:g}"
    return f"an integer of at least {least:g}"


def get_key(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def parse_override(arg: str) -> tuple[str, _Typed]:
    """`--a.b=value` -> ("a.b", value as typed; read for the key's type when the config is built)."""
    body = arg.removeprefix("--")
    if "=" not in body:
        raise ConfigError(f"override {arg!r} must look like --key.sub=value")
    key, raw = body.split("=", 1)
    return key, _Typed(arg, raw)


def load_config(path: str | pathlib.Path | None = None, overrides: list[str] = (),
                base: dict[str, Any] | None = None, checked: bool = True) -> TrainConfig:
    """Defaults, then `base` (a resumed run's own config), then the YAML file's keys, then `overrides`; each
    key's type checked, and (`checked`) the whole config validated."""
    values: dict[str, Any] = {}
    if path is not None:
        path = pathlib.Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            with open(path, encoding="utf-8") as stream:  # (a stream: yaml names it by its path, not <unicode string>)
                values = yaml.safe_load(stream) or {}
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
            what = "; ".join(part for part in (e.context, e.problem) if part)
            raise ConfigError(f"{path}{where}: not valid YAML: {what}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text ({e}): save it as UTF-8") from e
        if not isinstance(values, dict):
            raise ConfigError(f"{path} must map config keys to values, not be a YAML {type(values).__name__}")
    if base is not None:
        values = _merged(copy.deepcopy(base), values)
    for arg in overrides:
        key, value = parse_override(arg)
        node = values
        *parents, last = key.split(".")
        for part in parents:
            if isinstance(node.get(part), _Typed):  # an earlier override gave the whole section
                node[part] = node[part].parsed()
            if node.get(part) is None:  # absent, or a section left empty in the YAML (`data:`)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"override {arg!r}: {part} is not a section")
        node[last] = value
    cfg = _build(TrainConfig, values)
    return validate(cfg) if checked else cfg


def _merged(base: dict, over: dict) -> dict:
    """`over`'s keys over `base`'s, section by section (a free mapping such as data.roles replaced whole)."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict) and key not in ("roles", "placement"):
            _merged(base[key], value)
        else:
            base[key] = value
    return base


def to_dict(cfg) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    return _plain(out)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def describe_keys(cls=TrainConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """Every config key with its default and a line on what it does (and its allowed values), for `--help`."""
    rows = []
    default = cls()
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        key = prefix + f.name
        if dataclasses.is_dataclass(value):
            rows += describe_keys(type(value), key + ".")
            continue
        text = KEY_HELP.get(key, "")
        if key in CHOICES:
            text += f" (one of: {', '.join(CHOICES[key])})"
        rows.append((key, "{}" if key == "engine.placement" else repr(value), text))
    return rows
