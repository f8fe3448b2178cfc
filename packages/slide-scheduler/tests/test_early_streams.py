"""Streamed blocks updated early: without clipping, a streamed block's device update runs in the backward once its
gradient is home, its copies queued on the copies to the device behind the loads already staged, and its next
load takes the new master. Priced by hand at the window's level and in bytes, and chosen by the planner where the
backward's copies have room."""

from __future__ import annotations

import dataclasses

import pytest
from test_host_lane import MACHINE

from slide_scheduler import HOST, RunFacts, arrange
from slide_scheduler.plan.cost.rates import rates_of
from slide_scheduler.plan.cost.transfers import block_copies
from slide_scheduler.plan.cost.window import slide
from slide_scheduler.plan.placement import Shapes, StepShape

BLOCK = 100_000_000


def test_an_early_update_queues_behind_the_load_staged_after_its_block():
    """Four blocks, loads of 1 s, compute of 2 s, two slots: the third load is staged after the first block's
    backward, then the first block's update, which starts once that block's compute is done and its gradient home
    (3 s + 0.25 s), then the fourth load. A 2 s update ends at 6 s (the third load ended at 4 s), before the fourth
    load needs the link (its slot frees at 5 s, the compute reaches it at 7 s): hidden. A 3.5 s one ends at 7.5 s,
    and the fourth block's compute waits 1.5 s for its load. An update after the last load ends the pass only when
    it is done."""
    loads, compute, ready, resident = [1.0] * 4, [2.0] * 4, [0.0] * 4, [False] * 4
    assert slide(loads, compute, ready, 2, resident).length == 9.0
    hidden = slide(loads, compute, ready, 2, resident, after=[2.0, 0.0, 0.0, 0.0], lag=[0.25, 0.0, 0.0, 0.0])
    assert hidden.length == 9.0 and hidden.waits["loads"] == 1.0  # (the first load only)
    late = slide(loads, compute, ready, 2, resident, after=[3.5, 0.0, 0.0, 0.0], lag=[0.25, 0.0, 0.0, 0.0])
    assert late.length == pytest.approx(10.5) and late.waits["loads"] == pytest.approx(1.0 + 1.5)
    last = slide(loads, compute, ready, 2, resident, after=[0.0, 0.0, 0.0, 1.0], lag=[0.0] * 4)
    assert last.length == 10.0 and last.ends[-1] == 9.0


def two_streamed(early: float, held: int = 0):
    shapes = Shapes((1_000,) + (BLOCK,) * 2, hidden=1_000)
    step = StepShape(tokens_per_micro=50_000, micro_batches=1, seq_len=50_000)
    return arrange(shapes, step, RunFacts(clip=None, activations=HOST), resident=[0], window=2, share=1.0,
                   held=held, early_streams=early)


@pytest.mark.parametrize("held", [0, 2])
def test_an_early_update_moves_its_bytes_into_the_backward_and_its_load_takes_the_master(held):
    """At its next load a streamed update brings master, m, v (12 bytes a parameter) and a host gradient (2) in
    and takes 12 back; early, those cross in the backward, and the forward's load takes the fp32 master (4)."""
    at_load, early = two_streamed(0.0, held), two_streamed(1.0, held)
    assert at_load.early == set() and early.early == {1, 2}
    grad = 0 if held else 2
    r = rates_of(early, MACHINE)
    before, after = block_copies(at_load, r, True).work, block_copies(early, r, True).work
    assert before.forward.h2d == 2 * BLOCK * (12 + grad) and before.forward.d2h == 2 * BLOCK * 12
    assert after.forward.h2d == 2 * BLOCK * 4 and after.forward.d2h == 0
    assert after.backward.h2d - before.backward.h2d == 2 * BLOCK * (12 + grad)
    assert after.backward.d2h - before.backward.d2h == 2 * BLOCK * 12


def test_a_clipped_run_updates_no_stream_early():
    clipped = dataclasses.replace(two_streamed(0.0).run, clip=1.0)
    p = arrange(two_streamed(0.0).shapes, two_streamed(0.0).step, clipped, resident=[0], window=2, share=1.0,
                early_streams=1.0)
    assert p.early == set()
    with pytest.raises(ValueError, match="early"):
        dataclasses.replace(p, units=tuple(dataclasses.replace(u, early=u.update == "stream") for u in p.units))
