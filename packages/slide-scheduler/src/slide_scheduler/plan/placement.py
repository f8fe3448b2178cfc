"""The placement: for every unit, where its parameters, gradient, master and AdamW moments live and where its
update runs, and every allocation that follows, with its bytes. The engine executes a placement; `place` computes
one from the model's shapes, the step, the budgets and the cost model, and a hand-written one runs as well.

Units are numbered as the engine numbers them: 0 is the edges (embedding, final norm, lm head), 1 + i is block i.

How a placement is chosen (`arrange`, `size_for_budget`, `Overrides`, `Budgets`) lives in choices.py; its names
are found here too.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from slide_memory import FlatLayout, device_scratch_bytes, host_scratch_bytes, streamed_step_bytes

from .sizes import DISK_STAGING_SLOTS, GRADS_TO_DISK, PIECE_ALIGN, SLOTS_PER_MICRO, pool_bytes
from .sizes import LOAD_SLOTS as DISK_LOAD_SLOTS

GPU, HOST, DISK = "gpu", "host", "disk"
TIERS = (GPU, HOST, DISK)  # the tiers every machine has
# Each tier by name and the kind of memory it is, which says how the engine reaches what it holds: "device" (the
# GPU's), "memory" (host memory: the optimizer steps states there in place) or "files" (read in ahead of each
# update and written back). A tier of another name (a second pool of host memory with a budget of its own, say)
# is one `register_tier` call: the placement counts and budgets it by its name, the engine reaches it as its kind.
TIER_KINDS: dict[str, str] = {GPU: "device", HOST: "memory", DISK: "files"}


def register_tier(name: str, kind: str) -> None:
    if kind not in ("device", "memory", "files"):
        raise ValueError(f"a tier is device, memory or files, got {kind!r}")
    TIER_KINDS[name] = kind


def kind_of(tier: str) -> str:
    return TIER_KINDS[tier]
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
class Shapes:
    """What the placement needs of a model: parameters per unit and the widths of a block's activations."""

    unit_numels: tuple[int, ...]  # the edges, then each block
    hidden: int
    intermediate: int = 0
    vocab: int = 0  # rows of the output projection (0: half the edges, for the cost model's tail)
    # each block's parameters one token computes with (a mixture of experts' routed experts; empty: all of them)
    active_numels: tuple[int, ...] = ()
    active_block_numel: int = 0  # the same for every block alike (a mixture of experts' routed
    #                              experts; 0: all of them)
    # of those, each block's that run as a mixture's routed experts (grouped GEMMs; empty: none)
    routed_numels: tuple[int, ...] = ()
    attention_width: int = 0  # query heads x head dim (0: hidden)
    windows: tuple[int, ...] = ()  # each block's attention window in tokens (0: the whole causal row; empty: all)

    @property
    def num_blocks(self) -> int:
        return len(self.unit_numels) - 1

    @property
    def block_numel(self) -> int:
        """The largest block's parameters: what a slot holds."""
        return max(self.unit_numels[1:], default=0)

    def active(self, unit: int) -> int:
        """The parameters of unit `unit` (1 + block) one token computes with."""
        if self.active_numels:
            return self.active_numels[unit - 1]
        return self.active_block_numel or self.unit_numels[unit]

    def routed(self, unit: int) -> int:
        """Of unit `unit`'s (1 + block) active parameters, those of the routed experts a token runs."""
        return self.routed_numels[unit - 1] if self.routed_numels else 0

    def window(self, unit: int) -> int:
        """The attention window of unit `unit` (1 + block), in tokens; 0 for the whole causal row."""
        return self.windows[unit - 1] if self.windows else 0

    @property
    def mixed(self) -> bool:
        """Whether the blocks come in more than one size."""
        return len(set(self.unit_numels[1:])) > 1


