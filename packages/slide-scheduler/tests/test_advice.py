"""What the cost model says binds a step, and what the planner advises: settings near a run that does not fit
that do, and the step at which the GPU would bind one that fits."""

from __future__ import annotations

import dataclasses

import pytest
from test_placement import LLAMA_3B, with_rates

from slide_scheduler import (
    Budgets,
    Disk,
    Gpu,
    Host,
    Machine,
    Overrides,
    Pcie,
    RunFacts,
    StepShape,
    arrange,
    compute_bound_step,
    disk_traffic,
    place,
    price,
    suggest,
)
from slide_scheduler.plan.cost import ADAMW_BESIDE_COPIES, BOUND_SHARE

GIB = 2**30
PC = Machine(gpu=Gpu(memory_gib=24, bf16_tflops=165), host=Host(memory_gib=64, cores=16, memory_gbps=80,
                                                                 adamw_gparams=1.5),
             pcie=Pcie(h2d_gbps=25, d2h_gbps=25, duplex_gbps=45), disk=Disk(free_gib=1000, read_gbps=7.0,
                                                                           write_gbps=6.0))


def budgets(machine: Machine, cuda: bool = True) -> Budgets:
    return Budgets(gpu=0.92 * machine.gpu.memory_gib * GIB if cuda else None,
                   host=0.95 * machine.host.memory_gib * GIB, disk=machine.disk.free_gib * GIB)


STEP = StepShape(8192, 4, 4096)
CASES = {  # a placement and a machine each, binding different lanes
    "clipped": (dict(run=RunFacts(clip=1.0)), PC),
    "unclipped, states on disk": (dict(run=RunFacts(clip=None), nvme_fraction=0.5), PC),
    "streamed updates": (dict(run=RunFacts(clip=1.0), share=0.5), PC),
    "slow PCIe": (dict(run=RunFacts(clip=None)), with_rates(PC, pcie={"h2d_gbps": 3, "d2h_gbps": 3,
                                                                       "duplex_gbps": 5})),
    "weak host, clipped": (dict(run=RunFacts(clip=1.0)), with_rates(PC, host={"adamw_gparams": 0.3})),
    "activations on disk, slow drive": (dict(run=RunFacts(clip=1.0, activations="disk"), nvme_fraction=0.25),
                                        with_rates(PC, disk={"read_gbps": 1.0, "write_gbps": 0.8})),
    "two ranks": (dict(run=RunFacts(clip=1.0, ranks=2)), PC),
    "cpu": (dict(run=RunFacts(clip=1.0, device="cpu", compute_bytes=4)), PC),
}


@pytest.mark.parametrize("case", CASES)
def test_a_step_is_its_phases_each_as_long_as_its_slowest_lane_and_the_bottleneck_adds_the_most(case):
    """Recomputed from the estimate's own parts: each phase of the forward and the backward lasts as long as its
    slowest lane; the lanes that set a phase add up to it (the device's compute, then what another lane adds
    beyond it); the phases add up to the step, and so do the lanes' shares of it. The bottleneck is the lane that
    adds the most, unless it adds under 5% of the step; the compute's share is its busy time."""
    kwargs, machine = CASES[case]
    p = arrange(LLAMA_3B, STEP, **kwargs)
    e = price(p, machine)
    compute = "compute" if p.device_is_host else "gpu"
    assert e.step_s == pytest.approx(sum(e.phases.values()))
    assert sum(e.critical.values()) == pytest.approx(e.step_s)
    for phase in ("forward", "backward"):
        assert e.phases[phase] == pytest.approx(max(e.phase_lanes[phase].values()))
    for phase, parts in e.setters.items():
        assert sum(parts.values()) == pytest.approx(e.phases[phase], abs=1e-9)
        assert set(parts) <= set(e.lanes) and all(s > 0 for s in parts.values())
    assert e.critical[compute] == pytest.approx(e.lanes[compute])
    others = {lane: s for lane, s in e.critical.items() if lane != compute}
    worst = max(others, key=others.get)
    assert e.bottleneck == (worst if others[worst] > BOUND_SHARE * e.step_s else compute)
    for lane, added in others.items():  # what a lane adds to the step is time it is busy
        assert added <= e.lanes[lane] + 1e-9, lane


def test_a_cpu_run_has_a_compute_lane_and_no_gpu_or_pcie_lanes():
    e = price(arrange(LLAMA_3B, STEP, RunFacts(clip=1.0, device="cpu", compute_bytes=4)), PC)
    for lanes in (e.lanes, e.critical, *e.phase_lanes.values(), *e.setters.values()):
        assert "gpu" not in lanes and not any(lane.startswith("pcie") for lane in lanes)
    assert "compute" in e.lanes and e.bottleneck == "compute"


def test_the_gpu_waiting_for_loads_is_pcie_and_waiting_for_clipped_updates_is_the_host_optimizer():
    """A forward whose loads wait for each block's clipped host update: with a weak host optimizer the GPU's
    waits are host_adamw's, which binds the step; with slow PCIe and a fast optimizer they are PCIe's (but for the
    first block's update, which the first load waits for with the copies idle: a few milliseconds)."""
    p = arrange(LLAMA_3B, STEP, RunFacts(clip=1.0))
    weak = price(p, with_rates(PC, host={"adamw_gparams": 0.3}))
    assert weak.bottleneck == "host_adamw" and weak.setters["forward"].get("host_adamw", 0) > 0.5 * weak.step_s
    slow = price(p, with_rates(PC, host={"adamw_gparams": 50.0},
                               pcie={"h2d_gbps": 2, "d2h_gbps": 2, "duplex_gbps": 4}))
    first_update = LLAMA_3B.unit_numels[1] / (50e9 * ADAMW_BESIDE_COPIES)
    assert slow.bottleneck == "pcie_h2d"
    assert slow.setters["forward"].get("host_adamw") == pytest.approx(first_update, rel=1e-6)


