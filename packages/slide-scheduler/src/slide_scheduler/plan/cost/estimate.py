"""A step's estimate from its work: each phase lasts as long as its slowest lane. Of its length, the compute is
the compute lane's; what the phase lasts beyond it is set by that slowest lane or, where the compute is slowest
because it waited, by what it waited for: the loads (PCIe, or the GPUs' link) or the host updates the forward's
loads wait for. Where the loads' lane is the slowest, the time it idles for those updates counts too."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..placement import Placement
from .adamw import host_backlog
from .rates import Rates
from .transfers import copy_lanes
from .window import PassTimes
from .work import PhaseWork, Work

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


def compute_lane(p: Placement) -> str:
    """The name of the lane that computes: `gpu`, or `compute` where the device is the host."""
    return "compute" if p.device_is_host else "gpu"


def phase_lanes(w: PhaseWork, length: float, r: Rates) -> dict[str, float]:
    """Each lane's busy seconds in a pass that the window's overlap makes `length` long (the GPU's: its compute
    and its waits)."""
    return {"gpu": length, **copy_lanes(w, r), "host_memory": w.host_bytes / r.memory, "host_adamw": w.adamw,
            "disk": w.disk}


def loads_lane(lanes: dict[str, float]) -> str:
    """The lane the blocks' loads cross last: the GPUs' link where it is busier than PCIe."""
    return "gpu_link" if lanes["gpu_link"] > lanes["pcie_h2d"] else "pcie_h2d"


def phase_length(lanes: dict[str, float], times: PassTimes) -> float:
    """A pass lasts as long as its slowest lane; the loads' lane also idles while loads wait for their blocks'
    host updates."""
    return max(max(lanes.values()), lanes[loads_lane(lanes)] + times.copies_idle)


def phase_setters(lanes: dict[str, float], w: PhaseWork, times: PassTimes) -> dict[str, float]:
    """The compute's time, and what the slowest lane adds beyond it or, where that is the compute because it
    waited, what it waited for; where the loads' lane is slowest counting its idle time, that idle time is the
    host updates'."""
    top = max(lanes, key=lanes.get)  # (the GPU first among equals)
    loads = loads_lane(lanes)
    if lanes[loads] + times.copies_idle > lanes[top]:
        beyond = lanes[loads] + times.copies_idle - w.gpu
        waited = min(times.copies_idle, beyond)
        return {"gpu": w.gpu, loads: beyond - waited, "host_adamw": waited}
    if top == "gpu":
        return {"gpu": w.gpu, loads: times.waits["loads"], "host_adamw": times.waits["updates"]}
    return {"gpu": w.gpu, top: lanes[top] - w.gpu}


def estimate_of(p: Placement, r: Rates, work: Work, passes: dict[str, PassTimes], tail: float,
                exposed: float) -> Estimate:
    """The estimate of a step whose `work` the forward and backward `passes` carry out, then the `tail`, then the
    `exposed` host updates (those the next forward's start waits for)."""
    phases, setters, by_phase = {}, {}, {}
    busy = dict.fromkeys(LANES, 0.0)
    for name, w in (("forward", work.forward), ("backward", work.backward)):
        times = passes[name]
        by_phase[name] = lanes = phase_lanes(w, times.length, r)
        phases[name], setters[name] = phase_length(lanes, times), phase_setters(lanes, w, times)
        for lane, seconds in lanes.items():
            busy[lane] += seconds
    phases["tail"], setters["tail"] = tail, {"gpu": tail}
    phases["exposed_updates"], setters["exposed_updates"] = exposed, {"host_adamw": exposed}
    if work.anywhere.adamw:
        phases["host_backlog"], lane = host_backlog(work, phases["forward"] + tail, r)
        setters["host_backlog"] = {lane: phases["host_backlog"]}
        busy["host_adamw"] += work.anywhere.adamw
        busy["host_memory"] += work.anywhere.host_bytes / r.memory
    busy["gpu"] = work.forward.gpu + work.backward.gpu + tail  # its compute alone (its waits are other lanes' time)
    return named(p, phases, busy, by_phase, setters)


def named(p: Placement, phases: dict[str, float], busy: dict[str, float], by_phase: dict[str, dict[str, float]],
          setters: dict[str, dict[str, float]]) -> Estimate:
    """The estimate with the lanes this run has, the compute's by its name, and the bottleneck: the lane that
    lengthens the step most beyond the compute's work, where that is more than the model's own uncertainty."""
    critical = dict.fromkeys(LANES, 0.0)
    for part in setters.values():
        for lane, seconds in part.items():
            critical[lane] += seconds
    step = sum(phases.values())
    worst = max((lane for lane in LANES if lane != "gpu"), key=critical.get)
    bottleneck = worst if critical[worst] > BOUND_SHARE * step else "gpu"
    # A CPU run's device is the host: its lane is the host's compute, and nothing crosses PCIe or a GPU link
    pcie = not p.device_is_host
    kept = [lane for lane in LANES if (pcie or not lane.startswith("pcie")) and (lane != "gpu_link" or p.ranks > 1)]

    def of(lanes: dict[str, float]) -> dict[str, float]:
        return {compute_lane(p) if k == "gpu" else k: lanes.get(k, 0.0) for k in kept}

    return Estimate(step_s=step, bottleneck=compute_lane(p) if bottleneck == "gpu" else bottleneck,
                    lanes=of(busy), phases=phases, phase_lanes={k: of(v) for k, v in by_phase.items()},
                    setters={k: {lane: s for lane, s in of(v).items() if s > 0} for k, v in setters.items()},
                    critical=of(critical))
