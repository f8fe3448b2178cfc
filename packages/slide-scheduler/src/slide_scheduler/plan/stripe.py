"""The disk tier striped over several drives: which drive holds each unit's files (its masters, moments and held
gradient) and each block's input boundary activations, so that every drive's share of a step's reads and writes
takes about the same time at its own rates, within its free space.

A unit's or a boundary's files live whole on one drive: the engine opens one store per drive, and a transfer
never waits for two drives. The placement records the choice (`Placement.drives`, `boundary_drives`); the cost
model prices one disk lane per drive, and the step waits for the slowest."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .machine import Disk
from .placement import DISK, Placement

GIB = 2**30


@dataclass(frozen=True)
class Share:
    """Bytes a drive reads and writes per step, and what its files take."""

    read: int = 0
    written: int = 0
    size: int = 0

    def __add__(self, other: Share) -> Share:
        return Share(self.read + other.read, self.written + other.written, self.size + other.size)


def unit_share(p: Placement, unit: int) -> Share:
    """What `unit`'s files move per step: its states (moments, and master where there) read ahead of its update
    and written back, its master read for each load (forward and backward, but the last block's backward, which
    finds it still in its slot) where host memory has no copy, and its gradient written in the backward and read
    back where it waits on disk."""
    numel = p.shapes.unit_numels[unit]
    states = p.disk_state_bytes(unit) * numel
    loads = p.loads(unit) * 4 * numel if unit in p.loads_from_disk else 0
    grads = p.compute_bytes * numel if unit in p.grads_on_disk else 0
    return Share(states + loads + grads, states + grads, states + grads)


def boundary_share(p: Placement) -> Share:
    """One block's input boundary activations on disk, every micro-batch: written in the forward, read in the
    backward."""
    nbytes = p.boundary_bytes
    return Share(nbytes, nbytes, nbytes)


def drive_shares(p: Placement, drives: int | None = None) -> list[Share]:
    """Each drive's share of the step's disk bytes, as `p` stripes them (`drives`: at least that many entries)."""
    out = [Share() for _ in range(max(drives or 1, p.drive_count))]
    for u in p.on_disk:
        out[p.drive_of(u)] += unit_share(p, u)
    for block, tier in enumerate(p.boundary_tiers):
        if tier == DISK:
            out[p.boundary_drive(block)] += boundary_share(p)
    return out


def seconds_on(drive: Disk, share: Share) -> float:
    """A drive's busy seconds for `share` at its rates (a rate not measured, 0, stands for a very slow one)."""
    return share.read / (max(drive.read_gbps, 1e-3) * 1e9) + share.written / (max(drive.write_gbps, 1e-3) * 1e9)


def stripe(p: Placement, drives: Sequence[Disk]) -> Placement:
    """`p` with its disk files spread over `drives`: the largest first, each to the drive where it ends soonest
    (its bytes at that drive's rates on top of what the drive has already), among those with room for it (the
    one with the most room left where none has). One drive: every file on it."""
    items = [("unit", u, unit_share(p, u)) for u in sorted(p.on_disk)]
    items += [("block", b, boundary_share(p)) for b, tier in enumerate(p.boundary_tiers) if tier == DISK]
    if len(drives) < 2 or not items:
        return dataclasses.replace(p, drives=(), boundary_drives=()) if p.drives or p.boundary_drives else p
    busy, used = [0.0] * len(drives), [0] * len(drives)
    free = [d.free_gib * GIB if d.free_gib else math.inf for d in drives]  # (0: not measured, no limit known)
    units, blocks = [0] * len(p.units), [0] * p.shapes.num_blocks
    for kind, index, share in sorted(items, key=lambda item: -item[2].size):  # (stable: equal ones in order)
        room = [d for d in range(len(drives)) if used[d] + share.size <= free[d]]
        room = room or [max(range(len(drives)), key=lambda d: free[d] - used[d])]
        best = min(room, key=lambda d: busy[d] + seconds_on(drives[d], share))
        busy[best] += seconds_on(drives[best], share)
        used[best] += share.size
        (units if kind == "unit" else blocks)[index] = best
    return dataclasses.replace(p, drives=tuple(units),
                               boundary_drives=tuple(blocks) if DISK in p.boundary_tiers else ())