@pytest.mark.parametrize("activations", ["host", "disk"])
@pytest.mark.parametrize("loads", [False, True])
def test_disk_traffic_is_what_the_disk_lane_prices(activations, loads):
    """The bytes the tier moves per step, at the drive's rates, are the disk lane's busy time."""
    p = arrange(LLAMA_3B, STEP, RunFacts(clip=1.0, activations=activations), nvme_fraction=0.25, disk_loads=loads)
    slow = with_rates(PC, disk={"read_gbps": 2.0, "write_gbps": 1.5})
    read, written = disk_traffic(p)
    numel = sum(LLAMA_3B.unit_numels[u] for u in p.on_disk)
    boundaries = 28 * STEP.micro_batches * STEP.tokens_per_micro * LLAMA_3B.hidden * 2 if activations == "disk" else 0
    assert written == 12 * numel + boundaries  # fp32 master, m and v written back once; the activations once
    # read once, and the master for each load (the last block's backward finds it still in its slot)
    loaded = sum((1 if u == LLAMA_3B.num_blocks else 2) * 4 * LLAMA_3B.unit_numels[u] for u in p.on_disk)
    assert read == written + (loaded if loads else 0)
    assert price(p, slow).lanes["disk"] == pytest.approx(read / 2e9 + written / 1.5e9)


def applied(changes: dict, step: StepShape, run: RunFacts, o: Overrides):
    """A suggestion's changes, applied here field by field as a user's config would (not by the planner)."""
    seq = step.seq_len or step.tokens_per_micro
    rows = step.tokens_per_micro // seq
    for name, value in changes.items():
        if name in ("nvme_fraction", "speculate", "window"):
            o = dataclasses.replace(o, **{name: value})
        elif name in ("activations", "state_bytes", "clip"):
            run = dataclasses.replace(run, **{name: value})
        elif name == "rows":
            step = dataclasses.replace(step, tokens_per_micro=value * seq)
        elif name == "seq_len":
            step = dataclasses.replace(step, tokens_per_micro=rows * value, seq_len=value)
        else:
            raise AssertionError(f"unexpected change {name}")
    return step, run, o


def test_every_suggestion_fits_the_same_training_first_and_none_changes_more_than_it_needs():
    """A 3B run on a 32 GiB host with nothing on disk does not fit. Each suggestion, applied independently, fits
    at the step time it was offered with; those that keep the training come first, the least share on disk
    among them; a change to the training comes with a placement change only where it does not fit alone."""
    small = with_rates(PC, host={"memory_gib": 32})
    run, o = RunFacts(clip=1.0), Overrides(nvme_fraction=0.0)
    b = budgets(small)
    assert not place(LLAMA_3B, STEP, run, b, small, o).fits
    found = suggest(LLAMA_3B, STEP, run, b, small, o)
    kinds = [s.keeps_training for s in found]
    assert kinds == sorted(kinds, reverse=True) and True in kinds and False in kinds
    assert "nvme_fraction" in found[0].changes and found[0].plan.placement.on_disk
    assert {"state_bytes", "clip"} <= {name for s in found for name in s.changes}
    for s in found:
        step, r, over = applied(s.changes, STEP, run, o)
        plan = place(LLAMA_3B, step, r, b, small, over)
        assert plan.fits and plan.estimate.step_s == pytest.approx(s.plan.estimate.step_s), s.changes
        training = {k: v for k, v in s.changes.items() if k in ("state_bytes", "clip", "rows", "seq_len")}
        if training and training != s.changes:  # (the training change alone did not fit)
            alone_step, alone_run, alone_o = applied(training, STEP, run, o)
            assert not place(LLAMA_3B, alone_step, alone_run, b, small, alone_o).fits


def test_with_data_parallel_ranks_no_suggestion_puts_anything_on_disk():
    small = with_rates(PC, host={"memory_gib": 48})
    run = RunFacts(clip=1.0, ranks=2)
    b = Budgets(gpu=0.92 * 24 * GIB, host=0.95 * 48 * GIB / 2, disk=1000 * GIB)
    assert not place(LLAMA_3B, STEP, run, b, small).fits
    found = suggest(LLAMA_3B, STEP, run, b, small)
    assert found and all(s.plan.fits and not s.plan.placement.bytes("disk") for s in found)
    assert not any("nvme_fraction" in s.changes or s.changes.get("activations") == "disk" for s in found)


def test_the_step_at_which_the_gpu_binds_is_the_fewest_micro_batches_that_do():
    """A run on slow PCIe, bound by another lane than the GPU: at the micro-batches offered the GPU binds, at one
    fewer it does not."""
    slow = with_rates(PC, pcie={"h2d_gbps": 8, "d2h_gbps": 8, "duplex_gbps": 14})
    run, b, step = RunFacts(clip=None), budgets(slow), StepShape(4096, 2, 4096)
    assert place(LLAMA_3B, step, run, b, slow).estimate.bottleneck != "gpu"
    found = compute_bound_step(LLAMA_3B, step, run, b, slow)
    micro = found.changes["micro_batches"]
    assert micro > 2 and found.plan.fits and found.plan.estimate.bottleneck == "gpu"
    assert place(LLAMA_3B, dataclasses.replace(step, micro_batches=micro), run, b, slow).estimate.bottleneck == "gpu"
    assert place(LLAMA_3B, dataclasses.replace(step, micro_batches=micro - 1), run, b,
                 slow).estimate.bottleneck != "gpu"
    assert compute_bound_step(LLAMA_3B, step, run, b, slow, most=1) is None  # (not looked for past the run's own)
