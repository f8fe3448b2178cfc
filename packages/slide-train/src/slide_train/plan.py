"""A run's plan in words, for the run's start and `slide-train plan` (its text, and the parts of `--json` the
scheduler's `Plan.to_dict` leaves out): what each tier holds, the predicted step and what binds it, and what would
make a run that does not fit fit. The plan itself is made by the launch (launch.py)."""

from __future__ import annotations

import itertools

from slide_scheduler import DISK, GPU, HOST, Machine, Plan, Suggestion, disk_traffic, drive_shares, seconds_on

from .budgets import host_limit_problem
from .config import TrainConfig
from .disk_tier import folders_text, nvme_dirs
from .errors import plural

GIB = 2**30


def params_text(count: int) -> str:
    """A parameter count as people say it: 0.8M, 124.4M, 8.03B."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def aux_loss_text(cfg: TrainConfig, hf_config) -> str:
    """For the model line: a mixture of experts' load-balancing loss, where on, and which HF loop it follows."""
    if not getattr(hf_config, "output_router_logits", False):
        return ""
    how = ("each micro-batch's whole, as transformers.Trainer adds it" if cfg.router_aux_loss == "trainer" else
           "their mean over the step's micro-batches, as a loop of model(ids, labels=ids).loss / grad_accum has it")
    return (f"; load-balancing loss x {hf_config.router_aux_loss_coef:g}: {how} "
            f"(router_aux_loss={cfg.router_aux_loss})")


def checkpoint_cost(plan: Plan, machine: Machine) -> tuple[int, float | None]:
    """Bytes a checkpoint writes (every unit's fp32 master and AdamW moments) and its seconds on the machine
    file's disk: the write, plus reading back the share the NVMe tier holds (the same drive, taken as one); the
    files are hashed beside the writes. None for the seconds where the machine has no measured disk (no free
    space known, or no rates)."""
    p = plan.placement
    nbytes = sum(p.shapes.unit_numels) * (4 + 2 * p.state_bytes)
    disk = machine.disk
    if not (disk.free_gib and disk.write_gbps and disk.read_gbps):
        return nbytes, None
    return nbytes, nbytes / (disk.write_gbps * 1e9) + p.bytes(DISK) / (disk.read_gbps * 1e9)


# The planner's name of each change it suggests -> the config key
CONFIG_KEYS = {
    "nvme_fraction": "engine.nvme.fraction",
    "activations": "engine.activation_offload",
    "speculate": "engine.placement.speculate",
    "window": "engine.placement.window",
    "state_bytes": "engine.states_dtype",
    "clip": "max_grad_norm",
    "rows": "micro_batch_size",
    "seq_len": "seq_len",
    "micro_batches": "grad_accum",
}
ACTIVATIONS_WHERE = {GPU: "on the GPU", HOST: "in host memory", DISK: "on disk"}
MORE_TOKENS = 64  # how far past the run's own grad_accum a plan looks for the GPU to bind
STALL_SHARE = 0.05  # a stall under this share of the step binds nothing (the cost model's own uncertainty)

# The plan's words for slide-scheduler's names (its lanes, phases, kinds of allocation and unit placements);
# docs/placement.md's glossary explains the terms that remain (unit, edges, block, slot, sliding, resident, master,
# moments, boundary activations, speculation)
LANE_WORDS = {"gpu": "GPU compute", "compute": "CPU compute", "pcie_h2d": "copies to the GPU",
              "pcie_d2h": "copies from the GPU", "gpu_link": "the GPUs' link", "host_memory": "host memory traffic",
              "host_adamw": "CPU AdamW", "disk": "the disk"}
