"""The host optimizer lane: each host update's AdamW (whole, or split around the next forward), the speculative
passes and the updates behind held speculation, in the order the host thread works through them, and when each
block's update is ready for the next forward."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..placement import Placement
from .rates import Rates
from .window import PassTimes
from .work import Work, speculation_holds

# A speculative pass steps copies of master, m and v (cache-sized, around the same fused kernel, so that its
# parameters are bitwise the commit's) and narrows the result: twice an update's host time, per parameter.
SPECULATIVE_PASS = 2.0


@dataclass
class HostUpdates:
    """The blocks' host updates: each one's AdamW seconds (0 where it has none), the host thread's seconds each
    block's gradient starts during the backward (its update, where that does not wait for the step's end, or its
    speculative pass), the blocks whose update waits for the step's end (forward order), the edges' update, the
    split updates' moments parts, and the work of every update (the edges' too) by phase."""

    seconds: list[float]
    in_backward: list[float]
    deferred: list[int]  # blocks (0 = the first)
    work: Work
    edges: float = 0.0
    moments: float = 0.0  # queued after the forward: they run as the next backward begins


def adamw_bytes(p: Placement) -> int:
    """Host-memory bytes per parameter of one update: read master, m, v and gradient; write master, m, v."""
    return 26 if p.state_bytes == 4 else 18


def block_updates(p: Placement, r: Rates, clipping_acts: bool) -> HostUpdates:
    """Each sliding block's part of the host optimizer's work: a clipped speculation's pass under the backward;
    then its update proper, behind held speculation where nothing in the step waits for it, else under the
    backward or (waiting for the step's end) the next forward, a split one's moments part after that forward."""
    n = p.shapes.num_blocks
    updates = HostUpdates([0.0] * n, [0.0] * n, [], Work())
    bwd = updates.work.backward
    for u in p.sliding_blocks:
        unit, numel, b = p.units[u], p.shapes.unit_numels[u], u - 1
        if p.clips and unit.speculate:  # reads master, m, v, gradient; writes parameters
            updates.in_backward[b] += SPECULATIVE_PASS * numel / r.adamw
            bwd.adamw += SPECULATIVE_PASS * numel / r.adamw
            bwd.host_bytes += numel * (4 + 2 * p.state_bytes + 2 * p.compute_bytes)
        if speculation_holds(p, unit, clipping_acts):
            updates.work.anywhere.adamw += numel / r.adamw
            updates.work.anywhere.host_bytes += numel * adamw_bytes(p)
        elif unit.update == "host":
            updates.seconds[b] = numel / r.adamw
            if p.waits(u):
                updates.deferred.append(b)
            else:
                updates.in_backward[b] += updates.seconds[b]
            host = updates.work.update_phase(p.waits(u))
            host.adamw += updates.seconds[b] * (0.5 if unit.split else 1.0)
            host.host_bytes += numel * (18 if unit.split else adamw_bytes(p))
            if unit.split:
                updates.moments += updates.seconds[b] * 0.5
                bwd.adamw += updates.seconds[b] * 0.5
                bwd.host_bytes += numel * 22
    edges, e = p.units[0], p.shapes.unit_numels[0]
    if not edges.resident and edges.update != "stream":
        updates.edges = e / r.adamw
    return updates


def edge_update(p: Placement, r: Rates) -> Work:
    """Sliding edges not streamed through the device update on the host."""
    work, edges, e = Work(), p.units[0], p.shapes.unit_numels[0]
    if not edges.resident and edges.update != "stream":
        work.update_phase(p.waits(0)).adamw += e / r.adamw
        work.update_phase(p.waits(0)).host_bytes += e * adamw_bytes(p)
    return work


@dataclass
class HostLane:
    """When each block's host update has written its master (or its speculation its parameters), in seconds from
    the next forward's start (0 or less: before it), and how long that forward's start waits for the edges'."""

    ready: list[float]
    exposed: float


def host_lane(p: Placement, r: Rates, updates: HostUpdates, backward: PassTimes, backward_s: float,
              tail: float) -> HostLane:
    """The host optimizer thread, one queue worked through in the order things are submitted to it (the
    engine's): the last step's moments parts as the tail begins; each block's backward work (its update, or its
    speculative pass) once its gradient has landed, in the backward's order; at the step's end (the backward
    phase, `backward_s` long, over) the edges' update, which the next forward's first load waits for, then the
    updates that waited, in the forward's order."""
    n, ready = p.shapes.num_blocks, [-math.inf] * p.shapes.num_blocks
    free = updates.moments - backward_s - tail  # (seconds from the backward phase's end)
    for b in reversed(range(n)):
        if updates.in_backward[b]:
            landed = backward.ends[b] - backward_s + gradient_s(p, r, b)
            free = max(free, landed) + updates.in_backward[b]
            ready[b] = free
    free = max(free, 0.0) + updates.edges
    exposed = free if updates.edges else 0.0
    for b in updates.deferred:
        free += updates.seconds[b]
        ready[b] = free
    return HostLane([t - exposed for t in ready], exposed)


def gradient_s(p: Placement, r: Rates, block: int) -> float:
    """A block's gradient on its way to the host (none where the device is the host)."""
    return p.compute_bytes * p.shapes.unit_numels[block + 1] / p.ranks / r.d2h if r.pcie else 0.0


def host_backlog(work: Work, span: float, r: Rates) -> tuple[float, str]:
    """The updates behind held speculation fit in what the forward and tail (`span`) leave the host thread and
    its memory, or lengthen the step: they queue behind the forward's updates and ahead of the next backward's
    speculative passes, and that backward reuses their gradient buffers. Also the lane that sets it."""
    late, fwd = work.anywhere, work.forward
    idle = span - fwd.adamw
    room = max(late.adamw - idle, (late.host_bytes - (span * r.memory - fwd.host_bytes)) / r.memory)
    return max(0.0, room), "host_adamw" if late.adamw - idle >= room else "host_memory"
