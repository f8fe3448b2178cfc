"""Machine files: reading and writing them, and the cached probe of this machine that a run uses when it is
given none (`--machine FILE` overrides it). A probe that runs says so in one line on stderr, and where it keeps
what it measured."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import os
import pathlib
import platform
import sys
import tempfile

import torch
import yaml

from slide_io import free_bytes
from slide_scheduler import Disk, Machine, host_cores, host_memory_bytes, probe_disk
from slide_scheduler import __version__ as scheduler_version
from slide_scheduler import probe_machine as probe

from .errors import ConfigError
from .log import logger

GIB = 1 << 30
PROBE_HINT = "run `slide-train probe --out FILE` to measure this machine"


def load_machine(path: str | os.PathLike[str]) -> Machine:
    """The machine a machine file describes; raises ConfigError naming the file (and the key) at fault."""
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"machine file {path} does not exist ({PROBE_HINT}, or pass an existing file)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"machine file {path} cannot be read: {error}") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"machine file {path} is not valid YAML: {error}") from None
    if values is None:
        raise ConfigError(f"machine file {path} is empty: it needs sections gpu, host, pcie, disk ({PROBE_HINT})")
    try:
        machine = Machine.from_dict(values, source=f"machine file {path}")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    # from_dict takes .nan and .inf as numbers; no cost can be computed from them.
    for section, figures in machine.to_dict().items():
        for name, part in ([(f"{section}[{i}]", d) for i, d in enumerate(figures)] if section == "disks"
                           else [(section, figures)]):
            for key, value in part.items():
                if not isinstance(value, str) and not math.isfinite(value):
                    raise ConfigError(f"machine file {path}: {name}.{key} must be a finite number, got {value!r}")
    return machine


def save_machine(machine: Machine, path: str | os.PathLike[str], measured_by: str | None = None) -> None:
    """Write `machine` as a machine file, with a header saying what measured it (`measured_by`, by default
    the probe on this host) and when."""
    _write(machine.to_dict(), path, measured_by or _full_probe())


def fingerprint() -> str:
    """A short hash of what identifies this machine's hardware: GPU names and count, CPU model, cores and
    RAM. A cached probe is trusted only while it stays the same."""
    parts = []
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        parts.append(f"gpus={len(names)}:{','.join(names)}")
    else:
        parts.append("gpus=0")
    parts.append(f"cpu={_cpu_model()}")
    parts.append(f"cores={host_cores()}")  # the figures the probe reports, so a change in them shows here
    parts.append(f"ram_gib={round(host_memory_bytes() / GIB)}")
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:12]


def cache_dir() -> pathlib.Path:
    """Where this machine's probes are kept: `$XDG_CACHE_HOME/slide`, or `~/.cache/slide`."""
    base = os.environ.get("XDG_CACHE_HOME")
    return pathlib.Path(base if base else pathlib.Path.home() / ".cache") / "slide"


Folder = str | os.PathLike[str]


def this_machine(disk_dir: str | os.PathLike[str] | None = None, refresh: bool = False) -> Machine:
    """The last probe of this machine, measured now (a quick probe) when there is none for this hardware or
    when `refresh`.

    What is cached: `machine-<fingerprint>.yaml` holds the gpu, host and pcie figures, which belong to the
    hardware. Disk rates belong to a folder, so they are cached per folder (`disk-<fingerprint>-<folder
    hash>.yaml`, a machine file holding only its disk section) and only for a `disk_dir` that was given;
    free space changes from one run to the next, so it is always read afresh. Without `disk_dir` the machine
    has no disk tier (disk free_gib 0).
    """
    key = fingerprint()
    folder = cache_dir()
    machine_file = folder / f"machine-{key}.yaml"
    machine = None if refresh else _cached(machine_file)
    disk = None
    if machine is None:
        _announce(f"measuring this machine (a quick probe, a few seconds); keeping its figures in {machine_file}"
                  + (f" and the disk's in {_disk_file(folder, key, disk_dir)}" if disk_dir is not None else ""))
        # Without a folder of its own the probe's disk part runs where a file can surely be written.
        machine = probe(disk_dir=disk_dir if disk_dir is not None else tempfile.gettempdir(), quick=True)
        _keep(machine, disk_dir, _quick_probe())
        disk = machine.disk if disk_dir is not None else None
    if disk_dir is None:
        return dataclasses.replace(machine, disk=Disk(free_gib=0.0))
    if disk is None:
        disk_file = _disk_file(folder, key, disk_dir)
        cached = None if refresh else _cached(disk_file)
        if cached is None:
            _announce(f"measuring the disk under {disk_dir} (a few seconds); keeping its rates in {disk_file}")
            disk = probe_disk(disk_dir, quick=True)
            _write({"disk": dataclasses.asdict(disk)}, disk_file, _quick_probe())
        else:
            disk = dataclasses.replace(cached.disk, free_gib=round(free_bytes(disk_dir) / GIB, 1))
    return dataclasses.replace(machine, disk=disk)


def probe_this_machine(disk_dir: Folder | list[Folder] | None = None, quick: bool = False,
                       out: str | os.PathLike[str] | None = None) -> tuple[Machine, list[pathlib.Path]]:
    """Measure this machine (`slide-train probe`), its disk under `disk_dir` (default: the current folder; a list:
    each folder's drive, and the machine then lists them as `disks`), and keep the result as the last probe of
    this machine, which runs without a machine file read, and at `out` where given. Returns the machine and the
    files written (`out` first)."""
    folders = [os.getcwd()] if disk_dir is None else [disk_dir] if isinstance(disk_dir, (str, os.PathLike)) \
        else list(disk_dir)
    machine = probe(disk_dir=folders[0], quick=quick)
    if len(folders) > 1:  # (each drive measured alone: the others idle)
        machine = machine.with_drives([dataclasses.replace(machine.disk, dir=os.fspath(folders[0]))] + [
            dataclasses.replace(probe_disk(folder, quick=quick), dir=os.fspath(folder)) for folder in folders[1:]])
    measured_by = _quick_probe() if quick else None
    written = []
    if out is not None:
        save_machine(machine, out, measured_by)
        written.append(pathlib.Path(out))
    # The cache holds the newest figures of this machine whatever else the probe wrote: a run reads them
    return machine, written + _keep(machine, folders, measured_by or _full_probe())


