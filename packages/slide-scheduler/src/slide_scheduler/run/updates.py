"""Update kinds: where and when a unit's AdamW update runs, as parts the step talks to through the same events.

Every unit has one kind, the placement's `update`: `Resident` (on the device for good), `Host` (the optimizer
thread: whole, split into a params and a moments part, speculated during backward, its states on disk or not) and
`Streamed` (through device buffers as the unit next loads, with the edges' tail-only part early). The step tells
each kind what happened, in this order:
  before_backward()                 the backward is about to start
  gradient_ready(unit, grad, lr)    a unit's gradient has left its slot (`grad`: where it waits, and when it is there)
  edges_tail(chunks)                between blocks: room on the lanes for a piece of the edges' early update
  loadable(unit)                    whether loading the unit now would queue at once
  norm_known(grads, lr, grad_scale) the step's clip decision (1.0 without clipping; exact when it does not act)
  norm_not_finite()                 the clipped step changes nothing
  load(unit, slot, chunks)          queue the unit's newest parameters into a slot, its update first where it runs
                                    there; False where the unit's master (or copy of it) is what to load
and the engine queues the moments parts of split updates (`Moments`) after the next forward.

A kind is given what it uses when it is made (its units' states, the lanes, the updater, its buffers, the
placement's facts) and holds no engine: what the engine learns per step comes as the arguments of these calls.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from slide_memory import AdamWConfig, FlatAdamW, HostAdamW, Slot, StreamedStep, device_scratch, host_zeros

from ..plan.placement import Placement, early_reads_wait
from .lanes import DONE, Lanes, Signal
from .updater import HostUpdater, UpdateWaits


@dataclass
class Gradient:
    """Where a unit's gradient waits for its update, and when each optimizer chunk of it is there."""

    buffer: torch.Tensor | None  # None: in a file, read back with the unit's states for its update
    arrived: list[Signal]


@dataclass
class PendingUpdate:
    """A unit's update waiting for the unit's next load, to run on the device as it loads."""

    grad: torch.Tensor
    arrived: Signal  # the gradient is where `grad` says
    lr: float
    grad_scale: float
    chunks: list[int]  # optimizer chunks still to update
    split: bool  # the host steps the moments afterwards (a MomentsPart)


@dataclass
class MomentsPart:
    """The moments part of a split update whose params part has been queued."""

    grad: torch.Tensor
    arrived: list[Signal]  # per optimizer chunk
    lr: float
    grad_scale: float


@dataclass
class EdgesLoad:
    """The edges' last load into their slot: the signal for when it has landed, or None once an update changed
    their parameters on the host (the next forward loads them again)."""

    landed: Signal | None = None

    def stale(self) -> None:
        self.landed = None


class Moments:
    """Split updates' moments parts, queued on the optimizer thread after the next forward, last block first (the
    order in which backward reuses the gradient buffers, each waiting for it)."""

    def __init__(self, updater):
        self.updater = updater
        self.due: dict[int, MomentsPart] = {}

    def add(self, unit: int, part: MomentsPart) -> None:
        self.due[unit] = part

    def submit(self) -> None:
        for unit in sorted(self.due, reverse=True):
            due = self.due.pop(unit)
            self.updater.submit(unit, due.grad, due.arrived, due.lr, due.grad_scale, part="moments")


class UpdateKind:
    """The events every kind answers; a kind acts on those that concern it."""

    def __init__(self, units, updater: HostUpdater):
        self.units = sorted(units)
        self.updater = updater

    def before_backward(self) -> None:
        pass

    def gradient_ready(self, unit: int, grad: Gradient, lr: float) -> None:
        pass

    def edges_tail(self, chunks: int | None = 1) -> bool:
        return False

    def loadable(self, unit: int) -> bool:
        return self.updater.ready(unit, params_only=True)

    def norm_known(self, grads: dict[int, Gradient], lr: float, grad_scale: float) -> None:
        pass

    def norm_not_finite(self) -> None:
        pass

    def load(self, unit: int, slot: Slot, chunks: list[int] | None = None) -> bool:
        return False

    def flush(self) -> None:
        pass


class Resident(UpdateKind):
    """Units on the device for good: fp32 master and AdamW there, updated on the compute lane once the norm is
    known, from the gradient in their slot."""

    def __init__(self, units, updater: HostUpdater, *, states: list, slots: dict[int, Slot], lanes: Lanes,
                 config: AdamWConfig, device: torch.device):
        super().__init__(units, updater)
        self.slots = slots  # unit -> its slot
        self.lanes = lanes
        self.optimizers: dict[int, FlatAdamW] = {}
        if self.units:
            scratch = device_scratch([states[u].layout.numel for u in self.units], device)
            for u in self.units:
                master = states[u].master.to(device, copy=True)
                self.optimizers[u] = FlatAdamW(master, config, scratch)

    def loadable(self, unit: int) -> bool:
        return True

    def norm_known(self, grads: dict[int, Gradient], lr: float, grad_scale: float) -> None:
        lanes = self.lanes
        with lanes.timeline.span("compute", "update resident", lanes.compute.stream):
            for u, opt in self.optimizers.items():
                slot = self.slots[u]
                opt.step(slot.grads, lr, grad_scale)
                slot.params.copy_(opt.master)


