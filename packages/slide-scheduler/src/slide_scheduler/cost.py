"""The cost model: a placement's time per step on a machine, lane by lane, and what bounds it.

Each lane's work per step comes from FLOPs and bytes; its time from the machine's measured rates. The overlap
rules are the engine's: a block loads into a slot once the block `window` places before it has left that slot,
and runs once it has loaded (and, where host updates wait for the step's end, once its host update has written
its master); the host optimizer works through its blocks in order; host memory carries every PCIe, AdamW and disk
byte. With clipping (or deferred without it) the updates run under the next forward (a quarter of the compute),
otherwise under the backward.

With data-parallel ranks the estimate is one rank's: its shard of each unit crosses its own PCIe link, the rest
of the parameters arrive by all-gather and the gradients leave by reduce-scatter over the GPUs' link, and the
host (its memory, its cores) carries every rank's copies and shard updates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .machine import Machine
from .placement import Placement, early_reads_wait, kind_of

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
BOUND_SHARE = 0.05  # a lane that adds less than this share of the step to the GPU's work binds nothing
LANES = ("gpu", "pcie_h2d", "pcie_d2h", "gpu_link", "host_memory", "host_adamw", "disk")


@dataclass
class Estimate:
    """A step's time, phase by phase, and the lanes that set it. The lanes are those of LANES, but for a run on the
    CPU, whose device is the host: its lane is `compute`, and it has no PCIe lanes."""

    step_s: float  # the sum of the phases
    # the lane that adds the most to the compute's time in `critical`, where that is over BOUND_SHARE of the step;
    # else the compute's lane
    bottleneck: str
    lanes: dict[str, float] = field(default_factory=dict)  # busy seconds per step (the GPU's: its compute alone)
    phases: dict[str, float] = field(default_factory=dict)  # forward, backward, tail (and exposed updates, backlog)
    # forward and backward: each lane's busy seconds in that phase (the GPU's: its compute and its waits)
    phase_lanes: dict[str, dict[str, float]] = field(default_factory=dict)
    # per phase, what sets its length: the compute's time, and what the lane that outlasts it adds
    setters: dict[str, dict[str, float]] = field(default_factory=dict)
    critical: dict[str, float] = field(default_factory=dict)  # per lane, its part of the step (the setters summed)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
    offloaded, disk_acts = n - p.boundaries_in("none"), p.boundaries_in("nvme")  # blocks' input boundaries
    offload = offloaded > 0

    # Attention at its own rate where the machine file has one (in causal_attention_flops' count), else as the
    # GEMMs run
    attn_rate = machine.gpu.attention_tflops * 1e12 if pcie and machine.gpu.attention_tflops else gpu_rate
    rows = tokens / seq
    # a mixture's routed experts likewise (machine.experts_tflops), where measured
    experts_rate = machine.gpu.experts_tflops * 1e12 if pcie and machine.gpu.experts_tflops else 0.0

    def forward_s(u: int) -> float:  # one block's forward over the step: the GEMMs a token runs, its attention
        pairs = attention_pairs(seq, s.window(u))
        gemms = 2 * s.active(u) * tokens / gpu_rate
        if experts_rate:  # (the routed experts' share at their own rate)
            gemms += 2 * s.routed(u) * tokens * (1 / experts_rate - 1 / gpu_rate)
        return gemms + 4 * pairs * (s.attention_width or s.hidden) * rows / attn_rate

    launch = LAUNCH_S * t.micro_batches if pcie else 0.0
    forward_c = [forward_s(u) + launch for u in range(1, n + 1)]
    # one landing set: each block's boundary activations cross only once the backward after it is done
    fetch = act / h2d if pcie and offload and p.landing_sets == 1 else 0.0
    # (the backward recomputes the forward, then runs back at twice its work)
    backward_c = [3 * forward_s(u) + 2 * launch + fetch for u in range(1, n + 1)]
    vocab_numel = s.vocab * s.hidden if s.vocab else s.unit_numels[0] // 2
    tail_s = 6 * vocab_numel * tokens / gpu_rate + 2 * tokens * s.hidden * c / mem * (not pcie)
    clip = p.clip
    waits = p.deferred  # host updates wait for the step's end (with clipping, for the norm), under the next forward
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
        master_away, loads_away = kind_of(up.master) == "files", kind_of(up.loads) == "files"
        compact = held or (master_away and not loads_away)
        if loads_away:
            fwd.disk += 4 * numel / disk_r
            bwd.disk += 4 * numel / disk_r
            fwd.host_bytes += 4 * numel
            bwd.host_bytes += 4 * numel
        # Forward: the master crosses (a streamed update brings m, v and the gradient along)
        stream = up.update == "stream"
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
            work = fwd if waits else bwd
            work.adamw += update_s[b] * (0.5 if up.split else 1.0)
            work.host_bytes += numel * (18 if up.split else adamw_bytes)
            if up.split:  # the moments part runs after the forward
                bwd.adamw += update_s[b] * 0.5
                bwd.host_bytes += numel * 22
            if kind_of(up.moments) == "files":  # read in ahead and written back (the master too where it is there)
                on_disk = 2 * sb + (4 if master_away else 0)
                # (deferred: the first updates' reads run under the backward, one per staging slot, where no load
                # reads the disk there)
                early = waits and staged_early < p.staging_slots and not early_reads_wait(p)
                staged_early += early
                reads, writes = (bwd if early or not waits else fwd), (fwd if waits else bwd)
                reads.disk += on_disk * numel / disk_r
                reads.host_bytes += on_disk * numel
                writes.disk += on_disk * numel / disk_w
                writes.host_bytes += on_disk * numel + (c * numel if master_away and not loads_away else 0)
                if up.grad == "disk":  # written as the backward makes it, read back with the states
                    bwd.disk += c * numel / disk_w
                    bwd.host_bytes += c * numel
                    reads.disk += c * numel / disk_r
                    reads.host_bytes += c * numel
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
            (fwd if waits else bwd).adamw += e / adamw
            (fwd if waits else bwd).host_bytes += e * adamw_bytes
    if offload:  # boundaries out in the forward, back in the backward (through host memory to disk for some)
        fwd.d2h += offloaded * act
        bwd.h2d += offloaded * act
        fwd.disk += disk_acts * act / disk_w
        bwd.disk += disk_acts * act / disk_r
        fwd.host_bytes += disk_acts * act
        bwd.host_bytes += disk_acts * act
    for w in (fwd, bwd):
        w.host_bytes += (w.h2d + w.d2h) * ranks if pcie else 0.0

    # Forward: blocks load in order into `window` slots; deferred (with clipping), each waits for its host update
    host_free = 0.0
    if waits:
        for b in host_order:
            host_free += update_s[b]
            ready[b] = host_free
    fwd_s = _slide(load_f, forward_c, ready, p.window, [p.units[b + 1].resident for b in range(n)])
    fwd.gpu = sum(forward_c)
    # Backward: blocks in reverse; not deferred (no clipping), updates follow their gradients on the host thread
    rev = list(reversed(range(n)))
    bwd_s = _slide([load_b[b] for b in rev], [backward_c[b] for b in rev], [0.0] * n, p.window,
                   [p.units[b + 1].resident for b in rev])
    bwd.gpu = sum(backward_c)
    exposed_updates = 0.0
    if not waits and host_order:  # the last blocks' updates (block 0's, the edges') run after the backward
        exposed_updates = update_s[min(host_order)] + (e / adamw if edges.update == "host" else 0.0)

    # Each phase lasts as long as its slowest lane. Of its length, the GPU's compute is the GPU's; what the phase
    # lasts beyond it is set by that slowest lane or, where the GPU is slowest because it waited, by what it waited
    # for: the loads (PCIe, or the GPUs' link) or the host updates a clipped forward's loads wait for.
    phases: dict[str, float] = {}
    setters: dict[str, dict[str, float]] = {}
    phase_lanes: dict[str, dict[str, float]] = {}
    busy: dict[str, float] = {lane: 0.0 for lane in LANES}
    for name, w, (sim, waits) in (("forward", fwd, fwd_s), ("backward", bwd, bwd_s)):
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
        phases[name] = max(lanes.values())
        phase_lanes[name] = lanes
        for lane, seconds in lanes.items():
            busy[lane] += seconds
        top = max(lanes, key=lanes.get)  # (the GPU first among equals)
        if top == "gpu":
            loads = "gpu_link" if lanes["gpu_link"] > lanes["pcie_h2d"] else "pcie_h2d"
            setters[name] = {"gpu": w.gpu, loads: waits["loads"], "host_adamw": waits["updates"]}
        else:
            setters[name] = {"gpu": w.gpu, top: phases[name] - w.gpu}
    phases["tail"] = tail_s
    setters["tail"] = {"gpu": tail_s}
    phases["exposed_updates"] = exposed_updates
    setters["exposed_updates"] = {"host_adamw": exposed_updates}
    if anywhere.adamw:  # fits in what the forward and tail leave the host thread and its memory, or lengthens
        # the step: the commits queue behind the forward's updates and ahead of the next backward's speculative
        # passes, and that backward reuses their gradient buffers
        span = phases["forward"] + tail_s
        idle = span - fwd.adamw
        room = max(anywhere.adamw - idle, (anywhere.host_bytes - (span * mem - fwd.host_bytes)) / mem)
        phases["host_backlog"] = max(0.0, room)
        busy["host_adamw"] += anywhere.adamw
        busy["host_memory"] += anywhere.host_bytes / mem
        lane = "host_adamw" if anywhere.adamw - idle >= room else "host_memory"
        setters["host_backlog"] = {lane: phases["host_backlog"]}
    critical = {lane: 0.0 for lane in LANES}
    for part in setters.values():
        for lane, seconds in part.items():
            critical[lane] += seconds
    busy["gpu"] = fwd.gpu + bwd.gpu + tail_s  # its compute alone (its waits are other lanes' time)
    step = sum(phases.values())
    # The bottleneck: the lane that lengthens the step most beyond the GPU's work, where that is more than the
    # model's own uncertainty
    worst = max((lane for lane in LANES if lane != "gpu"), key=critical.get)
    bottleneck = worst if critical[worst] > BOUND_SHARE * step else "gpu"
    # A CPU run's device is the host: its lane is the host's compute, and nothing crosses PCIe or a GPU link
    kept = [lane for lane in LANES if (pcie or not lane.startswith("pcie")) and (lane != "gpu_link" or ranks > 1)]

    def named(lanes: dict[str, float]) -> dict[str, float]:
        return {compute_lane(p) if k == "gpu" else k: lanes.get(k, 0.0) for k in kept}

    return Estimate(step_s=step, bottleneck=compute_lane(p) if bottleneck == "gpu" else bottleneck,
                    lanes=named(busy), phases=phases, phase_lanes={k: named(v) for k, v in phase_lanes.items()},
                    setters={k: {lane: s for lane, s in named(v).items() if s > 0} for k, v in setters.items()},
                    critical=named(critical))


def attention_pairs(seq: int, window: int = 0) -> float:
    """(query, key) pairs of one row's causal attention, each query seeing itself and the `window` - 1 tokens
    before it (0: every token before it): S^2 / 2 for a whole row."""
    w = min(window or seq, seq)
    return seq * w - w * w / 2


def disk_traffic(p: Placement) -> tuple[int, int]:
    """Bytes the disk tier reads and writes per step, as `price` moves them: the states of each block there
    (its AdamW moments, and its master where that is there too) read and written back once, a master read for
    each load (forward and backward) where its parameters have no copy in host memory, and the boundary
    activations on disk written in the forward and read in the backward."""
    s, t = p.shapes, p.step
    read = written = 0
    for u in p.on_disk:
        numel = s.unit_numels[u]
        states = (2 * p.state_bytes + (4 if u in p.masters_on_disk else 0)) * numel
        read, written = read + states, written + states
    read += sum(2 * 4 * s.unit_numels[u] for u in p.loads_from_disk)
    grads = sum(p.compute_bytes * s.unit_numels[u] for u in p.grads_on_disk)  # written, then read back
    read, written = read + grads, written + grads
    boundaries = p.boundaries_in("nvme") * t.tokens_per_micro * s.hidden * p.compute_bytes * t.micro_batches
    read, written = read + boundaries, written + boundaries
    return read, written


def compute_lane(p: Placement) -> str:
    """The name of the lane that computes: `gpu`, or `compute` where the device is the host."""
    return "compute" if p.device_is_host else "gpu"


def _slide(loads: list[float], compute: list[float], ready: list[float], window: int,
           resident: list[bool]) -> tuple[float, dict[str, float]]:
    """When the last of these blocks (in running order) finishes: each sliding one loads after the previous load
    and once the slot it takes (`window` sliding blocks back) is free and its update is `ready`; each runs after
    the previous one and its own load. Also how long the compute waited: for `updates` where the late load had
    waited for its block's update, for `loads` otherwise."""
    load_end, done = 0.0, 0.0
    waits = {"loads": 0.0, "updates": 0.0}
    finished: list[float] = []  # compute end of each sliding block, in order
    for load, run, at, res in zip(loads, compute, ready, resident):
        if res:
            done += run
            continue
        slot_free = finished[-window] if len(finished) >= window else 0.0
        cause = "updates" if at > max(load_end, slot_free) else "loads"
        load_end = max(load_end, slot_free, at) + load
        if load_end > done:
            waits[cause] += load_end - done
        done = max(done, load_end) + run
        finished.append(done)
    return done, waits
