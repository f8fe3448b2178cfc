"""Choosing a placement: the one a few choices make (`arrange`), the one that fills a device budget
(`size_for_budget`), and the expert choices that override the planner's (`Overrides`, `Budgets`). The planner
(planner.py) searches over these; the placement itself (placement.py) says what each choice means in bytes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from .placement import (
    DISK,
    GIB,
    GPU,
    HELD_HEADROOM,
    HOST,
    Placement,
    RunFacts,
    Shapes,
    StepShape,
    UnitPlacement,
)


@dataclass(frozen=True)
class Budgets:
    gpu: float | None = None  # bytes the engine may use on the device (None: no limit)
    host: float | None = None
    disk: float | None = None
    others: tuple[tuple[str, float], ...] = ()  # registered tiers' budgets, (name, bytes)

    def of(self, tier: str) -> float | None:
        return {GPU: self.gpu, HOST: self.host, DISK: self.disk, **dict(self.others)}.get(tier)

    def holds(self, p: Placement, *tiers: str) -> bool:
        """Whether what `p` keeps in each of `tiers` is within that tier's budget (none: any amount)."""
        return all(self.of(t) is None or p.bytes(t) <= self.of(t) for t in tiers)


def expert(what: str, *, least: float = 0, most: float | None = None, must: str = "",
           words: tuple[str, ...] = ()) -> dict:
    """An `Overrides` field's metadata as an expert key (slide-train's engine.placement.<name>): what it does, the
    range of a number (`least`, `most`), the words it takes beside true and false (`words`), and what a wrong value
    is told it must be where its type and range do not say it (`must`)."""
    return {"expert": what, "least": least, "most": most, "must": must, "words": words}


def planner_only(why: str) -> dict:
    """An `Overrides` field no config key sets (the planner's own choice, or another key's), and why."""
    return {"planner_only": why}


