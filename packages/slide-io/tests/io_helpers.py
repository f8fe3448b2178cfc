"""Helpers for the slide-io tests: random data of every stored dtype, aligned buffers, raw bytes."""

from __future__ import annotations

import torch

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int8, torch.bool]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def aligned_tensor(numel: int, dtype: torch.dtype, align: int = 4096) -> torch.Tensor:
    """A host tensor whose data starts on an `align` boundary (what pinned allocations give), for O_DIRECT."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel * itemsize + align, dtype=torch.uint8)
    skip = -raw.data_ptr() % align
    out = raw[skip : skip + numel * itemsize].view(dtype)
    assert out.data_ptr() % align == 0
    return out


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's memory, taken through torch alone: the independent reference for file contents."""
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())

