"""One file per op: Triton kernels, their launchers, the autograd Function and the torch fallback."""

from .geglu import geglu
from .linear_cross_entropy import linear_cross_entropy
from .moe_experts import moe_experts
from .rms_norm import rms_norm
from .rope import partial_rope, rope, rope_cast_back
from .swiglu import swiglu, swiglu_gate_up

__all__ = [
    "geglu",
    "linear_cross_entropy",
    "moe_experts",
    "partial_rope",
    "rms_norm",
    "rope",
    "rope_cast_back",
    "swiglu",
    "swiglu_gate_up",
]
