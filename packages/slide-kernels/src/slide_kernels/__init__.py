"""Fused Triton kernels for LLM training (RMSNorm, RoPE, SwiGLU, GeGLU, MoE experts, linear cross-entropy), with
torch fallbacks.

Dispatch: Triton on CUDA tensors, or anywhere under TRITON_INTERPRET=1; plain torch on CPU otherwise.
"""

from .__about__ import __version__
from .modules import GeGLUMLP, LinearCrossEntropy, MoEExperts, RMSNorm, SwiGLUGateUpMLP, SwiGLUMLP
from .ops import geglu, linear_cross_entropy, moe_experts, partial_rope, rms_norm, rope, swiglu, swiglu_gate_up
from .patching import FamilyPatch, apply_to, family_patch

__all__ = [
    "FamilyPatch",
    "GeGLUMLP",
    "LinearCrossEntropy",
    "MoEExperts",
    "RMSNorm",
    "SwiGLUGateUpMLP",
    "SwiGLUMLP",
    "__version__",
    "apply_to",
    "family_patch",
    "geglu",
    "linear_cross_entropy",
    "moe_experts",
    "partial_rope",
    "rms_norm",
    "rope",
    "swiglu",
    "swiglu_gate_up",
]
