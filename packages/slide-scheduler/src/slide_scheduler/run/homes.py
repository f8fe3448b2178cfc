"""Gradient homes: where each unit's gradient waits for its update once the backward has made it, as the placement
says (`UnitPlacement.grad`): in its slot (resident units, and streamed edges), held in a device buffer, in its place
in the host memory it shares with the boundary activations (pool.py), in a ring of host buffers the sliding blocks
take turns in, in a host buffer of its own (sliding edges), or in a file (disk_states.py). A home answers one
call, `send`: queue the gradient there and say when each optimizer chunk of it has arrived. The homes are given
the lanes, the units' states, the optimizer's chunks, the disk tier and the update waits they use, not the
engine."""

from __future__ import annotations

import torch

from slide_memory import HostAdamW, StagingRing, host_zeros

from ..plan.placement import Placement
from ..plan.sizes import GRADS_TO_DISK
from .disk_states import done_future
from .lanes import FutureSignal, Lanes, Signal
from .pool import SharedPool
from .updater import UpdateWaits
from .updates import Gradient


class GradientHomes:
    def __init__(self, placement: Placement, *, lanes: Lanes, optimizer: HostAdamW, disk, waits: UpdateWaits,
                 edges_numel: int, ranks: int):
        p, dtype, device = placement, placement.run.compute_dtype, torch.device(placement.run.device)
        self.lanes, self.optimizer, self.disk, self.waits = lanes, optimizer, disk, waits
        self.kind = [unit.grad for unit in p.units]
        numel = p.shapes.block_numel
        self.held = {u: torch.zeros(p.shapes.unit_numels[u], dtype=dtype, device=device) for u in sorted(p.held)}
        self.pool = SharedPool(p.pooled, numel, dtype, p.shapes.num_blocks) if p.pooled else None
        self.ring = StagingRing(p.ring, numel // ranks, dtype) if p.ring else None
        self.own = host_zeros(edges_numel // ranks, dtype) if self.kind[0] == "own" else None
        # gradients on their way to disk take turns in a few host buffers, each free once its last write is done
        self.to_disk = [[host_zeros(numel, dtype), done_future()] for _ in range(GRADS_TO_DISK)] \
            if p.grads_on_disk else []
        self.next_to_disk = 0

    def send(self, unit: int, seat, made: Signal) -> Gradient:
        """Queue unit's gradient (this rank's shard of it, `seat.shard`) out of its slot once compute has made it
        (`made`): the d2h lane copies it home in the optimizer's chunks."""
        d2h, kind = self.lanes.d2h, self.kind[unit]
        label = f"grads {unit - 1 if unit else 'edges'}"
        if kind == "slot":  # updated from where it is (kept until then)
            return Gradient(seat.slot.grads, [made])
        d2h.wait(made)
        if kind == "held":  # kept on the device for its update: a device copy frees the slot
            buffer = self.held[unit]
            d2h.run(buffer.copy_, seat.slot.grads[:buffer.numel()], True, label=f"hold {label}")
            return Gradient(buffer, [d2h.record()])
        if kind == "disk":  # through a host buffer to its file, read back with its states for the update
            entry = self.to_disk[self.next_to_disk]
            self.next_to_disk = (self.next_to_disk + 1) % len(self.to_disk)
            d2h.wait(FutureSignal(entry[1]))
            arrived = self.copy_out(unit, entry[0], seat.shard, label)
            entry[1] = self.disk.put_gradient(unit, entry[0], arrived)
            return Gradient(None, arrived)
        if kind == "own":
            self.waits(unit)  # the unit's last update is done reading its buffer
            buffer = self.own
        elif kind == "pool":  # its own place, over boundaries the backward has read (see pool.py)
            self.waits(unit)  # (a host update, whole, finished before its block's load already)
            buffer = self.pool.gradient(unit - 1)
        else:
            buffer, previous = self.ring.take(unit)
            if previous is not None:  # the buffer's last gradient has been used by its update (both parts), and
                self.waits(previous)  # by its speculation (which, after a non-finite step, no update follows)
                self.waits(previous, speculated=True)
        return Gradient(buffer, self.copy_out(unit, buffer, seat.shard, label))

    def copy_out(self, unit: int, buffer: torch.Tensor, grads: torch.Tensor, label: str) -> list[Signal]:
        """Queue a gradient's copy to the host in the chunks the host optimizer steps, with a signal per chunk:
        the update of a chunk starts as soon as that chunk has arrived."""
        d2h, pieces = self.lanes.d2h, []
        for a, b in self.optimizer.units[unit].ranges:
            d2h.run(buffer[a:b].copy_, grads[a:b], True, label=label)
            pieces.append(d2h.record())
        return pieces

    def forward_begins(self, boundary_bytes: list[int]) -> None:
        """The step's boundary activations, one micro-batch's bytes each: the pool lays itself out for them."""
        if self.pool is not None:
            self.pool.fit(boundary_bytes)

    def step_ends(self) -> None:
        """Nothing queued can still read a gradient in an allocation the pool replaced this step."""
        if self.pool is not None:
            self.pool.drop_replaced()