PHASE_WORDS = {"exposed_updates": "updates after the backward", "host_backlog": "updates the forward cannot hide"}
TIER_WORDS = {GPU: "GPU", HOST: "host memory", DISK: "disk"}
CONTENT_WORDS = {
    "masters": "fp32 masters", "moments": "AdamW moments", "optimizer scratch": "AdamW scratch",
    "parameters of masters on disk": "parameter copies of blocks on disk",
    "masters read for loads": "buffers for masters read from disk",
    "moments staging": "buffers for moments on disk", "masters staging": "buffers for masters on disk",
    "gradients to disk": "buffers for gradients on disk",
    "resident states": "resident masters and AdamW moments",
    "device-update buffers": "buffers for updates on the GPU", "held gradients": "gradients kept on the GPU",
    "step readout": "loss and gradient norms",
    "gradients + boundary activations": "gradients and boundary activations (shared)",
    "boundary activation rings": "buffers for activations on disk",
    "speculative parameters": "speculated parameters",
    "activation landing": "buffers for activations coming back",
    "workspace": "recompute workspace", "loss chunk + margin": "loss chunk and allocator margin",
    "runtime": "torch and libraries",
    "export shard": "the export's largest shard (at the end)",
}
GRADIENT_WORDS = {"slot": "gradient stays where it is made", "held": "gradient kept on the GPU",
                  "pool": "gradient in host memory shared with the boundary activations",
                  "ring": "gradient in a host buffer shared by the blocks",
                  "own": "gradient in a host buffer of its own", "disk": "gradient on disk"}


def config_value(name: str, value):
    """A suggested change's value as the config has it (the planner counts the states' bytes)."""
    return {2: "bf16", 4: "fp32"}[value] if name == "state_bytes" else value


def setting_args(s: Suggestion) -> list[str]:
    """A suggestion's settings as command-line overrides."""
    def typed(value) -> str:
        if value is None or isinstance(value, bool):
            return {None: "null", True: "true", False: "false"}[value]
        return f"{value:g}" if isinstance(value, float) else str(value)

    return [f"--{CONFIG_KEYS[name]}={typed(config_value(name, value))}" for name, value in s.changes.items()]


def advice(plan: Plan) -> dict:
    """What the plan advises, for `plan --json`: each suggestion's settings (config keys) and predicted step, and
    the grad_accum at which the GPU would bind."""
    def settings(s: Suggestion) -> dict:
        return {CONFIG_KEYS[name]: config_value(name, value) for name, value in s.changes.items()}

    out = {"suggestions": [{"settings": settings(s), "keeps_training": s.keeps_training,
                            "predicted_step_s": s.plan.estimate.step_s} for s in plan.suggestions]}
    if plan.compute_bound is not None:
        out["compute_bound_at"] = {"settings": settings(plan.compute_bound),
                                   "predicted_step_s": plan.compute_bound.plan.estimate.step_s}
    return out


def suggestion_line(s: Suggestion, plan: Plan) -> str:
    """One suggestion: its overrides, its predicted step, what it changes of the training and where it puts
    what the run's own plan could not hold."""
    p, q = plan.placement, s.plan.placement
    tokens, was = q.step.tokens_per_micro * q.step.micro_batches, p.step.tokens_per_micro * p.step.micro_batches
    changed = {"state_bytes": "AdamW's m and v in bf16 (no longer exact fp32 AdamW)",
               "clip": "no gradient clipping",
               "rows": f"{plural(s.changes.get('rows', 0), 'row')} per micro-batch, {tokens} tokens per step instead "
                       f"of {was}",
               "seq_len": f"rows of {s.changes.get('seq_len')} tokens, {tokens} tokens per step instead of {was}"}
    what = [changed[name] for name in s.changes if name in changed]
    where = []
    if q.on_disk:
        where.append(f"the masters and AdamW moments of {len(q.on_disk)} of the {len(q.sliding_blocks)} sliding "
                     f"blocks on disk ({q.bytes(DISK) / GIB:.0f} GiB there)")
    if "activations" in s.changes:
        where.append(f"boundary activations {ACTIVATIONS_WHERE[q.activations]}")
    if "speculate" in s.changes:
        where.append("no block speculating")
    if "window" in s.changes:
        where.append("one slot")
    return (f"    {' '.join(setting_args(s))}: {s.plan.estimate.step_s:.1f} s per step, "
            + ("the same training" if s.keeps_training else "changes the training: " + "; ".join(what))
            + ("; " + ", ".join(where) if where else ""))


