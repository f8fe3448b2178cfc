"""Data parallelism: the ranks `torchrun` starts, each running the sliding engine on its share of every step.

    torchrun --nproc-per-node 2 -m slide_train finetune config.yaml

A step's rows are those of a one-process run with `micro_batch_size x ranks` rows per micro-batch: every rank
reads the same rows (the data is small beside the model) and keeps micro-batches rank, rank + ranks, ... of
`grad_accum x ranks` micro-batches of `micro_batch_size` rows. Results do not depend on the rank count.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from slide_scheduler import Ranks, host_cores

from .errors import ConfigError
from .progress import hide_bars


def world_size() -> int:
    """The ranks of this run, as torchrun set them (1 when not started by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def ranks_here() -> int:
    """The ranks on this host, which share its memory."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def join(device: str) -> Ranks:
    """This process's place among the ranks: the process group (NCCL on GPUs, gloo on CPUs), joined once
    (`device`: engine.device, already checked by the trainer's `resolve_device`)."""
    if world_size() == 1:
        return Ranks()
    if not dist.is_initialized():
        cuda = device != "cpu" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank())
            # NVLink multicast can take a shared host's GPUs out of service; rings and trees do the same work
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl" if cuda else "gloo")
        # The ranks of a host split its cores between their host optimizers (torchrun's default is one thread)
        torch.set_num_threads(max(1, host_cores() // ranks_here()))
    if dist.get_rank() > 0:  # the first rank speaks for all (log.say, too): the others' bars and warnings repeat it
        hide_bars()
        warnings.simplefilter("ignore")
    return Ranks()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_device(device: str, ranks: int) -> str:
    """engine.device for this rank: its own GPU (LOCAL_RANK) when several ranks run on CUDA."""
    if ranks > 1 and device.startswith("cuda:"):
        raise ConfigError(f"engine.device={device}: with several ranks each takes the GPU of its LOCAL_RANK; set "
                          "engine.device to cuda or auto, and pick the GPUs with CUDA_VISIBLE_DEVICES")
    if ranks > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{local_rank()}"
    return device


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