class Host(UpdateKind):
    """Units updated on the optimizer thread. Without clipping a block's update starts as soon as its gradient
    reaches the host, unless the placement defers it (`UnitPlacement.defer`); with clipping, or deferred, an
    update waits for the step's end (the norm), split where the placement says (the next forward waits only for
    new masters), and runs in the next forward's order, after those that started during the backward. A
    speculating block also runs its clipped update during backward as if clipping will not act, writing only its
    parameters; when it does not act its next loads take those, and the update proper runs whole after the
    others. A step whose clipping acted is followed by one that does not speculate (the next norm is most likely
    over the limit too), until a step's clipping does not act again, where the placement says so
    (`speculation_pause`).
    Blocks whose moments (and master) live on disk have them read in ahead of their updates."""

    def __init__(self, units, updater: HostUpdater, *, placement: Placement, states: list, lanes: Lanes, disk,
                 moments: Moments, waits: UpdateWaits, edges: EdgesLoad):
        super().__init__(units, updater)
        p = placement
        self.states, self.lanes, self.disk = states, lanes, disk  # (states: every unit's, by index)
        self.moments, self.waits, self.edges = moments, waits, edges
        self.clips, self.pause = p.clips, p.speculation_pause
        self.on_disk = sorted(set(self.units) & p.on_disk)
        self.early_reads = 0 if early_reads_wait(p) else p.staging_slots  # (first updates' states read early)
        self.split = {u for u in self.units if p.units[u].split}
        # Speculating blocks: the parameters their update gives if clipping does not act, written during backward
        self.speculative = {u: host_zeros(states[u].end - states[u].start, p.run.compute_dtype)
                            for u in sorted(p.speculated) if u in self.units}
        self.from_speculation: set[int] = set()  # blocks whose loads take their speculated parameters
        self.speculating = True
        self.speculation = "off"  # the last step's: held, discarded, or off
        # Units whose update waits for the step's end (without clipping the grad_scale is 1.0: waiting is only
        # where the updates run); the others' start during the backward
        self.deferred = {u for u in self.units if p.waits(u)}

    def before_backward(self) -> None:
        if self.disk is None:
            return
        # moments from disk in the order the updates will be submitted: the backward's, then the deferred ones
        # (the first of those read under the backward where nothing the backward waits for reads the disk then,
        # one per staging slot, and no update of the backward's waits behind them)
        eager = [u for u in reversed(self.on_disk) if u not in self.deferred]
        early = [] if eager else [u for u in self.on_disk if u in self.deferred][:self.early_reads]
        for u in eager + early:
            self.disk.fetch(u)

    def gradient_ready(self, unit: int, grad: Gradient, lr: float) -> None:
        if unit == 0:  # (the edges' update waits for the step's end: nothing reads their gradient before)
            return
        if unit not in self.deferred:  # the update starts as soon as its first piece is on the host
            self.updater.submit(unit, grad.buffer, grad.arrived, lr, 1.0, into=self.states[unit].params)
        elif unit in self.speculative and self.speculating:
            # As if clipping will not act: only new parameters are written (over the ones its loads took: until
            # this step says otherwise, later loads take the master)
            self.from_speculation.discard(unit)
            self.updater.submit(unit, grad.buffer, grad.arrived, lr, 1.0, part="speculate",
                             into=self.speculative[unit])

    def norm_known(self, grads: dict[int, Gradient], lr: float, grad_scale: float) -> None:
        # Clipping that does not act multiplies by exactly 1: the speculated parameters are the update's own
        acted = self.clips and grad_scale != 1.0
        tried = (self.clips and self.speculative and self.speculating)
        held = set(self.speculative) if tried and not acted else set()
        self._speculated(tried, held, acted)
        if self.disk:  # their moments start coming in, in the order the updates below will run
            for u in self.on_disk:
                if u in self.deferred:
                    self.disk.fetch(u)
        for u in self.units:
            if u in held:
                continue  # below, after the updates the next forward waits for
            if u == 0 or u in self.deferred:  # the other sliding blocks were submitted during backward
                g, split = grads[u], u in self.split
                self.updater.submit(u, g.buffer, g.arrived, lr, grad_scale, part="params" if split else "all",
                                    into=self.states[u].params)
                if split:
                    self.moments.add(u, MomentsPart(g.buffer, g.arrived, lr, grad_scale))
        # Whole, last block first: the next backward reuses the last block's gradient buffer first
        for u in sorted(held, reverse=True):
            self.updater.submit(u, grads[u].buffer, grads[u].arrived, lr, grad_scale)
        self.from_speculation = held
        if 0 in self.units:
            self.edges.stale()

    def norm_not_finite(self) -> None:
        self._speculated((self.clips and self.speculative and self.speculating), set(), True)
        self.from_speculation = set()
        if self.disk is not None:  # no update follows: the states read for them stay as they are on disk
            self.disk.call_off()

    def _speculated(self, tried: bool, held: set[int], acted: bool) -> None:
        self.speculation = "off" if not tried else "held" if held else "discarded"
        self.speculating = not (acted and self.pause)

    def load(self, unit: int, slot: Slot, chunks: list[int] | None = None) -> bool:
        """Speculated parameters, where this step's clipping did not act; else the master (or its copy)."""
        if unit not in self.from_speculation:
            return False
        self.waits(unit, speculated=True)
        self.lanes.h2d.run(self.states[unit].slot_shard(slot).copy_, self.speculative[unit], True,
                           label=f"params {unit - 1 if unit else None} (speculated)")
        return True

    def loadable(self, unit: int) -> bool:
        """Whether loading `unit` would queue at once (its update's params part, or its speculation, is done)."""
        if unit in self.from_speculation:
            return self.updater.speculated[unit].is_set()
        return self.updater.ready(unit, params_only=True)

    def flush(self) -> None:
        self.from_speculation = set()


