"""An unclipped run can always take its clipped run's placement (clipping that does not act scales by exactly 1),
so its plan is never predicted slower than the clipped plan's step where clipping does not act: every built-in
preset (dense, mixtures of experts, long-context shapes) on every machine file in docs/machines/."""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import pytest

from slide_scheduler import HOST
from slide_train.budgets import budgets_for
from slide_train.config import load_config
from slide_train.launch import facts_of, make_plan, model_shapes
from slide_train.machines import load_machine
from slide_train.models.build import load_model
from slide_train.models.presets import PRESETS

MACHINES = sorted((pathlib.Path(__file__).resolve().parents[3] / "docs" / "machines").glob("*.yaml"))
CAPS_GIB = (16, 24)  # GPU memory caps: consumer cards' sizes
STEP = ("--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8")  # 8 micro-batches x 1 x 4096 tokens
# The planner's tie (docs/placement.md): of two plans within 5% of each other it takes the one needing less host
# memory, so an unclipped plan may be slower by that much where it needs less host memory than the clipped one
NEAR_EQUAL = 0.05


@functools.cache
def shapes_of_preset(name: str):
    """A preset's shapes as `slide-train plan` sees them (no weights are made)."""
    model = load_model(name, 0, need_tokenizer=False, need_weights=False)
    return model_shapes(model, model.stack(kernels=True))


def test_the_machine_files_are_all_here():
    """(the glob below found the committed files, not an empty folder)"""
    assert {"h200-host.yaml", "h200-host-slow-adamw.yaml", "rtx4090-pc.yaml"} <= {m.name for m in MACHINES}


@pytest.mark.parametrize("machine_file", MACHINES, ids=lambda path: path.stem)
def test_no_clipped_plan_is_faster_than_its_unclipped_one(machine_file):
    """Each preset at each cap: where the clipped plan fits, the unclipped one fits and its predicted step is at
    most the clipped plan's step where clipping does not act (the figure the clipped plan reports beside its own),
    or a near-equal that needs less host memory."""
    machine = load_machine(machine_file)
    slower = []
    for name in PRESETS:
        shapes = shapes_of_preset(name)
        for cap in CAPS_GIB:
            cfg = load_config(None, [f"--model={name}", *STEP, f"--engine.gpu_memory_limit_gb={cap}"])
            clipped_run = facts_of(cfg, "cuda")
            budgets = budgets_for(machine, True, cap)
            clipped = make_plan(cfg, shapes, machine, clipped_run, budgets)
            if not clipped.fits:
                continue
            unclipped = make_plan(cfg, shapes, machine, dataclasses.replace(clipped_run, clip=None), budgets)
            limit, step = clipped.estimate_unclipped.step_s, unclipped.estimate.step_s
            leaner = unclipped.placement.bytes(HOST) < clipped.placement.bytes(HOST)
            if not unclipped.fits or step > limit * (1 + (NEAR_EQUAL if leaner else 1e-9)):
                slower.append(f"{name} at {cap} GiB: unclipped {step:.3f} s (fits: {unclipped.fits}, leaner: "
                              f"{leaner}), clipped where it does not act {limit:.3f} s")
    assert not slower, "\n".join(slower)
