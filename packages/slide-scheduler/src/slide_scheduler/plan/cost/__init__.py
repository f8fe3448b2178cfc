"""The cost model: a placement's time per step on a machine, lane by lane, and what bounds it.

Each lane's work per step comes from FLOPs and bytes; its time from the machine's measured rates. The overlap rules
are the engine's: a block loads into a slot once the block `window` places before it has left that slot (the
backward's first block is the forward's last, still in its slot), and runs once it has loaded (and, where host
updates wait for the step's end, once its host update has written its master); the host optimizer is one queue,
worked through in the order the engine submits to it (updates that run during the backward as their gradients land,
then at the step's end those that wait for it, in the next forward's order); host memory carries every PCIe, AdamW
and disk byte. With clipping every update waits for the step's end (the norm) and runs under the next forward (a
quarter of the compute); without, each block's update runs under the backward or, deferred, under the next forward,
as the placement says; a streamed block's device update runs as it next loads or, early, in the backward once its
gradient is home, its copies queued behind the loads staged before it and the one staged after its backward.

With data-parallel ranks the estimate is one rank's: its shard of each unit crosses its own PCIe link, the rest
of the parameters arrive by all-gather and the gradients leave by reduce-scatter over the GPUs' link, and the
host (its memory, its cores) carries every rank's copies and shard updates.

One module a lane (compute, transfers: PCIe each way and the GPUs' link, adamw, disk; host memory is the sum of
what they move through it), `window` for the overlap of a pass, `estimate` for the phases and what sets them.
"""

from __future__ import annotations

from ..machine import Machine
from ..placement import Placement
from .adamw import SPECULATIVE_PASS, block_updates, edge_update, gradient_s, host_lane
from .compute import LAUNCH_S, attention_pairs, block_compute, tail_s
from .disk import block_disk, boundary_disk, disk_traffic
from .estimate import BOUND_SHARE, LANES, Estimate, compute_lane, estimate_of, phase_lanes, phase_length
from .rates import ADAMW_BESIDE_COPIES, BLOCK_EFFICIENCY, CPU_FLOPS_PER_CORE, rates_of
from .transfers import block_copies, boundary_copies, edge_copies, through_host_memory
from .window import backward_pass, forward_pass

__all__ = ["ADAMW_BESIDE_COPIES", "BLOCK_EFFICIENCY", "BOUND_SHARE", "CPU_FLOPS_PER_CORE", "LANES", "LAUNCH_S",
           "SPECULATIVE_PASS", "Estimate", "attention_pairs", "compute_lane", "disk_traffic", "price"]


def price(p: Placement, machine: Machine, clipping_acts: bool = True) -> Estimate:
    """Predicted seconds per step of `p` on `machine`. With clipping on, `clipping_acts` False prices a step
    where it does not act: the blocks that speculate then load their speculated parameters and wait for no update
    (the others cost what they cost when it acts)."""
    r = rates_of(p, machine)
    loads = block_copies(p, r, clipping_acts)
    copies = loads.work + edge_copies(p) + boundary_copies(p)
    updates = block_updates(p, r, clipping_acts)
    work = (copies + through_host_memory(p, copies) + updates.work + edge_update(p, r) + block_disk(p, r)
            + boundary_disk(p, r))
    forward, backward = block_compute(p, r)
    work.forward.gpu, work.backward.gpu = sum(forward), sum(backward)
    tail = tail_s(p, r)
    lag = [0.0 if p.units[b + 1].grad == "held" else gradient_s(p, r, b) for b in range(len(backward))]
    bwd = backward_pass(p, loads.backward, backward, loads.early, lag)
    host = host_lane(p, r, updates, bwd, phase_length(phase_lanes(work.backward, bwd.length, r), bwd), tail)
    passes = {"forward": forward_pass(p, loads.forward, forward, host.ready), "backward": bwd}
    return estimate_of(p, r, work, passes, tail, host.exposed)
