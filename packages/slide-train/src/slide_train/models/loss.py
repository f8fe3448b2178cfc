"""The causal-LM loss of the tail: summed token cross-entropy straight from hidden states.

slide-kernels' fused linear cross-entropy never materializes the [tokens, vocab] logits (Triton on CUDA, a
chunked torch path on the CPU), which is what keeps a 128k vocabulary from setting the step's peak memory.
"""

from __future__ import annotations

import torch

from slide_kernels import linear_cross_entropy

from ..data.formats import IGNORE


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """Sum over tokens of cross-entropy(hidden @ weight.T + bias, targets); targets of IGNORE (-100) are ignored.
    With `softcap` c the logits are c * tanh(logits / c) first (Gemma 2's final soft-capping)."""
    extra = {"bias": bias} if bias is not None else {}
    if softcap is not None:
        extra["softcap"] = softcap
    return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                reduction="sum", **extra)


def loss_rows(targets: torch.Tensor) -> torch.Tensor:
    """The flat indices of the tokens that have a target. Found on the host, where the batch is made: its
    length is then known without reading anything back from the device, and the tail runs the lm head on those
    rows only (a chat or instruction prompt, whose tokens carry no target, costs no logits)."""
    return (targets.reshape(-1) != IGNORE).nonzero().squeeze(1)