class Streamed(UpdateKind):
    """Units updated on the device as they next load (or, unclipped and placed `early`, as soon as their gradient
    is home): master, moments and gradient streamed in piece by piece over h2d, stepped on the land lane, the new
    master (and moments, unless split) home on the store lane. The
    edges' tail-only part (final norm, untied lm head) updates apart from the rest: its gradient is final after the
    tail and nothing reads it before the next tail, so without clipping it updates during backward, and with
    clipping after the next forward's loads; only the part the head reads stands between one step and the next."""

    def __init__(self, units, updater: HostUpdater, tail_chunks: list[int], *, placement: Placement,
                 optimizer: HostAdamW, config: AdamWConfig, lanes: Lanes, moments: Moments, waits: UpdateWaits,
                 edge_slot: Slot, edges: EdgesLoad):
        super().__init__(units, updater)
        p = placement
        self.optimizer, self.lanes, self.moments, self.waits = optimizer, lanes, moments, waits
        self.edge_slot, self.edges, self.clips = edge_slot, edges, p.clips
        self.split = {u for u in self.units if p.units[u].split}
        self.early = p.early & set(self.units)  # (unclipped: updated as soon as their gradient is home)
        self.tail = list(tail_chunks)  # the edges' optimizer chunks only the tail reads
        self.buffers = [StreamedStep(p.stream_piece_numel, config, torch.device(p.run.device), p.run.compute_dtype)
                        for _ in range(p.stream_buffers if self.units else 0)]
        self.buffer_free = [DONE] * len(self.buffers)  # each buffer's last store has left
        self.next_buffer = 0
        self.pending: dict[int, PendingUpdate] = {}  # unit -> its update, to run at its next load
        self.written: dict[int, Signal] = {}  # unit -> what its device update stores is back on the host

    def tail_final(self, lr: float) -> None:
        """Without clipping the edges' tail-only gradient is final after the tail: it updates during backward."""
        if not self.clips and self.tail:
            self.pending[0] = PendingUpdate(self.edge_slot.grads, self.lanes.compute.record(), lr, 1.0,
                                            list(self.tail), False)

    def edges_tail(self, chunks: int | None = 1) -> bool:
        """Queue `chunks` more optimizer chunks (None: all that are left) of the edges' pending tail-only update;
        False when none is pending. (Outside the edges' own load, the only pending edges update is that part.)"""
        if 0 not in self.pending:
            return False
        todo = self.pending[0].chunks
        self.update_on_device(0, self.edge_slot, todo if chunks is None else todo[:chunks])
        return True

    def loadable(self, unit: int) -> bool:
        """A pending device update waits for the host's moments part of the last one; a load, for its master."""
        return self.updater.ready(unit, params_only=unit not in self.pending)

    def head_chunks(self) -> list[int] | None:
        """The edges' chunks their load updates now (the tail-only part waits); None: no update pending."""
        return [k for k in self.pending[0].chunks if k not in self.tail] if 0 in self.pending else None

    def gradient_ready(self, unit: int, grad: Gradient, lr: float) -> None:
        """Without clipping a block's update needs no norm: it is due once its gradient is home, at a grad_scale of
        1.0, and runs at the block's next load, or now where the placement has it update early (its pieces queue
        behind the loads already staged; the next load takes the new master)."""
        if not self.clips:
            self.pending[unit] = self._due(unit, grad, lr, 1.0)
            if unit in self.early:
                self.update_on_device(unit, None)

    def norm_known(self, grads: dict[int, Gradient], lr: float, grad_scale: float) -> None:
        for u in self.units:
            if u == 0 or self.clips:  # (unclipped, the blocks' updates were due at their gradients)
                self.pending[u] = self._due(u, grads[u], lr, grad_scale)
        if 0 in self.units:
            self.edges.stale()

    def _due(self, unit: int, grad: Gradient, lr: float, grad_scale: float) -> PendingUpdate:
        chunks = range(len(self.optimizer.units[unit].ranges))
        if unit == 0 and not self.clips:  # the tail-only part is done already
            chunks = [k for k in chunks if k not in self.tail]
        return PendingUpdate(grad.buffer, grad.arrived[-1], lr, grad_scale, list(chunks), unit in self.split)

    def load(self, unit: int, slot: Slot, chunks: list[int] | None = None) -> bool:
        if unit not in self.pending:
            return False
        self.update_on_device(unit, slot, chunks)
        return True

    def update_on_device(self, unit: int, slot: Slot | None, chunks: list[int] | None = None) -> None:
        """Queue unit's pending update on the device (only optimizer `chunks` of it, if given), writing the new
        parameters into `slot` (if any)."""
        lanes = self.lanes
        pending = self.pending.pop(unit)
        grad, arrived, lr, split = pending.grad, pending.arrived, pending.lr, pending.split
        grad_scale = pending.grad_scale
        chunks = pending.chunks if chunks is None else chunks
        if rest := [k for k in pending.chunks if k not in chunks]:
            self.pending[unit] = dataclasses.replace(pending, chunks=rest)
        opt = self.optimizer.units[unit]
        name = unit - 1 if unit else "edges"
        self.waits(unit)  # the host's moments part of its last update is done with m and v
        lanes.h2d.wait(arrived)
        lanes.h2d.wait(self.written.get(unit, DONE))
        piece = self.buffers[0].numel
        for k in chunks:
            (a, b), step = opt.ranges[k], opt.steps[k]
            count = int(step)
            for start in range(a, b, piece):
                end = min(start + piece, b)
                n = self.next_buffer
                buf = self.buffers[n]
                self.next_buffer = (n + 1) % len(self.buffers)
                lanes.h2d.wait(self.buffer_free[n])
                lanes.h2d.run(buf.load, opt, start, end, grad, label=f"update {name}")
                lanes.land.wait(lanes.h2d.record())
                lanes.land.run(step_piece, buf, start, end, grad, count, lr, grad_scale, slot, label=f"update {name}")
                lanes.store.wait(lanes.land.record())
                lanes.store.run(buf.store, opt, start, end, not split, label=f"store {name}")
                self.buffer_free[n] = lanes.store.record()
            step += 1  # host bookkeeping of the chunk's AdamW step count (in place: the chunk's state)
        if split:  # m and v stay as they were: the host steps them once they have been read (and, so that a failed
            # device step stops the host's part too, once the steps are done)
            self.moments.add(unit, MomentsPart(grad, [lanes.landed()] * len(opt.ranges), lr, grad_scale))
        self.written[unit] = lanes.store.record()
        if slot is not None:
            slot.unit = unit - 1 if unit else None

    def home(self, unit: int) -> Signal:
        """When what the unit's last device update stores is back on the host."""
        return self.written.get(unit, DONE)

    def flush(self) -> None:
        """Run the device updates still waiting for their unit's next load, and wait until all are home."""
        for unit in list(self.pending):
            self.update_on_device(unit, None)
        self.moments.submit()
        for signal in self.written.values():
            signal.wait_host()


def step_piece(buf: StreamedStep, start: int, end: int, grad: torch.Tensor, count: int, lr: float, grad_scale: float,
               slot: Slot | None) -> None:
    """The device's part of a streamed update piece, once `buf.load` has landed it: AdamW, then the new
    parameters into the slot (if any)."""
    buf.step(start, end, grad, count, lr, grad_scale)
    if slot is not None:
        slot.params[start:end].copy_(buf.param[: end - start])


def clip_scale(clip: float | None, grad_norm: float) -> float:
    """The factor gradients are scaled by: torch's clip_grad_norm_ factor, exactly 1.0 where clipping does not
    act (or is off); NaN for a non-finite norm."""
    if not clip:
        return 1.0
    if not math.isfinite(grad_norm):
        return math.nan
    return min(1.0, clip / (grad_norm + 1e-6))