def shapes_of(stack, hidden: int = 0, intermediate: int = 0, vocab: int = 0, ranks: int = 1) -> Shapes:
    """A stack's shapes (its edges' and each block's parameter counts, padded to split into `ranks` shards;
    widths as given). A stack whose blocks come in several shapes says which block has which with
    `block_shape(index)` and makes each with `make_block(shape)`; one whose tokens compute with only part of a
    block (a mixture of experts) says how much with `active_numel(block)`, given a block module, and how much of
    that its routed experts are with `routed_numel(block)`."""
    edges = FlatLayout(stack.make_edges(), shards=ranks).numel
    shapes = block_shapes(stack)
    made = {k: make_block(stack, k) for k in dict.fromkeys(shapes)}
    numel = {k: FlatLayout(m, shards=ranks).numel for k, m in made.items()}
    active = getattr(stack, "active_numel", None)
    actives = tuple(numel[k] - made_numel(made[k]) + active(made[k]) for k in shapes) if active else ()
    routed = getattr(stack, "routed_numel", None)
    routes = tuple(routed(made[k]) for k in shapes) if routed else ()
    return Shapes((edges,) + tuple(numel[k] for k in shapes), hidden, intermediate, vocab, active_numels=actives,
                  routed_numels=routes if any(routes) else ())


def block_shapes(stack) -> list:
    """Each block's shape, as the stack names it (None for all where its blocks have one shape)."""
    shape_of = getattr(stack, "block_shape", None)
    return [shape_of(i) if shape_of else None for i in range(stack.num_blocks)]


def make_block(stack, shape=None):
    """A block module of `shape` (a stack of one shape makes its only one)."""
    return stack.make_block(shape) if getattr(stack, "block_shape", None) else stack.make_block()


def made_numel(module) -> int:
    """A module's parameters, each tensor once (tied ones too)."""
    return sum(p.numel() for p in module.parameters())


ACTIVATION_TIERS = TIERS  # where boundary activations wait: the device, host memory, files
# The older words for those tiers, which a config may still give (`activation_tier` maps them, and only it)
OLD_ACTIVATION_WORDS = {"none": GPU, "cpu": HOST, "nvme": DISK}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # the one name -> dtype table
DTYPE_BYTES = {"fp32": 4, "bf16": 2}  # what a run computes in or keeps its AdamW moments in


@dataclass(frozen=True)
class RunFacts:
    """What the run is, decided once from its config: the plan carries it, the cost model prices it and the engine
    runs it. Nothing here is decided again at run time."""

    clip: float | None = 1.0  # the global gradient norm exact clipping keeps to; None: no clipping
    activations: str = HOST  # GPU | HOST | DISK: where boundary activations wait for the backward (auto: the plan's)
    compute_bytes: int = 2  # parameters, gradients and activations on the device: 2 (bf16) or 4 (fp32)
    state_bytes: int = 4  # per AdamW moment of a host unit: 4 (fp32) or 2 (bf16)
    device: str = "cuda"  # cpu | cuda | cuda:N
    ranks: int = 1  # data-parallel ranks (ranks.py): each keeps 1/ranks of every unit's host state
    # What the process holds in host memory besides the engine's buffers and the runtime, (name, bytes) each, as
    # the caller knows it (slide-train: the export's largest shard, converted while the engine still holds
    # everything): counted in the host tier with them, so that a plan fits its budget with it
    host_extras: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        if self.activations not in (*ACTIVATION_TIERS, "auto"):
            old = (f" (the older word for {OLD_ACTIVATION_WORDS[self.activations]}: run_facts maps it)"
                   if self.activations in OLD_ACTIVATION_WORDS else "")
            raise ValueError(f"activations must be auto or one of {', '.join(ACTIVATION_TIERS)}, got "
                             f"{self.activations!r}{old}")
        if self.compute_bytes not in (2, 4) or self.state_bytes not in (2, 4):
            raise ValueError("compute and state bytes are 2 (bf16) or 4 (fp32), got "
                             f"{self.compute_bytes} and {self.state_bytes}")
        if self.clip is not None and not self.clip >= 0:
            raise ValueError(f"the clipping norm must be positive (or None for no clipping), got {self.clip}")
        if self.ranks < 1:
            raise ValueError(f"a run has at least one rank, got {self.ranks}")
        if any(not isinstance(name, str) or nbytes < 0 for name, nbytes in self.host_extras):
            raise ValueError(f"host extras are (name, bytes) pairs, got {self.host_extras!r}")
        torch.device(self.device)  # (a name torch does not know is refused here)

    @property
    def clips(self) -> bool:
        return bool(self.clip)

    @property
    def cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.compute_bytes == 4 else torch.bfloat16

    @property
    def states_dtype(self) -> torch.dtype:
        return torch.float32 if self.state_bytes == 4 else torch.bfloat16


