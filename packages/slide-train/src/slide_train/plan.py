"""Memory plan: what a run needs per tier, and how many units can stay resident on the device.

Estimates, not measurements: the device side counts the buffers the engine allocates (slots, resident units,
edges) exactly and the activations of one block's recompute roughly (per token: ~10 hidden-sized and 4
intermediate-sized bf16 tensors), so a plan leaves a margin. The benchmark JSON records the measured peaks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from slide_scheduler import engine
from slide_scheduler.disk_activations import SLOTS_PER_MICRO
from slide_scheduler.disk_states import SLOTS
from slide_scheduler.pool import pool_bytes

GIB = 2**30
MARGIN = 1.0 * GIB  # allocator fragmentation, cuBLAS workspaces, small tensors
LOSS_CHUNK = 1.0 * GIB  # slide-kernels' fused cross-entropy keeps one logits chunk (~820 MiB by default)
HELD_HEADROOM = 0.05  # of the budget (at least 0.5 GiB), left free when spare memory keeps gradients for updates


@dataclass
class Plan:
    budget: float
    fixed: float  # edges params+grads, slots, activations, loss chunk, margin
    resident: int  # units resident with their optimizer on the device (0, 1 = edges, 1 + k = edges + k blocks)
    device_total: float
    host_total: float
    lines: list[str]
    held: int = 0  # device-updated blocks whose gradient stays on the device until the update (clipping)
    shared: bool = False  # held host gradients share the boundary activations' host memory (clipping)
    pool: int = 0  # bytes of that shared memory
    device_is_host: bool = False  # a CPU run: the "device" buffers are host memory too
    activations: float = 0.0  # device bytes of activations, all proportional to the tokens per micro-batch
    tokens_per_micro: int = 0
    unit_numels: tuple[int, ...] = ()  # parameters per unit: the edges, then each block
    window: int = 2  # GPU slots for sliding blocks
    disk_activations: float = 0.0  # bytes of boundary activations on the NVMe tier (activation_offload=nvme)
    disk_states: float = 0.0  # bytes of AdamW states there (optimizer_offload.nvme_fraction)
    state_bytes: int = 8  # of AdamW m and v per parameter of a host unit (8 fp32, 4 bf16)
    clip: bool = True  # exact clipping: the host holds every sliding block's gradient until the norm is known

    @property
    def num_params(self) -> int:
        return sum(self.unit_numels)

    @property
    def sliding(self) -> int:
        """Blocks that visit the device through the slots (the rest are resident)."""
        return len(self.unit_numels) - 1 - max(self.resident - 1, 0)

    def text(self) -> str:
        return "\n".join(self.lines)

    @property
    def ram_needed(self) -> float:
        """Host memory the run takes: the host side, plus, when the device is the CPU, the device side's
        buffers (not the GPU-only headroom for the loss chunk and the allocator)."""
        if not self.device_is_host:
            return self.host_total
        return self.host_total + max(0.0, self.device_total - LOSS_CHUNK - MARGIN)

    def fits_host(self, ram: float) -> bool:
        """Whether the run's host memory fits in `ram` bytes, leaving 5% for the rest of the machine."""
        return self.ram_needed <= 0.95 * ram


def make_plan(*, window: int | None, **kwargs) -> Plan:
    """The plan of a run (`_plan`'s arguments). `window` None picks the slots: a third where the budget has
    room for it at no cost to resident blocks or held gradients (on a GPU), else two.

    Why a third: with clipping, a block updated on the device streams its master and AdamW states in (14 bytes
    per parameter) and a host-updated one only its master (4), so loads alternate long and short; with two
    slots a load overlaps one block's compute, with three it overlaps two, and the long loads borrow the time
    the short ones leave (clipped Llama-3.2-3B under 24 GiB: 5% of the step exposed with 2, 2.5% with 3)."""
    if window is not None:
        return _plan(window=window, **kwargs)
    two = _plan(window=2, **kwargs)
    if two.device_is_host or not two.sliding:  # (nothing slides: no slots at all)
        return two
    three = _plan(window=3, **kwargs)
    free = (three.resident, three.held) == (two.resident, two.held) and three.device_total <= three.budget
    return three if free else two


