"""The run's NVMe tier (engine.nvme): the folders its files go to (one per drive), read and checked here once,
the machine file's drive each folder is on, and the scratch a stopped run left there."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from typing import TYPE_CHECKING

from slide_scheduler import (
    DISK,
    EngineConfig,
    Machine,
    Placement,
    boundary_share,
    folders_of,
    unit_share,
)

from .errors import ConfigError
from .space import Size, check_writable

if TYPE_CHECKING:
    from .config import TrainConfig

# The default home of the NVMe tier (engine.nvme.dir), under output_dir: scratch, whose contents the checkpoints
# hold, so what a killed process left there is removed when the next run in the folder starts.
NVME_DIR = "nvme"
STATES_DIR, ACTIVATIONS_DIR = "states", "activations"  # its two folders


def nvme_dirs(cfg: TrainConfig, machine: Machine | None = None) -> list[pathlib.Path]:
    """The tier's folders, one per drive: engine.nvme.dir's (a folder or a list), else the folders of the drives
    `machine`'s file lists (`disks:`), else <output_dir>/nvme."""
    given = cfg.engine.nvme.dir
    if given:
        return [pathlib.Path(d) for d in ([given] if isinstance(given, str) else given)]
    if machine is not None and machine.disks:
        return [pathlib.Path(d.dir) for d in machine.disks]
    return [pathlib.Path(cfg.output_dir) / NVME_DIR]


def nvme_dir(cfg: TrainConfig, machine: Machine | None = None) -> pathlib.Path:
    """The tier's (first) folder."""
    return nvme_dirs(cfg, machine)[0]


def check_folders(cfg: TrainConfig, machine: Machine | None = None) -> list[pathlib.Path]:
    """The tier's folders, checked before anything is written to them: a folder the user named (engine.nvme.dir,
    or the machine file's drives) must exist and take files. It is never made by the run: on a drive that is not
    mounted it would fill the disk above. The run's own folder under output_dir is made once the run starts.
    Returns the folders."""
    folders = nvme_dirs(cfg, machine)
    if not cfg.engine.nvme.dir and not (machine is not None and machine.disks):
        check_writable("output_dir", folders[0])
        return folders
    key = "engine.nvme.dir" if cfg.engine.nvme.dir else "the machine file's disks"
    for folder in folders:
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            raise ConfigError(f"{key}: {folder} {what}; the disk tier's folders are not made by a run (on a drive "
                              f"that is not mounted one would fill the disk above it): create it on the drive you "
                              f"mean, or set engine.nvme.dir to an existing folder")
        check_writable(key, folder)
    return folders


def existing_parent(folder: pathlib.Path) -> pathlib.Path:
    """`folder`, or the nearest folder above it that exists (where a folder yet to be made is measured)."""
    folder = folder.absolute()
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def folders_text(folders: list[pathlib.Path]) -> str:
    return " and ".join(map(str, folders)) if len(folders) < 3 else ", ".join(map(str, folders))


def drive_of(folder: pathlib.Path, machine: Machine) -> int | None:
    """The machine file's drive `folder` is on: the one whose `dir` is the longest prefix of its path, else the
    one on the same filesystem (`st_dev`); None where none is."""
    real = os.path.realpath(folder)
    prefixes = [(len(d), i) for i, d in ((i, os.path.realpath(d.dir)) for i, d in enumerate(machine.drives) if d.dir)
                if real == d or real.startswith(d.rstrip(os.sep) + os.sep)]
    if prefixes:
        return max(prefixes)[1]
    device = _device_of(pathlib.Path(real))
    for i, drive in enumerate(machine.drives):
        if drive.dir and device is not None and _device_of(pathlib.Path(drive.dir)) == device:
            return i
    return None


def _device_of(path: pathlib.Path) -> int | None:
    """The filesystem of `path`, or of its nearest folder that exists (a tier folder is made at the run)."""
    for folder in (path, *path.parents):
        try:
            return os.stat(folder).st_dev
        except OSError:
            continue
    return None


