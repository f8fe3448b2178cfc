"""The cost model prices every placement in data/cost_prices.json.gz as it did when the file was made (its full
estimate: step, phases, every lane's busy and critical seconds, setters, bottleneck), to 1e-9 relative: the
committed benchmark plans, every preset's plans on every machine file, and placements that exercise the disk
tier, activation offload, device updates, data-parallel ranks and a CPU device. data/make_cost_prices.py makes
the file again where a change means to move the prices."""

from __future__ import annotations

import functools
import gzip
import json
import math
import pathlib

from slide_scheduler import Machine
from slide_scheduler.plan.cost import price
from slide_scheduler.plan.facts import activation_tier
from slide_scheduler.plan.placement import Placement, RunFacts, Shapes, StepShape, UnitPlacement

PRICES = pathlib.Path(__file__).with_name("data") / "cost_prices.json.gz"
REL = 1e-9


@functools.cache
def recorded() -> dict:
    return json.loads(gzip.decompress(PRICES.read_bytes()))


def tupled(fields: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


def placement_of(doc: dict, fields: dict) -> Placement:
    """A placement as make_cost_prices wrote it: its fields that differ from the defaults, its shapes, step and
    run by index in the file's tables and its units as runs of [index, count]. The file names the boundary
    activations' tiers in the older words (none, cpu, nvme): read as the tiers they name."""
    rest = {k: v for k, v in fields.items() if k not in ("shapes", "step", "units", "run")}
    if "boundaries" in rest:
        rest["boundaries"] = [activation_tier(t) for t in rest["boundaries"]]
    run = doc["runs"][fields["run"]]
    units = tuple(UnitPlacement(**doc["units"][i]) for i, count in fields["units"] for _ in range(count))
    return Placement(shapes=Shapes(**tupled(doc["shapes"][fields["shapes"]])),
                     step=StepShape(**doc["steps"][fields["step"]]), units=units,
                     run=RunFacts(**{k: activation_tier(v) if k == "activations" else v for k, v in run.items()}),
                     **tupled(rest))


def estimate_of(doc: dict, figures: list) -> dict:
    """An estimate as make_cost_prices wrote it: [layout, figure, ...], each figure at its dotted path."""
    tree: dict = {}
    for path, figure in zip(doc["layouts"][figures[0]], figures[1:], strict=True):
        *parents, key = path.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[key] = figure
    return tree


def differences(got, want, path: str = "") -> list[str]:
    """Where `got` differs from `want` beyond REL (numbers), or at all (words, keys)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else got} != {sorted(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{path}.{k}")]
    if isinstance(got, float):
        return [] if math.isclose(got, want, rel_tol=REL, abs_tol=1e-15) else [f"{path}: {got!r} != {want!r}"]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def check(doc: dict, entry: dict) -> list[str]:
    p = placement_of(doc, entry["placement"])
    machine = Machine.from_dict(doc["machines"][entry["machine"]])
    got = price(p, machine, entry["clipping_acts"]).to_dict()
    want = estimate_of(doc, entry["estimate"])
    return [f"{entry['name']}: {d}" for d in differences(got, want)]


def test_the_file_holds_every_kind_of_placement():
    """(the committed plans, the presets' plans, and the made ones, with the disk, offload and ranks among them)"""
    names = [e["name"] for e in recorded()["entries"]]
    assert sum(n.startswith("plans.json") for n in names) == 12  # 8 plans, the 4 clipped also where it does not act
    assert sum(n.startswith("preset") for n in names) > 200
    assert all(any(word in n for n in names) for word in ("disk", "nvme acts", "ranks", "cpu device", "streamed"))


def test_every_recorded_placement_prices_as_it_did():
    doc = recorded()
    wrong = [d for entry in doc["entries"] for d in check(doc, entry)]
    assert not wrong, f"{len(wrong)} figures moved:\n" + "\n".join(wrong[:40])
