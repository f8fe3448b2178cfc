"""The cost model's host optimizer lane, on placements small enough to price by hand: one queue, the updates that
wait for the step's end worked through in the next forward's order, and each load of that forward waiting for
its block's update on whichever lane sets the pass's length."""

from __future__ import annotations

import pytest

from slide_scheduler import HOST, RunFacts, arrange
from slide_scheduler.plan.cost import ADAMW_BESIDE_COPIES, price
from slide_scheduler.plan.machine import Machine
from slide_scheduler.plan.placement import Shapes, StepShape

BLOCK = 100_000_000  # parameters per block: a load of its fp32 master moves 0.4 GB
TOKENS, HIDDEN = 50_000, 1_000  # one block's boundary activations: 0.1 GB
# 1 GB/s over PCIe, whichever way and both at once; compute and host memory too fast to matter
MACHINE = Machine.from_dict({"gpu": {"memory_gib": 80.0, "bf16_tflops": 1e6},
                             "host": {"memory_gib": 512.0, "cores": 16, "memory_gbps": 1e4, "adamw_gparams": 1.0},
                             "pcie": {"h2d_gbps": 1.0, "d2h_gbps": 1.0, "duplex_gbps": 1.0}})
UPDATE_S = BLOCK / (1e9 * ADAMW_BESIDE_COPIES)  # one block's host AdamW beside the copies


def two_blocks(defer: bool | int, window: int = 2):
    shapes = Shapes((1_000,) + (BLOCK,) * 2, hidden=HIDDEN)
    step = StepShape(tokens_per_micro=TOKENS, micro_batches=1, seq_len=TOKENS)
    # the edges on the device; both blocks slide, their updates on the host, whole
    return arrange(shapes, step, RunFacts(clip=None, activations=HOST), resident=[0], window=window, defer=defer,
                   split=False)


def test_the_first_forward_load_waits_for_its_deferred_update_on_the_copies_lane():
    """Both updates wait for the step's end and run in the forward's order: block 0's is done UPDATE_S after the
    backward, block 1's 2 UPDATE_S. The forward's copies (two 0.4 GB masters in, two 0.1 GB boundaries out: 1.0 s
    at 1 GB/s both ways together) are its longest lane, and they idle until block 0's update is done; block 1's
    is done before block 0's load is, so nothing else waits."""
    p = two_blocks(defer=True)
    assert p.deferred == {1, 2}
    estimate = price(p, MACHINE)
    assert estimate.phases["forward"] == pytest.approx(1.0 + UPDATE_S, rel=1e-6)
    assert estimate.setters["forward"]["host_adamw"] == pytest.approx(UPDATE_S, rel=1e-6)
    assert estimate.phases["exposed_updates"] == 0.0


def test_updates_during_the_backward_are_done_before_the_next_forward_needs_them():
    """The backward's copies take 1.0 s (block 0's master and two boundaries in, two 0.2 GB gradients out, at 1
    GB/s together; block 1, the forward's last, runs again from the slot it ran in) and each update (UPDATE_S)
    is done before the next forward's load of its block: that forward waits for nothing. Block 0's deferred alone,
    it waits UPDATE_S for it."""
    eager = price(two_blocks(defer=False), MACHINE)
    assert eager.phases["backward"] == pytest.approx(1.0, rel=1e-6)
    assert eager.phases["forward"] == pytest.approx(1.0, rel=1e-6)
    assert "host_adamw" not in eager.setters["forward"]
    mixed = two_blocks(defer=1)
    assert mixed.deferred == {1}
    assert price(mixed, MACHINE).phases["forward"] == pytest.approx(1.0 + UPDATE_S, rel=1e-6)
