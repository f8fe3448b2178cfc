"""GPU slots: pre-allocated device buffers, each able to hold any block of a stack.

A slot owns flat parameter and gradient buffers and a template module whose parameters are views into them, so
loading a block is one copy into the slot and running it needs no allocation. A stack whose blocks come in several
shapes (dense and mixture-of-experts layers, say) gives a slot one template module per shape, each bound to the
start of the same buffers, which are sized for the largest.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from .layout import FlatLayout


class Slot:
    def __init__(self, layout: FlatLayout, module: nn.Module, device: torch.device, dtype: torch.dtype,
                 shape: Hashable = None, more: dict[Hashable, tuple[FlatLayout, nn.Module]] | None = None):
        """`layout` and `module` (which may be built on the meta device: binding gives it real parameters) are the
        block shape `shape`; `more` maps the other shapes the slot holds to theirs."""
        self.layout = layout
        self.shapes = {shape: (layout, module), **(more or {})}
        numel = max(lay.numel for lay, _ in self.shapes.values())
        self.params = torch.zeros(numel, dtype=dtype, device=device)
        self.grads = torch.zeros(numel, dtype=dtype, device=device)
        self.module = module
        for lay, mod in self.shapes.values():
            lay.bind(mod, self.params[:lay.numel], self.grads[:lay.numel])
        self.unit: int | None = None  # which block the slot holds now
        # A narrow (bf16) slot lands fp32 masters in its gradient buffer, which is free while a block loads:
        # the fp32 -> bf16 conversion then costs the device a few microseconds and the host nothing.
        whole = self.grads.numel() * self.grads.element_size() // 4
        self.landing = self.grads.view(torch.uint8)[: whole * 4].view(torch.float32) if dtype != torch.float32 \
            else None

    def module_of(self, shape: Hashable = None) -> nn.Module:
        """The template module of a block shape, its parameters and gradients views of the slot's buffers."""
        return self.shapes[shape][1]

    @property
    def narrow(self) -> bool:
        """Whether a master lands through the landing zone (fp32 in, narrowed on the device)."""
        return self.landing is not None and self.landing.numel() > 0

    def pieces(self, numel: int) -> list[tuple[int, int, int, torch.Tensor]]:
        """How a master of `numel` fp32 elements lands in a narrow slot: (start, end, buffer, landing view) per
        piece. The pieces alternate between the two halves of the landing zone (buffers 0 and 1), so one can be
        copied in while the other is narrowed; a zone too small to halve is one buffer."""
        halves = 2 if self.landing.numel() >= 2 else 1
        size = self.landing.numel() // halves
        return [(start, min(start + size, numel), k % halves,
                 self.landing[(k % halves) * size:][: min(size, numel - start)])
                for k, start in enumerate(range(0, numel, size))]

    def load(self, master: torch.Tensor, unit: int | None = None, non_blocking: bool = False) -> None:
        """Copy a flat host master (fp32) into the slot's parameters, in the slot's dtype.

        The slot's gradient buffer is overwritten when the dtypes differ: it must not hold anything still needed,
        and it holds master bytes afterwards, so zero it before a backward accumulates into it. (The engine
        queues the same pieces itself, copies and narrowing on separate streams.)
        """
        if master.dtype == self.params.dtype or not self.narrow:
            self.params.copy_(master, non_blocking=non_blocking)
        else:
            for start, end, _, landing in self.pieces(master.numel()):
                landing.copy_(master[start:end], non_blocking=non_blocking)
                self.params[start:end].copy_(landing)
        self.unit = unit


class SlotQueue:
    """A fixed ring of `count` slots (the window); blocks take them round-robin. `more`: the other block shapes
    each slot holds (shape -> its layout and a maker of its module), beside `layout`'s, shape `shape`."""

    def __init__(self, layout: FlatLayout, make_module: Callable[[], nn.Module], count: int,
                 device: torch.device, dtype: torch.dtype, shape: Hashable = None,
                 more: dict[Hashable, tuple[FlatLayout, Callable[[], nn.Module]]] | None = None):
        if count < 1:
            raise ValueError("a slot queue needs at least one slot")
        self.slots = [Slot(layout, make_module(), device, dtype, shape,
                           {k: (lay, make()) for k, (lay, make) in (more or {}).items()}) for _ in range(count)]
        self._next = 0

    def __len__(self) -> int:
        return len(self.slots)

    def next(self) -> Slot:
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        return slot

    @property
    def nbytes(self) -> int:
        return sum(s.params.nbytes + s.grads.nbytes for s in self.slots)