def refusal(plan: Plan, cfg: TrainConfig) -> str:
    """What a run that does not fit is told: one line of what does not fit and what follows, then one line per
    setting near it that fits (those that keep the training the same first)."""
    head, *lines = _advice_lines(plan, cfg)
    return "\n".join(["this run cannot fit: " + "; ".join([*plan.problems, head]), *lines])


def _advice_lines(plan: Plan, cfg: TrainConfig) -> list[str]:
    """What follows from a plan that does not fit: a line that says so, then one line per suggestion."""
    note = ""
    if plan.placement.ranks > 1 and cfg.engine.nvme.fraction == "auto":
        note = ("with data-parallel ranks engine.nvme.fraction=auto keeps every state in host memory (they do not "
                "run the disk tier); ")
    if not plan.suggestions:
        capped = host_limit_problem(plan, cfg) is not None
        return [note + "no setting near this one fits (placements, bf16 AdamW states, no clipping, down to an "
                "eighth of the rows and of their length): it needs "
                + ("a larger engine.host_memory_limit_gb or " if capped else "") + "a machine with more memory"]
    ordered = sorted(plan.suggestions, key=lambda s: not s.keeps_training)
    return [note + "these settings fit, with their predicted step:", *(suggestion_line(s, plan) for s in ordered)]


def lane_word(lane: str) -> str:
    return LANE_WORDS.get(lane, lane.replace("_", " "))


def bound_words(estimate, compute: str, device: str) -> str:
    """What binds a step, in words, from the estimate's `bottleneck` (the field `--json` prints): the device's
    compute where no lane adds over STALL_SHARE of the step beyond it, else the lane that adds the most."""
    if estimate.bottleneck == compute:
        return f"{device.removeprefix('the ')}-bound"
    return f"bound by {lane_word(estimate.bottleneck)}"


def prediction_lines(plan: Plan) -> list[str]:
    """The predicted step, what binds it and the figures that show it: the step is the sum of its phases; each
    phase lasts as long as its slowest lane, of which the device's compute is its own and the rest is what
    another lane adds (a stall). The step is bound by the lane that adds the most where that is over
    STALL_SHARE of it, else GPU-bound (CPU-bound on the CPU): the estimate's `bottleneck`, as `--json` says.
    Where the lane named is not the busiest, a line says why."""
    p, e, u = plan.placement, plan.estimate, plan.estimate_unclipped
    compute = "compute" if p.device_is_host else "gpu"
    device = "the CPU" if p.device_is_host else "the GPU"
    scale, unit, digits = (1e3, "ms", 1) if e.step_s < 1 else (1.0, "s", 2)  # (a tiny model's step takes ms)

    def num(seconds: float) -> str:
        return f"{seconds * scale:.{digits}f}"

    def shown(seconds: float) -> bool:  # (what would print as zero is left out)
        return round(seconds * scale, digits) > 0

    unclipped = "" if u.bottleneck == e.bottleneck else f", then {bound_words(u, compute, device)}"
    clipped = f" (clipping acts; {num(u.step_s)} {unit} when it does not{unclipped})" if p.clips else ""
    added = sorted(((lane, s) for lane, s in e.critical.items() if lane != compute and shown(s)),
                   key=lambda item: -item[1])
    stalls = ", ".join(f"{lane_word(lane)} {num(s)} {unit}" for lane, s in added)
    lines = [f"  predicted step {num(e.step_s)} {unit}{clipped}, {bound_words(e, compute, device)}: {device} "
             f"computes {num(e.critical[compute])} {unit} of it ({e.critical[compute] / e.step_s:.0%})"
             + (f"; stalls add {num(sum(s for _, s in added))} {unit}: {stalls}" if added else "; nothing stalls it")]
    lines.append("    " + "; ".join(
        f"{PHASE_WORDS.get(name, name)} {num(e.phases[name])} {unit} = "
        + " + ".join(f"{lane_word(lane)} {num(s)}" for lane, s in e.setters[name].items() if shown(s))
        for name in e.phases if shown(e.phases[name])))
    lines.append("    busy per step: " + ", ".join(f"{lane_word(lane)} {num(busy)} {unit}"
                                                  for lane, busy in e.lanes.items()))
    why = why_line(plan, num, unit)
    tie = plan.tie_passed_over_s
    tied = [f"    the planner took this plan over one priced {num(tie)} {unit} ({1 - tie / e.step_s:.1%} faster, "
            "within the cost model's uncertainty), for its smaller host memory"] if tie is not None else []
    return lines + ([f"    {why}"] if why else []) + tied


