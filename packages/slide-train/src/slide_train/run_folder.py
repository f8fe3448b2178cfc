"""A run's folder (output_dir) before the run starts: an earlier run there is refused, or, with --overwrite,
the files it wrote are found for deleting (and nothing else)."""

from __future__ import annotations

import pathlib

from .checkpoint import list_checkpoints
from .config import TrainConfig
from .errors import CheckpointError, ConfigError
from .export import MARKER as EXPORT_MARKER
from .export import is_earlier_export
from .log import LOG_FILE

# Files a run writes into its directory, which --overwrite=true deletes; in its folders it deletes only what
# `earlier_outputs` names (config.yaml and base-model/ are rewritten by the new run).
RUN_FILES = ("metrics.jsonl", "loss.png", "timeline.png", "trace.json", LOG_FILE)


def refuse_earlier_run(cfg: TrainConfig) -> None:
    """An output_dir that holds an earlier run (checkpointed or not) is refused, unless the run resumes or
    overwrites it: before anything is loaded or written."""
    run_dir = pathlib.Path(cfg.output_dir)
    earlier = list_checkpoints(run_dir / "checkpoints")
    metrics = run_dir / "metrics.jsonl"
    if (earlier or metrics.is_file()) and not cfg.resume and not cfg.overwrite:
        what = (f"checkpoints up to {earlier[-1].name}: continue it with --resume=auto," if earlier else
                "metrics.jsonl, no checkpoint to continue from:")
        raise CheckpointError(
            f"{run_dir} holds an earlier run ({what} start afresh there with --overwrite=true), or choose "
            "another output_dir")


def earlier_outputs(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """What --overwrite deletes: the files and folders an earlier run wrote, and nothing else. A folder of
    ours that holds something we did not write keeps that (an export folder without our marker is refused)."""
    out = [run_dir / name for name in RUN_FILES]
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        out += [p for p in checkpoints.iterdir() if p.name.startswith((".step-", "step-"))]
    tensorboard = run_dir / "tensorboard"
    if tensorboard.is_dir():
        out += list(tensorboard.glob("events.out.tfevents.*"))
    export = run_dir / "export"
    if export.is_dir():
        if not is_earlier_export(export):
            raise ConfigError(f"--overwrite: {export} was not written by slide-train (no {EXPORT_MARKER} in it); "
                              "move it away, or choose another output_dir")
        out.append(export)
    return [p for p in out if p.exists()]