def on_drives(machine: Machine, folders: list[pathlib.Path]) -> Machine:
    """`machine` with the disk tier on `folders`, each at the rates of the drive it is on (`drive_of`). A folder
    on none of the file's drives takes the first drive's rates, saying so. One folder and one drive: `machine`."""
    if len(folders) == 1 and not machine.disks:
        return machine
    drives = []
    for folder in folders:
        found = drive_of(folder, machine)
        if found is None and any(d.dir for d in machine.drives):
            warnings.warn(f"engine.nvme.dir {folder} is on none of the machine file's drives "
                          f"({', '.join(d.dir for d in machine.drives)}): planned at the first one's rates",
                          stacklevel=2)
        drives.append(dataclasses.replace(machine.drives[found or 0], dir=str(folder)))
    return machine.with_drives(drives)


def default_disk_folders(cfg: TrainConfig) -> list[str]:
    """The run's own folder of the NVMe tier under output_dir, unless engine.nvme.dir names others: cleared at the
    start (a killed run leaves files behind) and removed at the end. A folder of the user's choosing is left as it
    is."""
    return [] if cfg.engine.nvme.dir else [str(nvme_dir(cfg))]


def leftovers(cfg: TrainConfig, machine: Machine | None = None) -> list[pathlib.Path]:
    """Scratch stores a killed run left in folders of the user's own (engine.nvme.dir, or the machine file's
    drives), which are not cleared: the slide-io store folders under their states/ and activations/ folders."""
    if not cfg.engine.nvme.dir and not (machine is not None and machine.disks):
        return []
    return sorted(p for folder in nvme_dirs(cfg, machine) for sub in (STATES_DIR, ACTIVATIONS_DIR)
                  for p in (folder / sub).glob("slide-io-*"))


def tier_wants(p: Placement, engine_cfg: EngineConfig) -> list[tuple[str, pathlib.Path, Size]]:
    """What the tier's files take on each drive's folders, as the disk check counts them: (what, folder, size)
    for its boundary activations and its states (AdamW moments, and masters and gradients where there)."""
    states_dirs, acts_dirs = (folders_of(d) if d else [] for d in (engine_cfg.nvme_dir, engine_cfg.activation_dir))
    out = []
    for drive, folder in enumerate(acts_dirs):
        blocks = sum(1 for b, tier in enumerate(p.boundary_tiers) if tier == DISK and p.boundary_drive(b) == drive)
        out.append(("boundary activations (engine.nvme.dir)", pathlib.Path(folder),
                    Size(blocks * boundary_share(p).size)))
    for drive, folder in enumerate(states_dirs):
        states = sum(unit_share(p, u).size for u in p.on_disk if p.drive_of(u) == drive)
        out.append(("AdamW states on disk (engine.nvme.dir)", pathlib.Path(folder), Size(states)))
    return out


def slow_disk_warning(record: dict, machine: Machine, cfg: TrainConfig) -> str | None:
    """Where a step's NVMe tier moved its bytes much slower than the machine file's disk figures (the plan's
    prediction, and every step, rest on them): what to tell the user; None otherwise."""
    busy, read, written = (record.get(k, 0.0) for k in ("disk_busy_s", "disk_read_gb", "disk_written_gb"))
    disk = machine.disk
    if not busy or not (read or written) or not (disk.read_gbps and disk.write_gbps):  # (no figures: no promise)
        return None
    expected = read / disk.read_gbps + written / disk.write_gbps
    if busy <= 1.5 * expected or busy - expected <= 0.5:
        return None
    folder = nvme_dir(cfg)
    return (f"step {record['step']}: the NVMe tier under {folder} moved {read:.2f} GB in and {written:.2f} GB out "
            f"in {busy:.1f} s ({(read + written) / busy:.2f} GB/s); the machine file says {disk.read_gbps:g} GB/s "
            f"read and {disk.write_gbps:g} GB/s write ({expected:.1f} s), so steps run slower than the plan's "
            f"{record['predicted_step_s']:.1f} s. `slide-train probe --disk {folder}` measures this disk, or set "
            "engine.nvme.dir on a faster one")