def why_line(plan: Plan, num, unit: str) -> str | None:
    """Where the lane that binds the step is not the busiest: why, in one line (`num`: seconds as printed)."""
    p, e = plan.placement, plan.estimate
    compute = "compute" if p.device_is_host else "gpu"
    device = "the CPU" if p.device_is_host else "the GPU"
    bound, busiest = e.bottleneck, max(e.lanes, key=e.lanes.get)
    if busiest == bound:
        return None
    rule = "the step is the sum of its phases, each as long as its slowest lane"
    if bound == compute:
        return (f"{lane_word(busiest)}: busy longer than {device}'s compute ({num(e.lanes[busiest])} {unit} against "
                f"{num(e.lanes[compute])} {unit}), but {rule}, and most of it runs beside {device}'s work: it adds "
                f"{num(e.critical.get(busiest, 0.0))} {unit}")
    where = [PHASE_WORDS.get(name, name) for name, parts in e.setters.items() if parts.get(bound, 0) > 0]
    than = f"{device}'s compute" if busiest == compute else lane_word(busiest)
    return (f"{lane_word(bound)}: busy less than {than} ({num(e.lanes[bound])} {unit} against "
            f"{num(e.lanes[busiest])} {unit}), but {rule}: in the {' and the '.join(where)} it outlasts "
            f"{device}'s work, by {num(e.critical[bound])} {unit} in all, over {STALL_SHARE:.0%} of the step"
            + ("" if busiest == compute
               else f", while {lane_word(busiest)} adds {num(e.critical.get(busiest, 0.0))} {unit}"))


def unit_lines(p) -> list[str]:
    """One line per run of units placed alike: where each keeps its parameters, runs its AdamW, keeps its
    gradient, its master and its moments."""
    device = "the CPU" if p.device_is_host else "the GPU"
    where = {GPU: f"on {device}", HOST: "in host memory", DISK: "on disk"}
    lines = []
    for u, group in itertools.groupby(range(len(p.units)), key=lambda i: p.units[i]):
        units = list(group)
        first, last = units[0], units[-1]
        blocks = (f"block {last - 1}" if last == max(first, 1) else f"blocks {max(first, 1) - 1}..{last - 1}")
        name = "edges" if last == 0 else (f"edges, {blocks}" if first == 0 else blocks)
        update = {"device": f"AdamW on {device}", "stream": "AdamW on the GPU as it loads",
                  "host": "AdamW on the CPU"}.get(u.update, u.update)
        if u.early:
            update = "AdamW on the GPU in the backward, once its gradient is home"
        elif u.defer:
            update += ", after the backward"
        states = (f"master and AdamW moments {where.get(u.master, u.master)}" if u.master == u.moments else
                  f"master {where.get(u.master, u.master)}, AdamW moments {where.get(u.moments, u.moments)}")
        parts = [f"resident on {device}" if u.resident else "sliding", update, GRADIENT_WORDS.get(u.grad, u.grad),
                 states]
        if u.split:
            parts.append("a clipped update in two parts (master before the next forward, moments after)")
        if u.speculate:
            parts.append("speculates")
        if u.loads == u.master != HOST and not u.resident:
            parts.append(f"loads read the master from {u.loads}")
        lines.append(f"    {name}: {'; '.join(parts)}")
    return lines


