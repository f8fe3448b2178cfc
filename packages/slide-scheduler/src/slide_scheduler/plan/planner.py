"""The planner: the placement a run gets on a machine, chosen by the cost model among those that fit.

What used to be tuning constants are choices here: the window of slots (two or three) and the share of
sliding-block updates streamed through the device. Each candidate is sized to the device budget (residency
first, then held gradients) and priced; the fastest that fits wins, and among near-equals (within `TIE`, the
model's own uncertainty) the one that takes the least host memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from .attention import chosen as attention_backends
from .choices import Budgets, Overrides, run_unclipped, size_for_budget
from .cost import Estimate, disk_traffic, price
from .machine import Machine
from .placement import (
    DISK,
    GIB,
    GPU,
    HOST,
    Placement,
    RunFacts,
    Shapes,
    StepShape,
)
from .stripe import stripe

SHARES = (0.0, 0.25, 0.375, 0.5, 0.5625, 0.625, 0.75, 1.0)
WINDOWS = (2, 3)
SPECULATED = (0.75, 0.5, 0.25)  # shares of the blocks tried where speculating for every block does not fit
# shares of the blocks (the first ones) whose unclipped host updates wait for the step's end, tried
DEFERRED_SHARES = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)
# shares of the streamed blocks (the last ones) whose device updates the unclipped search tries early
EARLY_SHARES = (0.125, 0.25, 0.5, 0.75, 1.0)
TIE = 0.05
# How much the cost model has underpriced a speculating step where clipping does not act (docs/findings.md):
# `speculate: auto` takes a speculating plan only where it is faster by more than that
SPECULATION_MARGIN = 0.15
DEEP_STAGING = 4  # the disk tier's staging slots tried beside the default two, where host memory has room
# Positions per sequence tile tried, largest first, where whole rows' intermediates do not fit the GPU (the
# largest that fits prices fastest: fewer tiles, fewer launches); multiples of FlexAttention's 128
SEQUENCE_TILES = (16384, 4096, 1024)
SEQUENCE_TILE = SEQUENCE_TILES[1]


@dataclass
class Plan:
    placement: Placement
    estimate: Estimate  # with clipping on: a step where clipping acts
    estimate_unclipped: Estimate
    budgets: Budgets
    problems: list[str] = field(default_factory=list)  # why it does not fit, each with what would
    # Where it does not fit, settings near it that do (`suggest`); where it fits but another lane than the GPU's
    # compute binds it, the step at which the GPU would (`compute_bound_step`). Filled in by whoever asks.
    suggestions: list[Suggestion] = field(default_factory=list)
    compute_bound: Suggestion | None = None
    # each block's attention backend, the fastest of its candidates on the machine (empty: the shapes name none)
    attention: tuple[str, ...] = ()
    # the step of a faster plan within TIE that the search passed over for this one's smaller host memory (None:
    # this is the fastest it found)
    tie_passed_over_s: float | None = None

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
            "phases_s": self.estimate.phases,
            "critical_s": self.estimate.critical,
            "gpu_bytes": p.bytes(GPU),
            "host_bytes": p.bytes(HOST),
            "disk_bytes": p.bytes(DISK),
            "disk_traffic": disk_traffic(p),  # bytes the disk tier reads and writes per step
            "budgets": dataclasses.asdict(self.budgets),
            "tiers": p.tiers(),
            "window": p.window,
            "landing_sets": p.landing_sets,
            "sequence_tile": p.sequence_tile,
            "query_tiles": p.query_tiles,  # (the attention by query tiles too)
            # (unclipped) the blocks whose host update waits for the step's end
            "deferred_blocks": [u - 1 for u in sorted(p.deferred) if u and not p.clips],
            "synchronous": p.synchronous,  # the reference schedule: every lane inline
            "run": dataclasses.asdict(p.run),
            "units": [dataclasses.asdict(u) for u in p.units],
            "attention": list(self.attention),  # each block's attention backend
            "tie_passed_over_s": self.tie_passed_over_s,  # a faster plan within TIE, taken over for host memory
        }


def place(shapes: Shapes, step: StepShape, run: RunFacts, budgets: Budgets, machine: Machine,
          overrides: Overrides | None = None) -> Plan:
    """The plan of a run: its placement (overrides honoured), the cost model's prices, and what does not fit.

    The share of sliding blocks whose masters and moments live on disk is the least that fits host memory unless
    `overrides.nvme_fraction` says (data-parallel ranks and CPU runs keep everything in memory); blocks whose
    master is on disk keep a copy of their parameters in host memory for their loads where that fits, and
    otherwise read the master from disk for each load (`overrides.disk_loads` decides where given)."""
    return _Planning(shapes, step, run, budgets, machine).plan(overrides or Overrides())


@dataclass(frozen=True)
class _Planning:
    """One run's planning. The overrides the caller left open are resolved in one pass, in the order of
    `RESOLVES`: the first whose override is open weighs its values, each planned with the resolves after it;
    with none open, the search over windows, shares and speculation, refined where the result does not fit."""

    shapes: Shapes
    step: StepShape
    run: RunFacts
    budgets: Budgets
    machine: Machine

    def plan(self, o: Overrides, first: int = 0) -> Plan:
        for k, (is_open, resolve) in enumerate(RESOLVES[first:], first + 1):
            if is_open(self, o):
                return resolve(self, o, k)
        return self.search(o)

    def activations(self, o: Overrides, rest: int) -> Plan:
        """`auto` activations: the tier that prices best (each a run of its own)."""
        return _activation_tier(self.shapes, self.step, self.run, self.budgets, self.machine, o)

    def update_timing(self, o: Overrides, rest: int) -> Plan:
        """Which blocks' host updates run during the backward as their gradients land and which wait for the
        step's end as clipped ones do (under the next forward, in its order; they need a gradient buffer each, so
        the least share on disk may differ): the first k sliding blocks wait, whose loads the next forward needs
        first, the later ones (whose gradients come first) run in the backward, k over DEFERRED_SHARES, each
        planned whole; with each split, the share of the streamed blocks whose device updates run early, in the
        backward (the last ones, over EARLY_SHARES). The two are weighed together: which split is best depends
        on how much of the streamed blocks' traffic leaves the forward. Then the clipped run's plan, run without
        clipping (its scale being exactly 1), where that is faster: an unclipped plan is never predicted slower
        than the clipped one."""
        n = self.shapes.num_blocks
        plans = []
        for k in sorted({round(share * n) for share in DEFERRED_SHARES}):
            plan = self.plan(dataclasses.replace(o, defer_updates=k, early_streams=o.early_streams or 0.0), rest)
            plans.append(plan)
            # (early streams only where the forward waits on its copies to the GPU: they move it into the backward)
            if o.early_streams is None and plan.placement.streamed - {0} and _copies_hold_forward(plan.estimate):
                plans += [self.plan(dataclasses.replace(o, defer_updates=k, early_streams=share), rest)
                          for share in EARLY_SHARES]
        best = _pick(plans)
        clipped = self.clipped_unclipped(o)
        if clipped is not None and clipped.fits and clipped.estimate.step_s < best.estimate.step_s:
            return clipped
        return best

    def clipped_unclipped(self, o: Overrides) -> Plan | None:
        """The plan a clipped run would make, run without clipping (`run_unclipped`); None where it cannot."""
        clipped = place(self.shapes, self.step, dataclasses.replace(self.run, clip=1.0), self.budgets, self.machine,
                        o)
        placement = run_unclipped(clipped.placement)
        if placement is None:
            return None
        placement = dataclasses.replace(placement, run=self.run)
        estimate = price(placement, self.machine)
        plan = Plan(placement, estimate, estimate, self.budgets)
        plan.problems = _problems(plan)
        return plan

    def disk_fraction(self, o: Overrides, rest: int) -> Plan:
        """Nothing on disk where host memory holds it all, else the least share that fits."""
        plan = self.plan(dataclasses.replace(o, nvme_fraction=0.0, disk_loads=False), rest)
        if self.budgets.host is None or plan.placement.bytes(HOST) <= self.budgets.host or self.run.ranks > 1:
            return plan
        found = disk_share(self.shapes, self.step, self.run, self.budgets, self.machine, o)
        return self.plan(dataclasses.replace(o, nvme_fraction=found[0], disk_loads=found[2], disk_grads=found[3]),
                         rest) if found else plan

    def disk_reads(self, o: Overrides, rest: int) -> Plan | None:
        """Whether loads read masters from disk and gradients wait there: the least taken to disk that fits host
        memory."""
        tried = [(False, False), (True, False), (False, True), (True, True)]  # (loads read from disk, gradients)
        plan = None
        for loads, grads in tried:
            if o.disk_loads not in (None, loads) or o.disk_grads not in (None, grads) or (grads and not self.run.clips):
                continue
            lean = self.plan(dataclasses.replace(o, disk_loads=loads, disk_grads=grads), rest)
            p = lean.placement
            if plan is None or lean.placement.bytes(HOST) < plan.placement.bytes(HOST):
                plan = lean
            if not p.masters_on_disk or self.budgets.host is None or p.bytes(HOST) <= self.budgets.host:
                break
        return plan

    def search(self, o: Overrides) -> Plan:
        """The best of the candidates; where it does not fit the GPU, tiles or one landing set where they need
        less; where its disk tier's reads may run further ahead, deeper staging where that is faster."""
        misses_gpu, placement, estimate, passed = self.best(o)
        smaller = self.smaller(o, placement) if misses_gpu else None
        if smaller is not None:
            return smaller
        unclipped = price(placement, self.machine, clipping_acts=False) if self.run.clips else estimate
        plan = Plan(placement, estimate, unclipped, self.budgets,
                    attention=attention_backends(placement.shapes, self.machine.gpu,
                                                 placement.query_tiles and placement.tiled)
                    if self.run.cuda else (),
                    tie_passed_over_s=passed)
        plan.problems = _problems(plan)
        if placement.on_disk and o.disk_staging is None and plan.fits:  # the disk tier's reads further ahead
            deeper = self.search(dataclasses.replace(o, disk_staging=DEEP_STAGING))
            if deeper.fits and deeper.estimate.step_s < plan.estimate.step_s * (1 - TIE):
                return deeper
        return plan

    def smaller(self, o: Overrides, placement: Placement) -> Plan | None:
        """Where whole rows do not fit the GPU: tiles of the sequence; still too big, one set of landing buffers
        (each block's activations fetched after the next one's backward). Either, fitting or not, where it needs
        less of the GPU."""
        tiled = self.tiled(o) if o.sequence_tile is None or o.query_tiles is None else None
        if tiled is not None and tiled.placement.bytes(GPU) < placement.bytes(GPU):
            return tiled
        if o.landing_sets is None and placement.landing_sets > 1 and self.run.activations != GPU:
            lean = self.search(dataclasses.replace(o, landing_sets=1))
            if lean.placement.bytes(GPU) < placement.bytes(GPU):
                return lean
        return None

    def tiled(self, o: Overrides) -> Plan | None:
        """The first plan that fits of: the MLP by the largest sequence tile down to the smallest, then the
        attention by query tiles too (the tiles' second forward then covers the attention, and the backend must run
        query tiles), where every block has a backend that does; else the last tried (None where rows are no longer
        than a tile)."""
        seq = self.step.seq_len or self.step.tokens_per_micro
        if o.sequence_tile == 0:  # (whole rows, as the user asked)
            return None
        tiles = (o.sequence_tile,) if o.sequence_tile else tuple(t for t in SEQUENCE_TILES if t < seq)
        if not tiles:
            return None
        queries = (o.query_tiles,) if o.query_tiles is not None else (False, True) if self.shapes.tileable else (False,)
        plan = None
        for query_tiles in queries:  # (the smallest tile first: where it does not fit, no larger one does)
            plan = self.search(dataclasses.replace(o, sequence_tile=min(tiles), query_tiles=query_tiles))
            if not self.budgets.holds(plan.placement, GPU):
                continue
            for tile in sorted(tiles, reverse=True)[:-1]:
                larger = self.search(dataclasses.replace(o, sequence_tile=tile, query_tiles=query_tiles))
                if self.budgets.holds(larger.placement, GPU):
                    return larger
            return plan
        return plan

    def best(self, o: Overrides) -> tuple[bool, Placement, Estimate, float | None]:
        """Over windows, shares of device updates and kinds of gradient home: the candidate that fits and prices
        fastest (whether it misses the GPU budget, the placement, its price), and the step of a faster one within
        TIE that it was taken over for its host memory (None: it is the fastest)."""
        run, budgets, machine = self.run, self.budgets, self.machine
        windows = (o.window,) if o.window else WINDOWS if run.cuda else (2,)
        if o.device_update_share is not None:
            shares = (o.device_update_share,)
        elif not run.cuda or run.state_bytes != 4:  # (streamed updates need fp32 states)
            shares = (0.0,)
        else:  # (without clipping too: a clip scale of exactly 1 runs every placement a clipped run has)
            shares = SHARES
        forced = o.speculate is True
        best: tuple[bool, bool, float, float, Placement, Estimate] | None = None
        fastest: dict[tuple, tuple] = {}  # per kind of fit, the candidate that ranks fastest
        for window, share, (shared, speculate) in itertools.product(windows, shares, self.kinds(o)):
            for order in self.orders(o, share):
                candidate = stripe(size_for_budget(self.shapes, self.step, run, budgets.gpu, window=window,
                                                   share=share, shared=shared, speculate=speculate,
                                                   overrides=dataclasses.replace(o, device_first=order)),
                                   machine.drives)
                entry = self.weighed(candidate, forced)
                if entry[:3] not in fastest or entry[3] < fastest[entry[:3]][3]:
                    fastest[entry[:3]] = entry
                if best is None or _better(entry[:5], best[:5]):
                    best = entry
        quicker = fastest[best[:3]]
        passed = quicker[6].step_s if quicker[3] < best[3] and quicker[6].step_s < best[6].step_s else None
        return best[0], best[5], best[6], passed

    @staticmethod
    def orders(o: Overrides, share: float) -> tuple[bool, ...]:
        """Streamed blocks last in each group of sliding blocks, and first, where both kinds share the groups
        (the cost model picks: the host's updates and the copies wait for each other differently)."""
        if o.device_first is not None or share in (0.0, 1.0):
            return (bool(o.device_first),)
        return (False, True)

    def weighed(self, p: Placement, forced: bool) -> tuple:
        """Candidate `p` as best() weighs it: its key, placement and price."""
        budgets, machine = self.budgets, self.machine
        gpu_fits, host_fits = budgets.holds(p, GPU), budgets.holds(p, HOST)
        est = price(p, machine)
        # Speculating, the step that matters is the usual one of a fine-tune: clipping does not act; and it must
        # win by more than its price's error against the speculating steps measured
        ranked = price(p, machine, clipping_acts=False).step_s * (1 + SPECULATION_MARGIN) if p.speculated \
            else est.step_s
        key = (not gpu_fits, not host_fits, forced and not p.speculated, ranked, p.bytes(HOST))
        return (*key, p, est)

    def kinds(self, o: Overrides) -> list[tuple[bool, bool | int]]:
        """(gradients pooled, speculating) pairs tried. Host gradients that wait (for the norm, or for a device
        update at the next load) share the boundary activations' memory: up to the activations' size less host
        memory, at the speed of a buffer each (docs/findings.md). Speculating: every block, or the first ones
        where the host cannot afford all (each speculating block needs its speculated parameters and a gradient
        buffer of its own); `auto` also weighs not speculating, and takes what prices faster by more than
        SPECULATION_MARGIN. Not by default (docs/findings.md)."""
        poolable = self.run.activations == HOST and not o.disk_boundaries
        pooled = poolable if o.share_grads is None else bool(o.share_grads) and poolable
        speculating = o.speculate in (True, "auto") and self.run.clips
        return [(pooled, False)] + ([(False, True), *((False, round(f * self.shapes.num_blocks)) for f in SPECULATED)]
                                    if speculating else [])


