"""The cost model: a placement's time per step on a machine, lane by lane, and what bounds it.

Each lane's work per step comes from FLOPs and bytes; its time from the machine's measured rates. The overlap
rules are the engine's: a block loads into a slot once the block `window` places before it has left that slot,
and runs once it has loaded (and, with clipping, once its host update has written its master); the host
optimizer works through its blocks in order; host memory carries every PCIe, AdamW and disk byte. With clipping
the updates run under the next forward (a quarter of the compute), without it under the backward.

With data-parallel ranks the estimate is one rank's: its shard of each unit crosses its own PCIe link, the rest
of the parameters arrive by all-gather and the gradients leave by reduce-scatter over the GPUs' link, and the
host (its memory, its cores) carries every rank's copies and shard updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .disk_states import SLOTS as DISK_STAGING_SLOTS
from .machine import Machine
from .placement import Placement, early_reads_wait

# A decoder block's fwd+bwd runs at this share of the machine's dense bf16 matmul rate (attention, norms and
# element-wise kernels between the GEMMs); per block, micro-batch and pass, a fixed cost of launching kernels.
BLOCK_EFFICIENCY = 0.71
LAUNCH_S = 1.5e-4
# A speculative pass steps copies of master, m and v (cache-sized, around the same fused kernel, so that its
# parameters are bitwise the commit's) and narrows the result: twice an update's host time, per parameter.
SPECULATIVE_PASS = 2.0
# The host AdamW rate beside a step's DMA copies, as a share of the machine file's (measured alone): the fused
# kernel is bound by host memory, which the copies share (docs/findings.md)
ADAMW_BESIDE_COPIES = 0.73
CPU_FLOPS_PER_CORE = 2e10  # fp32 on a CPU device
LANES = ("gpu", "pcie_h2d", "pcie_d2h", "gpu_link", "host_memory", "host_adamw", "disk")


@dataclass
class Estimate:
    step_s: float
    bottleneck: str
    lanes: dict[str, float] = field(default_factory=dict)  # busy seconds per step
    phases: dict[str, float] = field(default_factory=dict)  # forward, tail, backward (and exposed updates)

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "bottleneck": self.bottleneck, "lanes": self.lanes, "phases": self.phases}


@dataclass
class _Work:
    """Bytes and seconds of one phase, lane by lane."""

    h2d: float = 0.0
    d2h: float = 0.0
    host_bytes: float = 0.0
    adamw: float = 0.0
    disk: float = 0.0
    gpu: float = 0.0
    link: float = 0.0  # collectives with the other ranks' GPUs


def price(p: Placement, machine: Machine, clipping_acts: bool = True) -> Estimate:
    """Predicted seconds per step of `p` on `machine`. With clipping on, `clipping_acts` False prices a step
    where it does not act: the blocks that speculate then load their speculated parameters and wait for no update
    (the others cost what they cost when it acts)."""
    s, t = p.shapes, p.step
    c = p.compute_bytes
    n = s.num_blocks
    tokens = t.tokens_per_micro * t.micro_batches
    seq = t.seq_len or t.tokens_per_micro
    gpu_rate = (machine.gpu.bf16_tflops * 1e12 * BLOCK_EFFICIENCY if not p.device_is_host and machine.has_gpu
                else CPU_FLOPS_PER_CORE * max(1, machine.host.cores))
    h2d = max(machine.pcie.h2d_gbps, 1e-3) * 1e9
    d2h = max(machine.pcie.d2h_gbps, 1e-3) * 1e9
    duplex = max(machine.pcie.duplex_gbps, machine.pcie.h2d_gbps, machine.pcie.d2h_gbps, 1e-3) * 1e9
    mem = max(machine.host.memory_gbps, 1e-3) * 1e9
    adamw = max(machine.host.adamw_gparams, 1e-3) * 1e9 * (ADAMW_BESIDE_COPIES if not p.device_is_host else 1.0)
    disk_r, disk_w = max(machine.disk.read_gbps, 1e-3) * 1e9, max(machine.disk.write_gbps, 1e-3) * 1e9
    pcie = not p.device_is_host  # a CPU device copies within host memory
    ranks = p.ranks
    # A unit's bytes over one rank's PCIe link are its shard's; a load gathers the others' shards (compute dtype)
    # and a gradient gives the others theirs; the host carries every rank's copies and updates.
    shard = 1 / ranks
    peers = (ranks - 1) / ranks * c
    link = max(machine.gpu.link_gbps or machine.pcie.h2d_gbps, 1e-3) * 1e9
    act = t.tokens_per_micro * s.hidden * c * t.micro_batches  # one boundary, every micro-batch
    offload = p.activations != "none"

    def block_flops(numel: int) -> float:  # forward pass of one block over the step: GEMMs and causal attention
        return 2 * numel * tokens + 2 * tokens * seq * s.hidden

    launch = LAUNCH_S * t.micro_batches if pcie else 0.0
    active = [s.active_block_numel or s.unit_numels[u] for u in range(1, n + 1)]  # what a token computes with
    forward_c = [block_flops(a) / gpu_rate + launch for a in active]
    backward_c = [3 * block_flops(a) / gpu_rate + 2 * launch for a in active]
    vocab_numel = s.vocab * s.hidden if s.vocab else s.unit_numels[0] // 2
    tail_s = 6 * vocab_numel * tokens / gpu_rate + 2 * tokens * s.hidden * c / mem * (not pcie)
    clip = p.clip
    sb = p.state_bytes
    adamw_bytes = 26 if sb == 4 else 18  # read master, m, v, gradient; write master, m, v

    fwd, bwd = _Work(), _Work()
    anywhere = _Work()  # host work nothing waits for within the step (updates behind held speculation)
    load_f, load_b, ready, update_s = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    host_order: list[int] = []
    staged_early = 0  # clipped updates whose states on disk are read during the backward
    for b in range(n):
        u, up = b + 1, p.units[b + 1]
        numel = s.unit_numels[u]
        if up.resident:
            continue
        # Speculation that holds: loads take the speculated parameters (compute dtype), and nothing waits for the
        # update proper, which runs whole under the next forward; one that is discarded only adds its pass.
        held = clip and up.speculate and not clipping_acts
        # Loads take the compute-dtype parameters where those are kept (held speculation, a master on disk and its
        # copy in host memory); a master read from disk for each load crosses as fp32, after the read
        compact = held or (up.disk_master and not up.disk_loads)
        if up.disk_loads:
            fwd.disk += 4 * numel / disk_r
            bwd.disk += 4 * numel / disk_r
            fwd.host_bytes += 4 * numel
            bwd.host_bytes += 4 * numel
        # Forward: the master crosses (with clipping, a streamed update brings m, v and the gradient along)
        stream = clip and up.update == "stream"
        into = numel * (c if compact else 4 + (8 + (0 if up.grad == "held" else c) if stream else 0)) * shard
        back = numel * ((4 if up.split else 12) if stream else 0) * shard
        load_f[b] = into / h2d + peers * numel / link if pcie else 0.0
        fwd.h2d += into
        fwd.d2h += back
        fwd.link += peers * numel
        # Backward: the master again, the gradient home (unless held for a device update)
        load_b[b] = numel * (c if compact else 4) * shard / h2d + peers * numel / link if pcie else 0.0
        bwd.h2d += numel * (c if compact else 4) * shard
        bwd.d2h += 0 if up.grad == "held" else numel * c * shard
        bwd.link += 2 * peers * numel  # the load's all-gather, the gradient's reduce-scatter
        if clip and up.speculate:  # the speculative pass, under the backward
            bwd.adamw += SPECULATIVE_PASS * numel / adamw
            bwd.host_bytes += numel * (4 + 2 * sb + 2 * c)  # reads master, m, v, gradient; writes parameters
        if held:
            anywhere.adamw += numel / adamw
            anywhere.host_bytes += numel * adamw_bytes
        elif up.update == "host":
            update_s[b] = numel / adamw
            host_order.append(b)
            work = fwd if clip else bwd
            work.adamw += update_s[b] * (0.5 if up.split else 1.0)
            work.host_bytes += numel * (18 if up.split else adamw_bytes)
            if up.split:  # the moments part runs after the forward
                bwd.adamw += update_s[b] * 0.5
                bwd.host_bytes += numel * 22
            if up.moments == "disk":  # read in ahead and written back (the master too where it is there)
                on_disk = 2 * sb + (4 if up.disk_master else 0)
                # (clipped: the first updates' reads run under the backward, one per staging slot, where no load
                # reads the disk there)
                early = clip and staged_early < DISK_STAGING_SLOTS and not early_reads_wait(p)
                staged_early += early
                reads, writes = (bwd if early or not clip else fwd), (fwd if clip else bwd)
                reads.disk += on_disk * numel / disk_r
                reads.host_bytes += on_disk * numel
                writes.disk += on_disk * numel / disk_w
                writes.host_bytes += on_disk * numel + (c * numel if up.disk_master and not up.disk_loads else 0)
    # Edges: streamed through the device (their master and moments), or their master loaded and updated on the host
    e, edges = s.unit_numels[0], p.units[0]
    if not edges.resident:
        if edges.update == "stream":
            (fwd if clip else bwd).h2d += 12 * e
            (fwd if clip else bwd).d2h += 12 * e
        else:
            fwd.h2d += 4 * e * shard
            bwd.d2h += c * e * shard
            fwd.link += peers * e
            bwd.link += peers * e
            (fwd if clip else bwd).adamw += e / adamw
            (fwd if clip else bwd).host_bytes += e * adamw_bytes
    if offload:  # boundaries out in the forward, back in the backward
        fwd.d2h += n * act
        bwd.h2d += n * act
        if p.activations == "nvme":
            fwd.disk += n * act / disk_w
            bwd.disk += n * act / disk_r
            fwd.host_bytes += n * act
            bwd.host_bytes += n * act
    for w in (fwd, bwd):
        w.host_bytes += (w.h2d + w.d2h) * ranks if pcie else 0.0

    # Forward: blocks load in order into `window` slots; with clipping each waits for its host update
    host_free = 0.0
    if clip:
        for b in host_order:
            host_free += update_s[b]
            ready[b] = host_free
    fwd_s = _slide(load_f, forward_c, ready, p.window, [p.units[b + 1].resident for b in range(n)])
    fwd.gpu = sum(forward_c)
    # Backward: blocks in reverse; without clipping, updates follow their gradients on the host thread
    rev = list(reversed(range(n)))
    bwd_s = _slide([load_b[b] for b in rev], [backward_c[b] for b in rev], [0.0] * n, p.window,
                   [p.units[b + 1].resident for b in rev])
    bwd.gpu = sum(backward_c)
    exposed_updates = 0.0
    if not clip and host_order:  # the last blocks' updates (block 0's, the edges') run after the backward
        exposed_updates = update_s[min(host_order)] + (e / adamw if edges.update == "host" else 0.0)

    phases = {}
    bound: dict[str, float] = {lane: 0.0 for lane in LANES}
    for name, w, sim in (("forward", fwd, fwd_s), ("backward", bwd, bwd_s)):
        if pcie:
            copies = max(w.h2d / h2d, w.d2h / d2h, (w.h2d + w.d2h) / duplex)
        else:
            copies = 0.0
        lanes = {"gpu": sim, "pcie_h2d": w.h2d / h2d if pcie else 0.0, "pcie_d2h": w.d2h / d2h if pcie else 0.0,
                 "gpu_link": w.link / link if pcie else 0.0, "host_memory": w.host_bytes / mem,
                 "host_adamw": w.adamw, "disk": w.disk}
        if pcie and copies > max(lanes["pcie_h2d"], lanes["pcie_d2h"]):  # duplex-bound: the busier direction
            key = "pcie_h2d" if w.h2d >= w.d2h else "pcie_d2h"
            lanes[key] = copies
        phase = max(lanes.values())
        phases[name] = phase
        for lane, busy in lanes.items():
            bound[lane] += busy
        # what stretched this phase beyond the GPU's own work (its compute and the loads it waited for)
        if phase > w.gpu * 1.02:
            worst = max(lanes, key=lambda k: lanes[k] if k != "gpu" else -1.0)
            culprit = worst if lanes[worst] >= sim else _wait_culprit(load_f if name == "forward" else load_b,
                                                                   ready, w)
            bound[f"_excess_{culprit}"] = bound.get(f"_excess_{culprit}", 0.0) + phase - w.gpu
    phases["tail"] = tail_s
    phases["exposed_updates"] = exposed_updates
    if anywhere.adamw:  # fits in whatever the phases leave the host thread and its memory, or lengthens the step
        span = phases["forward"] + phases["backward"]
        room = max(anywhere.adamw - (span - fwd.adamw - bwd.adamw),
                   (anywhere.host_bytes - (span * mem - fwd.host_bytes - bwd.host_bytes)) / mem)
        phases["host_backlog"] = max(0.0, room)
        bound["host_adamw"] += anywhere.adamw
        bound["host_memory"] += anywhere.host_bytes / mem
        if phases["host_backlog"]:
            lane = "host_adamw" if anywhere.adamw - (span - fwd.adamw - bwd.adamw) >= room else "host_memory"
            bound[f"_excess_{lane}"] = bound.get(f"_excess_{lane}", 0.0) + phases["host_backlog"]
    step = sum(phases.values())
    excess = {k.removeprefix("_excess_"): v for k, v in bound.items() if k.startswith("_excess_")}
    excess["host_adamw"] = excess.get("host_adamw", 0.0) + exposed_updates
    worst = max(excess, key=excess.get, default="gpu")
    bottleneck = worst if excess.get(worst, 0.0) > 0.05 * step else "gpu"
    lanes = {k: v for k, v in bound.items() if not k.startswith("_") and (k != "gpu_link" or ranks > 1)}
    lanes["gpu"] = fwd.gpu + bwd.gpu + tail_s
    return Estimate(step, bottleneck, lanes, phases)


def _wait_culprit(loads: list[float], ready: list[float], w: _Work) -> str:
    """Which lane the GPU waited for where no lane's total exceeds the phase: the host updates, or the copies."""
    return "host_adamw" if max(ready, default=0.0) > sum(loads) else "pcie_h2d"


def _slide(loads: list[float], compute: list[float], ready: list[float], window: int, resident: list[bool]) -> float:
    """When the last of these blocks (in running order) finishes: each sliding one loads after the previous load
    and once the slot it takes (`window` sliding blocks back) is free and its update is `ready`; each runs after
    the previous one and its own load."""
    load_end, done = 0.0, 0.0
    finished: list[float] = []  # compute end of each sliding block, in order
    for load, run, at, res in zip(loads, compute, ready, resident):
        if res:
            done += run
            continue
        slot_free = finished[-window] if len(finished) >= window else 0.0
        load_end = max(load_end, slot_free, at) + load
        done = max(done, load_end) + run
        finished.append(done)
    return done
