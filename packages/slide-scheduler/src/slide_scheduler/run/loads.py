"""Loads: queuing a unit's newest parameters into a slot, on the h2d lane (copies) and the land lane (kernels), as
its update kind and the tier of its master say."""

from __future__ import annotations

import torch

from slide_memory import Slot, host_zeros

from ..plan.sizes import LOAD_SLOTS
from .lanes import DONE, Lanes, Signal
from .ranks import Ranks
from .updater import UpdateWaits


class Loads:
    """A unit's load into a slot: its update kind's where that runs at the load (a device update) or keeps them
    apart (speculated); otherwise its master (or its copy in the compute dtype) once its host update has written
    it and any device update's store is home. Masters read from disk for loads (`read_from_disk`) wait in a ring of
    host buffers (pinned on CUDA) until they have crossed to the device."""

    def __init__(self, units: list, update_of: dict, stream, *, lanes: Lanes, waits: UpdateWaits, ranks: Ranks,
                 disk, read_from_disk: bool, numel: int):
        self.units, self.update_of, self.stream = units, update_of, stream
        self.lanes, self.waits, self.ranks, self.disk = lanes, waits, ranks, disk
        self.ring = [host_zeros(numel, torch.float32) for _ in range(LOAD_SLOTS)] if read_from_disk else []
        self.ring_free = [DONE] * len(self.ring)
        self.ring_next = 0

    def load(self, unit: int, slot: Slot, chunks: list[int] | None = None) -> None:
        """Queue the unit's newest parameters into `slot` (a device update's `chunks` of it, if given); loads gather
        the other ranks' shards."""
        block = unit - 1 if unit else None
        label = f"params {'edges' if unit == 0 else block}"
        h2d = self.lanes.h2d
        if not self.update_of[unit].load(unit, slot, chunks):
            self.waits(unit, params_only=True)  # (which also means its gradient has left the slot)
            h2d.wait(self.stream.home(unit))
            into, ready = self.units[unit].slot_shard(slot), self.units[unit].params
            if ready is not None:  # (a master on disk: the copy its update wrote)
                h2d.run(into.copy_, ready, True, label=label)
            else:
                self._master(unit, slot, into, label)
        self.ranks.gather_load(slot.params, h2d, self.lanes.land, label)
        slot.unit = block

    def _master(self, unit: int, slot: Slot, into: torch.Tensor, label: str) -> None:
        """Queue the unit's fp32 master into `into` (its part of `slot`'s parameters), narrowed where the slot is
        narrower."""
        h2d, land = self.lanes.h2d, self.lanes.land
        master = self.units[unit].master
        ring = None
        if master is None:  # its master is on disk and host memory keeps no copy: read it for this load
            ring, self.ring_next = self.ring_next, (self.ring_next + 1) % len(self.ring)
            self.ring_free[ring].wait_host()  # the copies out of this buffer an earlier load queued are done
            master = self.ring[ring][:self.units[unit].layout.numel]
            self.disk.read_master(unit, master)
            label += " (read from disk)"
        if not slot.narrow:
            h2d.run(into.copy_, master, True, label=label)
        else:  # copied in on h2d, narrowed on the land lane, piece by piece through the landing zone's halves
            narrowed: dict[int, Signal] = {}  # landing buffer -> its last narrowing
            for start, end, k, landing in slot.pieces(master.numel()):
                h2d.wait(narrowed.get(k, DONE))
                h2d.run(landing.copy_, master[start:end], True, label=label)
                land.wait(h2d.record())
                land.run(into[start:end].copy_, landing, label=label)
                narrowed[k] = land.record()
        if ring is not None:
            self.ring_free[ring] = h2d.record()
