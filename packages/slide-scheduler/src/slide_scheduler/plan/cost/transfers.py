"""The copy lanes: PCIe each way and the GPUs' link. With data-parallel ranks a unit's bytes over one rank's PCIe
link are its shard's; a load gathers the others' shards (compute dtype) over the link and a gradient gives them
theirs. Host memory carries every rank's copies."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..placement import GPU, Placement, UnitPlacement
from .rates import Rates
from .work import PhaseWork, Work, loads_compact


@dataclass
class Loads:
    """Each block's load seconds (PCIe, then the link) in the forward and in the backward, in block order (0 for a
    resident block), the seconds an early streamed update puts on the copies to the device in the backward (0
    where it has none), and the bytes the blocks' copies move."""

    forward: list[float]
    backward: list[float]
    work: Work
    early: list[float] = field(default_factory=list)


def shard(p: Placement) -> float:
    return 1 / p.ranks


def gathered(p: Placement, numel: int) -> float:
    """Bytes of a unit's other shards, gathered over the GPUs' link for a load (or scattered for a gradient)."""
    return (p.ranks - 1) / p.ranks * p.compute_bytes * numel


def forward_load(p: Placement, unit: UnitPlacement, numel: int, compact: bool) -> tuple[float, float]:
    """Bytes a block's forward load takes in and gives back over PCIe: its parameters (a streamed update at the
    load brings its master, m, v and the gradient in, and takes the new master, or that and the moments, back
    out; an early one ran in the backward, so the load takes the new master)."""
    if unit.update == "stream" and not unit.early:
        return stream_update(p, unit, numel)
    return numel * (p.compute_bytes if compact else 4) * shard(p), 0.0


def stream_update(p: Placement, unit: UnitPlacement, numel: int) -> tuple[float, float]:
    """Bytes a streamed update takes in (master, m, v, and the gradient unless held on the device) and gives back
    (the new master, and the moments unless split)."""
    into = numel * (12 + (0 if unit.grad == "held" else p.compute_bytes)) * shard(p)
    return into, numel * (4 if unit.split else 12) * shard(p)


def load_s(r: Rates, into: float, gathered_bytes: float) -> float:
    return into / r.h2d + gathered_bytes / r.link if r.pcie else 0.0


def block_copies(p: Placement, r: Rates, clipping_acts: bool) -> Loads:
    """The blocks' loads, each pass, and their gradients home (unless held for a device update)."""
    n = p.shapes.num_blocks
    loads = Loads([0.0] * n, [0.0] * n, Work(), [0.0] * n)
    fwd, bwd = loads.work.forward, loads.work.backward
    for u in p.sliding_blocks:
        unit, numel = p.units[u], p.shapes.unit_numels[u]
        compact = loads_compact(p, unit, clipping_acts)
        into, back = forward_load(p, unit, numel, compact)
        loads.forward[u - 1] = load_s(r, into, gathered(p, numel))
        fwd.h2d += into
        fwd.d2h += back
        fwd.link += gathered(p, numel)
        reloads = p.loads(u) - 1  # (the parameters, as the forward's, where the forward did not leave them)
        again = reloads * numel * (p.compute_bytes if compact else 4) * shard(p)
        loads.backward[u - 1] = load_s(r, again, reloads * gathered(p, numel))
        bwd.h2d += again
        bwd.d2h += 0 if unit.grad == "held" else numel * p.compute_bytes * shard(p)
        bwd.link += (1 + reloads) * gathered(p, numel)  # the load's all-gather, the gradient's reduce-scatter
        if unit.early:  # (its pieces cross both ways at once: the slower of h2d alone and the duplex rate)
            into, back = stream_update(p, unit, numel)
            loads.early[u - 1] = max(into / r.h2d, (into + back) / r.duplex) if r.pcie else 0.0
            bwd.h2d += into
            bwd.d2h += back
    return loads


def edge_copies(p: Placement) -> Work:
    """Sliding edges: streamed through the device (their master and moments, in and out, under the pass their
    update runs in), or their master loaded for the forward and their gradient home in the backward."""
    work, edges, e = Work(), p.units[0], p.shapes.unit_numels[0]
    if edges.resident:
        return work
    if edges.update == "stream":
        streamed = work.forward if p.clips else work.backward
        streamed.h2d += 12 * e
        streamed.d2h += 12 * e
    else:
        work.forward.h2d += 4 * e * shard(p)
        work.backward.d2h += p.compute_bytes * e * shard(p)
        work.forward.link += gathered(p, e)
        work.backward.link += gathered(p, e)
    return work


def boundary_copies(p: Placement) -> Work:
    """Offloaded boundary activations: out in the forward, back in the backward."""
    work, offloaded = Work(), p.shapes.num_blocks - p.boundaries_in(GPU)
    work.forward.d2h += offloaded * p.boundary_bytes
    work.backward.h2d += offloaded * p.boundary_bytes
    return work


def through_host_memory(p: Placement, work: Work) -> Work:
    """The host-memory bytes of every rank's copies (a CPU device copies within host memory already)."""
    carried = Work()
    if p.device_is_host:
        return carried
    for phase, w in ((carried.forward, work.forward), (carried.backward, work.backward)):
        phase.host_bytes += (w.h2d + w.d2h) * p.ranks
    return carried


def copy_lanes(w: PhaseWork, r: Rates) -> dict[str, float]:
    """A phase's seconds on each copy lane; where the two directions together outrun the duplex rate, the busier
    direction carries that."""
    if not r.pcie:
        return {"pcie_h2d": 0.0, "pcie_d2h": 0.0, "gpu_link": 0.0}
    lanes = {"pcie_h2d": w.h2d / r.h2d, "pcie_d2h": w.d2h / r.d2h, "gpu_link": w.link / r.link}
    copies = max(w.h2d / r.h2d, w.d2h / r.d2h, (w.h2d + w.d2h) / r.duplex)
    if copies > max(lanes["pcie_h2d"], lanes["pcie_d2h"]):
        lanes["pcie_h2d" if w.h2d >= w.d2h else "pcie_d2h"] = copies
    return lanes
