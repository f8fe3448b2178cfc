"""Learning-rate schedules: linear warmup, then constant, cosine or linear decay to `min_lr_ratio * lr`."""

from __future__ import annotations

import math


def lr_at(step: int, total: int, lr: float, warmup: int, decay: str, min_ratio: float) -> float:
    """The learning rate of optimizer step `step` (0-based) of `total`."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if decay == "constant" or total <= warmup + 1:
        return lr
    progress = (step - warmup) / (total - warmup - 1)
    if decay == "linear":
        factor = 1.0 - progress
    elif decay == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown decay {decay!r}")
    return lr * (min_ratio + (1.0 - min_ratio) * factor)
