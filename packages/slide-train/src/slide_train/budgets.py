"""A run's memory budgets: the share of a GPU, of host memory and of the disk that a plan may fill, each the
smaller of the machine's figure and the config's cap."""

from __future__ import annotations

from slide_scheduler import HOST, Budgets, Machine, Plan

from .config import TrainConfig

GIB = 2**30
GPU_USABLE = 0.92  # of a card or a cap: the rest for the CUDA context and what the plan does not see
HOST_USABLE = 0.95  # of host memory: the rest for the operating system and the data pipeline


def budgets_for(machine: Machine, cuda: bool, cap_gib: float | None, card_gib: float | None = None,
                ranks_here: int = 1, host_cap_gib: float | None = None, ram_gib: float | None = None) -> Budgets:
    """Each budget is the smaller of the machine's figure and the config's cap (and, running, the card or the RAM
    here); a GPU's is one rank's, the host's shared by the `ranks_here` ranks on it."""
    gpu = None
    if cuda:
        sizes = [x for x in (machine.gpu.memory_gib or None, cap_gib, card_gib) if x]
        gpu = GPU_USABLE * min(sizes) * GIB if sizes else None
    sizes = [x for x in (machine.host.memory_gib or None, host_cap_gib, ram_gib) if x]
    host = HOST_USABLE * min(sizes) * GIB / ranks_here if sizes else None
    # (0: not measured here; several drives: their space together, the placement keeps each drive's share in its own)
    free = sum(d.free_gib for d in machine.drives) if all(d.free_gib for d in machine.drives) else 0
    disk = free * GIB if free else None
    return Budgets(gpu=gpu, host=host, disk=disk)


def host_limit_problem(plan: Plan, cfg: TrainConfig) -> str | None:
    """Where host memory does not fit a budget that engine.host_memory_limit_gb set: a line that says so."""
    cap, b = cfg.engine.host_memory_limit_gb, plan.budgets
    if cap is None or b.host is None or plan.placement.bytes(HOST) <= b.host:
        return None
    return (f"engine.host_memory_limit_gb={cap:g} sets that budget ({HOST_USABLE:.0%} of it, the rest for the "
            f"data pipeline and the operating system)")
