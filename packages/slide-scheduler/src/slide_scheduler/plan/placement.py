"""The placement: for every unit, where its parameters, gradient, master and AdamW moments live and where its
update runs, and every allocation that follows, with its bytes. The engine executes a placement; `place` computes
one from the model's shapes, the step, the budgets and the cost model, and a hand-written one runs as well.

Units are numbered as the engine numbers them: 0 is the edges (embedding, final norm, lm head), 1 + i is block i.

The run's facts and the tiers are facts.py's, the model's and the step's shapes shapes.py's; how a placement is
chosen (`arrange`, `size_for_budget`, `Overrides`, `Budgets`) lives in choices.py.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from slide_memory import device_scratch_bytes, host_scratch_bytes, streamed_step_bytes

from .facts import ACTIVATION_TIERS, DISK, GPU, HOST, TIER_KINDS, TIERS, RunFacts, kind_of
from .shapes import Shapes, StepShape
from .sizes import DISK_STAGING_SLOTS, GRADS_TO_DISK, PIECE_ALIGN, SLOTS_PER_MICRO, pool_bytes
from .sizes import LOAD_SLOTS as DISK_LOAD_SLOTS
from .workspace import block_workspace

GIB = 2**30
STREAM_PIECE = 1 << 23  # elements per device-update piece: each buffer ~150 MB on the device
STREAM_BUFFERS = 2  # a piece's copy in waits for the store of the piece that used its buffer last
LOSS_CHUNK = 1 * GIB  # slide-kernels' fused cross-entropy keeps one logits chunk
MARGIN = 1 * GIB  # allocator fragmentation, cuBLAS workspaces, small tensors
# The process's own host memory beside the engine's buffers (torch, the CUDA context, libraries, the model's
# metadata): a run's RSS exceeds its planned buffers by this much on a CUDA host (benchmarks/results)
HOST_RUNTIME_CUDA = 2 * GIB
HOST_RUNTIME_CPU = GIB // 2
HELD_HEADROOM = 0.05  # of the GPU budget (at least 0.5 GiB), left free when spare memory holds gradients

UPDATES = ("device", "stream", "host")  # on the device for good / streamed through it as it loads / CPU AdamW
GRADS = ("slot", "held", "pool", "ring", "own", "disk")  # where a gradient waits for its update


@dataclass(frozen=True)
class UnitPlacement:
    resident: bool  # on the device for good, fp32 master and moments there too
    update: str  # "device" (resident), "stream" (through device buffers as it loads), "host"
    # "slot" (where it is made), "held" (a device buffer), "pool", "ring", "own" (a host buffer), "disk" (written
    # to a file during the backward, read back with the unit's states for its update)
    grad: str
    moments: str  # GPU, HOST or DISK
    split: bool = False  # clipped: new master before the next forward, moments after it
    # clipped: its update also runs during backward as if clipping did not act, writing only the new parameters;
    # when it does not act, the next loads take those and the update proper runs whenever the host gets to it
    speculate: bool = False
    # The tier of its fp32 master: the device's for a resident unit, host memory, or disk beside its moments (read
    # and written back around each update; its loads then take a copy of its parameters in the compute dtype, which
    # the update writes). "": the device's where resident, else host memory.
    master: str = ""
    # Where its loads read its parameters: the master's tier, or host memory where a master on disk keeps a copy
    # there. "": the device's where resident, else host memory.
    loads: str = ""
    # Without clipping: its host update waits for the step's end and runs in the next forward's order, rather than
    # as soon as its gradient lands (with clipping every host update waits for the norm)
    defer: bool = False
    # Without clipping, a streamed block: its device update runs during the backward once its gradient is home,
    # where the copies have room, rather than at its next load (which then takes the new master)
    early: bool = False

    def __post_init__(self):
        for name in ("master", "loads"):
            if not getattr(self, name):
                object.__setattr__(self, name, GPU if self.resident else HOST)


@dataclass(frozen=True)
class Allocation:
    tier: str
    kind: str
    nbytes: int
    transient: bool = False  # a working estimate (recompute, loss chunk, margin), not a buffer the engine holds


@dataclass(frozen=True)
class Placement:
    shapes: Shapes
    step: StepShape
    units: tuple[UnitPlacement, ...]
    window: int  # device slots for sliding blocks
    run: RunFacts = field(default_factory=RunFacts)
    stream_piece: int = field(default_factory=lambda: STREAM_PIECE)  # (read when made: tests shrink them)
    stream_buffers: int = field(default_factory=lambda: STREAM_BUFFERS)
    threads: int = field(default_factory=torch.get_num_threads)  # host optimizer threads (its scratch)
    # positions per tile where a block runs its MLP over tiles of the sequence (0: whole rows)
    sequence_tile: int = 0
    # its attention half by query tiles of `sequence_tile` too (against the keys and values up to each tile's end)
    query_tiles: bool = False
    # sets of device buffers the backward fetches boundary activations into (0: one per slot and one more)
    landing: int = 0
    # streamed sliding edges: their tail-only part (final norm, untied lm head) updates apart, early
    edges_early: bool = True
    # where each block's input boundary activations wait (GPU | HOST | DISK), block by block; empty: all in the
    # run's tier (`activations`)
    boundaries: tuple[str, ...] = ()
    # staging slots of the disk tier's states: how many updates ahead their reads run (0: DISK_STAGING_SLOTS)
    staging: int = 0
    # The disk tier striped over several drives (stripe.py): the drive of each unit's files (masters, moments,
    # held gradient), and of each block's input boundary activations; empty: every file on drive 0
    drives: tuple[int, ...] = ()
    boundary_drives: tuple[int, ...] = ()
    # speculating blocks sit out the step after one whose clipping acted (its norm is most likely over the limit
    # too, and a discarded speculation costs host time), until a step's clipping does not act again
    speculation_pause: bool = True
    # the synchronous reference schedule: every lane inline and the optimizer on the calling thread (the pipelined
    # engine is tested against it, bit for bit)
    synchronous: bool = False

    def __post_init__(self):
        validate(self)

    # -- the run's facts (one rank's bytes where there are several) ------------------------------------------------

    @property
    def clips(self) -> bool:
        return self.run.clips

    def waits(self, unit: int) -> bool:
        """Whether `unit`'s update waits for the step's end (with clipping, for the norm; without, where the unit
        defers it), split where placed so."""
        return self.clips or self.units[unit].defer

    def loads(self, unit: int) -> int:
        """A sliding block's loads per step: forward and backward, but the last block's backward, which finds it
        still in its slot from the forward."""
        return 1 if unit == self.shapes.num_blocks else 2

    @property
    def deferred(self) -> set[int]:
        """Units whose host update waits for the step's end."""
        return {u for u in self.where("update", "host") if self.waits(u)}

    @property
    def activations(self) -> str:
        return self.run.activations

    @property
    def tiles(self) -> int:
        """Sequence tiles per row (1: whole rows)."""
        seq = self.step.seq_len or self.step.tokens_per_micro
        return -(-seq // self.sequence_tile) if self.sequence_tile else 1

    @property
    def tiled(self) -> bool:
        """Whether the blocks run their rows by tiles (rows longer than a tile)."""
        return self.tiles > 1

    @property
    def compute_bytes(self) -> int:
        return self.run.compute_bytes

    @property
    def state_bytes(self) -> int:
        return self.run.state_bytes

    @property
    def boundary_bytes(self) -> int:
        """One block's input boundary activations over the step (every micro-batch), in the compute dtype."""
        return self.step.tokens_per_micro * self.shapes.hidden * self.compute_bytes * self.step.micro_batches

    def disk_state_bytes(self, unit: int) -> int:
        """Per parameter of `unit`, what its states on disk take: the AdamW moments, and the fp32 master where it is
        there too."""
        return 2 * self.state_bytes + (4 if kind_of(self.units[unit].master) == "files" else 0)

    @property
    def boundary_tiers(self) -> tuple[str, ...]:
        """Each block's input boundary activations' tier."""
        return self.boundaries or (self.activations,) * self.shapes.num_blocks

    def boundaries_in(self, tier: str) -> int:
        """How many blocks' input boundaries wait in `tier` (GPU | HOST | DISK)."""
        return self.boundary_tiers.count(tier)

    @property
    def device_is_host(self) -> bool:
        """A CPU run: the "device" is host memory too."""
        return not self.run.cuda

    @property
    def ranks(self) -> int:
        return self.run.ranks

    # -- views by unit --------------------------------------------------------------------------------------------

    def where(self, attr: str, value) -> set[int]:
        # (kept per placement, which does not change: counting its bytes asks for these sets unit by unit)
        found = self.__dict__.setdefault("_where", {})
        if (attr, value) not in found:
            found[attr, value] = frozenset(u for u, p in enumerate(self.units) if getattr(p, attr) == value)
        return set(found[attr, value])

    @property
    def resident(self) -> set[int]:
        return self.where("resident", True)

    @property
    def sliding_blocks(self) -> list[int]:
        return [u for u in range(1, len(self.units)) if not self.units[u].resident]

    @property
    def streamed(self) -> set[int]:
        return self.where("update", "stream")

    @property
    def early(self) -> set[int]:
        """Streamed blocks whose device update runs during the backward (unclipped)."""
        return self.where("early", True)

    @property
    def on_disk(self) -> set[int]:
        """Units whose moments live in files (the disk tier), read in ahead of each update."""
        return set().union(*(self.where("moments", t) for t, kind in TIER_KINDS.items() if kind == "files"))

    @property
    def masters_on_disk(self) -> set[int]:
        """Units whose master lives in files, beside their moments."""
        return set().union(*(self.where("master", t) for t, kind in TIER_KINDS.items() if kind == "files"))

    @property
    def loads_from_disk(self) -> set[int]:
        """Units whose loads read the master from its files (no copy of their parameters in host memory)."""
        return set().union(*(self.where("loads", t) for t, kind in TIER_KINDS.items() if kind == "files"))

    @property
    def held(self) -> set[int]:
        return self.where("grad", "held")

    def drive_of(self, unit: int) -> int:
        """The drive (of the disk tier's, in the machine's order) that holds `unit`'s files."""
        return self.drives[unit] if self.drives else 0

    def boundary_drive(self, block: int) -> int:
        """The drive that holds the input boundary activations of `block` (0-based), where they are on disk."""
        return self.boundary_drives[block] if self.boundary_drives else 0

    @property
    def drive_count(self) -> int:
        """How many drives the disk tier's files are striped over (1: one drive)."""
        return 1 + max((*self.drives, *self.boundary_drives), default=0)

    @property
    def grads_on_disk(self) -> set[int]:
        """Units whose clipped gradient waits in a file for its update."""
        return self.where("grad", "disk")

    @property
    def speculated(self) -> set[int]:
        return self.where("speculate", True)

    @property
    def pooled(self) -> list[int]:
        """Blocks (not units) whose gradient waits in the memory shared with the boundary activations."""
        return sorted(u - 1 for u in self.where("grad", "pool"))

    @property
    def ring(self) -> int:
        """Host gradient buffers the sliding blocks without a place of their own take turns in (in the backward's
        order, round the ring): three where host updates empty them during backward; from the first gradient that
        waits (for the step's end, or for a streamed update's next load) on, one each, so that none is taken again
        within the step."""
        ringed = sorted(self.where("grad", "ring"), reverse=True)
        first = next((k for k, u in enumerate(ringed) if self.waits(u) or u in self.streamed), len(ringed))
        return max(min(3, first), len(ringed) - first)

    @property
    def landing_sets(self) -> int:
        """Sets of device buffers the backward fetches boundary activations into: the plan's, else one per slot and
        one more (two when nothing slides: resident blocks wait for no slot, so one more gives slack), at most one
        per block. With one, each block's fetch waits for the backward of the block after it."""
        return min(self.shapes.num_blocks, self.landing or (self.window if self.sliding_blocks else 1) + 1)

    @property
    def staging_slots(self) -> int:
        """Host staging slots of the disk tier's states (each a block's m and v, and master and gradient where
        those are on disk): their reads run that many updates ahead of the optimizer."""
        return self.staging or DISK_STAGING_SLOTS

    @property
    def stream_piece_numel(self) -> int:
        """Elements per device-update buffer: a piece, or the largest streamed unit if smaller."""
        largest = max((self.shapes.unit_numels[u] for u in self.streamed), default=1)
        return min(self.stream_piece, -(-largest // PIECE_ALIGN) * PIECE_ALIGN)

    # -- allocations ----------------------------------------------------------------------------------------------

    @property
    def allocations(self) -> list[Allocation]:
        return list(self._made)

    @functools.cached_property
    def _made(self) -> tuple[Allocation, ...]:  # (a placement does not change: the planner asks for its bytes often)
        return tuple(_allocations(self))

    def bytes(self, tier: str, transient: bool = True) -> int:
        return sum(a.nbytes for a in self.allocations if a.tier == tier and (transient or not a.transient))

    def tiers(self) -> dict[str, dict[str, int]]:
        """Tier -> kind of content -> bytes."""
        out: dict[str, dict[str, int]] = {t: {} for t in TIERS}
        for a in self.allocations:
            out.setdefault(a.tier, {})[a.kind] = out.get(a.tier, {}).get(a.kind, 0) + a.nbytes
        return out

    def describe(self) -> list[str]:
        """One line per run of units placed alike."""
        lines = []
        for p, group in itertools.groupby(range(len(self.units)), key=lambda u: self.units[u]):
            units = list(group)
            name = _names(units)
            where = ("resident" if p.resident else "sliding") + f", update on {p.update}, gradient in {p.grad}, " \
                f"master on {p.master}, moments on {p.moments}" + (", split" if p.split else "") \
                + (", speculates" if p.speculate else "") \
                + (f", loads read from {p.loads}" if p.loads == p.master != HOST and not p.resident else "")
            lines.append(f"    {name}: {where}")
        return lines


def _names(units: list[int]) -> str:
    names = ["edges" if u == 0 else f"block {u - 1}" for u in (units[0], units[-1])]
    return names[0] if len(units) == 1 else f"{names[0]}..{names[1].removeprefix('block ')}"


def validate(p: Placement) -> None:
    """Refuse a placement the engine cannot run, saying which unit and why: the placement's checks, then each
    unit's, in order; the first that fails names the problem."""
    for check in PLACEMENT_CHECKS:
        if problem := check(p):
            raise ValueError(problem)
    for u, unit in enumerate(p.units):
        for check in UNIT_CHECKS:
            if problem := check(p, u, unit):
                raise ValueError(f"{_names([u])}: {problem}")


# -- the placement's checks: each the problem it finds, or None ----------------------------------------------------


def _activation_tiers(p: Placement) -> str | None:
    if p.activations not in ACTIVATION_TIERS:
        return (f"a placement puts the boundary activations in one of {', '.join(ACTIVATION_TIERS)}, got "
                f"{p.activations!r} (the planner chooses for `auto`)")
    if p.boundaries and (len(p.boundaries) != p.shapes.num_blocks
                         or any(t not in ACTIVATION_TIERS for t in p.boundaries)):
        return (f"a placement names one tier of {', '.join(ACTIVATION_TIERS)} per block's boundary activations "
                f"({p.shapes.num_blocks}), got {p.boundaries!r}")
    return None


def _counts(p: Placement) -> str | None:
    if len(p.units) != len(p.shapes.unit_numels):
        return f"a placement needs one entry per unit ({len(p.shapes.unit_numels)}), got {len(p.units)}"
    if p.window < 1:
        return f"the window needs at least one slot, got {p.window}"
    if p.staging < 0:
        return f"the disk tier's staging slots are a count (0: the default), got {p.staging}"
    if p.landing < 0:
        return f"activation landing sets are a count (0: the rule), got {p.landing}"
    return None


def _drives(p: Placement) -> str | None:
    for name, drives, count in (("unit", p.drives, len(p.units)), ("block", p.boundary_drives, p.shapes.num_blocks)):
        if drives and (len(drives) != count or any(not isinstance(d, int) or d < 0 for d in drives)):
            return f"a striped placement names a drive (0, 1, ...) per {name} ({count}), got {drives!r}"
    return None


def _ranks(p: Placement) -> str | None:
    if any(n % p.ranks for n in p.shapes.unit_numels):
        return f"units of {p.shapes.unit_numels[:2]}... elements do not split into {p.ranks} shards"
    if p.ranks > 1 and p.shapes.mixed:
        return (f"with {p.ranks} data-parallel ranks every block has one shape (not yet: blocks of "
                f"{sorted(set(p.shapes.unit_numels[1:]))} parameters)")
    if p.ranks == 1:
        return None
    other = [_names([u]) for u, unit in enumerate(p.units)
             if unit.update != "host" or kind_of(unit.moments) != "memory" or unit.grad == "pool"]
    if other:
        return (f"with {p.ranks} data-parallel ranks every unit slides and updates on the host, its moments in host "
                f"memory (not yet: {', '.join(other)})")
    return None


def _tiles(p: Placement) -> str | None:
    if p.query_tiles and not p.sequence_tile:
        return "a placement runs the attention by query tiles only of a sequence tile (sequence_tile > 0)"
    return None


PLACEMENT_CHECKS = (_activation_tiers, _counts, _drives, _ranks, _tiles)


# -- each unit's checks (p, u, unit): the problem, which the unit's name will lead, or None ----------------------


def _kinds(p: Placement, u: int, unit: UnitPlacement) -> str | None:
    if unit.update not in UPDATES or unit.grad not in GRADS or unit.moments not in TIER_KINDS:
        return f"update must be one of {UPDATES}, grad one of {GRADS}, moments one of {tuple(TIER_KINDS)}"
    return None


def _resident(p: Placement, u: int, unit: UnitPlacement) -> str | None:
    if unit.resident != (unit.update == "device") or unit.resident != (kind_of(unit.moments) == "device"):
        return "a resident unit updates on the device with its moments there, and only it"
    if unit.resident and unit.grad != "slot":
        return "a resident unit's gradient stays in its slot"
    return None


def _moments_on_disk(p: Placement, u: int, unit: UnitPlacement) -> str | None:
    if kind_of(unit.moments) == "files" and (u == 0 or unit.update != "host" or unit.split):
        return "moments on disk are for sliding blocks updated on the host, whole"
    return None


def _master(p: Placement, u: int, unit: UnitPlacement) -> str | None:
    if unit.master not in TIER_KINDS or unit.loads not in TIER_KINDS:
        return f"master and loads name tiers, one of {tuple(TIER_KINDS)}"
    if unit.resident != (kind_of(unit.master) == "device") or unit.resident != (kind_of(unit.loads) == "device"):
        return "a resident unit's master is on the device, and only its"
    if kind_of(unit.master) == "files" and unit.master != unit.moments:
        return "a master on disk has its moments there too"
    if unit.loads not in (unit.master, HOST):
        return "loads read the master where it is, or a copy of it in host memory"
    return None


def _update(p: Placement, u: int, unit: UnitPlacement) -> str | None:
    if unit.update == "stream" and p.state_bytes != 4:
        return "updates streamed through the device need fp32 AdamW states"
    # (a streamed update runs at the unit's next load whenever its gradient came: its moments may follow that load)
    if unit.split and (not (p.waits(u) or unit.update == "stream") or unit.grad not in ("ring", "own")):
        return "only an update that waits for the step's end (clipped, deferred, or streamed) whose gradient has a " \
            "host buffer of its own splits"
    if unit.defer and (p.clips or unit.update != "host"):
        return "only an unclipped host update defers to the step's end (clipped ones all wait for the norm)"
    if unit.early and (p.clips or u == 0 or unit.update != "stream"):
        return "only an unclipped streamed block updates early, in the backward (clipped ones wait for the norm)"
    if unit.speculate and (not p.clips or u == 0 or unit.update != "host" or unit.grad != "ring"
                           or kind_of(unit.moments) != "memory"):
        return ("only a clipped sliding block updated on the host, its gradient in the ring and its moments in host "
                "memory, speculates (a pooled gradient lies under the next forward's activations, which cannot wait "
                "for a late update)")
    return None


def _edges_gradient(p: Placement, u: int, unit: UnitPlacement) -> str | None:
    if u == 0 and not unit.resident and unit.grad != ("slot" if unit.update == "stream" else "own"):
        return "sliding edges keep their gradient in their slot when streamed, else in a host buffer of their own"
    return None


def _block_gradient(p: Placement, u: int, unit: UnitPlacement) -> str | None:
    if u == 0 or unit.resident:
        return None
    if unit.grad not in ("held", "pool", "ring", "disk"):
        return "a sliding block's gradient is held on the device, pooled, in the ring or on disk"
    if unit.grad == "disk" and (not p.clips or unit.update != "host" or unit.split or unit.speculate
                                or kind_of(unit.moments) != "files"):
        return ("a gradient waits on disk for a clipped host update, whole, of a block whose moments are on disk (it "
                "is read back with them)")
    if unit.grad == "held" and unit.update != "stream":
        return "only a block updated on the device holds its gradient there"
    if unit.grad == "pool" and p.boundaries_in(HOST) != p.shapes.num_blocks:
        return ("pooled gradients share the host memory of the boundary activations: they need activations on the "
                "host")
    return None


UNIT_CHECKS = (_kinds, _resident, _moments_on_disk, _master, _update, _edges_gradient, _block_gradient)


def early_reads_wait(p: Placement) -> bool:
    """Whether a clipped step's first updates must wait for the norm to read their states from disk: they
    read under the backward only where nothing the backward waits for reads the disk then (masters for loads,
    boundary activations on disk)."""
    return bool(p.loads_from_disk) or bool(p.boundaries_in(DISK)) or bool(p.grads_on_disk)


def block_range(units: Iterable[int]) -> list[int]:
    return sorted(u - 1 for u in units if u > 0)


# -- bytes ------------------------------------------------------------------------------------------------------------


def _allocations(p: Placement) -> list[Allocation]:
    """Every buffer the engine holds under `p` (as slide-memory and the engine allocate them), plus the working
    estimates of a step on the device."""
    out = _Counted()
    for part in (_host_states, _disk_files, _device_buffers, _waiting, _working_sets):
        part(p, out)
    return out


class _Counted(list):
    def add(self, tier: str, kind: str, nbytes: float, transient: bool = False) -> None:
        if nbytes:
            self.append(Allocation(tier, kind, int(nbytes), transient))


def _shards(p: Placement) -> list[int]:
    """What one rank keeps of each unit's host state."""
    return [n // p.ranks for n in p.shapes.unit_numels]


def _device_of(p: Placement) -> str:
    return HOST if p.device_is_host else GPU


def _host_states(p: Placement, out: _Counted) -> None:
    """An fp32 master per unit (resident ones keep theirs for checkpoints) but those on disk, which keep a copy of
    their parameters in the compute dtype instead; moments of host units; the host optimizer's scratch."""
    numel, shard, c = p.shapes.unit_numels, _shards(p), p.compute_bytes
    resident = p.resident
    host_units = [u for u in range(len(numel)) if u not in resident]
    away, read = p.masters_on_disk, p.loads_from_disk
    out.add(HOST, "masters", 4 * sum(shard[u] for u in range(len(numel)) if u not in away))
    out.add(HOST, "parameters of masters on disk", c * sum(numel[u] for u in away - read))
    out.add(HOST, "masters read for loads", DISK_LOAD_SLOTS * 4 * p.shapes.block_numel if read else 0)
    on_disk = p.on_disk
    in_memory = [u for u in host_units if u not in on_disk]  # (in host memory, or another tier of that kind)
    for tier in dict.fromkeys([HOST, *(p.units[u].moments for u in in_memory)]):
        out.add(tier, "moments", 2 * p.state_bytes * sum(shard[u] for u in in_memory if p.units[u].moments == tier))
    if host_units:  # the host optimizer's scratch and its three fp32 rows, shared by every unit
        out.add(HOST, "optimizer scratch", host_scratch_bytes(max(shard[u] for u in host_units), p.threads))


def _disk_files(p: Placement, out: _Counted) -> None:
    """The disk tier's files and the host buffers they pass through."""
    numel, block, c = p.shapes.unit_numels, p.shapes.block_numel, p.compute_bytes
    if p.on_disk:
        out.add(DISK, "moments", 2 * p.state_bytes * sum(numel[u] for u in p.on_disk))
        out.add(DISK, "masters", 4 * sum(numel[u] for u in p.masters_on_disk))
        out.add(HOST, "moments staging", p.staging_slots * 2 * p.state_bytes * block)
        out.add(HOST, "masters staging", p.staging_slots * 4 * block if p.masters_on_disk else 0)
    if p.grads_on_disk:  # written from a ring of host buffers, read back into the states' staging slots
        out.add(DISK, "gradients", c * sum(numel[u] for u in p.grads_on_disk))
        out.add(HOST, "gradients to disk", (GRADS_TO_DISK + p.staging_slots) * c * block)


def _device_buffers(p: Placement, out: _Counted) -> None:
    """The edges' slot, the window, resident blocks' slots, resident units' fp32 master, moments and optimizer
    scratch, device-update buffers, held gradients, gradient shards and the step's readout."""
    numel, block, c, dev = p.shapes.unit_numels, p.shapes.block_numel, p.compute_bytes, _device_of(p)
    resident, sliding = sorted(p.resident), p.sliding_blocks
    out.add(dev, "edges", 2 * c * numel[0])
    if sliding:
        out.add(dev, "slots", p.window * 2 * c * block)
    out.add(dev, "resident blocks", 2 * c * sum(numel[u] for u in resident if u))
    out.add(dev, "resident states", 12 * sum(numel[u] for u in resident))
    if resident:  # their optimizers' scratch (and, on a CPU device, three fp32 rows each)
        out.add(dev, "optimizer scratch", device_scratch_bytes([numel[u] for u in resident], p.device_is_host,
                                                               p.threads))
    if p.streamed:  # device-update buffers: fp32 master, m, v, gradient, and the gradient as it lands
        out.add(dev, "device-update buffers", p.stream_buffers * streamed_step_bytes(p.stream_piece_numel, c))
    out.add(dev, "held gradients", c * sum(numel[u] for u in p.held))
    if p.ranks > 1:  # each slot's (and the edges') gradient shard, reduce-scattered before it leaves
        out.add(dev, "gradient shards", c * ((p.window if sliding else 0) * block // p.ranks + _shards(p)[0]))
    out.add(dev, "step readout", 4 * (1 + len(numel)))  # the loss, then each unit's squared gradient norm


def _activation_bytes(p: Placement) -> int:
    """One micro-batch's boundary activation."""
    return p.step.tokens_per_micro * p.shapes.hidden * p.compute_bytes


def _waiting(p: Placement, out: _Counted) -> None:
    """Host gradients (the ring, the sliding edges' own buffer, the pool shared with the boundary activations)
    and the boundary activations in each tier, with the rings and landing buffers they pass through."""
    s, t, c, dev = p.shapes, p.step, p.compute_bytes, _device_of(p)
    act, shard = _activation_bytes(p), _shards(p)
    # block inputs 0..n-1 (the last output goes straight on), each in its block's tier
    host_acts, disk_acts, device_acts = (p.boundaries_in(tier) * t.micro_batches for tier in (HOST, DISK, GPU))
    out.add(HOST, "gradients", p.ring * c * s.block_numel // p.ranks)
    out.add(HOST, "speculative parameters", c * sum(shard[u] for u in p.speculated))
    if p.units[0].grad == "own":
        out.add(HOST, "gradients", c * shard[0])
    if p.pooled:
        out.add(HOST, "gradients + boundary activations",
                pool_bytes(p.pooled, c * s.block_numel, [act] * t.micro_batches, s.num_blocks))
    elif host_acts:
        out.add(HOST, "boundary activations", host_acts * act)
    if disk_acts:
        out.add(DISK, "boundary activations", disk_acts * act)
        # (the write ring turns over every buffer; reads fill the read ring from its start each step)
        rings = SLOTS_PER_MICRO + min(SLOTS_PER_MICRO, p.boundaries_in(DISK))
        out.add(HOST, "boundary activation rings", rings * t.micro_batches * act)
    if device_acts:
        out.add(dev, "boundary activations", device_acts * act)
    if host_acts or disk_acts:  # backward's landing buffers: the plan's sets, reused every step
        out.add(dev, "activation landing", p.landing_sets * t.micro_batches * act)


def _working_sets(p: Placement, out: _Counted) -> None:
    """The working set of one block's recompute and backward, the tail's loss chunk, the allocator's margin, the
    process's runtime and the caller's extras: estimates, not buffers the engine holds."""
    work = block_workspace(p.shapes, p.step, p.sequence_tile, p.compute_bytes, p.query_tiles)
    out.add(_device_of(p), "workspace", work, transient=True)
    if not p.device_is_host:
        out.add(GPU, "loss chunk + margin", LOSS_CHUNK + MARGIN, transient=True)
    out.add(HOST, "runtime", HOST_RUNTIME_CPU if p.device_is_host else HOST_RUNTIME_CUDA, transient=True)
    for kind, nbytes in p.run.host_extras:  # (the caller's, beside the engine's buffers)
        out.add(HOST, kind, nbytes, transient=True)
