"""The planner: the placement a run gets on a machine, chosen by the cost model among those that fit.

What used to be tuning constants are choices here: the window of slots (two or three) and the share of clipped
sliding-block updates streamed through the device. Each candidate is sized to the device budget (residency
first, then held gradients) and priced; the fastest that fits wins, and among near-equals (within `TIE`, the
model's own uncertainty) the one that takes the least host memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from .cost import Estimate, price
from .machine import Machine
from .placement import (
    DISK,
    GIB,
    GPU,
    HOST,
    Budgets,
    Overrides,
    Placement,
    RunFacts,
    Shapes,
    StepShape,
    size_for_budget,
)

SHARES = (0.0, 0.25, 0.375, 0.5, 0.5625, 0.625, 0.75, 1.0)
WINDOWS = (2, 3)
SPECULATED = (0.75, 0.5, 0.25)  # shares of the blocks tried where speculating for every block does not fit
TIE = 0.05


@dataclass
class Plan:
    placement: Placement
    estimate: Estimate  # with clipping on: a step where clipping acts
    estimate_unclipped: Estimate
    budgets: Budgets
    problems: list[str] = field(default_factory=list)  # why it does not fit, each with what would

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        p = self.placement
        return {
            "fits": self.fits,
            "problems": self.problems,
            "predicted_step_s": self.estimate.step_s,
            "predicted_step_s_unclipped": self.estimate_unclipped.step_s,
            "bottleneck": self.estimate.bottleneck,
            "bottleneck_unclipped": self.estimate_unclipped.bottleneck,
            "lanes_s": self.estimate.lanes,
            "gpu_bytes": p.bytes(GPU),
            "host_bytes": p.bytes(HOST),
            "disk_bytes": p.bytes(DISK),
            "budgets": dataclasses.asdict(self.budgets),
            "tiers": p.tiers(),
            "window": p.window,
            "run": dataclasses.asdict(p.run),
            "units": [dataclasses.asdict(u) | {"master": u.master} for u in p.units],
        }


def place(shapes: Shapes, step: StepShape, run: RunFacts, budgets: Budgets, machine: Machine,
          overrides: Overrides | None = None) -> Plan:
    """The plan of a run: its placement (overrides honoured), the cost model's prices, and what does not fit.

    The share of sliding blocks whose masters and moments live on disk is the least that fits host memory unless
    `overrides.nvme_fraction` says (data-parallel ranks and CPU runs keep everything in memory); blocks whose
    master is on disk keep a copy of their parameters in host memory for their loads where that fits, and
    otherwise read the master from disk for each load (`overrides.disk_loads` decides where given)."""
    o = overrides or Overrides()
    if run.activations == "auto":
        return _activation_tier(shapes, step, run, budgets, machine, o)
    if o.nvme_fraction is None:
        plan = place(shapes, step, run, budgets, machine, dataclasses.replace(o, nvme_fraction=0.0, disk_loads=False))
        if budgets.host is None or plan.placement.bytes(HOST) <= budgets.host or run.ranks > 1:
            return plan
        found = disk_share(shapes, step, run, budgets, machine, o)
        return place(shapes, step, run, budgets, machine,
                     dataclasses.replace(o, nvme_fraction=found[0], disk_loads=found[2])) if found else plan
    if o.disk_loads is None:
        plan = place(shapes, step, run, budgets, machine, dataclasses.replace(o, disk_loads=False))
        p = plan.placement
        if p.masters_on_disk and budgets.host is not None and p.bytes(HOST) > budgets.host:
            lean = place(shapes, step, run, budgets, machine, dataclasses.replace(o, disk_loads=True))
            if lean.placement.bytes(HOST) < p.bytes(HOST):  # (their loads read the master from disk, twice a step)
                return lean
        return plan
    cuda = run.cuda
    windows = (o.window,) if o.window else WINDOWS if cuda else (2,)
    streamable = run.state_bytes == 4
    if o.device_update_share is not None:
        shares = (o.device_update_share,)
    elif not cuda or not streamable:
        shares = (0.0,)
    elif run.clip:
        shares = SHARES
    else:  # without clipping only the sliding edges can stream
        shares = (0.0, 1.0)
    poolable = run.clip and run.activations == "cpu"
    # Held host gradients share the boundary activations' memory wherever clipping holds them: up to the
    # activations' size less host memory, at the speed of a buffer each (docs/findings.md)
    pooled = poolable if o.share_grads is None else bool(o.share_grads) and poolable
    # Speculating: every block, or the first ones where the host cannot afford all (each speculating block needs
    # its speculated parameters and a gradient buffer of its own); `auto` also weighs not speculating, and takes
    # what prices faster. Not by default: the cost model has priced it faster than it measured (docs/findings.md)
    kinds = [(pooled, False)] + ([(False, True), *((False, round(f * shapes.num_blocks)) for f in SPECULATED)]
                                 if o.speculate in (True, "auto") and run.clip else [])
    forced = o.speculate is True
    best: tuple[bool, bool, float, float, Placement, Estimate] | None = None
    for window, share, (shared, speculate) in itertools.product(windows, shares, kinds):
        p = size_for_budget(shapes, step, run, budgets.gpu, window=window, share=share, shared=shared,
                            overrides=o, speculate=speculate)
        gpu_fits = budgets.gpu is None or p.bytes(GPU) <= budgets.gpu
        host_fits = budgets.host is None or p.bytes(HOST) <= budgets.host
        est = price(p, machine)
        # Speculating, the step that matters is the usual one of a fine-tune: clipping does not act
        ranked = price(p, machine, clipping_acts=False) if p.speculated else est
        key = (not gpu_fits, not host_fits, forced and not p.speculated, ranked.step_s, p.bytes(HOST))
        if best is None or _better(key, best[:5]):
            best = (*key, p, est)
    placement, estimate = best[5:]
    unclipped = price(placement, machine, clipping_acts=False) if run.clip else estimate
    plan = Plan(placement, estimate, unclipped, budgets)
    plan.problems = _problems(plan)
    return plan


def disk_share(shapes: Shapes, step: StepShape, run: RunFacts, budgets: Budgets, machine: Machine,
               overrides: Overrides | None = None) -> tuple[float, int, bool] | None:
    """The least share of the sliding blocks on disk at which the run fits: with copies of their parameters in
    host memory where some share fits so, else with their loads read from disk. Returns the share, the blocks it
    puts on disk and whether their loads read from disk; None where no share fits (or the run keeps everything
    in memory: a CPU run, data-parallel ranks)."""
    o = overrides or Overrides()

    def at(fraction: float, loads: bool) -> Plan:
        return place(shapes, step, run, budgets, machine,
                     dataclasses.replace(o, nvme_fraction=fraction, disk_loads=loads))

    sliding = len(at(0.0, False).placement.sliding_blocks)
    if not run.cuda or run.ranks > 1 or not sliding:
        return None

    def share(blocks: int) -> float:
        return math.ceil(100 * blocks / sliding) / 100

    def fits_in_memory(candidate: Plan) -> bool:  # the disk aside: more on disk only ever needs more of it
        p, b = candidate.placement, candidate.budgets
        return (b.host is None or p.bytes(HOST) <= b.host) and (b.gpu is None or p.bytes(GPU) <= b.gpu)

    for loads in (False, True):
        if not fits_in_memory(at(share(sliding), loads)):
            continue
        low, high = 0, sliding  # more blocks on disk only ever take less host memory: bisect, a plan per halving
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fits_in_memory(at(share(middle), loads)) else (middle, high)
        if at(share(high), loads).fits:
            return share(high), high, loads
    return None


def _better(key: tuple, than: tuple) -> bool:
    """Fitting the GPU, then the host, first; then what was asked for (speculation forced); then faster by more
    than TIE; among near-equals, less host memory."""
    if key[:3] != than[:3]:
        return key[:3] < than[:3]
    if abs(key[3] - than[3]) > TIE * min(key[3], than[3]):
        return key[3] < than[3]
    return key[4] < than[4]


ACTIVATION_PREFERENCE = ("cpu", "none", "nvme")  # among tiers that price alike: host memory, the device, files


def _activation_tier(shapes: Shapes, step: StepShape, run: RunFacts, budgets: Budgets, machine: Machine,
                     o: Overrides) -> Plan:
    """`activations: auto`: the plan of each tier for the boundary activations, and the fastest that fits (the
    disk only for a single process: data-parallel ranks keep theirs in memory); among near-equals, the first of
    ACTIVATION_PREFERENCE. None fitting, the host tier's plan says what does not fit."""
    tiers = [t for t in ACTIVATION_PREFERENCE if t != "nvme" or run.ranks == 1]
    plans = [place(shapes, step, dataclasses.replace(run, activations=t), budgets, machine, o) for t in tiers]
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return plans[0]
    fastest = min(p.estimate.step_s for p in fitting)
    return next(p for p in fitting if p.estimate.step_s <= fastest * (1 + TIE))