@dataclass(frozen=True)
class Overrides:
    """Expert choices the placement otherwise makes itself. Each field is declared once, here: a field with
    `expert` metadata is slide-train's engine.placement.<name> (its help, type and range checked from this
    declaration); `planner_only` ones are set by the planner or by another key."""

    window: int | None = field(default=None, metadata=expert(
        "GPU slots for sliding blocks (an integer of at least 1)", least=1))
    # a count (edges, then blocks from 0) or the units themselves
    resident: int | tuple[int, ...] | None = field(default=None, metadata=expert(
        "units kept on the GPU: a count (the edges, then blocks from 0) or a list such as [edges, block.3]",
        must="a count of at least 0 or a list of units such as [edges, block.3]"))
    device_update_share: float | None = field(default=None, metadata=expert(
        "share of the sliding blocks whose clipped update runs on the GPU (0 to 1)", most=1))
    held_grads: int | None = field(default=None, metadata=planner_only(  # (None: what fits)
        "device-updated blocks whose gradient waits on the device: what the GPU budget has room for"))
    share_grads: bool | None = field(default=None, metadata=planner_only(  # (None: wherever there is something to
        "pooled host gradients: wherever clipping holds gradients and activations are on the host"))  # share)
    split: bool = field(default=True, metadata=planner_only("clipped host updates split wherever that is exact"))
    # clipped host updates speculated during backward: True wherever the host has room, "auto" where the cost
    # model prices it faster, None or False: off
    speculate: bool | str | None = field(default=None, metadata=expert(
        "true: clipped host updates also run during backward as if clipping will not act (the same result bit for "
        "bit, more host memory); auto: where the cost model prices it faster; off by default (docs/findings.md)",
        words=("auto",)))
    # the reference schedule: every lane inline, no overlap (None: pipelined)
    synchronous: bool | None = field(default=None, metadata=expert(
        "true: the synchronous reference schedule, no overlap"))
    # The share of the sliding blocks whose masters and moments live on disk (None: the least that fits host
    # memory), and whether their loads read the master from disk (None: only where copies of their parameters do
    # not fit)
    nvme_fraction: float | None = field(default=None, metadata=planner_only("engine.nvme.fraction sets it"))
    disk_loads: bool | None = field(default=None, metadata=planner_only(
        "where copies of the disk blocks' parameters do not fit host memory"))
    # positions per tile of a block's MLP (and, with query_tiles, its attention's queries) over the sequence (None:
    # the planner's tile where whole rows do not fit the GPU; 0: never)
    sequence_tile: int | None = field(default=None, metadata=expert(
        "positions per tile of each block's MLP over the sequence (and of its attention's queries, with query_tiles), "
        "recomputed tile by tile in the backward (0: whole rows; unset: the largest of 16384, 4096 and 1024 that "
        "fits, where whole rows do not fit the GPU)",
        must="a whole number of positions (0: none)"))
    # the attention half runs by query tiles of `sequence_tile` too (None: where the MLP's tiles alone do not fit)
    query_tiles: bool | None = field(default=None, metadata=expert(
        "each block's attention runs by query tiles of sequence_tile positions too (unset: where tiling the MLP "
        "alone does not fit the GPU)"))
    # sets of activation landing buffers (None: one per slot and one more, one where that does not fit the GPU)
    landing_sets: int | None = field(default=None, metadata=expert(
        "sets of GPU buffers the backward fetches boundary activations into (unset: one per slot and one more, one "
        "where that does not fit the GPU)", least=1, must="a count of at least 1"))
    # streamed edges update their tail-only part early (None: yes)
    edges_early: bool | None = field(default=None, metadata=expert(
        "streamed edges update their final norm and lm head apart, early (unset: true)"))
    # (clipped) the gradients of the blocks whose states are on disk wait there too (None: where host memory
    # holds the run no other way)
    disk_grads: bool | None = field(default=None, metadata=expert(
        "clipped gradients of the blocks whose states are on disk wait there too (unset: where host memory holds "
        "the run no other way)"))
    # staging slots of the disk tier's states, how many updates ahead its reads run (None: the planner's)
    disk_staging: int | None = field(default=None, metadata=expert(
        "host staging slots of the disk tier's states, how many updates ahead its reads run (unset: 2, or 4 where "
        "the plan prices that faster)", least=1, must="a count of at least 1"))
    # speculating blocks sit out the step after one whose clipping acted (None: yes)
    speculation_pause: bool | None = field(default=None, metadata=expert(
        "speculating blocks sit out the step after one whose clipping acted (unset: true)"))
    # blocks (the first ones) whose input boundary activations wait on disk, the others in the run's tier (None:
    # none, or with `activations: auto` the fewest that fit host memory)
    disk_boundaries: int | None = field(default=None, metadata=planner_only(
        "engine.activation_offload=auto chooses it"))
    # without clipping, host updates wait for the step's end: all (True), none (False) or those of the first that
    # many sliding blocks, whose loads the next forward needs first (None: the split the cost model prices fastest)
    defer_updates: bool | int | None = field(default=None, metadata=planner_only(
        "the planner prices splits of the blocks and takes the fastest"))
    # streamed blocks come first in each group of sliding blocks, host-updated ones after them (None: the planner
    # prices both orders)
    device_first: bool | None = field(default=None, metadata=planner_only(
        "the planner prices both orders and takes the faster"))
    # without clipping, the share of the streamed blocks (the last ones, whose gradients come first) whose device
    # updates run during the backward, the others' at their next load (None: the share the cost model prices
    # fastest)
    early_streams: float | None = field(default=None, metadata=planner_only(
        "the planner prices shares of the streamed blocks and takes the fastest"))


def device_updated(sliding: int, share: float, device_first: bool = False) -> list[int]:
    """Which of `sliding` blocks (0 = the first to slide) a step updates on the device at `share`:
    int(sliding * share) of them, spread evenly over the forward order, host blocks first in each group (or, with
    `device_first`, last: the mirror image, counted from the last block)."""
    last = [j for j in range(sliding) if int((j + 1) * share) > int(j * share)]
    return sorted(sliding - 1 - j for j in last) if device_first else last


def on_disk_blocks(num_blocks: int, sliding: int, fraction: float) -> list[int]:
    """The blocks whose fp32 masters and AdamW moments live on disk at `fraction`: the last
    round(fraction * sliding) (with clipping their updates come last in the next forward, so their reads have
    the most time to run ahead)."""
    return list(range(num_blocks - round(fraction * sliding), num_blocks))


