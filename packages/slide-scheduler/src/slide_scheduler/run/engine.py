"""The layer-sliding engine: trains a `Stack` whose blocks live on the host and visit the device in slots, as a
`Placement` says (placement.py: the run's facts and where every unit's parameters, gradient, master and moments
live; the engine decides none of it).

One optimizer step over a list of micro-batches (DESIGN.md section 3), as queued work on five lanes (compute,
host-to-device copies, land: the kernels that turn landed bytes into slot contents, device-to-host, store: device
updates' results going home) plus a host optimizer thread:
  forward   head, then block by block: each block is staged into a slot ahead of its turn (while the previous
            block computes: the fp32 master crosses PCIe on h2d and is narrowed to bf16 in the slot on land) and runs
            every micro-batch there (layer-major); each output boundary activation goes to its store
  tail      loss and the gradient w.r.t. the last boundary activation, per micro-batch
  backward  block by block in reverse: stage params + boundary activations ahead, recompute + backward per
            micro-batch (grads accumulate in the slot); the gradient goes to its home (homes.py) and is handed to
            the unit's update kind (updates.py)
  readout   the step's one device->host read: its loss and every unit's squared gradient norm
  commit    the clip decision, told to every update kind, which queues the updates where it runs them

Where and when each unit's update runs is its kind's (updates.py: on the device for good, on the host optimizer
thread, or streamed through the device as the unit next loads); exact global clipping holds every update until the
norm is known, so with clipping the updates of a step run while the next step's forward goes, each block's load
waiting for its own update or running it. Data-parallel ranks (ranks.py) hook in at the backward (gradients
reduce-scattered), the load (shards gathered) and the readout (summed over ranks).

A synchronous placement (`Placement.synchronous`) runs the very same schedule with every lane inline and the
optimizer on the calling thread: the reference the pipelined one is tested against.

The engine wires parts and holds none of their state: each is given at construction what it uses (lanes.py's
`Lanes`, the updater and its waits, the units' states, its buffers, the placement's facts), and none holds the
engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from slide_memory import AdamWConfig, FlatLayout, Slot, SlotQueue

from ..plan.facts import DISK
from ..plan.placement import Placement
from ..plan.shapes import layouts_of, make_block
from .activations import ActivationStore
from .disk_states import DiskStates
from .homes import GradientHomes
from .lanes import DONE, Lanes, Signal
from .loads import Loads
from .ranks import Ranks
from .stack import Batch, Stack, StackCalls
from .timeline import PhaseClock, Span, drain_spans, memory_counters, summarize
from .units import Unit, UnitStates, buffers_to, host_optimizer, load_weights, tail_only_from
from .updater import HostUpdater, UpdateWaits
from .updates import EdgesLoad, Gradient, Host, Moments, Resident, Streamed, clip_scale


@dataclass
class EngineConfig:
    """How the engine runs: mechanism only. What the run is and where everything lives is the plan's
    (`Placement` and its `RunFacts`, placement.py)."""

    optimizer: AdamWConfig = field(default_factory=AdamWConfig)
    pipeline: bool = True  # False: the placement's `synchronous` reference schedule, whatever the placement says
    # where masters and AdamW moments placed on disk live: a folder, or one per drive the placement stripes over
    nvme_dir: str | list[str] | None = None
    # where boundary activations placed on disk live (disk_activations.py), likewise
    activation_dir: str | list[str] | None = None


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    seconds: float
    phases: dict[str, float]  # host time between the schedule's phase boundaries
    timeline: dict[str, float]  # GPU busy vs exposed time, time spent waiting for updates, memory counters
    spans: list | None = None  # every lane's spans of this step (Timeline.spans), when asked for
    # "held" (speculated, clipping did not act), "discarded" (speculated, it acted) or "off" (no block speculated:
    # none may, no clipping, or the step after one whose clipping acted)
    speculation: str = "off"


@dataclass
class Seat:
    """A slot and the engine's scheduling state of it: when compute is done with its contents (`free`), when its
    gradient has left (`drained`), when what was staged into it has landed (`ready`), and where this rank's shard
    of its gradient lands from the reduce-scatter (`shard`: the gradient itself for one rank)."""

    slot: Slot
    shard: torch.Tensor
    free: Signal = DONE
    drained: Signal = DONE
    ready: Signal = DONE


class SlidingEngine:
    """Executes a `Placement`: allocates what it says where it says, and runs steps over it. `loaded(index)`,
    where given, is called as each block's weights are in (a progress bar's step)."""

    def __init__(self, stack: Stack, placement: Placement, config: EngineConfig | None = None,
                 ranks: Ranks | None = None, loaded: Callable[[int], None] | None = None):
        self.config = config = config or EngineConfig()
        self.ranks = ranks = ranks or Ranks()
        if not config.pipeline and not placement.synchronous:  # (the config's word for it, as slide-train says it)
            placement = dataclasses.replace(placement, synchronous=True)
        self.device = torch.device(placement.run.device)
        if hasattr(stack, "tile_sequence"):  # (before any block is made)
            stack.tile_sequence(placement.sequence_tile, placement.query_tiles)
        self.edges = stack.make_edges()
        self.calls = StackCalls(stack, self.edges)  # (the stack's hooks: each block's context, the tail's)
        # Blocks may come in several shapes (the stack's `block_shape`): a layout per shape, a slot holds any
        laid = layouts_of(stack, ranks.size, self.edges)
        edge_layout, layouts, self.block_shapes = laid.edges, laid.blocks, laid.shapes
        _check(placement, (edge_layout.numel,) + tuple(layouts[k].numel for k in self.block_shapes), config, ranks)
        self.placement = placement
        self.lanes = Lanes(self.device, inline=placement.synchronous)
        self._allocate(stack, placement, edge_layout, layouts, loaded)
        self.closed = False

    def _allocate(self, stack: Stack, p: Placement, edge_layout: FlatLayout, layouts: dict, loaded) -> None:
        config, numel, lanes = self.config, p.shapes.block_numel, self.lanes  # (numel: the largest block's)
        shape_of, n = self.block_shapes, self.num_blocks
        # Edges: head + tail parameters, on the device in a slot of their own for the whole run.
        self.edge_slot = Slot(edge_layout, self.edges, self.device, self.dtype)
        buffers_to(self.edges, self.device)
        # Every unit's fp32 master on the host, or on disk with a compute-dtype copy of its parameters on the host
        # (none where its loads read the master from disk); a window of device slots for the sliding blocks.
        away, read = p.masters_on_disk, p.loads_from_disk
        self.disk = DiskStates(sorted(p.on_disk), {u: p.shapes.unit_numels[u] for u in p.on_disk},
                               config.nvme_dir, p.run.states_dtype, masters=sorted(away),
                               grads=sorted(p.grads_on_disk), grad_dtype=self.dtype,
                               slots=p.staging_slots, drives={u: p.drive_of(u) for u in p.on_disk}) \
            if p.on_disk else None
        units = [Unit(edge_layout, ranks=self.ranks)] + [
            Unit(layouts[shape_of[u - 1]], u in away, None if u in read else self.dtype, self.ranks)
            for u in range(1, n + 1)]
        load_weights(stack, units, edge_layout, self.disk, loaded)
        first, *others = layouts
        self.slots = SlotQueue(layouts[first], lambda: make_block(stack, first), p.window, self.device, self.dtype,
                               first, {k: (layouts[k], lambda k=k: make_block(stack, k)) for k in others}) \
            if p.sliding_blocks else None
        tail_from = tail_only_from(self.edges, edge_layout)
        optimizer = host_optimizer(units, p, config.optimizer, self.disk, tail_from)
        # Resident blocks get a slot of their own. Every slot has a seat: the engine's scheduling state of it.
        # Then each unit's update kind, and where each gradient waits for it (homes.py).
        self.resident_slots: dict[int, Slot] = {
            u - 1: Slot(layouts[shape_of[u - 1]], make_block(stack, shape_of[u - 1]), self.device, self.dtype,
                        shape_of[u - 1]) for u in sorted(p.resident) if u}
        self.seats: dict[int, Seat] = {id(slot): self._seat(slot) for slot in [
            self.edge_slot, *self.resident_slots.values(), *(self.slots.slots if self.slots else [])]}
        self._update_kinds(p, units, optimizer, tail_from)
        self.states = UnitStates(units, optimizer, self.disk, p.on_disk, self.resident_updates.optimizers)
        self.homes = GradientHomes(p, lanes=lanes, optimizer=optimizer, disk=self.disk, waits=self.waits,
                                   edges_numel=edge_layout.numel, ranks=self.ranks.size)
        self.loads = Loads(units, self.update_of, self.stream, lanes=lanes, waits=self.waits, ranks=self.ranks,
                           disk=self.disk, read_from_disk=bool(read), numel=numel)
        self._load_resident()
        self._disk_counted: tuple[int, int] | None = None  # disk_traffic() when the last step ended
        self.activations = ActivationStore(p.boundary_tiers, self.device, lanes.d2h, lanes.h2d, lanes.compute,
                                           self.homes.pool, config.activation_dir, p.boundary_drives)
        # Backward fetches activations into the plan's sets of device buffers, each free again once the backward
        # that read it is done
        self._act_landing = [_Landing() for _ in range(p.landing_sets)]
        # The step's one device->host read: its loss (`_loss`), then each unit's squared gradient norm (on device)
        self._readout = torch.zeros(1 + len(units), dtype=torch.float32, device=self.device)
        self._loss = self._readout[0]

    def _update_kinds(self, p: Placement, units: list[Unit], optimizer, tail_from: int) -> None:
        """The host updater, and each unit's update kind (updates.py) over it."""
        self.updater = updater = HostUpdater(optimizer, inline=p.synchronous, disk=self.disk)
        self.moments = Moments(updater)
        self.waits = UpdateWaits(updater, self.lanes.timeline, p.synchronous)  # (where the engine blocks for them)
        self.edges_load = EdgesLoad()  # set once the edges' latest parameters are queued to the device
        resident = p.resident
        slots = {u: self.edge_slot if u == 0 else self.resident_slots[u - 1] for u in resident}
        edge_ranges = optimizer.units[0].ranges if 0 in p.streamed else []
        early = [k for k, (a, _) in enumerate(edge_ranges) if a >= tail_from] if p.edges_early else []
        parts = dict(lanes=self.lanes, moments=self.moments, waits=self.waits, edges=self.edges_load)
        self.updates = (  # (the order their work is queued)
            Resident(resident, updater, states=units, slots=slots, lanes=self.lanes, config=self.config.optimizer,
                     device=self.device),
            Host(p.where("update", "host"), updater, placement=p, states=units, disk=self.disk, **parts),
            Streamed(p.streamed, updater, early, placement=p, optimizer=optimizer, config=self.config.optimizer,
                     edge_slot=self.edge_slot, **parts))
        self.update_of = {u: kind for kind in self.updates for u in kind.units}

    def _seat(self, slot: Slot) -> Seat:
        shard = slot.grads if not self.ranks.sharded else \
            torch.zeros(slot.grads.numel() // self.ranks.size, dtype=self.dtype, device=self.device)
        return Seat(slot, shard)

    # -- views of the parts (for tests, tools and slide-train) ----------------------------------------------------

    compute = property(lambda self: self.lanes.compute)
    h2d = property(lambda self: self.lanes.h2d)
    land = property(lambda self: self.lanes.land)
    d2h = property(lambda self: self.lanes.d2h)
    store = property(lambda self: self.lanes.store)
    timeline = property(lambda self: self.lanes.timeline)
    resident_updates = property(lambda self: self.updates[0])
    host_updates = property(lambda self: self.updates[1])
    stream = property(lambda self: self.updates[2])
    units = property(lambda self: self.states.units)
    optimizer = property(lambda self: self.states.optimizer)
    speculative = property(lambda self: self.host_updates.speculative)
    dtype = property(lambda self: self.placement.run.compute_dtype)
    num_blocks = property(lambda self: len(self.block_shapes))
    resident = property(lambda self: self.placement.resident)
    on_disk = property(lambda self: self.placement.on_disk)
    streamed = property(lambda self: self.placement.streamed)

    @property
    def window(self) -> int:
        return len(self.slots) if self.slots else 1

    def seat(self, slot: Slot) -> Seat:
        return self.seats[id(slot)]

    # -- parameters -------------------------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every queued update: afterwards the host fp32 masters are the model."""
        self.stream.flush()
        self.updater.wait_all()
        for u, opt in self.resident_updates.optimizers.items():  # resident masters live on the device
            self.units[u].master.copy_(opt.master)

    def refresh(self) -> None:
        """After host masters were changed from outside (a checkpoint load): rebuild every copy of them."""
        self.stream.flush()
        self.updater.wait_all()
        self.host_updates.flush()
        for u, opt in self.resident_updates.optimizers.items():
            opt.master.copy_(self.units[u].master)
        self.edges_load.stale()
        self._load_resident()

    def _load_resident(self) -> None:
        for i, slot in self.resident_slots.items():
            slot.load(self.units[i + 1].master, i)
            self.seat(slot).free = self.seat(slot).drained = DONE
        if 0 in self.resident_updates.units:
            self.edge_slot.load(self.units[0].master)
            self.edges_load.landed = DONE

    def optimizer_state(self, unit: int) -> dict[str, torch.Tensor]:
        """A unit's AdamW state as host tensors, for checkpoints (call `synchronize()` first; UnitStates says more)."""
        return self.states.optimizer_state(unit)

    def load_optimizer_state(self, unit: int, tensors: dict[str, torch.Tensor]) -> None:
        self.states.load_optimizer_state(unit, tensors)

    def unit_names(self) -> list[str]:
        return self.states.names()

    def named_masters(self) -> dict[str, dict[str, torch.Tensor]]:
        """Unit name ('edges', 'block.<i>') -> parameter name -> fp32 master view (after pending updates; of its
        memory-mapped file where the master is on disk)."""
        self.synchronize()
        masters = [self.master(k) for k in range(len(self.units))]
        if not self.ranks.lead:  # (sharded: it gave its shards to the first rank)
            return {}
        return {name: u.layout.views(m) for name, u, m in zip(self.unit_names(), self.units, masters)}

    def master(self, unit: int) -> torch.Tensor:
        """A unit's flat fp32 master (call `synchronize()` first; UnitStates says more)."""
        return self.states.master(unit)

    def load_master(self, unit: int, master: torch.Tensor) -> None:
        """Replace a unit's fp32 master (a checkpoint's; call `refresh()` after the last; sharded, each rank
        takes its shard of the whole)."""
        self.states.load_master(unit, master)

    # -- loading units --------------------------------------------------------------------------------------------

    def _load_edges(self) -> None:
        """Refresh the resident edge parameters once their pending update is done (the tail-only part of a
        device update waits: see _forward)."""
        if self.edges_load.landed is None:
            self.loads.load(0, self.edge_slot, self.stream.head_chunks())
            self.edges_load.landed = self.lanes.landed()
        self.compute.wait(self.edges_load.landed)

    def stage(self, block: int) -> Seat:
        """Queue block `block` into the next slot on the h2d and land lanes; the seat's `ready` says when."""
        if block in self.resident_slots:  # always loaded; its update runs on the compute lane
            seat = self.seat(self.resident_slots[block])
        else:
            seat = self.seat(self.slots.next())
            self.h2d.wait(seat.free)
            self.h2d.wait(seat.drained)  # loading lands in the gradient buffer: its last gradient has left
            self.loads.load(block + 1, seat.slot)  # never before its update has finished (or it runs now, into it)
        seat.ready = self.lanes.landed()
        return seat

    def fetch_boundary(self, block: int, micro: int) -> tuple[list, Signal]:
        """Queue block `block`'s input activations (each micro-batch's) into its landing set, once the backward
        that read that set last is done; and a signal for when they have landed."""
        landing = self._act_landing[block % len(self._act_landing)]
        self.h2d.wait(landing.free)
        acts = [self.activations.fetch(block, j, owner=landing) for j in range(micro)]
        return acts, self.lanes.landed()

    # -- one optimizer step -------------------------------------------------------------------------------------

    def step(self, micro_batches: list[Batch], *, lr: float, normalizer: float) -> StepStats:
        """Forward, backward and AdamW update over `micro_batches`; the loss is normalized by `normalizer`."""
        if self.closed:
            raise RuntimeError("this engine was closed")
        try:
            return self._step(micro_batches, lr, normalizer)
        except BaseException:
            if self.disk is not None:  # moments read in for updates this step never queued
                self.disk.call_off()
            raise

    def _step(self, micro_batches: list[Batch], lr: float, normalizer: float) -> StepStats:
        """stage -> forward -> tail -> backward (each gradient handed to its unit's update) -> the one readout ->
        the clip decision -> commit."""
        clock = self._begin()
        batches = self._to_device(micro_batches)
        self.activations.trim(len(batches))
        hidden, contexts, kept = self._forward(batches)
        self.moments.submit()
        clock.lap("forward")
        grads = self._tail(hidden, batches, contexts, normalizer)
        del hidden
        self.stream.tail_final(lr)
        clock.lap("tail")
        gradients = self._backward(batches, contexts, grads, lr, kept)
        clock.lap("backward")
        loss, grad_norm = self._readout_and_commit(gradients, lr)
        return self._end(clock, loss, grad_norm)

    def _backward(self, batches: list[Batch], contexts: list, grads: list, lr: float,
                  kept: dict[int, Seat]) -> dict[int, Gradient]:
        """Blocks in reverse, then the head; each unit's gradient sent home and handed to its update. `kept`: the
        blocks the forward left in their slots (its last), which run again from there."""
        for kind in self.updates:
            kind.before_backward()
        gradients: dict[int, Gradient] = {}
        n, m = self.num_blocks, len(batches)
        # Parameters are staged a window ahead; boundary activations as far ahead as the landing sets allow (a set
        # is free once the backward of the block that used it last is queued, so sets - 1 blocks ahead)
        ahead = len(self._act_landing) - 1
        staged: dict[int, Seat] = dict(kept)
        fetched: dict[int, tuple[list, Signal]] = {}
        self._prefetch(staged, range(n - 1, max(n - 1 - self.window, -1), -1), fetched, 1, m)
        for i in reversed(range(n)):
            self._edges_tail()  # a piece of the edges' early update: backward's loads leave room for it
            seat = staged.pop(i) if i in staged else self.stage(i)
            acts, landed = fetched.pop(i) if i in fetched else self.fetch_boundary(i, m)
            self._block_backward(i, seat, acts, landed, contexts, grads)
            gradients[i + 1] = self._send_home(i + 1, seat)
            self._prefetch(staged, range(i - 1, max(i - self.window - 1, -1), -1), fetched, ahead, m)
            # (after the next load is staged: an update that streams now queues behind it, not ahead)
            self.update_of[i + 1].gradient_ready(i + 1, gradients[i + 1], lr)
        self._edges_tail(None)
        with self.timeline.span("compute", "head backward", self.compute.stream):
            for j, batch in enumerate(batches):
                self.calls.head_activation(batch).backward(grads[j])
            self._gradient_made(0, self.seat(self.edge_slot))
        gradients[0] = self.homes.send(0, self.seat(self.edge_slot), self.compute.record())
        return gradients

    def _block_backward(self, i: int, seat: Seat, acts: list, landed: Signal, contexts: list, grads: list) -> None:
        """Recompute and backward of block `i` for every micro-batch once its parameters and input activations
        have landed; `grads` becomes the gradient w.r.t. its inputs."""
        self.compute.wait(seat.ready)
        self.compute.wait(landed)
        self.compute.wait(seat.drained)  # the slot's last gradient has left before it is zeroed
        with self.timeline.span("compute", f"backward {i}", self.compute.stream):
            seat.slot.grads.zero_()
            for j, ctx in enumerate(contexts):
                h = acts[j].detach().requires_grad_()
                seat.slot.module_of(self.block_shapes[i])(h, self.calls.context(i, ctx)).backward(grads[j])
                grads[j] = h.grad
            self._gradient_made(i + 1, seat)
        seat.free = self._act_landing[i % len(self._act_landing)].free = self.compute.record()

    def _send_home(self, unit: int, seat: Seat) -> Gradient:
        """Send a block's gradient home once made; the slot takes a load once it has left."""
        gradient = self.homes.send(unit, seat, seat.free)
        seat.drained = gradient.arrived[-1]
        return gradient

    def _readout_and_commit(self, gradients: dict[int, Gradient], lr: float) -> tuple[float, float]:
        """The one read of the step: loss and the per-unit squared norms (the clip needs the global norm), summed
        over ranks; then the clip decision, told to every update kind. A clipped step has changed no weight yet:
        with a non-finite norm it leaves every weight and AdamW state as it was (without clipping, sliding blocks
        were updated during backward already)."""
        self.ranks.readout(self.compute, self._readout)
        loss_value, *sq = self._readout.tolist()
        grad_norm = math.sqrt(sum(sq))
        grad_scale = clip_scale(self.placement.run.clip, grad_norm)
        commit = math.isfinite(grad_scale)  # (a clipped step with a non-finite norm changes nothing)
        for kind in self.updates:
            if commit:
                kind.norm_known(gradients, lr, grad_scale)
            else:
                kind.norm_not_finite()
        return loss_value, grad_norm

    def _edges_tail(self, chunks: int | None = 1) -> bool:
        """Queue `chunks` more of the edges' early update (None: what is left); whether any was pending."""
        return any([kind.edges_tail(chunks) for kind in self.updates])

    def _gradient_made(self, unit: int, seat: Seat) -> None:
        """On the compute lane, once a unit's gradient is made: this rank's shard of it summed over ranks, and its
        squared norm."""
        self.ranks.reduce_gradient(seat.shard, seat.slot.grads)
        self._readout[1 + unit] = torch.linalg.vector_norm(seat.shard, dtype=torch.float32).square()

    def _begin(self) -> PhaseClock:
        memory = memory_counters(self.device)
        if self._disk_counted is None:  # (not the tier's first fill, when the weights were loaded)
            self._disk_counted = self.disk_traffic()
        # Phase laps synchronize the device only in the synchronous schedule; pipelined, the timeline says more.
        clock = PhaseClock(self.device, sync=self.placement.synchronous)
        clock.memory = memory
        self.timeline.begin()
        self.waits.seconds = 0.0
        return clock

    def _end(self, clock: PhaseClock, loss: float, grad_norm: float) -> StepStats:
        """The step's work is queued: wait for every lane (in the synchronous schedule, every update), and count
        what it took."""
        if self.placement.synchronous:
            self.synchronize()
        for lane in self.lanes:  # the spans of every lane are complete (and a failed copy raises here)
            lane.record().wait_host()
        self.homes.step_ends()
        clock.lap("update")
        spans = self._spans(clock.start)
        timeline = summarize(spans, clock.total)
        timeline["wait_update_s"] = self.waits.seconds
        timeline.update(clock.memory)
        traffic = self.disk_traffic()  # (write-backs still running finish in the next step's count)
        timeline["disk_read_gb"] = (traffic[0] - self._disk_counted[0]) / 1e9
        timeline["disk_written_gb"] = (traffic[1] - self._disk_counted[1]) / 1e9
        self._disk_counted = traffic
        return StepStats(loss=loss, grad_norm=grad_norm, seconds=clock.total, phases=clock.laps,
                         timeline=timeline, spans=spans, speculation=self.host_updates.speculation)

    def _tail(self, hidden: list[torch.Tensor], batches: list[Batch], contexts: list, normalizer: float) -> list:
        """The loss of every micro-batch (summed into the readout) and its gradient w.r.t. the last boundary
        activation."""
        grads = []
        with self.timeline.span("compute", "tail", self.compute.stream):
            self.edge_slot.grads.zero_()
            self._readout.zero_()
            for j, batch in enumerate(batches):
                h = hidden[j].detach().requires_grad_()
                share = self.calls.loss(h, batch, normalizer, contexts[j])
                share.backward()
                self._loss.add_(share.detach().float())
                grads.append(h.grad)
        return grads

    def _spans(self, origin: float):
        """This step's spans, plus the optimizer thread's updates that ran during it (host times)."""
        spans = self.timeline.spans()
        for label, start, end in drain_spans(self.updater.spans, origin):
            spans.append(Span("optimizer", label, start, end))
            if self.placement.synchronous:  # inline updates: the engine's thread itself was busy with them
                spans.append(Span("waits", label, start, end))
        if self.disk is not None:  # the moments' reads and write-backs, likewise
            spans += [Span("disk", *span) for span in drain_spans(self.disk.spans, origin)]
        return spans

    def disk_stores(self) -> list:
        """The NVMe stores this engine moves bytes through: the states' and the activations', one per drive."""
        return [store for s in (self.disk, self.activations.disk) if s is not None for store in s.tier.stores]

    def disk_traffic(self) -> tuple[int, int]:
        """Bytes read from and written to the NVMe tier so far, by finished operations."""
        stores = self.disk_stores()
        return sum(s.bytes_read for s in stores), sum(s.bytes_written for s in stores)

    def evaluate(self, micro_batches: list[Batch], *, normalizer: float) -> float:
        """The loss over `micro_batches` (normalized by `normalizer`) with no gradient and no update."""
        batches = self._to_device(micro_batches)
        with torch.no_grad():
            hidden, contexts, _ = self._forward(batches, keep=False)
            self.moments.submit()
            loss = sum((self.calls.loss(h, batch, normalizer, ctx).float() for h, batch, ctx in zip(hidden, batches,
                                                                                                    contexts)),
                       torch.zeros((), device=self.device))  # (a rank may have no micro-batch of the last group)
            self.ranks.readout(self.compute, loss)
        return float(loss)  # one read for all micro-batches

    def _to_device(self, micro_batches: list[Batch]) -> list[Batch]:
        """Micro-batches to the device; on CUDA through (reused) pinned memory, so the copies are asynchronous."""
        pin = self.device.type == "cuda"
        return [{k: (v.pin_memory() if pin and v.device.type == "cpu" else v).to(self.device, non_blocking=True)
                 for k, v in mb.items()} for mb in micro_batches]

    @torch.no_grad()
    def _forward(self, batches: list[Batch], keep: bool = True):
        """Head and blocks, layer-major: each block visits a slot once and sees every micro-batch there. Returns
        the last hidden states, each micro-batch's context, and the last block's seat (by block), which still
        holds it: the backward starts there without loading it again."""
        n, acts = self.num_blocks, self.activations
        self._load_edges()
        hidden, contexts = [], []
        with self.timeline.span("compute", "head", self.compute.stream):
            for batch in batches:
                h, ctx = self.edges.head(batch)
                hidden.append(h)
                contexts.append(ctx)
        if keep:  # (every boundary holds what the head made: the residual stream)
            self.homes.forward_begins([h.numel() * h.element_size() for h in hidden])
            made = self.compute.record()
            for j, h in enumerate(hidden):
                acts.put(0, j, h, made)
        staged: dict[int, Seat] = {}
        self._prefetch(staged, range(n))
        tail_ready = None  # the edges' tail-only part, deferred by clipping, is queued a chunk per block
        for i in range(n):
            # Not staged yet when its host update was still running: nothing else can be queued before it now,
            # not even the chunk of the edges' update below, which the tail alone waits for.
            seat = staged.pop(i) if i in staged else self.stage(i)
            if self._edges_tail():
                tail_ready = self.lanes.landed()
            self.compute.wait(seat.ready)
            with self.timeline.span("compute", f"forward {i}", self.compute.stream):
                block = seat.slot.module_of(self.block_shapes[i])
                hidden = [block(h, self.calls.context(i, ctx)) for h, ctx in zip(hidden, contexts)]
            seat.free = self.compute.record()
            acts.release()  # this block's inputs (all that is held): compute has queued its last read of them
            if keep and i + 1 < n:  # the last output goes straight to the tail; backward never reads it
                for j, h in enumerate(hidden):
                    acts.put(i + 1, j, h, seat.free)
            self._prefetch(staged, range(i + 1, n))
        if self._edges_tail(None):
            tail_ready = self.lanes.landed()
        if tail_ready is not None:  # the tail reads it
            self.compute.wait(tail_ready)
        return hidden, contexts, ({n - 1: seat} if n else {})

    def _prefetch(self, staged: dict[int, Seat], blocks: Iterable[int], fetched: dict | None = None,
                  fetches: int = 0, micro: int = 0) -> None:
        """Stage `blocks` (the pass's next ones, in its order) until every slot holds one not yet run. Resident
        blocks need no slot and are staged on the way, so the first sliding blocks load while the resident ones
        compute. In the backward the first `fetches` of them also have their boundary activations (`micro` of
        them) queued into `fetched`, each right after its parameters.

        Staging stops at a block whose host update is still running: queuing its load would block this thread
        until the update is done, and with it the work of blocks that are ready to run (resident ones, or the one
        loaded a slot ahead). Such a block is staged at its own turn, or by a later call."""
        ahead = sum(k not in self.resident_slots for k in staged)
        for position, k in enumerate(blocks):
            if ahead >= self.window:
                return
            if k not in staged:
                if not self.update_of[k + 1].loadable(k + 1):
                    return
                staged[k] = self.stage(k)
                ahead += k not in self.resident_slots
            if position < fetches and k not in fetched:
                fetched[k] = self.fetch_boundary(k, micro)

    def close(self) -> None:
        """Finish pending updates and stop the worker threads (they stop even when an update failed)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.ExitStack() as later:  # each runs, last pushed first, even when one before it raises
            later.callback(self.activations.close)  # (its threads and files)
            for lane in reversed(self.lanes):
                later.callback(lane.close)
            if self.disk is not None:  # after the updater: its last updates write their moments back
                later.callback(self.disk.close)
            later.callback(self.updater.close)
            self.synchronize()


def _check(p: Placement, numels: tuple[int, ...], config: EngineConfig, ranks: Ranks) -> None:
    """Refuse a placement made for another model, for another number of ranks than this process group has, or
    needing a folder the config does not give."""
    if p.shapes.unit_numels != numels:
        raise ValueError(f"the placement is for units of {p.shapes.unit_numels[:2]}... parameters, this model's "
                         f"are {numels[:2]}... ({len(numels)} units)")
    if p.ranks != ranks.size:
        raise ValueError(f"the placement is for {p.ranks} data-parallel rank(s), this process group has {ranks.size}")
    if p.on_disk and not config.nvme_dir:
        raise ValueError("the placement keeps masters and AdamW moments on disk: set nvme_dir to a directory on a "
                         "fast local disk")
    if p.boundaries_in(DISK) and not config.activation_dir:
        raise ValueError("the placement keeps boundary activations on disk: set activation_dir to a directory on a "
                         "fast local disk")


class _Landing:
    free: Signal = DONE  # compute is done with the activations last fetched into it
