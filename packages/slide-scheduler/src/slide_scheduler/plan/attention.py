"""Which attention backend runs each block: among those that compute its layer exactly (the front end's list, in
its order of preference), the one the machine file rates fastest for the layer's head dim."""

from __future__ import annotations

from .machine import Gpu
from .shapes import Shapes

WIDE_HEAD = 128  # head dims over this take a backend's own rate (measured at 256); others the plain causal rate


def rate_of(gpu: Gpu, backend: str, head_dim: int) -> float:
    """TFLOP/s of `backend` for a layer of `head_dim` on `gpu` (causal_attention_flops' count): its own measured
    rate for wide heads, else (or where not measured) the machine's `attention_tflops`; 0: not measured."""
    own = getattr(gpu, f"{backend}_tflops", 0.0) if head_dim > WIDE_HEAD else 0.0
    return own or gpu.attention_tflops


def chosen(shapes: Shapes, gpu: Gpu, tiled: bool = False) -> tuple[str, ...]:
    """Each block's attention backend (empty where the shapes name none): the fastest of its candidates on `gpu`
    (`tiled`: of those that run query tiles), the first of them where rates tie."""
    if not shapes.attention_backends:
        return ()
    lists = (shapes.backends_tiled(u) if tiled else shapes.backends(u) for u in range(1, shapes.num_blocks + 1))
    return tuple(max(names, key=lambda n: (rate_of(gpu, n, shapes.head_dim), -names.index(n))) if names else ""
                 for names in lists)