def _copies_hold_forward(estimate: Estimate) -> bool:
    """Whether the copies to the GPU lengthen the forward beyond its compute."""
    return estimate.setters.get("forward", {}).get("pcie_h2d", 0.0) > 0.0


# (whether an override is open, how it is resolved), in the order they are resolved
RESOLVES = (
    (lambda s, o: s.run.activations == "auto", _Planning.activations),
    (lambda s, o: not s.run.clips and o.defer_updates is None and s.run.ranks == 1, _Planning.update_timing),
    (lambda s, o: o.nvme_fraction is None, _Planning.disk_fraction),
    (lambda s, o: o.disk_loads is None or o.disk_grads is None, _Planning.disk_reads),
)


def disk_share(shapes: Shapes, step: StepShape, run: RunFacts, budgets: Budgets, machine: Machine,
               overrides: Overrides | None = None) -> tuple[float, int, bool, bool] | None:
    """The least share of the sliding blocks on disk at which the run fits: with copies of their parameters in
    host memory where some share fits so, else with their loads read from disk, else (clipped) with their
    gradients waiting on disk too. Returns the share, the blocks it puts on disk, whether their loads read from
    disk and whether their gradients wait there; None where no share fits (or the run keeps everything in
    memory: a CPU run, data-parallel ranks)."""
    o = overrides or Overrides()

    def at(fraction: float, loads: bool, grads: bool = False) -> Plan:  # (deeper staging is tried on the share found)
        return place(shapes, step, run, budgets, machine,
                     dataclasses.replace(o, nvme_fraction=fraction, disk_loads=loads, disk_grads=grads,
                                         disk_staging=o.disk_staging or 0))

    sliding = len(at(0.0, False).placement.sliding_blocks)
    if not run.cuda or run.ranks > 1 or not sliding:
        return None

    def share(blocks: int) -> float:
        return math.ceil(100 * blocks / sliding) / 100

    def fits_in_memory(candidate: Plan) -> bool:  # the disk aside: more on disk only ever needs more of it
        return candidate.budgets.holds(candidate.placement, HOST, GPU)

    grads = (False, True) if run.clips and o.disk_grads is None else (bool(o.disk_grads),)
    for loads, grads_away in [(loads, g) for g in grads for loads in (False, True)]:
        if not fits_in_memory(at(share(sliding), loads, grads_away)):
            continue
        low, high = 0, sliding  # more blocks on disk only ever take less host memory: bisect, a plan per halving
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fits_in_memory(at(share(middle), loads, grads_away)) else (middle, high)
        if at(share(high), loads, grads_away).fits:
            return share(high), high, loads, grads_away
    return None


