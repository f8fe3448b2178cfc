"""The planner: the placement a run gets on a machine, chosen by the cost model among those that fit.

What used to be tuning constants are choices here: the window of slots (two or three) and the share of clipped
sliding-block updates streamed through the device. Each candidate is sized to the device budget (residency
first, then held gradients) and priced; the fastest that fits wins, and among near-equals (within `TIE`, the
model's own uncertainty) the one that takes the least host memory.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from .cost import Estimate, price
from .machine import Machine
from .placement import (
    DISK,
    GIB,
    GPU,
    HOST,
    Budgets,
    Options,
    Overrides,
    Placement,
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
            "units": [dataclasses.asdict(u) | {"master": u.master} for u in p.units],
        }


def place(shapes: Shapes, step: StepShape, options: Options, budgets: Budgets, machine: Machine,
          overrides: Overrides | None = None) -> Plan:
    """The plan of a run: its placement (overrides honoured), the cost model's prices, and what does not fit."""
    o = overrides or Overrides()
    cuda = options.cuda
    windows = (o.window,) if o.window else WINDOWS if cuda else (2,)
    streamable = options.state_bytes == 4
    if o.device_update_share is not None:
        shares = (o.device_update_share,)
    elif not cuda or not streamable:
        shares = (0.0,)
    elif options.clip:
        shares = SHARES
    else:  # without clipping only the sliding edges can stream
        shares = (0.0, 1.0)
    poolable = options.clip and options.activations == "cpu"
    # Held host gradients share the boundary activations' memory wherever clipping holds them: up to the
    # activations' size less host memory, at the speed of a buffer each (docs/findings.md)
    pooled = poolable if o.share_grads is None else bool(o.share_grads) and poolable
    # Asked to speculate: every block, or the first ones where the host cannot afford all (each speculating block
    # needs its speculated parameters and a gradient buffer of its own), or none where it prices no better. Not
    # by default: the cost model prices it faster than it measures (docs/findings.md)
    kinds = [(pooled, False)] + ([(False, True), *((False, round(f * shapes.num_blocks)) for f in SPECULATED)]
                                 if o.speculate and options.clip else [])
    best: tuple[bool, bool, float, float, Placement, Estimate] | None = None
    for window, share, (shared, speculate) in itertools.product(windows, shares, kinds):
        p = size_for_budget(shapes, step, options, budgets.gpu, window=window, share=share, shared=shared,
                            overrides=o, speculate=speculate)
        gpu_fits = budgets.gpu is None or p.bytes(GPU) <= budgets.gpu
        host_fits = budgets.host is None or p.bytes(HOST) <= budgets.host
        est = price(p, machine)
        # Speculating, the step that matters is the usual one of a fine-tune: clipping does not act
        ranked = price(p, machine, clipping_acts=False) if p.speculated else est
        key = (not gpu_fits, not host_fits, ranked.step_s, p.bytes(HOST))
        if best is None or _better(key, best[:4]):
            best = (*key, p, est)
    placement, estimate = best[4:]
    unclipped = price(placement, machine, clipping_acts=False) if options.clip else estimate
    plan = Plan(placement, estimate, unclipped, budgets)
    plan.problems = _problems(plan, options)
    return plan


def _better(key: tuple, than: tuple) -> bool:
    """Fitting the GPU, then the host, first; then faster by more than TIE; among near-equals, less host
    memory."""
    if key[:2] != than[:2]:
        return key[:2] < than[:2]
    if abs(key[2] - than[2]) > TIE * min(key[2], than[2]):
        return key[2] < than[2]
    return key[3] < than[3]


def _problems(plan: Plan, options: Options) -> list[str]:
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
