"""The run's NVMe tier (engine.nvme): whether the config puts anything on disk, the folder its files go to, and
the scratch a stopped run left there."""

from __future__ import annotations

import pathlib

from .config import TrainConfig

# The default home of the NVMe tier (engine.nvme.dir), under output_dir: scratch, whose contents the checkpoints
# hold, so what a killed process left there is removed when the next run in the folder starts.
NVME_DIR = "nvme"
STATES_DIR, ACTIVATIONS_DIR = "states", "activations"  # its two folders


def nvme_dir(cfg: TrainConfig) -> pathlib.Path:
    return pathlib.Path(cfg.engine.nvme.dir or pathlib.Path(cfg.output_dir) / NVME_DIR)


def uses_disk(cfg: TrainConfig) -> bool:
    fraction = cfg.engine.nvme.fraction
    return fraction == "auto" or fraction > 0 or cfg.engine.activation_offload in ("nvme", "auto")


def asks_for_disk(cfg: TrainConfig) -> bool:
    """Whether the config itself puts something on disk (`auto` leaves it to the plan)."""
    return cfg.engine.nvme.fraction not in (0, "auto") or cfg.engine.activation_offload == "nvme"


def default_disk_folders(cfg: TrainConfig) -> list[str]:
    """The run's own folder of the NVMe tier under output_dir, where it uses one: cleared at the start (a killed
    run leaves files behind) and removed at the end. A folder of the user's choosing is left as it is."""
    return [str(nvme_dir(cfg))] if uses_disk(cfg) and not cfg.engine.nvme.dir else []


def leftovers(cfg: TrainConfig) -> list[pathlib.Path]:
    """Scratch stores a killed run left in a folder of the user's own (engine.nvme.dir), which is not cleared:
    the slide-io store folders under its states/ and activations/ folders."""
    if not cfg.engine.nvme.dir:
        return []
    folder = pathlib.Path(cfg.engine.nvme.dir)
    return sorted(p for sub in (STATES_DIR, ACTIVATIONS_DIR) for p in (folder / sub).glob("slide-io-*"))