@dataclass(frozen=True)
class Suggestion:
    """Settings near a run's own and their plan. `changes` names what differs, in the planner's words:
    `nvme_fraction`, `activations`, `speculate` and `window` only place the same training; `state_bytes`,
    `clip`, `rows` (per micro-batch), `seq_len` and `micro_batches` change it."""

    changes: dict[str, Any]
    plan: Plan

    @property
    def keeps_training(self) -> bool:
        return set(self.changes) <= PLACEMENT_CHANGES


PLACEMENT_CHANGES = {"nvme_fraction", "activations", "speculate", "window"}
HALVINGS = 3  # smaller micro-batches and shorter rows are tried down to an eighth of the run's own
SHORTEST_ROWS = 128


@dataclass(frozen=True)
class _Setting:
    """A run's settings as the planner takes them, and what was changed to reach them."""

    step: StepShape
    run: RunFacts
    overrides: Overrides
    changes: tuple[tuple[str, Any], ...] = ()

    def but(self, name: str, value: Any, **replaced) -> _Setting:
        step = dataclasses.replace(self.step, **replaced.pop("step", {}))
        run = dataclasses.replace(self.run, **replaced.pop("run", {}))
        overrides = dataclasses.replace(self.overrides, **replaced.pop("overrides", {}))
        return _Setting(step, run, overrides, (*self.changes, (name, value)))


