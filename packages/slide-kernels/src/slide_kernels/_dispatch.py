"""Chooses between the Triton kernels and the torch fallbacks, per call, from the tensors' device.

Triton is imported here only: the ops take `triton`, `tl` and `jit` from this module, so the package imports
(and every op runs its torch fallback) where Triton is not installed or does not import.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # platforms without Triton (it is a Linux-only dependency), or a broken install
    triton = tl = None


def triton_available() -> bool:
    return triton is not None


def jit(fn):
    """`triton.jit`; without Triton the plain function, defined but never launched (use_triton() is False)."""
    return fn if triton is None else triton.jit(fn)


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton on CUDA tensors, or on any tensor under the interpreter; the torch fallback otherwise."""
    if not triton_available():
        return False
    if interpreting():
        return True
    return all(t.is_cuda for t in tensors)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def _patch_interpreter_scalars() -> None:
    """Let Triton's interpreter use runtime scalars as loop bounds under NumPy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts them with `int(array)`, which NumPy 2.4
    rejects for non-0-d arrays. We wrap its tensor patching so `__index__` reads the single element instead.
    Only runs under TRITON_INTERPRET=1; compiled kernels are untouched.
    """
    try:
        from triton.runtime import interpreter
    except Exception:  # pragma: no cover
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_slide_kernels", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._slide_kernels = True
    interpreter._patch_lang_tensor = patched


if interpreting() and triton_available():
    _patch_interpreter_scalars()
