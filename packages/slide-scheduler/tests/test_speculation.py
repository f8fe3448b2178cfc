"""Speculative updates: a clipped step's host updates also run during backward as if clipping will not act,
writing only new parameters; when it does not act the next loads take them and the updates proper run later.
Whatever the clipping does, the result is bit for bit the engine's without speculation."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
from test_engine import DEPTH, Model, ToyStack, batches, make_engine

from slide_memory import AdamWConfig
from slide_scheduler import HOST, RunFacts, UnitPlacement, arrange, shapes_of
from slide_scheduler.plan import placement as placement_module

STEPS = 5


def run(clip, speculate: bool, pipeline: bool = True, slow: str | None = None, **choices):
    """Losses, speculation outcomes and final masters of STEPS steps on the toy stack."""
    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", max_grad_norm=clip, pipeline=pipeline,
                         optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1), speculate=speculate, **choices)
    if slow:
        getattr(engine, slow).delay = 0.003
    losses, outcomes = [], []
    for step in batches(seed=4, steps=STEPS, micro=3):
        n = sum(int((b["targets"] != -100).sum()) for b in step)
        stats = engine.step(step, lr=1e-2, normalizer=n)
        losses.append(stats.loss)
        outcomes.append((stats.speculation, stats.grad_norm))
    masters = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}
    states = [{k: v.clone() for k, v in engine.optimizer_state(u).items()} for u in range(len(engine.units))]
    engine.close()
    return losses, outcomes, masters, states


def same(a, b) -> bool:
    (la, _, ma, sa), (lb, _, mb, sb) = a, b
    return la == lb and all(ma[u][n].equal(t) for u, p in mb.items() for n, t in p.items()) and all(
        x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x) for x, y in zip(sa, sb))


def mixed_clip() -> float:
    """A limit some of the run's steps' norms exceed and others do not."""
    norms = []
    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", max_grad_norm=None,
                         optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1))
    for step in batches(seed=4, steps=STEPS, micro=3):
        n = sum(int((b["targets"] != -100).sum()) for b in step)
        norms.append(engine.step(step, lr=1e-2, normalizer=n).grad_norm)
    engine.close()
    return sorted(norms)[len(norms) // 2]


@pytest.mark.parametrize("slow", [None, "h2d", "land", "d2h", "updater"])
@pytest.mark.parametrize("clips", ["always", "never", "mixed"])
def test_speculation_gives_the_result_without_it_bit_for_bit(clips, slow):
    clip = {"always": 0.05, "never": 1e6, "mixed": mixed_clip()}[clips]
    reference = run(clip, speculate=False)
    synchronous = run(clip, speculate=True, pipeline=False)
    speculated = run(clip, speculate=True, slow=slow)
    assert same(speculated, reference) and same(synchronous, reference)
    assert [o for o, _ in speculated[1]] == expected_outcomes(clip, reference)
    assert set(expected_outcomes(clip, reference)) == {"always": {"discarded", "off"}, "never": {"held"},
                                                        "mixed": {"held", "discarded", "off"}}[clips]
    assert synchronous[1] == speculated[1] and {o for o, _ in reference[1]} == {"off"}


def expected_outcomes(clip: float, reference, pause: bool = True) -> list[str]:
    """What each step of a speculating run says, from the norms of the run without speculation: a step whose
    clipping acts discards, the step after it does not speculate (where the placement pauses), the others hold."""
    acted = [clip / (norm + 1e-6) < 1.0 for _, norm in reference[1]]
    return ["off" if pause and t and acted[t - 1] else "discarded" if a else "held" for t, a in enumerate(acted)]


@pytest.mark.parametrize("slow", [None, "updater", "d2h"])
@pytest.mark.parametrize("clips", ["never", "mixed"])
def test_the_first_blocks_speculating_give_the_result_without_it_bit_for_bit(clips, slow):
    """Clipped, only the first blocks speculate (their updates run during the backward where clipping does not
    act), the others' wait for the norm: the weights without speculation, and those of every block speculating."""
    clip = {"never": 1e6, "mixed": mixed_clip()}[clips]
    reference = run(clip, speculate=False)
    first = run(clip, speculate=2, slow=slow)
    every = run(clip, speculate=True, slow=slow)
    assert same(first, reference) and same(every, reference)
    assert [o for o, _ in first[1]] == expected_outcomes(clip, reference)