def _problems(plan: Plan) -> list[str]:
    p, b = plan.placement, plan.budgets
    out = []
    if b.gpu is not None and p.bytes(GPU) > b.gpu:
        fixed = p.bytes(GPU)
        scale = p.step.tokens_per_micro
        acts = sum(a.nbytes for a in p.allocations  # what grows with the tokens per micro-batch
                   if a.tier == GPU and ("activation" in a.kind or a.kind == "workspace"))
        room = b.gpu - (fixed - acts)
        tokens = int(scale * room / acts) if room > 0 and acts else 0
        fit = (f"at most ~{tokens} tokens per micro-batch would fit" if tokens >= 64
               else "even short micro-batches do not fit")
        out.append(f"gpu: needs ~{fixed / GIB:.1f} GiB, {b.gpu / GIB:.1f} GiB usable; {fit}, or a larger GPU budget")
    if b.host is not None and p.bytes(HOST) > b.host:
        out.append(f"host: needs ~{p.bytes(HOST) / GIB:.1f} GiB, {b.host / GIB:.1f} GiB usable")
    if b.disk is not None and p.bytes(DISK) > b.disk:
        out.append(f"disk: needs ~{p.bytes(DISK) / GIB:.1f} GiB, {b.disk / GIB:.1f} GiB free")
    return out
