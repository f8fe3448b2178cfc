"""Units and their states: each unit's layout, its shard of the fp32 master on the host (or on disk), and the
checkpoint accessors over every unit's master and AdamW state, whichever tier holds them (`UnitStates`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from slide_memory import AdamWConfig, FlatAdamW, FlatLayout, HostAdamW, Slot, host_zeros

from .ranks import Ranks
from .stack import Stack


class Unit:
    """One trainable unit (the edges, or one block): its layout and fp32 master weights on the host (this rank's
    shard [start, end) of them).

    The master is pinned and is what crosses PCIe when the unit loads (slots narrow it to bf16 on the device), so
    the host keeps no compute-dtype copy: 12 bytes per parameter with the AdamW states. A unit whose master is on
    disk (`on_disk`) keeps at most such a copy, `params` (`params_dtype` given), which its updates write and its
    loads take; without one, its loads read the master from disk.
    """

    def __init__(self, layout: FlatLayout, on_disk: bool = False, params_dtype: torch.dtype | None = None,
                 ranks: Ranks | None = None):
        self.layout = layout
        self.ranks = ranks = ranks or Ranks()
        self.start, self.end = ranks.shard(layout.numel)
        numel = self.end - self.start
        self.master = None if on_disk else host_zeros(numel, torch.float32)
        self.params = host_zeros(numel, params_dtype) if on_disk and params_dtype is not None else None

    def slot_shard(self, slot: Slot) -> torch.Tensor:
        """This rank's shard of `slot`'s parameters (all of them, alone)."""
        return slot.params[self.start:self.end]

    def whole(self, shard: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `shard` of the unit's flat host tensor, without the padding that made it split evenly, on
        the first rank (None on the others); one rank's is the tensor itself."""
        if not self.ranks.sharded:
            return shard
        whole = self.ranks.gather_host(shard)
        return None if whole is None else whole[:self.layout.base_numel]

    def shard_of(self, whole: torch.Tensor, unit: int) -> torch.Tensor:
        """This rank's shard of the unit's (number `unit`) flat tensor given whole (padded or not); one rank's is
        the whole."""
        if not self.ranks.sharded:
            return whole
        if whole.numel() not in (self.layout.numel, self.layout.base_numel):
            raise ValueError(f"unit {unit}: {whole.numel()} elements given, its layout has {self.layout.base_numel}")
        out = torch.zeros(self.end - self.start, dtype=whole.dtype)
        piece = whole[self.start:min(self.end, whole.numel())]
        out[:piece.numel()] = piece
        return out

    def keep_shard(self, whole: torch.Tensor) -> None:
        """Keep this rank's shard of the unit's whole master (sharded; otherwise the master is the whole)."""
        if self.ranks.sharded:
            self.master.copy_(whole[self.start:self.end])


class UnitStates:
    """Every unit's master and AdamW state as checkpoints see them, wherever they live: the host optimizer's, the
    disk tier's files, or the device optimizers of resident units (`on_device`)."""

    def __init__(self, units: list[Unit], optimizer: HostAdamW, disk, on_disk: set[int],
                 on_device: dict[int, FlatAdamW]):
        self.units, self.optimizer, self.disk, self.on_device = units, optimizer, disk, on_device
        self.on_disk = on_disk  # units whose moments live in the disk tier's files

    def names(self) -> list[str]:
        return ["edges"] + [f"block.{i}" for i in range(len(self.units) - 1)]

    def optimizer_state(self, unit: int) -> dict[str, torch.Tensor]:
        """A unit's AdamW state as host tensors (moments on disk are their files memory-mapped, to read before the
        unit's next update). Sharded, every rank calls it and gets the whole unit's on the first rank, in the
        layout of one process (`base_numel` long); None on the others."""
        if unit in self.on_device:
            return self.on_device[unit].state_tensors(to_host=True)
        if unit in self.on_disk:
            opt, moments = self.optimizer.units[unit], self.disk.state(unit)
            if not opt.step_count or moments is None:
                return {}
            return {"step": opt.steps[0].clone(), "exp_avg": moments[0], "exp_avg_sq": moments[1]}
        state = self.optimizer.state_tensors(unit)
        # (sharded, every rank has stepped alike: all have a state or none has)
        return {k: v if k == "step" else self.units[unit].whole(v) for k, v in state.items()}

    def load_optimizer_state(self, unit: int, tensors: dict[str, torch.Tensor]) -> None:
        """Load `optimizer_state(unit)` output (sharded: each rank takes its shard of the whole)."""
        if unit in self.on_device:
            self.on_device[unit].load_state_tensors(tensors)
        elif unit in self.on_disk:
            self.disk.load(unit, tensors.get("exp_avg"), tensors.get("exp_avg_sq"))
            for step in self.optimizer.units[unit].steps:
                step.fill_(float(tensors["step"]) if tensors else 0.0)
        else:
            self.optimizer.load_state_tensors(unit, {k: v if k == "step" else self.units[unit].shard_of(v, unit)
                                                     for k, v in tensors.items()})

    def master(self, unit: int) -> torch.Tensor:
        """A unit's flat fp32 master: the host tensor itself, or its file on disk memory-mapped (read it before the
        unit's next update). Sharded, every rank calls it; the first gets the whole master, gathered, in the layout
        of one process (`base_numel` long), the others None."""
        u = self.units[unit]
        if u.master is None:
            return self.disk.master(unit)
        return u.whole(u.master)

    def load_master(self, unit: int, master: torch.Tensor) -> None:
        """Replace a unit's fp32 master (sharded, each rank takes its shard of the whole)."""
        load_master(self.units, self.disk, unit, master)


