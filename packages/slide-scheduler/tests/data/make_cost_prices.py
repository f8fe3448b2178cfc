"""Writes cost_prices.json.gz beside this file: the cost model's full estimate (every lane, phase and setter) of the
committed benchmark plans (benchmarks/results/plans.json, planned again), of every preset's plans on every machine
file, and of placements made to exercise the disk tier, activation offload, device updates, ranks and a CPU
device. tests/test_cost_prices.py prices them again: a change meant to keep the prices must keep these.

Run from the monorepo root in the dev venv (it plans through slide-train):

    python packages/slide-scheduler/tests/data/make_cost_prices.py
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.util
import json
import pathlib
import types

from slide_scheduler import Machine
from slide_scheduler.plan.choices import arrange
from slide_scheduler.plan.cost import price
from slide_scheduler.plan.placement import Placement, RunFacts, Shapes, StepShape
from slide_train.budgets import budgets_for
from slide_train.config import load_config
from slide_train.launch import facts_of, make_plan, model_shapes, plan_run
from slide_train.machines import load_machine
from slide_train.models.build import load_model
from slide_train.models.presets import PRESETS

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[3]
MACHINES = sorted((ROOT / "docs" / "machines").glob("*.yaml"))
CAPS_GIB = (16, 24)
STEP = ("--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8")
SIGNIFICANT = 11  # digits kept of each figure: a rounding 100 times finer than the test's 1e-9


def non_default(obj) -> dict:
    """A frozen dataclass's fields that differ from their defaults (so a field added later keeps its default)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if value != default:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


class Tables:
    """Shapes, machines, unit placements and estimates' layouts shared by many entries, each kept once."""

    def __init__(self):
        self.shapes: list[dict] = []
        self.machines: list[dict] = []
        self.units: list[dict] = []
        self.layouts: list[list[str]] = []
        self.steps: list[dict] = []
        self.runs: list[dict] = []

    @staticmethod
    def _index(table: list, item) -> int:
        if item not in table:
            table.append(item)
        return table.index(item)

    def placement(self, p: Placement) -> dict:
        """Its fields that differ from the defaults; shapes, step and run by index, units as runs of
        [index, count]."""
        fields = non_default(p)
        fields["shapes"] = self._index(self.shapes, non_default(p.shapes))
        fields["step"] = self._index(self.steps, non_default(p.step))
        fields["run"] = self._index(self.runs, non_default(p.run))
        runs: list[list[int]] = []
        for u in p.units:
            i = self._index(self.units, non_default(u))
            if runs and runs[-1][0] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        fields["units"] = runs
        return fields

    def machine(self, m: Machine) -> int:
        return self._index(self.machines, m.to_dict())

    def estimate(self, e: dict) -> list:
        """[layout, figure, figure, ...]: each figure (the bottleneck's lane too) at its dotted path in the layout."""
        paths, figures = zip(*flattened(e))
        return [self._index(self.layouts, list(paths)), *(rounded(f) for f in figures)]