def held_on_device(device_units: list[int], count: int, shared: bool) -> list[int]:
    """Which device-updated units (forward order) keep their gradient on the device: the first `count`,
    whose updates the next forward needs first; or, when host gradients are pooled, the last, which lie over the
    fewest boundaries and would need the most room of their own there."""
    count = min(count, len(device_units))
    return device_units[len(device_units) - count:] if shared else device_units[:count]


def arrange(shapes: Shapes, step: StepShape, run: RunFacts, *, resident: Iterable[int] = (), window: int = 2,
            share: float = 0.0, shared: bool = False, held: int = 0, split: bool = True,
            speculate: bool | int = False, nvme_fraction: float = 0.0, disk_loads: bool = False,
            disk_grads: bool = False, staging: int = 0,
            sequence_tile: int = 0, query_tiles: bool = False, landing: int = 0, edges_early: bool = True,
            disk_boundaries: int = 0,
            speculation_pause: bool = True, threads: int | None = None, defer: bool | int = False,
            device_first: bool = False, early_streams: float = 0.0, synchronous: bool = False) -> Placement:
    """The placement these choices make: `resident` units on the device; of the sliding blocks, the last
    `nvme_fraction` with masters and moments on disk, `share` of the rest (spread out) updated on the device,
    `held` of those keeping their gradient there, the others' gradients pooled (`shared`; where host updates run
    during backward, unclipped and not `defer`red, only the device-updated ones) or in the ring, where with
    `speculate` their clipped updates speculate (a number: only the first that many such blocks, whose loads the
    next forward needs soonest); without clipping `defer` (all, or a number: the first that many sliding blocks)
    has host updates wait for the step's end; `device_first`: streamed blocks first in each group; without
    clipping `early_streams` of the streamed blocks (the last ones) update during the backward; `synchronous`: the
    reference schedule."""
    o, n = run, shapes.num_blocks
    if o.ranks > 1:  # what data parallelism runs so far: host updates of host states, gradients in the ring
        share, shared, defer = 0.0, False, False
    resident = set(resident)
    sliding = [u for u in range(1, n + 1) if u not in resident]
    disk = {1 + b for b in on_disk_blocks(n, len(sliding), nvme_fraction)} & set(sliding)
    streamed = {sliding[j] for j in device_updated(len(sliding), share, device_first)} - disk
    deferring = set() if o.clips else set(sliding if defer is True else sliding[:int(defer)]) - streamed
    early = set() if o.clips else set(sorted(streamed)[len(streamed) - round(early_streams * len(streamed)):])
    waits = {u: o.clips or u in deferring for u in range(n + 1)}  # (host updates that wait for the step's end)
    waits[0] = o.clips or bool(deferring)  # (the edges' update waits anyway: it splits where blocks defer)
    shared = shared and bool(sliding)
    on_device = set(held_on_device(sorted(streamed), held, shared))
    eligible = [u for u in sliding if o.clips and not shared and u not in streamed and u not in disk]
    speculating = set(eligible if speculate is True else eligible[:int(speculate)])
    units = []
    for u in range(n + 1):
        if u in resident:
            units.append(UnitPlacement(True, "device", "slot", GPU))
        elif u == 0:
            stream = share > 0 and o.state_bytes == 4
            units.append(UnitPlacement(False, "stream" if stream else "host", "slot" if stream else "own", HOST,
                                       split=waits[0] and split and not stream,
                                       defer=waits[0] and not stream and not o.clips))
        else:
            grad = "held" if u in on_device else "disk" if disk_grads and o.clips and u in disk \
                else "pool" if shared and (waits[u] or u in streamed) else "ring"
            host = u not in streamed
            units.append(UnitPlacement(False, "host" if host else "stream", grad, DISK if u in disk else HOST,
                                       split=waits[u] and split and grad == "ring" and u not in disk,
                                       speculate=u in speculating, master=DISK if u in disk else "",
                                       loads=DISK if disk_loads and u in disk else "", defer=u in deferring,
                                       early=u in early))
    extra = {} if threads is None else {"threads": threads}
    # the first `disk_boundaries` blocks' input activations on disk (written earliest, read last), the rest in
    # the run's tier
    boundaries = (DISK,) * disk_boundaries + (run.activations,) * (n - disk_boundaries) if disk_boundaries else ()
    return Placement(shapes, step, tuple(units), window, run, sequence_tile=sequence_tile,
                     query_tiles=query_tiles and bool(sequence_tile), landing=landing,
                     edges_early=edges_early, boundaries=boundaries, staging=staging,
                     speculation_pause=speculation_pause, synchronous=synchronous, **extra)