def suggest(shapes: Shapes, step: StepShape, run: RunFacts, budgets: Budgets, machine: Machine,
            overrides: Overrides | None = None) -> list[Suggestion]:
    """Settings near the run's that fit, each with its plan. First those that place the same training
    otherwise (the least share of the states on disk, another tier for the boundary activations, no
    speculation, one slot): each change that fits alone, then pairs where neither fits alone. Then each change
    to the training (AdamW moments in bf16, no clipping, fewer rows per micro-batch, shorter rows: the first
    halving that fits), alone or with the first of those placements it needs."""
    base = _Setting(step, run, overrides or Overrides())

    def tried(s: _Setting, atoms: tuple[str, ...]) -> Suggestion | None:
        for atom in atoms:
            s = _apply(atom, s, shapes, budgets, machine)
            if s is None:  # (it does not apply here)
                return None
        plan = place(shapes, s.step, s.run, budgets, machine, s.overrides)
        return Suggestion(dict(s.changes), plan) if plan.fits else None

    atoms = _placement_atoms(base, budgets, place(shapes, step, run, budgets, machine, base.overrides))
    pairs = [(a, b) for a, b in itertools.combinations(atoms, 2) if a.split("=")[0] != b.split("=")[0]]
    out: list[Suggestion] = []
    enough = set()  # placement changes that fit alone
    for atom in atoms:
        if found := tried(base, (atom,)):
            out.append(found)
            enough.add(atom)
    for pair in pairs:
        if enough.isdisjoint(pair) and (found := tried(base, pair)):
            out.append(found)
    for kind in _training_changes(base):
        found = next((s for variant in kind for extra in [(), *((a,) for a in atoms), *pairs]
                      if (s := tried(variant, extra))), None)
        if found:
            out.append(found)
    return out


