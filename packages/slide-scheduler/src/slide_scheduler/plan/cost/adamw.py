"""The host optimizer lane: each host update's AdamW (whole, or split around the next forward), the speculative
passes and the updates behind held speculation, in the order the host thread works through them, and what of
them the step waits for."""

from __future__ import annotations

from dataclasses import dataclass

from ..placement import Placement
from .rates import Rates
from .work import Work, speculation_holds

# A speculative pass steps copies of master, m and v (cache-sized, around the same fused kernel, so that its
# parameters are bitwise the commit's) and narrows the result: twice an update's host time, per parameter.
SPECULATIVE_PASS = 2.0


@dataclass
class HostUpdates:
    """The blocks' host updates: each one's AdamW seconds (0 where it has none), the blocks in the order the host
    thread runs them, and the work of every update (the edges' too) by phase."""

    seconds: list[float]
    order: list[int]  # blocks (0 = the first)
    work: Work


def adamw_bytes(p: Placement) -> int:
    """Host-memory bytes per parameter of one update: read master, m, v and gradient; write master, m, v."""
    return 26 if p.state_bytes == 4 else 18


def block_updates(p: Placement, r: Rates, clipping_acts: bool) -> HostUpdates:
    """Each sliding block's part of the host optimizer's work: a clipped speculation's pass under the backward;
    then its update proper, behind held speculation where nothing in the step waits for it, else under the
    backward or (deferred) the next forward, a split one's moments part after that forward."""
    n = p.shapes.num_blocks
    updates = HostUpdates([0.0] * n, [], Work())
    bwd, host = updates.work.backward, updates.work.update_phase(p.deferred)
    for u in p.sliding_blocks:
        unit, numel, b = p.units[u], p.shapes.unit_numels[u], u - 1
        if p.clips and unit.speculate:  # reads master, m, v, gradient; writes parameters
            bwd.adamw += SPECULATIVE_PASS * numel / r.adamw
            bwd.host_bytes += numel * (4 + 2 * p.state_bytes + 2 * p.compute_bytes)
        if speculation_holds(p, unit, clipping_acts):
            updates.work.anywhere.adamw += numel / r.adamw
            updates.work.anywhere.host_bytes += numel * adamw_bytes(p)
        elif unit.update == "host":
            updates.seconds[b] = numel / r.adamw
            updates.order.append(b)
            host.adamw += updates.seconds[b] * (0.5 if unit.split else 1.0)
            host.host_bytes += numel * (18 if unit.split else adamw_bytes(p))
            if unit.split:
                bwd.adamw += updates.seconds[b] * 0.5
                bwd.host_bytes += numel * 22
    return updates


def edge_update(p: Placement, r: Rates) -> Work:
    """Sliding edges not streamed through the device update on the host."""
    work, edges, e = Work(), p.units[0], p.shapes.unit_numels[0]
    if not edges.resident and edges.update != "stream":
        work.update_phase(p.deferred).adamw += e / r.adamw
        work.update_phase(p.deferred).host_bytes += e * adamw_bytes(p)
    return work


def ready_s(p: Placement, updates: HostUpdates) -> list[float]:
    """When each block's host update has written its master, where the next forward's loads wait for that
    (deferred): the host thread runs them one after another in the forward's order."""
    ready, host_free = [0.0] * p.shapes.num_blocks, 0.0
    if p.deferred:
        for b in updates.order:
            host_free += updates.seconds[b]
            ready[b] = host_free
    return ready


def exposed_s(p: Placement, r: Rates, updates: HostUpdates) -> float:
    """Not deferred, the updates follow their gradients under the backward: the last ones (block 0's, the
    edges') run after it."""
    if p.deferred or not updates.order:
        return 0.0
    return updates.seconds[min(updates.order)] + (p.shapes.unit_numels[0] / r.adamw
                                                  if p.units[0].update == "host" else 0.0)


def host_backlog(work: Work, span: float, r: Rates) -> tuple[float, str]:
    """The updates behind held speculation fit in what the forward and tail (`span`) leave the host thread and
    its memory, or lengthen the step: they queue behind the forward's updates and ahead of the next backward's
    speculative passes, and that backward reuses their gradient buffers. Also the lane that sets it."""
    late, fwd = work.anywhere, work.forward
    idle = span - fwd.adamw
    room = max(late.adamw - idle, (late.host_bytes - (span * r.memory - fwd.host_bytes)) / r.memory)
    return max(0.0, room), "host_adamw" if late.adamw - idle >= room else "host_memory"