@pytest.mark.parametrize("clips", ["always", "mixed"])
def test_speculating_right_after_a_clipped_step_gives_the_result_without_it_bit_for_bit(clips):
    """Without the pause (`speculation_pause` off) every step speculates, also after one whose clipping acted:
    consecutive discarded speculations, and the weights without speculation."""
    clip = {"always": 0.05, "mixed": mixed_clip()}[clips]
    reference = run(clip, speculate=False)
    eager = run(clip, speculate=True, slow="updater", speculation_pause=False)
    assert same(eager, reference)
    outcomes = [o for o, _ in eager[1]]
    assert outcomes == expected_outcomes(clip, reference, pause=False) and "off" not in outcomes
    assert outcomes != expected_outcomes(clip, reference)  # (a step the pause would have sat out speculated)


@pytest.mark.parametrize("choices", [{"resident": 2}, {"device_update_share": 0.5, "held_grads": 1},
                                     {"window": 3}, {"window": 1}])
@pytest.mark.parametrize("slow", [None, "updater", "d2h"])
def test_speculating_blocks_beside_resident_and_device_updated_ones(choices, slow):
    clip = mixed_clip()
    speculated = run(clip, True, slow=slow, **choices)
    reference = run(clip, False, **choices)
    assert same(speculated, reference) and [o for o, _ in speculated[1]] == expected_outcomes(clip, reference)
    assert "held" in expected_outcomes(clip, reference)


def slow_after_writing(monkeypatch):
    """A speculative pass that lingers after writing its parameters, before it says it is done."""
    from slide_memory import HostAdamW

    step_unit = HostAdamW.step_unit

    def lingering(self, *args, **kwargs):
        step_unit(self, *args, **kwargs)
        if kwargs.get("part") == "speculate":
            time.sleep(0.02)

    monkeypatch.setattr(HostAdamW, "step_unit", lingering)


@pytest.mark.parametrize("resident", [0, 1])
def test_a_non_finite_step_between_speculating_ones_changes_nothing(monkeypatch, resident):
    """A non-finite norm queues no update behind the step's speculation: the next step's gradient must still wait
    for it to finish reading its buffer, and its late finish must not pass for the next speculation's."""
    slow_after_writing(monkeypatch)

    def steps(speculate):
        torch.manual_seed(0)
        engine = make_engine(ToyStack(Model(tied=True)), device="cpu", max_grad_norm=1e6, resident=resident,
                             optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1), speculate=speculate)
        losses, outcomes = [], []
        for k, step in enumerate(batches(seed=4, steps=4, micro=3)):
            n = sum(int((b["targets"] != -100).sum()) for b in step)
            stats = engine.step(step, lr=1e-2, normalizer=0.0 if k == 1 else n)  # step 1: an infinite loss
            losses.append(stats.loss)
            outcomes.append(stats.speculation)
        masters = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}
        engine.close()
        return losses, outcomes, masters

    (losses, outcomes, masters), (ref_losses, _, ref) = steps(True), steps(False)
    # (after the non-finite step, one step does not speculate)
    assert outcomes == ["held", "discarded", "off", "held"] and not math.isfinite(losses[1])
    assert losses[2:] == ref_losses[2:] and all(masters[u][n].equal(t) for u, p in ref.items() for n, t in p.items())