def longest_rows(shapes: Shapes, step: StepShape, run: RunFacts, budgets: Budgets, machine: Machine,
                 overrides: Overrides | None = None, limit: int = 1 << 22, unit: int = 128) -> int | None:
    """The longest rows (a multiple of `unit`, at most `limit`) whose plan fits, the step's rows per micro-batch
    and micro-batches as they are: doublings, then a bisection between the last two. None where not even rows of
    `unit` fit."""
    o, rows = overrides or Overrides(), step.tokens_per_micro // (step.seq_len or step.tokens_per_micro)

    def fits(length: int) -> bool:
        return place(shapes, StepShape(rows * length, step.micro_batches, length), run, budgets, machine, o).fits

    if not fits(unit):
        return None
    low = high = unit
    while high < limit and fits(min(2 * high, limit)):
        low = high = min(2 * high, limit)
    high = min(2 * high, limit) if high < limit else high
    while high - low > unit:
        middle = (low + high) // 2 // unit * unit
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def compute_bound_step(shapes: Shapes, step: StepShape, run: RunFacts, budgets: Budgets, machine: Machine,
                       overrides: Overrides | None = None, most: int = 64) -> Suggestion | None:
    """The fewest micro-batches per step (each as it is) at which the step is bound by the compute, and that
    plan: doublings of the run's own up to `most` times it, then a bisection down to the first. None where no
    such step fits first (more tokens per step need more memory for their boundary activations)."""
    o = overrides or Overrides()

    def at(micro: int) -> Plan:
        return place(shapes, dataclasses.replace(step, micro_batches=micro), run, budgets, machine, o)

    def bound(plan: Plan) -> bool:
        return plan.estimate.bottleneck in ("gpu", "compute")

    low, high, plan = step.micro_batches, step.micro_batches, None
    while high < most * step.micro_batches:
        low, high = high, 2 * high
        plan = at(high)
        if not plan.fits:
            return None
        if bound(plan):
            break
    else:
        return None
    while high - low > 1:
        middle = (low + high) // 2
        tried = at(middle)
        if tried.fits and bound(tried):
            high, plan = middle, tried
        else:
            low = middle
    return Suggestion({"micro_batches": high}, plan)


