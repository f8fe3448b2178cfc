"""Fused Triton kernels for LLM training (RMSNorm, RoPE, SwiGLU, linear cross-entropy), with torch fallbacks.

Dispatch: Triton on CUDA tensors, or anywhere under TRITON_INTERPRET=1; plain torch on CPU otherwise.
"""

from .__about__ import __version__
from .modules import LinearCrossEntropy, RMSNorm, SwiGLUMLP
from .ops import linear_cross_entropy, rms_norm, rope, swiglu
from .patching import apply_to

__all__ = [
    "LinearCrossEntropy",
    "RMSNorm",
    "SwiGLUMLP",
    "__version__",
    "apply_to",
    "linear_cross_entropy",
    "rms_norm",
    "rope",
    "swiglu",
]