def block_sizes_line(p) -> str:
    """Blocks of several sizes: how many of each, their parameters (those a token computes with) and the bytes of
    each one's parameters in the compute dtype (a slot holds the largest)."""
    sizes: dict[int, list[int]] = {}
    for u in range(1, len(p.units)):
        sizes.setdefault(p.shapes.unit_numels[u], []).append(u)
    parts = []
    for numel, units in sizes.items():
        active = p.shapes.active(units[0])
        ran = f", {params_text(active)} active" if active != numel else ""
        parts.append(f"{plural(len(units), 'block')} of {params_text(numel)} params{ran} "
                     f"({numel * p.compute_bytes / GIB:.2f} GiB each), from block {units[0] - 1}")
    return "  blocks of " + plural(len(sizes), "size") + ": " + "; ".join(parts) + \
        f"; each slot holds the largest ({p.shapes.block_numel * p.compute_bytes / GIB:.2f} GiB)"


def drive_figures(plan: Plan, machine: Machine) -> list[dict]:
    """Each drive of a striped disk tier: its folder, the bytes its files take, what it reads and writes per step,
    its busy seconds of the step, and the steps its rated endurance lasts at that rate (None: no TBW given)."""
    p, out = plan.placement, []
    for drive, share in zip(machine.drives, drive_shares(p, len(machine.drives))):
        steps = drive.tbw * 1e12 / share.written if drive.tbw and share.written else None  # (TB of 1e12 bytes)
        out.append({"dir": drive.dir, "bytes": share.size, "read_bytes": share.read, "written_bytes": share.written,
                    "busy_s": seconds_on(drive, share), "tb_written": share.written / 1e12, "tbw": drive.tbw,
                    "steps_to_tbw": steps})
    return out


def drive_lines(plan: Plan, machine: Machine) -> list[str]:
    """The plan's lines for each drive of a striped disk tier."""
    lines = [f"  the disk tier striped over {len(machine.drives)} drives:"]
    for i, d in enumerate(drive_figures(plan, machine)):
        wear = (f"; its rated {d['tbw']:g} TBW lasts ~{d['steps_to_tbw']:,.0f} steps "
                f"(~{d['steps_to_tbw'] * plan.estimate.step_s / 86400:,.1f} days)" if d["steps_to_tbw"] else "")
        lines.append(f"    drive {i} ({d['dir'] or 'no folder named'}): {d['bytes'] / GIB:.0f} GiB, reads "
                     f"{d['read_bytes'] / GIB:.0f} GiB and writes {d['written_bytes'] / GIB:.0f} GiB per step, busy "
                     f"{d['busy_s']:.1f} s; writes {d['tb_written']:.3f} TB per step{wear}")
    return lines


def counted(n: int, one: str, many: str) -> str:  # "1 block updates", "2 blocks update"
    return f"{n} {one if n == 1 else many}"


