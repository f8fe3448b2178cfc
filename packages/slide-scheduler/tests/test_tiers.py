"""A tier of another name, added by a test alone: a second pool of host memory with a budget of its own. Moments
placed there train bit for bit as in host memory, and the placement counts and budgets them by the tier's name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine import DEPTH, Model, ToyStack, batches
from test_placement import STEP, facts_for, measure, toy_shapes

from slide_memory import AdamWConfig
from slide_scheduler import (
    HOST,
    Budgets,
    EngineConfig,
    Plan,
    SlidingEngine,
    arrange,
    budget_problems,
    price,
    register_tier,
)
from slide_scheduler.plan import placement as placement_module
from slide_scheduler.plan.machine import Machine

SECOND = "host2"


@pytest.fixture
def second_tier():
    register_tier(SECOND, "memory")
    yield SECOND
    del placement_module.TIER_KINDS[SECOND]


def placement_with(stack, blocks: set[int]):
    base = arrange(toy_shapes(stack), STEP, facts_for("cpu", 0.05), speculate=2)
    units = tuple(dataclasses.replace(u, moments=SECOND) if i - 1 in blocks else u for i, u in enumerate(base.units))
    return dataclasses.replace(base, units=units)


def run(placement) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    engine = SlidingEngine(ToyStack(Model(tied=True)), placement,
                           EngineConfig(optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1)))
    losses = [engine.step(step, lr=1e-2, normalizer=20).loss for step in batches(seed=3, steps=3, micro=3)]
    masters = engine.named_masters()
    engine.close()
    return losses, masters


def test_moments_in_a_second_memory_tier_train_bit_for_bit_and_count_there(second_tier):
    torch.manual_seed(0)
    model = Model(tied=True)
    stack = ToyStack(model)
    moved = {1, 2}
    placement = placement_with(stack, moved)
    assert {u for u, unit in enumerate(placement.units) if unit.moments == SECOND} == {b + 1 for b in moved}
    numel = placement.shapes.unit_numels
    assert placement.tiers()[SECOND] == {"moments": 2 * 4 * sum(numel[b + 1] for b in moved)}
    home = placement_with(stack, set())
    assert placement.bytes(HOST) + placement.bytes(SECOND) == home.bytes(HOST)
    losses, masters = run(placement)
    ref_losses, ref = run(home)
    assert losses == ref_losses
    assert all(masters[u][n].equal(t) for u, params in ref.items() for n, t in params.items())
    engine = SlidingEngine(stack, placement, EngineConfig(optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1)))
    try:
        held = measure(engine, stack)
    finally:
        engine.close()
    assert held[HOST] == placement.bytes(HOST, transient=False) + placement.bytes(SECOND)


def test_a_second_tier_has_a_budget_of_its_own(second_tier):
    stack = ToyStack(Model(tied=True))
    placement = placement_with(stack, set(range(DEPTH)))
    machine = Machine()
    need = placement.bytes(SECOND)
    for budget, fits in ((need, True), (need - 1, False)):
        plan = Plan(placement, price(placement, machine), price(placement, machine),
                    Budgets(others=((SECOND, budget),)))
        problems = budget_problems(plan)
        assert (problems == []) == fits
        if not fits:
            assert problems[0].startswith(f"{SECOND}: needs ~")
