"""The causal-LM loss of the tail: summed token cross-entropy straight from hidden states.

On CUDA it is slide-kernels' fused linear cross-entropy, which never materializes the [tokens, vocab] logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of cross-entropy(hidden @ weight.T, targets); targets of -100 are ignored."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=-100, reduction="sum")