def residency_lines(p) -> list[str]:
    """What is resident and what slides, how the sliding blocks update and keep their states, and one line per
    run of units placed alike."""
    streamed, only_moments = len(p.streamed - {0}), len(p.on_disk - p.masters_on_disk)
    parts = [] if p.device_is_host else [
        counted(streamed, "sliding block updates on the GPU", "sliding blocks update on the GPU"),
        counted(len(p.held), "holds its gradient there", "hold their gradient there")]
    parts.append(counted(len(p.pooled), "shares host memory with the boundary activations",
                         "share host memory with the boundary activations"))
    parts.append(counted(len(p.masters_on_disk), "keeps its master and AdamW moments on disk",
                         "keep their master and AdamW moments on disk")
                 + (f" ({counted(len(p.loads_from_disk), 'reads its', 'read their')} master from disk for each "
                    "load)" if p.loads_from_disk else ""))
    if only_moments:
        parts.append(counted(only_moments, "only its moments", "only their moments"))
    if p.speculated:
        parts.append(counted(len(p.speculated), "speculates", "speculate"))
    device = "host memory (CPU run)" if p.device_is_host else "the GPU"
    lines = [f"plan: {len(p.resident)} of {plural(len(p.units), 'unit')} resident on {device}, "
             f"{len(p.sliding_blocks)} sliding through {plural(p.window, 'slot')}; " + ", ".join(parts)]
    groups = unit_lines(p)
    if len(groups) > 8:
        groups = [f"    ({len(groups)} runs of units placed alike: `plan --json` lists each unit)"]
    return lines + groups


def tier_lines(plan: Plan) -> list[str]:
    """Where the boundary activations wait, the blocks' sequence tiles, and each tier's bytes by what they hold."""
    p, b, tiers = plan.placement, plan.budgets, plan.placement.tiers()
    lines = [block_sizes_line(p)] if p.shapes.mixed else []
    where = {tier: p.boundaries_in(tier) for tier in ACTIVATIONS_WHERE if p.boundaries_in(tier)}
    lines.append("  boundary activations: " + (f"{ACTIVATIONS_WHERE[p.activations]}" if len(where) == 1 else ", ".join(
        f"{counted(n, 'block', 'blocks')}' {ACTIVATIONS_WHERE[tier]}" for tier, n in where.items())))
    if p.sequence_tile:
        what = "attention runs by query tiles and its MLP" if p.query_tiles else "MLP runs"
        lines.append(f"  each block's {what} over tiles of {p.sequence_tile:,} positions (rows of "
                     f"{p.step.seq_len or p.step.tokens_per_micro:,}; a mixture's experts whole), each tile "
                     "recomputed in the backward")
    for tier, budget in ((GPU, b.gpu), (HOST, b.host), (DISK, b.disk)):
        if (tier == GPU and p.device_is_host) or (tier == DISK and not p.bytes(DISK)):
            continue
        parts = ", ".join(f"{CONTENT_WORDS.get(kind, kind)} {nbytes / GIB:.2f}" for kind, nbytes in tiers[tier].items()
                          if round(nbytes / GIB, 2))  # (a few bytes, the loss and norms: no 0.00)
        cap = "" if budget is None else f" of {budget / GIB:.1f} usable"
        lines.append(f"  {TIER_WORDS.get(tier, tier)} ~{p.bytes(tier) / GIB:.1f} GiB{cap}: {parts or 'nothing'}")
    return lines


