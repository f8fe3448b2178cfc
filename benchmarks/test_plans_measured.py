"""The committed GPU figures planned again, each with the arguments and the machine figures its run planned with
(worker.py records both): the measured step is within 10% of the plan the cost model makes now. Where the cost
model changed since the run, the plan differs from the run's own; the test says by how much, and holds the new
model to the old measurement."""

from __future__ import annotations

import json
import pathlib
import warnings

import pytest

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SUITES = ("b1", "b3", "b8", "gemma2", "moe", "moe-96k", "moe-256k", "long", "nvme")
WITHIN = 0.10
# Figures the cost model is known to miss by more than WITHIN, and why: strict, so a model that comes within WITHIN
# of one fails here until it is taken off this list
KNOWN_GAPS = {
    **dict.fromkeys(("moe-clip-1.0", "moe-96k-clip-1.0"),
                    "OLMoE's host AdamW runs slower beside the streamed updates' copies than the plan prices it: "
                    "host memory is shared, and the plan takes the probe's rate beside plain copies"),
    "moe-clip-none": "OLMoE unclipped: the copies to the GPU set the plan and outlast it in the engine, with the GPU's "
                     "compute and the host AdamW within 10% of theirs (docs/findings.md); the cause is not found",
}


def figures() -> list:
    found = []
    for suite in SUITES:
        path = RESULTS / f"{suite}.json"
        if not path.is_file():
            continue
        for f in json.loads(path.read_text())["figures"]:
            if f.get("system") == "slide" and f.get("status") == "ok" and f.get("machine") and f.get("args"):
                name = f"{suite}-{f.get('variant') or f.get('bench') or ''}-clip-{f.get('mode')}".replace("--", "-")
                gap = KNOWN_GAPS.get(name)
                marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
                found.append(pytest.param(f, id=name, marks=marks))
    return found


MEASURED = figures()


def replanned(figure: dict) -> float:
    from slide_scheduler import Machine
    from slide_train.config import load_config
    from slide_train.launch import plan_run
    from slide_train.models.build import load_model

    cfg = load_config(None, figure["args"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a family's kernel notes)
        model = load_model(cfg.model, 0, need_tokenizer=False, need_weights=False)
        plan = plan_run(cfg, model, Machine.from_dict(figure["machine"]), running=False)[0]
    return plan.estimate.step_s


def test_committed_gpu_figures_record_what_they_were_planned_with():
    """Every suite measured since the figures carry their plan's inputs has some: a sweep that stopped recording
    them would leave the test below with nothing to check."""
    assert MEASURED, "no committed GPU figure records its args and machine: run the sweep's suites on a GPU"


@pytest.mark.parametrize("figure", MEASURED)
def test_the_measured_step_is_within_10_percent_of_its_plan(figure):
    planned = replanned(figure)
    if planned != pytest.approx(figure["predicted_step_s"], rel=1e-3):
        print(f"the cost model changed since the run: planned {planned:.3f} s here, {figure['predicted_step_s']:.3f} s "
              f"then (commit {figure.get('commit', '?')})")
    off = planned / figure["step_s"] - 1
    assert abs(off) <= WITHIN, f"planned {planned:.3f} s, measured {figure['step_s']:.3f} s ({off:+.1%})"