def resident_units(resident: int | Iterable[int]) -> set[int]:
    """A resident count (the edges, then blocks from 0) as units."""
    return set(range(resident)) if isinstance(resident, int) else set(resident)


def size_for_budget(shapes: Shapes, step: StepShape, run: RunFacts, budget: float | None, *, window: int,
                    share: float, shared: bool, overrides: Overrides | None = None,
                    threads: int | None = None, speculate: bool | int | None = None) -> Placement:
    """The placement with as many units resident as the device budget allows (edges first, then blocks from 0),
    and as many device-updated blocks' gradients held there as the room left allows."""
    n, overrides = shapes.num_blocks, overrides or Overrides()

    def make(res, held=0):
        return arrange(shapes, step, run, resident=res, window=window, share=share, shared=shared, held=held,
                       split=overrides.split, threads=threads,
                       speculate=overrides.speculate is True if speculate is None else speculate,
                       nvme_fraction=overrides.nvme_fraction or 0.0, disk_loads=bool(overrides.disk_loads),
                       disk_grads=bool(overrides.disk_grads), staging=overrides.disk_staging or 0,
                       sequence_tile=overrides.sequence_tile or 0, query_tiles=bool(overrides.query_tiles),
                       landing=overrides.landing_sets or 0,
                       edges_early=overrides.edges_early is not False,
                       disk_boundaries=overrides.disk_boundaries or 0,
                       speculation_pause=overrides.speculation_pause is not False,
                       defer=overrides.defer_updates or False, device_first=bool(overrides.device_first),
                       early_streams=overrides.early_streams or 0.0,
                       synchronous=bool(overrides.synchronous))

    if overrides.resident is not None:
        chosen = make(resident_units(overrides.resident))
    elif run.ranks > 1:
        chosen = make(set())
    elif not run.cuda or budget is None:
        chosen = make(set() if not run.cuda else set(range(n + 1)))
    else:
        every = make(set(range(n + 1)))
        if every.bytes(GPU) <= budget:
            chosen = every
        else:
            chosen = make(set())
            for k in range(n + 1):  # residency only grows the device side: stop at the first that does not fit
                candidate = make(set(range(k + 1)))
                if candidate.bytes(GPU) > budget:
                    break
                chosen = candidate
    if overrides.held_grads is not None:
        return make(chosen.resident, overrides.held_grads)
    if run.cuda and budget is not None and chosen.streamed - {0} and run.ranks == 1:
        room = budget - chosen.bytes(GPU) - max(0.5 * GIB, HELD_HEADROOM * budget)
        held = int(max(0.0, room) // (run.compute_bytes * shapes.block_numel))
        chosen = make(chosen.resident, held)
    return chosen


def run_unclipped(p: Placement) -> Placement | None:
    """Clipped placement `p` run without clipping, as it runs where clipping does not act (a scale of exactly 1):
    its host updates wait for the step's end but for those that speculate, which run during the backward as their
    gradients land. None where it has what an unclipped run cannot (gradients waiting on disk for the norm)."""
    if p.grads_on_disk:
        return None
    units = tuple(dataclasses.replace(unit, speculate=False, split=unit.split and not unit.speculate,
                                      defer=unit.update == "host" and not unit.speculate) for unit in p.units)
    return dataclasses.replace(p, run=dataclasses.replace(p.run, clip=None), units=units)


def with_units(p: Placement, **changes) -> Placement:
    """`p` with some of its fields replaced (validated again)."""
    return dataclasses.replace(p, **changes)
