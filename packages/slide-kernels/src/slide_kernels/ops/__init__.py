"""One file per op: Triton kernels, their launchers, the autograd Function and the torch fallback."""

from .linear_cross_entropy import linear_cross_entropy
from .rms_norm import rms_norm
from .rope import rope
from .swiglu import swiglu

__all__ = ["linear_cross_entropy", "rms_norm", "rope", "swiglu"]
