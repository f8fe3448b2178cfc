"""Flat per-unit parameter layout: every parameter of a module as a view into one contiguous buffer.

One buffer per unit lets a whole block cross PCIe in one copy, lets the CPU optimizer run over one long tensor,
and lets a GPU slot hold any block of a homogeneous stack (same layout, different contents).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Offsets are padded to this many elements (128 bytes in bf16) so that every view starts aligned for
# vectorized copies and kernels. Padding elements stay zero: zero grad, zero param, untouched by AdamW.
ALIGN = 64


@dataclass(frozen=True)
class Entry:
    name: str
    shape: torch.Size
    offset: int
    numel: int


class FlatLayout:
    """Where each (deduplicated) parameter of a module sits in a flat buffer.

    Tied parameters (one Parameter reachable under two names) get a single entry, so the tie survives binding.
    A layout split into `shards` equal parts (data-parallel ranks) ends in zero padding up to a multiple of
    `shards * align`; the offsets are those of one shard, and `base_numel` is that layout's length.
    """

    def __init__(self, module: nn.Module, align: int = ALIGN, shards: int = 1):
        entries, offset = [], 0
        for name, p in module.named_parameters():
            entries.append(Entry(name, p.shape, offset, p.numel()))
            offset += -(-p.numel() // align) * align
        self.entries: tuple[Entry, ...] = tuple(entries)
        self.base_numel = offset
        self.numel = -(-offset // (align * shards)) * align * shards

    def signature(self) -> tuple:
        return tuple((e.name, tuple(e.shape)) for e in self.entries)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> view of `flat` shaped like the parameter."""
        self._check(flat)
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}

    def pack(self, module: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """Copy the module's parameter values into `out` (any dtype/device); padding is zeroed."""
        self._check(out)
        out.zero_()
        params = dict(module.named_parameters())
        for name, view in self.views(out).items():
            view.copy_(params[name].detach())
        return out

    def bind(self, module: nn.Module, params: torch.Tensor, grads: torch.Tensor | None = None) -> None:
        """Replace the module's parameters by views into the flat buffers (any device, meta modules too).

        Each new Parameter is set under every name the old one had, so ties survive. With `.grad` preset to a
        view, autograd accumulates in place into the flat gradient buffer.
        """
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for full, p in module.named_parameters(remove_duplicate=False):
            parent, _, attr = full.rpartition(".")
            owners.setdefault(id(p), []).append((module.get_submodule(parent), attr))
        named = dict(module.named_parameters())
        grad_views = self.views(grads) if grads is not None else {}
        for name, view in self.views(params).items():
            old = named[name]
            new = nn.Parameter(view, requires_grad=old.requires_grad)
            new.grad = grad_views.get(name)
            for parent, attr in owners[id(old)]:
                setattr(parent, attr, new)

    def _check(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() not in (self.numel, self.base_numel):
            raise ValueError(f"flat buffer has shape {tuple(flat.shape)}, layout needs ({self.numel},)")