def flattened(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict) and value:  # (an empty one is a figure of its own: a phase nothing sets)
            yield from flattened(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def rounded(value):
    if isinstance(value, float):
        return 0 if value == 0 else float(f"{value:.{SIGNIFICANT}g}")
    return value


@functools.cache
def preset_shapes(name: str, ranks: int = 1) -> Shapes:
    model = load_model(name, 0, need_tokenizer=False, need_weights=False)
    return model_shapes(model, model.stack(kernels=True), ranks)


def benchmark_plans():
    """benchmarks/run.py's plans suite, planned again from the arguments each of its figures records."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "plans.json").read_text())
    models = {}
    for figure in doc["figures"]:
        name, machine_path = figure["model"], figure["machine"]
        if name not in models:
            models[name] = load_model(name, 0, need_tokenizer=False, need_weights=False)
        machine = load_machine(ROOT / machine_path)
        plan = plan_run(load_config(None, figure["args"]), models[name], machine, running=False)[0]
        yield f"plans.json {name} {machine_path} {figure['setting']}", plan.placement, machine


def preset_plans():
    """Every preset on every machine file at each cap, clipped and not (as test_unclipped_plans plans them)."""
    for machine_file in MACHINES:
        machine = load_machine(machine_file)
        for name in PRESETS:
            for cap in CAPS_GIB:
                cfg = load_config(None, [f"--model={name}", *STEP, f"--engine.gpu_memory_limit_gb={cap}"])
                clipped = facts_of(cfg, "cuda")
                budgets = budgets_for(machine, True, cap)
                for run, word in ((clipped, "clipped"), (dataclasses.replace(clipped, clip=None), "unclipped")):
                    plan = make_plan(cfg, preset_shapes(name), machine, run, budgets)
                    yield f"preset {name} {machine_file.stem} {cap} GiB {word}", plan.placement, machine


def with_candidates(plans, every: int = 10) -> tuple[list, list]:
    """The plans `plans` yields, and every `every`th of the other placements the planner priced on the way (in the
    order it priced them, each once): what a plan is chosen from."""
    import slide_scheduler

    hooked = [m for m in vars(slide_scheduler).values()
              if isinstance(m, types.ModuleType) and getattr(m, "price", None) is price]
    priced = []

    def recording(p, machine, clipping_acts=True):
        priced.append((p, machine, clipping_acts))
        return price(p, machine, clipping_acts)

    for module in hooked:
        module.price = recording
    try:
        chosen = list(plans)
    finally:
        for module in hooked:
            module.price = price
    distinct = list({(p, id(machine)): (p, machine) for p, machine, _ in priced}.values())
    return chosen, [(f"candidate {i}", p, machine) for i, (p, machine) in enumerate(distinct) if i % every == 0]


# A machine with every optional rate measured: attention's, the routed experts', the GPUs' link
MEASURED = {"gpu": {"memory_gib": 80.0, "bf16_tflops": 700.0, "attention_tflops": 420.0, "experts_tflops": 250.0,
                    "link_gbps": 300.0},
            "host": {"memory_gib": 512.0, "cores": 32, "memory_gbps": 150.0, "adamw_gparams": 3.0},
            "pcie": {"h2d_gbps": 50.0, "d2h_gbps": 48.0, "duplex_gbps": 90.0},
            "disk": {"free_gib": 2000.0, "read_gbps": 3.0, "write_gbps": 2.5}}

# (name, arrange's choices): the disk tier, activation tiers, device updates, speculation, deferral, ranks
CHOICES = {
    "disk half": dict(nvme_fraction=0.5),
    "disk all, loads from disk": dict(nvme_fraction=1.0, disk_loads=True),
    "disk, grads on disk": dict(nvme_fraction=0.75, disk_grads=True, staging=3),
    "disk, boundaries on disk": dict(nvme_fraction=0.5, disk_boundaries=6),
    "streamed share, held": dict(share=0.5, held=2, window=3),
    "streamed share, pooled": dict(share=0.25, shared=True),
    "speculating": dict(speculate=True),
    "speculating first 4, no split": dict(speculate=4, split=False),
    "resident first 3, landing 1": dict(resident=range(3), landing=1),
    "edges streamed": dict(share=1.0),
    "deferred": dict(defer=True),
    "deferred first 8": dict(defer=8),
    "streamed share, device first": dict(share=0.5, device_first=True),
    "window 4, disk some": dict(window=4, nvme_fraction=0.3),
}
RUNS = {
    "clip, cpu acts": RunFacts(),
    "clip, device acts": RunFacts(activations="gpu"),
    "clip, nvme acts": RunFacts(activations="disk"),
    "no clip": RunFacts(clip=None),
    "no clip, bf16 states": RunFacts(clip=None, state_bytes=2),
    "clip, bf16 states, fp32 compute": RunFacts(state_bytes=2, compute_bytes=4),
    "clip, 2 ranks": RunFacts(ranks=2),
    "no clip, 4 ranks, device acts": RunFacts(clip=None, ranks=4, activations="gpu"),
    "cpu device": RunFacts(device="cpu", compute_bytes=4),
}
MODELS = ("llama-3.1-8b", "qwen3-30b-a3b", "gemma-2-9b", "tiny-llama", "olmoe-1b-7b")


def made_placements():
    """Placements made with arrange, beyond what the planner picks: each model with each run and choice on
    MEASURED, and the disk choices of a clipped run on the rtx4090 and H200 machine files too."""
    measured = Machine.from_dict(MEASURED)
    files = [load_machine(ROOT / "docs" / "machines" / name) for name in ("rtx4090-pc.yaml", "h200-host.yaml")]
    step = StepShape(tokens_per_micro=4096, micro_batches=8, seq_len=4096)
    for model in MODELS:
        for run_name, run in RUNS.items():
            shapes = preset_shapes(model, run.ranks)
            for choice, kwargs in CHOICES.items():
                if run.ranks > 1 and "disk" in choice:
                    continue  # (ranks keep every state in host memory)
                kwargs = {"window": 2, **kwargs}
                if "disk_boundaries" in kwargs:
                    kwargs["disk_boundaries"] = min(kwargs["disk_boundaries"], shapes.num_blocks)
                try:
                    p = arrange(shapes, step, run, **kwargs)
                except ValueError:
                    continue  # (a combination the placement refuses)
                yield f"made {model} {run_name} {choice} on measured", p, measured
                if "disk" in choice and run_name == "clip, cpu acts":
                    for machine in files:
                        yield f"made {model} {run_name} {choice} on {machine.gpu.bf16_tflops:g} TFLOP/s", p, machine


def main():
    tables, entries, seen = Tables(), [], set()
    presets, candidates = with_candidates(preset_plans())
    for source in (benchmark_plans(), presets, candidates, made_placements()):
        for name, p, machine in source:
            for acts in (True, False) if p.clips else (True,):
                entry = {"placement": tables.placement(p), "machine": tables.machine(machine), "clipping_acts": acts}
                key = json.dumps(entry, sort_keys=True)
                if key in seen:
                    continue  # (the same placement planned again, at another cap or setting)
                seen.add(key)
                estimate = tables.estimate(price(p, machine, acts).to_dict())
                entries.append({"name": name + ("" if acts else ", not acting"), **entry,
                                "estimate": estimate})
    doc = {"about": "tests/test_cost_prices.py: the cost model's estimates these placements had (made by "
                    "data/make_cost_prices.py)", "shapes": tables.shapes, "machines": tables.machines,
           "units": tables.units, "steps": tables.steps, "runs": tables.runs, "layouts": tables.layouts,
           "entries": entries}
    check_round_trip(doc)
    packed = gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), mtime=0)
    (HERE / "cost_prices.json.gz").write_bytes(packed)
    print(f"{len(entries)} estimates, {len(packed) / 1e3:.0f} kB")


def check_round_trip(doc: dict) -> None:
    """The test's rebuilt placements price as the originals did (to the digits kept)."""
    spec = importlib.util.spec_from_file_location("test_cost_prices", HERE.parent / "test_cost_prices.py")
    test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test)
    wrong = [d for entry in doc["entries"] for d in test.check(doc, entry)]
    assert not wrong, "\n".join(wrong[:20])


if __name__ == "__main__":
    main()