def written_lines(files: list[pathlib.Path], out: str | os.PathLike[str] | None) -> str:
    """What `slide-train probe` tells of the files it wrote (`probe_this_machine`'s list)."""
    kept = files[1:] if out is not None else files
    lines = [f"slide-train: wrote {files[0]}"] if out is not None else []
    lines.append(f"slide-train: kept as the last probe of this machine, which `finetune` and `plan` use without "
                 f"--machine: {' and '.join(map(str, kept))}")
    return "\n".join(lines)


def resolve_machine(path: str | os.PathLike[str] | None, disk_dir: Folder | list[Folder] | None = None) -> Machine:
    """The machine a run plans for: the machine file at `path` when given (as it is: a file describes a
    machine, maybe another one), then the file named by $SLIDE_MACHINE, else this machine's cached probe (with
    the disk under `disk_dir`; a list of folders: a drive each)."""
    path = path if path is not None else os.environ.get("SLIDE_MACHINE") or None
    if path is not None:
        return load_machine(path)
    if disk_dir is None or isinstance(disk_dir, (str, os.PathLike)) or len(disk_dir) == 1:
        return this_machine(disk_dir if disk_dir is None or isinstance(disk_dir, (str, os.PathLike)) else disk_dir[0])
    return this_machine(disk_dir[0]).with_drives([dataclasses.replace(this_machine(d).disk, dir=os.fspath(d))
                                                  for d in disk_dir])


def _announce(text: str) -> None:
    """One line on stderr (stdout may be a plan's JSON), and in the run's log.txt; of data-parallel ranks, the
    first speaks."""
    if os.environ.get("RANK", "0") != "0":
        return
    print(f"slide-train: {text}", file=sys.stderr, flush=True)
    logger().info("%s", text)


def _write(sections: dict, path: str | os.PathLike[str], measured_by: str) -> None:
    # Replaced whole (written beside it, then renamed): a reader, or a run started meanwhile, never sees half.
    path = pathlib.Path(path)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"# Slide machine file: measured by {measured_by}, {when}.\n"
              "# Sizes in GiB, rates in GB/s (1e9 bytes/s), bf16_tflops of dense matrix work, attention_tflops of\n"
              "# causal attention forward and backward (in slide_scheduler.causal_attention_flops' count; 0:\n"
              "# not measured), sdpa_tflops, fa4_tflops and flex_tflops each attention backend's at head_dim 256\n"
              "# (soft-capped at 50 where it can), experts_tflops of a mixture's routed MLP forward and backward (in\n"
              "# routed_expert_flops' count; 0: not measured), adamw_gparams in billions of fp32 parameters updated\n"
              "# per second (adamw_beside_copies: the share of it kept beside copies both ways); disk.path is\n"
              "# slide-io's path the disk rates are of (chosen from both paths' measured rates, disk.path_reason\n"
              "# says why).\n")
    body = yaml.safe_dump(sections, default_flow_style=None, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(header + body)
        os.replace(temporary, path)
    except BaseException:
        pathlib.Path(temporary).unlink(missing_ok=True)
        raise


def _keep(machine: Machine, disk_dir: Folder | list[Folder] | None, measured_by: str) -> list[pathlib.Path]:
    """Cache `machine` as this machine's last probe: its hardware's figures, and each drive's rates as those of
    its folder in `disk_dir` (where given). Returns the files written."""
    key, folder, sections = fingerprint(), cache_dir(), machine.to_dict()
    files = [folder / f"machine-{key}.yaml"]
    _write({name: sections[name] for name in ("gpu", "host", "pcie")}, files[0], measured_by)
    dirs = [] if disk_dir is None else [disk_dir] if isinstance(disk_dir, (str, os.PathLike)) else list(disk_dir)
    for drive, where in zip(machine.drives, dirs):
        files.append(_disk_file(folder, key, where))
        _write({"disk": {k: v for k, v in dataclasses.asdict(drive).items() if k != "dir"}}, files[-1], measured_by)
    return files


def _cached(path: pathlib.Path) -> Machine | None:
    # A damaged or hand-broken cache entry is measured again rather than failing the run; so is one an earlier
    # version wrote, which lacks a figure measured since (a rate it would otherwise read as 0, not measured)
    if not path.exists():
        return None
    try:
        machine = load_machine(path)
    except ConfigError:
        return None
    written = yaml.safe_load(path.read_text()) or {}
    sections = machine.to_dict()
    if any(set(sections[name]) - set(written[name] or {}) for name in written if name in sections):
        return None
    return machine


def _disk_file(folder: pathlib.Path, key: str, disk_dir: str | os.PathLike[str]) -> pathlib.Path:
    where = hashlib.sha256(os.path.realpath(os.fspath(disk_dir)).encode()).hexdigest()[:12]
    return folder / f"disk-{key}-{where}.yaml"


def _quick_probe() -> str:
    return f"a quick slide-scheduler {scheduler_version} probe on {_host()}"


def _full_probe() -> str:
    return f"slide-scheduler {scheduler_version} probe on {_host()}"


def _host() -> str:
    return platform.node() or "this host"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
