"""nn.Module wrappers around the ops, drop-in for the HF RMSNorms, gated MLPs, MoE experts and lm-head + loss."""

from __future__ import annotations

import torch
from torch import nn

from .ops import geglu, linear_cross_entropy, moe_experts, rms_norm, swiglu, swiglu_gate_up


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; `offset=1.0, casting_mode="gemma"` gives Gemma's `1 + weight` norm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
                 init: float | None = None, device=None, dtype=None):
        super().__init__()
        fill = (1.0 - offset) if init is None else init
        self.weight = nn.Parameter(torch.full((hidden_size,), fill, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, self.offset, self.casting_mode)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}"


class SwiGLUMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with bias-free projections, the Llama/Qwen/Mistral MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class GeGLUMLP(SwiGLUMLP):
    """`down(gelu_tanh(gate(x)) * up(x))`, the Gemma MLP (`gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class SwiGLUGateUpMLP(nn.Module):
    """`down(silu(gate) * up)` with gate and up the halves of one `gate_up_proj` output, the Phi-3 MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_gate_up(self.gate_up_proj(x)))


class MoEExperts(nn.Module):
    """A mixture's experts as transformers stores them, `gate_up_proj` [E, 2I, H] (gate rows first) and
    `down_proj` [E, H, I]; `forward(hidden_states, top_k_index, top_k_weights)` as transformers' experts module
    (Qwen3-MoE, OLMoE, Mixtral), through `moe_experts`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


class LinearCrossEntropy(nn.Module):
    """The loss of a linear head: `forward(hidden, weight, labels)` with the options of `linear_cross_entropy`.

    It holds no parameters, so it can sit next to an existing `lm_head` (pass `lm_head.weight`).
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 softcap: float | None = None, z_loss: float = 0.0):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.softcap, self.z_loss = label_smoothing, softcap, z_loss

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                bias: torch.Tensor | None = None, normalizer=None) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, labels, bias=bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, normalizer=normalizer,
                                    label_smoothing=self.label_smoothing, softcap=self.softcap,
                                    z_loss=self.z_loss)
