"""The plan's attention backend per block: the fastest of the block's candidates by the machine file's rates (its
own rate for heads over 128 wide, else the plain causal one), the first where they tie; the cost model prices each
block's attention at the rate of the backend chosen for it, and the plan lists the choice."""

from __future__ import annotations

import dataclasses

import pytest

from slide_scheduler import Budgets, Machine, RunFacts, Shapes, StepShape, place
from slide_scheduler.plan.attention import chosen, rate_of
from slide_scheduler.plan.cost import compute
from slide_scheduler.plan.cost.rates import rates_of
from slide_scheduler.plan.machine import Gpu, Host, Pcie, causal_attention_flops

GPU = Gpu(memory_gib=80, bf16_tflops=800, attention_tflops=500, sdpa_tflops=340, fa4_tflops=370, flex_tflops=96)
SEQ, HEADS, HEAD_DIM = 4096, 16, 256


def shapes(candidates, head_dim=HEAD_DIM) -> Shapes:
    blocks = len(candidates)
    return Shapes((10_000_000,) + (20_000_000,) * blocks, hidden=HEADS * head_dim, intermediate=8192,
                  vocab=32000, attention_width=HEADS * head_dim, head_dim=head_dim,
                  attention_backends=tuple(candidates))


def test_each_block_takes_its_fastest_candidate_and_ties_keep_the_front_ends_order():
    assert chosen(shapes([("fa4", "flex"), ("flex",), ("sdpa", "fa4", "flex")]), GPU) == ("fa4", "flex", "fa4")
    # heads of 128: every backend at the plain causal rate, so the first candidate
    assert chosen(shapes([("sdpa", "fa4", "flex"), ("fa4", "flex")], head_dim=128), GPU) == ("sdpa", "fa4")
    # a backend not measured stands at the plain rate, which may beat a measured slower one
    unmeasured = dataclasses.replace(GPU, fa4_tflops=0.0)
    assert rate_of(unmeasured, "fa4", 256) == 500 and chosen(shapes([("flex", "fa4")]), unmeasured) == ("fa4",)
    assert chosen(shapes([]), GPU) == ()


def test_each_blocks_attention_is_priced_at_its_backends_rate():
    """A block's attention seconds: causal_attention_flops' forward count over the chosen backend's rate."""
    s = shapes([("fa4", "flex"), ("flex",)])
    machine = Machine(gpu=GPU, host=Host(memory_gib=256, cores=16, memory_gbps=100, adamw_gparams=3),
                      pcie=Pcie(50, 50, 90))
    run = RunFacts(device="cuda")
    plan = place(s, StepShape(SEQ, 2, SEQ), run, Budgets(), machine)
    assert plan.attention == ("fa4", "flex") and plan.to_dict()["attention"] == ["fa4", "flex"]
    r = rates_of(plan.placement, machine)
    forward = causal_attention_flops(SEQ, HEADS, HEAD_DIM, batch=2, backward=False)
    for unit, tflops in ((1, 370), (2, 96)):
        assert compute.attention_s(plan.placement, r, unit) == pytest.approx(forward / (tflops * 1e12), rel=1e-3)
    # without candidates (a front end that names none) attention runs at the plain causal rate
    bare = place(dataclasses.replace(s, attention_backends=()), StepShape(SEQ, 2, SEQ), run, Budgets(), machine)
    assert bare.attention == () and compute.attention_s(bare.placement, rates_of(bare.placement, machine), 2) == \
        pytest.approx(forward / 500e12, rel=1e-3)