def _plan(*, edge_numel: int, block_numel: int, num_blocks: int, hidden: int, intermediate: int,
          tokens_per_micro: int, micro_batches: int, window: int, offload_activations: bool,
          budget_bytes: float | None, resident: int | None, cuda: bool, state_bytes: int = 8,
          clip: bool = True, device_updates: bool = False, device_share: float = engine.DEVICE_UPDATE_SHARE,
          compute_bytes: int = 2, shared: bool = False, nvme_fraction: float = 0.0,
          activations_on_disk: bool = False) -> Plan:
    bf16 = compute_bytes  # parameters, gradients and activations in the compute dtype (bf16 on a GPU by default)
    device_updates = device_updates and cuda  # streamed updates need a device
    edges = edge_numel * 2 * bf16
    slots = window * block_numel * 2 * bf16
    act_one = tokens_per_micro * hidden * bf16
    activations = (3 * micro_batches * act_one  # current boundary in and out, and the gradients flowing back
                   + tokens_per_micro * (10 * hidden + 4 * intermediate) * bf16)  # one block's recompute
    if offload_activations:  # backward's landing buffers: the current block's (above) and the window's ahead
        activations += window * micro_batches * act_one
    else:
        activations += (num_blocks + 1) * micro_batches * act_one
    # The device-update buffers (fp32 master, m, v, gradient + the bf16 gradient as it lands) when updates are
    # streamed through the device: clipped blocks, and sliding edges (counted below once residency is known).
    # (read when planning, so a caller that changes the engine's count changes the plan's too)
    buffers = engine.STREAM_BUFFERS * min(engine.STREAM_PIECE, max(block_numel, edge_numel)) * 18 \
        if device_updates else 0
    streamed = buffers if clip else 0
    fixed = edges + slots + activations + streamed + LOSS_CHUNK + MARGIN
    per_edges, per_block = 12 * edge_numel, 16 * block_numel  # fp32 master + m + v (+ params, grads)
    budget = float("inf") if budget_bytes is None else budget_bytes
    if resident is None:
        resident = 0
        if cuda and fixed + per_edges <= budget:
            resident = 1
            spare = budget - fixed - per_edges
            resident += min(num_blocks, int(spare // per_block))
            # With every block resident there is no window of slots and nothing streams: that room counts too.
            if fixed - slots - streamed + per_edges + num_blocks * per_block <= budget:
                resident = num_blocks + 1
    if not resident and not streamed:  # the edges slide, so they update through the buffers
        streamed = buffers
        fixed += buffers
    states = (per_edges if resident else 0) + max(resident - 1, 0) * per_block  # resident units' device state
    device = fixed + states
    if resident - 1 >= num_blocks:  # nothing slides: no window of slots, no streamed update
        device -= slots + streamed
        slots = streamed = 0
    total = edge_numel + num_blocks * block_numel
    # Host gradients (bf16): sliding edges updated on the host have their own buffer; sliding blocks share a ring,
    # which holds every one of them when exact clipping waits for the global norm, and three otherwise.
    sliding = num_blocks - max(resident - 1, 0)
    # The last sliding blocks' AdamW moments on disk (the engine's count): they update on the host, whole
    disk_blocks = set(engine.on_disk_blocks(num_blocks, sliding, nvme_fraction))
    on_disk = len(disk_blocks)
    first = num_blocks - sliding
    device_blocks = [first + j for j in engine.device_updated(sliding, device_share) if first + j not in disk_blocks] \
        if device_updates else []
    if streamed and resident and not device_blocks:  # every sliding block on disk: nothing streams (the engine's
        device -= streamed                             # rule), though residency was sized with the buffers
        fixed -= streamed
        streamed = 0
    edges_on_host = not resident and not device_updates  # streamed edges keep it on the device
    # With clipping, device memory left over holds the gradients of blocks updated on the device (the engine's
    # share of the sliding ones): 2 bytes per parameter there instead of on the host, and no PCIe round trip.
    held = 0
    if clip and device_updates and budget_bytes is not None:
        room = budget - device - max(0.5 * GIB, HELD_HEADROOM * budget)
        held = min(len(device_blocks), int(max(0.0, room) // (bf16 * block_numel)))
        device += held * bf16 * block_numel
    grads = bf16 * (edges_on_host * edge_numel + ((sliding - held) if clip else min(3, sliding)) * block_numel)
    acts_host = num_blocks * micro_batches * act_one * offload_activations  # boundaries 0..n-1 (the last goes on)
    acts_disk = 0
    if activations_on_disk:  # they pass through two rings of host buffers on their way to and from the disk
        acts_disk, acts_host = acts_host, 2 * SLOTS_PER_MICRO * micro_batches * act_one
    shared = shared and clip and offload_activations and sliding > 0 and not activations_on_disk
    if shared:  # the engine's pool, counted as it lays it out: blocks whose clipped gradient waits on the host
        on_gpu = engine.held_on_device(device_blocks, held, True)
        host_blocks = [b for b in range(first, num_blocks) if b not in on_gpu]
        acts_host = pool_bytes(host_blocks, bf16 * block_numel, [act_one] * micro_batches, num_blocks)
        grads = bf16 * edges_on_host * edge_numel
        host_buffers = (f"gradient staging {grads / GIB:.1f}, " if grads else "") + \
            f"held gradients sharing the boundary activations' memory {acts_host / GIB:.1f}"
    else:
        host_buffers = f"gradient staging {grads / GIB:.1f}{' (held for exact clipping)' if clip and sliding else ''}"
        if offload_activations:
            where = "staging for the boundary activations on disk" if acts_disk else "boundary activations"
            host_buffers += f", {where} {acts_host / GIB:.1f}"
    on_device = (edge_numel if resident else 0) + max(resident - 1, 0) * block_numel  # AdamW states there
    # fp32 masters + the AdamW states kept here (those on disk pass through two staging slots of m and v)
    states_host = total * 4 + (total - on_device - on_disk * block_numel) * state_bytes
    staging = SLOTS * state_bytes * block_numel if on_disk else 0  # (in the states' dtype, as on disk)
    host = states_host + staging + grads + acts_host
    lines = [
        f"plan: {resident} of {num_blocks + 1} units resident on the device "
        f"(edges{' + blocks 0..' + str(resident - 2) if resident > 1 else ''}"
        f"{'' if resident else ': none'}), {sliding} sliding through {window} slots",
        f"  device ~{device / GIB:.1f} GiB of {'no cap' if budget_bytes is None else f'{budget / GIB:.1f} GiB'}: "
        f"edges {edges / GIB:.2f}, slots {slots / GIB:.2f}, activations ~{activations / GIB:.2f}, "
        + (f"device-update buffers {streamed / GIB:.2f}, " if streamed else "") +
        f"resident states {states / GIB:.2f}"
        + (f", gradients kept for device updates ({held} blocks) {held * bf16 * block_numel / GIB:.2f}"
           if held else ""),
        f"  host ~{host / GIB:.1f} GiB: fp32 masters + AdamW states {states_host / GIB:.1f}, {host_buffers}"
        + (f", staging for the states on disk {staging / GIB:.1f}" if on_disk else ""),
    ]
    on_disk_parts = ([f"AdamW states of {on_disk} sliding blocks {on_disk * block_numel * state_bytes / GIB:.1f}"]
                     if on_disk else []) + ([f"boundary activations {acts_disk / GIB:.1f}"] if acts_disk else [])
    if on_disk_parts:
        lines.append(f"  disk ~{(on_disk * block_numel * state_bytes + acts_disk) / GIB:.1f} GiB: "
                     + ", ".join(on_disk_parts))
    return Plan(budget, fixed, resident, device, host, lines, held, shared, acts_host if shared else 0,
                device_is_host=not cuda,
                activations=activations, tokens_per_micro=tokens_per_micro,
                unit_numels=(edge_numel,) + (block_numel,) * num_blocks, window=window,
                disk_activations=acts_disk, disk_states=on_disk * block_numel * state_bytes, state_bytes=state_bytes,
                clip=clip)


def check_fits(plan: Plan, budget_key: str, micro_batch_size: int = 1, seq_len: int = 0, window: int = 1) -> None:
    """Refuse a plan over its device budget, saying what would fit (the current micro_batch_size, seq_len and
    engine.window let it name concrete values)."""
    from .errors import ConfigError

    if plan.fixed > plan.budget:
        room = plan.budget - (plan.fixed - plan.activations)  # activations grow with tokens per micro-batch
        tokens = int(plan.tokens_per_micro * room / plan.activations) if room > 0 and plan.activations else 0
        if seq_len and tokens >= seq_len and micro_batch_size > 1:
            fits = f"micro_batch_size={tokens // seq_len} would fit (at most ~{tokens} tokens per micro-batch)"
        elif tokens >= 64:
            fits = (f"at most ~{tokens} tokens per micro-batch fit: e.g. micro_batch_size=1 with "
                    f"seq_len={tokens // 64 * 64}")
        else:
            fits = "even short micro-batches do not fit"
        other = " Or use engine.window=1 (fewer slots)." if window > 1 else ""
        raise ConfigError(
            f"this run cannot fit in {budget_key} ({plan.budget / GIB:.1f} GiB usable): the edges, the slots and "
            f"the activations alone need ~{plan.fixed / GIB:.1f} GiB; {fits}, or raise the limit.{other}")
    if plan.device_total > plan.budget:  # only a forced engine.resident gets here: the planner stays within
        raise ConfigError(
            f"engine.resident={plan.resident} keeps ~{plan.device_total / GIB:.1f} GiB on the device, more than "
            f"the {plan.budget / GIB:.1f} GiB usable in {budget_key}: lower it, or set it to null and the planner "
            "keeps as many units resident as fit")


def host_memory() -> float | None:
    """Bytes of RAM on this machine (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_host(plan: Plan, ram: float | None, replan: Callable[[float], Plan] | None = None) -> None:
    """Refuse a run whose host state cannot fit in RAM, before it allocates 100 GB and gets killed. `replan(f)`,
    the same run with `engine.optimizer_offload.nvme_fraction` f, finds the least share on disk that would fit."""
    from .errors import ConfigError

    if ram is not None and not plan.fits_host(ram):
        on_cpu = " and, on a CPU run, the device side's buffers and activations" if plan.device_is_host else ""
        share = "" if plan.shared else (" (with engine.activation_offload=cpu and engine.grads_share_activations "
                                        "left on, most of them share the boundary activations' memory)")
        disk = ""
        for blocks in range(1, plan.sliding + 1) if replan is not None else ():  # (replanned: held gradients move)
            fraction = math.ceil(100 * blocks / plan.sliding) / 100
            if replan(fraction).fits_host(ram):
                disk = (f", engine.optimizer_offload.nvme_fraction={fraction} keeps the AdamW states of {blocks} of "
                        f"the {plan.sliding} sliding blocks on disk (engine.optimizer_offload.dir: a fast local "
                        "NVMe drive; each step reads and writes them)")
                break
        raise ConfigError(
            f"this run needs ~{plan.ram_needed / GIB:.0f} GiB of host memory (fp32 masters, AdamW states, "
            f"gradient staging, boundary activations{on_cpu}); this machine has {ram / GIB:.0f} GiB. "
            + ("engine.states_dtype=bf16 saves 4 bytes per parameter, " if plan.state_bytes > 4 else "")
            + (f"max_grad_norm=null saves the 2 bytes per parameter that exact clipping holds{share}, "
               if plan.clip and plan.sliding else "")
            + "fewer tokens per step shrink the activations"
            + ("" if plan.disk_activations else " (engine.activation_offload=nvme keeps them on disk)") + disk)