def load_master(units: list[Unit], disk, unit: int, master: torch.Tensor) -> None:
    """Replace a unit's fp32 master, in host memory or on disk (with the copy of its parameters its loads take)."""
    u = units[unit]
    if u.master is not None:
        u.master.copy_(u.shard_of(master, unit))
        return
    disk.load_master(unit, master)
    if u.params is not None:
        u.params.copy_(master)  # what its loads take, rounded as a slot would round the master


def host_optimizer(units: list[Unit], p, config: AdamWConfig, disk, tail_from: int) -> HostAdamW:
    """The host optimizer over every unit's master as the placement `p` puts it. Only the states of units updated
    on the device cross PCIe: only they are page-locked. A master on disk is bound before each update, as its
    moments are (a staging buffer stands in until then). The edges' chunks split at `tail_from`, where the part
    only the tail reads begins."""
    resident, away, n = p.resident, p.masters_on_disk, len(units)
    masters = [None if u in resident else disk.slots[0][2][:unit.layout.numel] if u in away else unit.master
               for u, unit in enumerate(units)]
    return HostAdamW(masters, config, p.run.states_dtype,
                     pinned=[p.run.cuda and u in p.streamed for u in range(n)],
                     bounds=[tuple(b - units[0].start for b in (tail_from,) if units[0].start < b < units[0].end)]
                     + [()] * (n - 1),
                     external=[u in p.on_disk for u in range(n)])


def load_weights(stack: Stack, units: list[Unit], edge_layout: FlatLayout, disk,
                 loaded: Callable[[int], None] | None = None) -> None:
    """The model's weights into every unit's master (this rank's shard of it; on disk where the unit's master is
    there, through the disk tier's first staging slot, free until the first update); `loaded(i)` after block i."""
    largest = max(u.layout.numel for u in units)
    whole = torch.zeros(largest) if units[0].ranks.sharded else None

    def whole_master(unit: int) -> torch.Tensor:  # (loaded whole, kept as this rank's shard)
        if whole is None:
            return units[unit].master
        return whole[:units[unit].layout.numel].zero_()  # (padding stays zero)

    with torch.no_grad():
        stack.load_edges(edge_layout.views(master := whole_master(0)))
        units[0].keep_shard(master)
        for i in range(len(units) - 1):
            u = units[i + 1]
            if u.master is not None:
                stack.load_block(i, u.layout.views(master := whole_master(i + 1)))
                u.keep_shard(master)
            else:
                staged = disk.slots[0][2][:u.layout.numel]
                stack.load_block(i, u.layout.views(staged))
                load_master(units, disk, i + 1, staged)
            if loaded is not None:
                loaded(i)


def tail_only_from(edges, layout: FlatLayout) -> int:
    """Flat offset from which every edge parameter is one only the tail reads (`edges.tail_only`, a tuple of
    parameter names; a parameter tied to one the head reads does not count), or the layout's end."""
    names: dict[int, list[str]] = {}
    for name, p in edges.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    declared = set(getattr(edges, "tail_only", ()))
    tail = {n for group in names.values() if set(group) <= declared for n in group}
    start = layout.numel
    for entry in reversed(layout.entries):
        if entry.name not in tail:
            break
        start = entry.offset
    return start


def buffers_to(edges, device: torch.device) -> None:
    """The edges' buffers (rotary tables, say) to the device, where they stay."""
    for module in edges.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