def disk_lines(plan: Plan, machine: Machine | None, cfg: TrainConfig | None) -> list[str]:
    """The disk tier's traffic per step and its folders, each drive's share and wear, the I/O path, and what a
    checkpoint costs on the machine's disk."""
    p, lines = plan.placement, []
    if p.bytes(DISK):
        read, written = disk_traffic(p)
        auto = cfg is not None and cfg.engine.nvme.fraction == "auto" and p.on_disk
        folder = f" in {folders_text(nvme_dirs(cfg, machine))}" if cfg is not None else ""
        lines.append(f"  {'host memory alone does not hold this run: ' if auto else ''}the disk tier{folder} reads "
                     f"{read / GIB:.0f} GiB and writes {written / GIB:.0f} GiB per step, busy "
                     f"{plan.estimate.lanes['disk']:.1f} s of the {plan.estimate.step_s:.1f} s step")
        if machine is not None and len(machine.drives) > 1:
            lines += drive_lines(plan, machine)
        elif machine is not None and machine.disk.tbw and written:
            steps = machine.disk.tbw * 1e12 / written  # (a drive's rating counts terabytes of 1e12 bytes)
            lines.append(f"  drive wear: at {written / GIB:,.0f} GiB written per step, the drive's rated "
                         f"{machine.disk.tbw:g} TBW lasts ~{steps:,.0f} steps "
                         f"(~{steps * plan.estimate.step_s / 86400:,.1f} days of this run)")
    if machine is not None and machine.disk.path and p.bytes(DISK):
        lines.append(f"  disk path: {machine.disk.path} ({machine.disk.path_reason})")
    nbytes, seconds = checkpoint_cost(plan, machine) if machine is not None else (0, None)
    if seconds is not None:
        tier = (f", reading the tier's {p.bytes(DISK) / GIB:.1f} GiB at {machine.disk.read_gbps:g} GB/s"
                if p.bytes(DISK) else "")
        lines.append(f"  a checkpoint writes ~{nbytes / GIB:.1f} GiB: ~{seconds:.0f} s at the disk's "
                     f"{machine.disk.write_gbps:g} GB/s{tier}")
    return lines


def advice_lines(plan: Plan, cfg: TrainConfig | None) -> list[str]:
    """Where the plan fits but a stall binds it, the grad_accum at which none would; where it does not fit, why
    and the settings near it that do."""
    p, lines = plan.placement, []
    if plan.fits and plan.compute_bound is not None:
        s = plan.compute_bound
        q = s.plan.placement
        tokens = q.step.tokens_per_micro * q.step.micro_batches
        now = p.step.tokens_per_micro * p.step.micro_batches
        lines.append(f"  more tokens per step: at {' '.join(setting_args(s))} ({tokens} tokens) every stall would "
                     f"add under {STALL_SHARE:.0%} of the step, {s.plan.estimate.step_s:.2f} s per step "
                     f"({tokens / s.plan.estimate.step_s:,.0f} tokens/s against {now / plan.estimate.step_s:,.0f} now)")
    elif plan.fits and plan.estimate.bottleneck not in ("gpu", "compute"):
        lines.append(f"  more tokens per step: no grad_accum up to {MORE_TOKENS} times this one that fits brings "
                     f"every stall under {STALL_SHARE:.0%} of the step")
    lines += [f"  does NOT fit: {problem}" for problem in plan.problems]
    if not plan.fits and cfg is not None:
        head, *suggestions = _advice_lines(plan, cfg)
        lines += ["  " + head, *suggestions]
    return lines


def describe(plan: Plan, machine: Machine | None = None, cfg: TrainConfig | None = None) -> str:
    """The plan as a user reads it: residency, each tier's contents, the prediction and what binds it, with
    `machine` what a checkpoint costs, with `cfg` where the disk tier's folder is; where it does not fit, the
    settings near it that do, and where it fits but the GPU does not bind it, the grad_accum at which it would."""
    return "\n".join([*residency_lines(plan.placement), *attention_lines(plan), *tier_lines(plan),
                      *prediction_lines(plan), *disk_lines(plan, machine, cfg), *advice_lines(plan, cfg)])


def attention_lines(plan: Plan) -> list[str]:
    """The attention backend of each run of blocks the plan gave one (the field `--json` lists per block)."""
    if not plan.attention:
        return []
    runs, start = [], 0
    for i in range(1, len(plan.attention) + 1):
        if i == len(plan.attention) or plan.attention[i] != plan.attention[start]:
            runs.append(f"{plan.attention[start]} for block{'s' if i - start > 1 else ''} "
                        + (f"{start}..{i - 1}" if i - start > 1 else f"{start}"))
            start = i
    return ["attention: " + ", ".join(runs) if len(runs) <= 4 else
            "attention: " + ", ".join(f"{name} for {plan.attention.count(name)} blocks"
                                      for name in dict.fromkeys(plan.attention))]