def _placement_atoms(s: _Setting, budgets: Budgets, plan: Plan) -> list[str]:
    """The placement changes that could help `s` (whose plan is `plan`): names of `_apply`."""
    run, o, p = s.run, s.overrides, plan.placement
    atoms = []
    if o.nvme_fraction is not None and run.cuda and run.ranks == 1:  # (`auto` searches the disk itself)
        atoms.append("disk")
    if run.activations != "auto":
        atoms += [f"activations={t}" for t in ACTIVATION_PREFERENCE
                  if t != run.activations and (t != DISK or run.ranks == 1)]
    if p.speculated:
        atoms.append("speculate=off")
    if budgets.gpu is not None and p.bytes(GPU) > budgets.gpu and p.window > 1 and p.sliding_blocks:
        atoms.append("window=1")
    return atoms


def _apply(atom: str, s: _Setting, shapes: Shapes, budgets: Budgets, machine: Machine) -> _Setting | None:
    if atom == "disk":  # the least share on disk that fits (a number, as a user would write it)
        found = disk_share(shapes, s.step, s.run, budgets, machine, s.overrides)
        return None if found is None else s.but("nvme_fraction", found[0], overrides={"nvme_fraction": found[0]})
    if atom.startswith("activations="):
        tier = atom.removeprefix("activations=")
        return s.but("activations", tier, run={"activations": tier})
    if atom == "speculate=off":
        return s.but("speculate", False, overrides={"speculate": False})
    if atom == "window=1":
        return s.but("window", 1, overrides={"window": 1})
    raise ValueError(f"no placement change {atom!r}")


def _training_changes(s: _Setting) -> list[list[_Setting]]:
    """Each kind of change to the training, as the settings to try in turn: bf16 AdamW moments; no clipping;
    fewer rows per micro-batch, halving; shorter rows, halving (the tokens per step shrink with either)."""
    run, step, o = s.run, s.step, s.overrides
    out = []
    if run.state_bytes == 4 and not o.device_update_share:  # (streamed updates carry fp32 moments)
        out.append([s.but("state_bytes", 2, run={"state_bytes": 2})])
    if run.clips:
        out.append([s.but("clip", None, run={"clip": None})])
    seq = step.seq_len or step.tokens_per_micro
    rows = step.tokens_per_micro // seq
    out.append([s.but("rows", rows >> k, step={"tokens_per_micro": (rows >> k) * seq})
                for k in range(1, HALVINGS + 1) if rows >> k >= 1])
    out.append([s.but("seq_len", seq >> k, step={"tokens_per_micro": rows * (seq >> k), "seq_len": seq >> k})
                for k in range(1, HALVINGS + 1) if seq >> k >= SHORTEST_ROWS])
    return [kind for kind in out if kind]