def resolve_device(name: str = "auto") -> str:
    """A device name as the run uses it: `auto` is CUDA where there is a device, else the CPU. CUDA asked for
    where there is none is refused."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"the device is {name!r} but no CUDA device is available here; use cpu")
    return name


def activation_tier(word: str) -> str:
    """The boundary activations' tier a config's word names: GPU, HOST, DISK and auto name themselves, and the
    older words none (the device), cpu (host memory) and nvme (files) their tiers."""
    return OLD_ACTIVATION_WORDS.get(word, word)


def run_facts(*, device: str = "auto", compute_dtype: str = "auto", states_dtype: str = "fp32",
              max_grad_norm: float | None = 1.0, activation_offload: str = HOST, ranks: int = 1,
              here: bool = True) -> RunFacts:
    """A run's facts from its config's words: `auto` compute is bf16 on CUDA and fp32 on a CPU. `here`: the
    device is this machine's (resolved, refused where absent); otherwise a name for planning elsewhere.
    `activation_offload` is a tier (or auto), or an older word for one (`activation_tier`)."""
    device = resolve_device(device) if here else ("cuda" if device == "auto" else device)
    cuda = torch.device(device).type == "cuda"
    if compute_dtype not in ("auto", *DTYPE_BYTES):
        raise ValueError(f"compute_dtype must be auto, fp32 or bf16, got {compute_dtype!r}")
    if states_dtype not in DTYPE_BYTES:
        raise ValueError(f"states_dtype must be fp32 or bf16, got {states_dtype!r}")
    compute = 2 if compute_dtype == "bf16" or (compute_dtype == "auto" and cuda) else 4
    return RunFacts(clip=max_grad_norm or None, activations=activation_tier(activation_offload), compute_bytes=compute,
                    state_bytes=DTYPE_BYTES[states_dtype], device=device, ranks=ranks)


@dataclass(frozen=True)
class StepShape:
    tokens_per_micro: int  # micro-batch size x sequence length
    micro_batches: int
    seq_len: int = 0  # for attention's FLOPs (0: tokens_per_micro)


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
    # positions per tile where a block's MLP runs over tiles of the sequence (0: whole rows)
    sequence_tile: int = 0
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
    # without clipping: host updates wait for the step's end all the same and run in the next forward's order, as
    # clipped ones do (under the forward rather than the backward; the same weights, the scale being 1)
    defer_updates: bool = False
    # the synchronous reference schedule: every lane inline and the optimizer on the calling thread (the pipelined
    # engine is tested against it, bit for bit)
    synchronous: bool = False

    def __post_init__(self):
        validate(self)

    # -- the run's facts (one rank's bytes where there are several) ------------------------------------------------

    @property
    def clips(self) -> bool:
        return self.run.clips

    @property
    def deferred(self) -> bool:
        """Whether host updates wait for the step's end (with clipping, for the norm), split where placed so."""
        return self.clips or self.defer_updates

    @property
    def activations(self) -> str:
        return self.run.activations

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
        """Host gradient buffers the sliding blocks without a place of their own take turns in: one each where a
        gradient waits (with clipping for the norm; for a streamed update, the next load), else three (host
        updates empty them during backward)."""
        ringed = self.where("grad", "ring")
        return len(ringed) if self.deferred or ringed & self.streamed else min(3, len(ringed))

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
    """Refuse a placement the engine cannot run, saying which unit and why."""
    if p.activations not in ACTIVATION_TIERS:
        raise ValueError(f"a placement puts the boundary activations in one of {', '.join(ACTIVATION_TIERS)}, got "
                         f"{p.activations!r} (the planner chooses for `auto`)")
    if p.boundaries and (len(p.boundaries) != p.shapes.num_blocks
                         or any(t not in ACTIVATION_TIERS for t in p.boundaries)):
        raise ValueError(f"a placement names one tier of {', '.join(ACTIVATION_TIERS)} per block's boundary "
                         f"activations ({p.shapes.num_blocks}), got {p.boundaries!r}")
    if len(p.units) != len(p.shapes.unit_numels):
        raise ValueError(f"a placement needs one entry per unit ({len(p.shapes.unit_numels)}), got {len(p.units)}")
    if p.window < 1:
        raise ValueError(f"the window needs at least one slot, got {p.window}")
    if p.staging < 0:
        raise ValueError(f"the disk tier's staging slots are a count (0: the default), got {p.staging}")
    if p.landing < 0:
        raise ValueError(f"activation landing sets are a count (0: the rule), got {p.landing}")
    for name, drives, count in (("unit", p.drives, len(p.units)), ("block", p.boundary_drives, p.shapes.num_blocks)):
        if drives and (len(drives) != count or any(not isinstance(d, int) or d < 0 for d in drives)):
            raise ValueError(f"a striped placement names a drive (0, 1, ...) per {name} ({count}), got {drives!r}")
    if any(n % p.ranks for n in p.shapes.unit_numels):
        raise ValueError(f"units of {p.shapes.unit_numels[:2]}... elements do not split into {p.ranks} shards")
    if p.ranks > 1 and p.shapes.mixed:
        raise ValueError(f"with {p.ranks} data-parallel ranks every block has one shape (not yet: blocks of "
                         f"{sorted(set(p.shapes.unit_numels[1:]))} parameters)")
    if p.ranks > 1:
        other = [_names([u]) for u, unit in enumerate(p.units)
                 if unit.update != "host" or kind_of(unit.moments) != "memory" or unit.grad == "pool"]
        if other:
            raise ValueError(f"with {p.ranks} data-parallel ranks every unit slides and updates on the host, its "
                             f"moments in host memory (not yet: {', '.join(other)})")
    for u, unit in enumerate(p.units):
        name = "edges" if u == 0 else f"block {u - 1}"
        if unit.update not in UPDATES or unit.grad not in GRADS or unit.moments not in TIER_KINDS:
            raise ValueError(f"{name}: update must be one of {UPDATES}, grad one of {GRADS}, moments one of "
                             f"{tuple(TIER_KINDS)}")
        if unit.resident != (unit.update == "device") or unit.resident != (kind_of(unit.moments) == "device"):
            raise ValueError(f"{name}: a resident unit updates on the device with its moments there, and only it")
        if unit.resident and unit.grad != "slot":
            raise ValueError(f"{name}: a resident unit's gradient stays in its slot")
        if kind_of(unit.moments) == "files" and (u == 0 or unit.update != "host" or unit.split):
            raise ValueError(f"{name}: moments on disk are for sliding blocks updated on the host, whole")
        if unit.master not in TIER_KINDS or unit.loads not in TIER_KINDS:
            raise ValueError(f"{name}: master and loads name tiers, one of {tuple(TIER_KINDS)}")
        if unit.resident != (kind_of(unit.master) == "device") or unit.resident != (kind_of(unit.loads) == "device"):
            raise ValueError(f"{name}: a resident unit's master is on the device, and only its")
        if kind_of(unit.master) == "files" and unit.master != unit.moments:
            raise ValueError(f"{name}: a master on disk has its moments there too")
        if unit.loads not in (unit.master, HOST):
            raise ValueError(f"{name}: loads read the master where it is, or a copy of it in host memory")
        if unit.update == "stream" and p.state_bytes != 4:
            raise ValueError(f"{name}: updates streamed through the device need fp32 AdamW states")
        if unit.split and (not p.deferred or unit.grad not in ("ring", "own")):
            raise ValueError(f"{name}: only a deferred update (clipped, or `defer_updates`) whose gradient has a "
                             "host buffer of its own splits")
        if unit.speculate and (not p.clips or u == 0 or unit.update != "host" or unit.grad != "ring"
                               or kind_of(unit.moments) != "memory"):
            raise ValueError(f"{name}: only a clipped sliding block updated on the host, its gradient in the ring "
                             "and its moments in host memory, speculates (a pooled gradient lies under the next "
                             "forward's activations, which cannot wait for a late update)")
        if u == 0 and not unit.resident and unit.grad != ("slot" if unit.update == "stream" else "own"):
            raise ValueError("edges: sliding edges keep their gradient in their slot when streamed, else in a "
                             "host buffer of their own")
        if u > 0 and not unit.resident:
            if unit.grad not in ("held", "pool", "ring", "disk"):
                raise ValueError(f"{name}: a sliding block's gradient is held on the device, pooled, in the ring or "
                                 "on disk")
            if unit.grad == "disk" and (not p.clips or unit.update != "host" or unit.split or unit.speculate
                                        or kind_of(unit.moments) != "files"):
                raise ValueError(f"{name}: a gradient waits on disk for a clipped host update, whole, of a block "
                                 "whose moments are on disk (it is read back with them)")
            if unit.grad == "held" and unit.update != "stream":
                raise ValueError(f"{name}: only a block updated on the device holds its gradient there")
            if unit.grad == "pool" and p.boundaries_in(HOST) != p.shapes.num_blocks:
                raise ValueError(f"{name}: pooled gradients share the host memory of the boundary activations: "
                                 "they need activations on the host")


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
    s, t = p.shapes, p.step
    c, dev = p.compute_bytes, (HOST if p.device_is_host else GPU)
    numel = s.unit_numels
    shard = [n // p.ranks for n in numel]  # what one rank keeps of each unit's host state
    out: list[Allocation] = []

    def add(tier: str, kind: str, nbytes: float, transient: bool = False) -> None:
        if nbytes:
            out.append(Allocation(tier, kind, int(nbytes), transient))

    resident, sliding = sorted(p.resident), p.sliding_blocks
    host_units = [u for u in range(len(numel)) if u not in resident]
    # Host: an fp32 master per unit (resident ones keep theirs for checkpoints) but those on disk, which keep a
    # copy of their parameters in the compute dtype instead; moments of host units
    away, read = p.masters_on_disk, p.loads_from_disk
    add(HOST, "masters", 4 * sum(shard[u] for u in range(len(numel)) if u not in away))
    add(HOST, "parameters of masters on disk", c * sum(numel[u] for u in away - read))
    add(HOST, "masters read for loads", DISK_LOAD_SLOTS * 4 * s.block_numel if read else 0)
    on_disk = p.on_disk
    in_memory = [u for u in host_units if u not in on_disk]  # (in host memory, or another tier of that kind)
    for tier in dict.fromkeys([HOST, *(p.units[u].moments for u in in_memory)]):
        add(tier, "moments", 2 * p.state_bytes * sum(shard[u] for u in in_memory if p.units[u].moments == tier))
    if host_units:  # the host optimizer's scratch and its three fp32 rows, shared by every unit
        add(HOST, "optimizer scratch", host_scratch_bytes(max(shard[u] for u in host_units), p.threads))
    if p.on_disk:
        add(DISK, "moments", 2 * p.state_bytes * sum(numel[u] for u in p.on_disk))
        add(DISK, "masters", 4 * sum(numel[u] for u in away))
        add(HOST, "moments staging", p.staging_slots * 2 * p.state_bytes * s.block_numel)
        add(HOST, "masters staging", p.staging_slots * 4 * s.block_numel if away else 0)
    if p.grads_on_disk:  # written from a ring of host buffers, read back into the states' staging slots
        add(DISK, "gradients", c * sum(numel[u] for u in p.grads_on_disk))
        add(HOST, "gradients to disk", (GRADS_TO_DISK + p.staging_slots) * c * s.block_numel)
    # Device: the edges' slot, the window, resident blocks' slots, resident units' fp32 master and moments
    add(dev, "edges", 2 * c * numel[0])
    if sliding:
        add(dev, "slots", p.window * 2 * c * s.block_numel)
    add(dev, "resident blocks", 2 * c * sum(numel[u] for u in resident if u))
    add(dev, "resident states", 12 * sum(numel[u] for u in resident))
    if resident:  # their optimizers' scratch (and, on a CPU device, three fp32 rows each)
        add(dev, "optimizer scratch", device_scratch_bytes([numel[u] for u in resident], p.device_is_host, p.threads))
    if p.streamed:  # device-update buffers: fp32 master, m, v, gradient, and the gradient as it lands
        add(dev, "device-update buffers", p.stream_buffers * streamed_step_bytes(p.stream_piece_numel, c))
    add(dev, "held gradients", c * sum(numel[u] for u in p.held))
    if p.ranks > 1:  # each slot's (and the edges') gradient shard, reduce-scattered before it leaves
        add(dev, "gradient shards", c * ((p.window if sliding else 0) * s.block_numel // p.ranks + shard[0]))
    add(dev, "step readout", 4 * (1 + len(numel)))  # the loss, then each unit's squared gradient norm
    # Host gradients: the ring, the sliding edges' own buffer, and the pool shared with the boundary activations
    act = t.tokens_per_micro * s.hidden * c  # one micro-batch's boundary activation
    # block inputs 0..n-1 (the last output goes straight on), each in its block's tier
    host_acts, disk_acts, device_acts = (p.boundaries_in(tier) * t.micro_batches for tier in (HOST, DISK, GPU))
    add(HOST, "gradients", p.ring * c * s.block_numel // p.ranks)
    add(HOST, "speculative parameters", c * sum(shard[u] for u in p.speculated))
    if p.units[0].grad == "own":
        add(HOST, "gradients", c * shard[0])
    if p.pooled:
        add(HOST, "gradients + boundary activations",
            pool_bytes(p.pooled, c * s.block_numel, [act] * t.micro_batches, s.num_blocks))
    elif host_acts:
        add(HOST, "boundary activations", host_acts * act)
    if disk_acts:
        add(DISK, "boundary activations", disk_acts * act)
        # (the write ring turns over every buffer; reads fill the read ring from its start each step)
        rings = SLOTS_PER_MICRO + min(SLOTS_PER_MICRO, p.boundaries_in(DISK))
        add(HOST, "boundary activation rings", rings * t.micro_batches * act)
    if device_acts:
        add(dev, "boundary activations", device_acts * act)
    if host_acts or disk_acts:  # backward's landing buffers: the plan's sets, reused every step
        add(dev, "activation landing", p.landing_sets * t.micro_batches * act)
    # The working set of one block's recompute and backward, the tail's loss chunk, the allocator's margin
    seq = t.seq_len or t.tokens_per_micro
    mlp_tokens = t.tokens_per_micro // seq * min(seq, p.sequence_tile or seq)  # (one tile's, where tiled)
    work = 3 * t.micro_batches * act + (t.tokens_per_micro * 10 * s.hidden + mlp_tokens * 4 * s.intermediate) * c
    add(dev, "workspace", work, transient=True)
    if not p.device_is_host:
        add(GPU, "loss chunk + margin", LOSS_CHUNK + MARGIN, transient=True)
    add(HOST, "runtime", HOST_RUNTIME_CPU if p.device_is_host else HOST_RUNTIME_CUDA, transient=True)
    for kind, nbytes in p.run.host_extras:  # (the caller's, beside the engine's buffers)
        add(HOST, kind, nbytes, transient=True)
    return out