def test_a_step_that_fails_after_speculating_leaves_the_masters_in_charge(monkeypatch):
    """A step that raises once its blocks have speculated (their loads took the last step's speculated
    parameters): what loads next is the master, as without speculation."""
    def after_failure(speculate):
        torch.manual_seed(0)
        engine = make_engine(ToyStack(Model(tied=True)), device="cpu", max_grad_norm=1e6,
                             optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1), speculate=speculate)
        data = batches(seed=4, steps=3, micro=3)
        n = [sum(int((b["targets"] != -100).sum()) for b in step) for step in data]
        assert engine.step(data[0], lr=1e-2, normalizer=n[0]).speculation == ("held" if speculate else "off")
        queue = engine.host_updates.norm_known

        def fail(*args):
            raise RuntimeError("stopped before its updates")

        engine.host_updates.norm_known = fail
        with pytest.raises(RuntimeError, match="stopped before its updates"):
            engine.step(data[1], lr=1e-2, normalizer=n[1])
        engine.host_updates.norm_known = queue
        loss = engine.evaluate(data[2], normalizer=n[2])
        engine.close()
        return loss

    assert after_failure(True) == after_failure(False)


def test_speculation_needs_a_gradient_buffer_of_its_own():
    """A pooled gradient lies under the next forward's activations, which cannot wait for an update that runs
    late: such blocks do not speculate, and a placement that says they do is refused."""
    stack = ToyStack(Model(tied=True))
    options = RunFacts(clip=1.0, device="cpu", compute_bytes=4)
    shapes = shapes_of(stack)
    step = placement_module.StepShape(30, 3, 10)
    pooled = arrange(shapes, step, options, resident=(), window=2, share=0.0, shared=True, held=0, speculate=True)
    assert not pooled.speculated
    ringed = arrange(shapes, step, options, resident=(), window=2, share=0.0, shared=False, held=0, speculate=True)
    assert ringed.speculated == set(range(1, DEPTH + 1))
    assert ringed.tiers()[HOST]["speculative parameters"] == 4 * DEPTH * shapes.block_numel
    units = list(pooled.units)
    units[1] = dataclasses.replace(units[1], speculate=True)
    with pytest.raises(ValueError, match="block 0: only a clipped sliding block updated on the host"):
        dataclasses.replace(pooled, units=tuple(units))
    unclipped = arrange(shapes, step, dataclasses.replace(options, clip=None), resident=(), window=2, share=0.0,
                        shared=False, held=0, speculate=True)
    assert not unclipped.speculated
    with pytest.raises(ValueError, match="speculates"):
        dataclasses.replace(unclipped, units=(unclipped.units[0],
                                              UnitPlacement(False, "host", "ring", HOST, speculate=True),
                                              *unclipped.units[2:]))


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [1e6, 0.05])
def test_speculation_on_cuda_gives_the_result_without_it_bit_for_bit(clip):
    """On CUDA the speculated parameters are rounded to bf16 on the host, where a load without speculation
    narrows the fp32 master on the device: both round to nearest even, so the two runs are equal bit for bit."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")
    results = []
    for speculate in (False, True):
        torch.manual_seed(0)
        engine = make_engine(ToyStack(Model(tied=True)), device="cuda", max_grad_norm=clip, speculate=speculate,
                             optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1))
        assert bool(engine.speculative) == speculate and engine.dtype == torch.bfloat16
        losses, outcomes = [], []
        for step in batches(seed=4, steps=STEPS, micro=3):
            stats = engine.step([{k: v.cuda() for k, v in b.items()} for b in step], lr=1e-2, normalizer=10)
            losses.append(stats.loss)
            outcomes.append(stats.speculation)
        masters = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}
        engine.close()
        results.append((losses, outcomes, masters))
    (ref_losses, _, ref), (losses, outcomes, got) = results
    assert outcomes == (["held"] * STEPS if clip > 1 else ["discarded"] + ["off"] * (STEPS - 1))
    assert losses == ref_losses and all(got[u][n].equal(t) for u, p in ref.items() for n, t in p.items())