def _rank(plan: Plan) -> tuple:
    """A plan's key for `_better`: fitting, its step, its host memory."""
    return (not plan.fits, False, False, plan.estimate.step_s, plan.placement.bytes(HOST))


def _pick(plans: list[Plan]) -> Plan:
    """The plan `_better` prefers among `plans`, whatever their order: of the best-fitting ones, those within
    TIE of the fastest; of those, the least host memory, and at that memory the fastest."""
    ranked = [(_rank(plan), plan) for plan in plans]
    fit = min(key[:3] for key, _ in ranked)
    ranked = [(key, plan) for key, plan in ranked if key[:3] == fit]
    fastest = min(key[3] for key, _ in ranked)
    return min(((key, plan) for key, plan in ranked if key[3] <= fastest * (1 + TIE)),
               key=lambda entry: (entry[0][4], entry[0][3]))[1]


def _better(key: tuple, than: tuple) -> bool:
    """Fitting the GPU, then the host, first; then what was asked for (speculation forced); then faster by more
    than TIE; among near-equals, less host memory, and at the same memory the faster."""
    if key[:3] != than[:3]:
        return key[:3] < than[:3]
    if abs(key[3] - than[3]) > TIE * min(key[3], than[3]):
        return key[3] < than[3]
    return key[4] < than[4] or (key[4] == than[4] and key[3] < than[3])


ACTIVATION_PREFERENCE = (HOST, GPU, DISK)  # among tiers that price alike: host memory, the device, files


def _activation_tier(shapes: Shapes, step: StepShape, run: RunFacts, budgets: Budgets, machine: Machine,
                     o: Overrides) -> Plan:
    """`activations: auto`: the plan of each tier for the boundary activations, and of host memory with the
    fewest first blocks' on disk that fit where host memory alone does not; the fastest that fits (the disk
    only for a single process: data-parallel ranks keep theirs in memory); among near-equals, the first of
    ACTIVATION_PREFERENCE, the mixture just after the host's. None fitting, the host tier's plan says what does
    not fit."""
    tiers = [t for t in ACTIVATION_PREFERENCE if t != DISK or run.ranks == 1]
    plans = [place(shapes, step, dataclasses.replace(run, activations=t), budgets, machine, o) for t in tiers]
    mixed = _fewest_boundaries_on_disk(shapes, step, run, budgets, machine, o) \
        if not plans[0].fits and DISK in tiers and o.disk_boundaries is None else None
    if mixed:
        plans.insert(1, mixed)
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return plans[0]
    fastest = min(p.estimate.step_s for p in fitting)
    return next(p for p in fitting if p.estimate.step_s <= fastest * (1 + TIE))


def _fewest_boundaries_on_disk(shapes: Shapes, step: StepShape, run: RunFacts, budgets: Budgets,
                               machine: Machine, o: Overrides) -> Plan | None:
    """Boundary activations in host memory but the first blocks', on disk: the plan with the fewest of those
    that fits (more on disk only ever takes less host memory: a bisection), or None."""
    host = dataclasses.replace(run, activations=HOST)

    def at(k: int) -> Plan:
        return place(shapes, step, host, budgets, machine, dataclasses.replace(o, disk_boundaries=k))

    low, high = 0, shapes.num_blocks - 1  # (all of them on disk is the disk tier's own plan)
    if high < 1 or not at(high).fits:
        return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if at(middle).fits else (middle, high)
    return at(high)


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
    for tier, budget in b.others:  # registered tiers (placement.register_tier)
        if p.bytes(tier) > budget:
            out.append(f"{tier}: needs ~{p.bytes(tier) / GIB:.1f} GiB, {budget / GIB:.1f} GiB usable")
    return out


def budget_problems(plan: Plan) -> list[str]:
    """What of `plan`'s placement does not fit its budgets, each tier in one line."""
    return _problems(plan)
