"""engine.placement's expert keys come from slide-scheduler's one declaration of them, `Overrides`: each of its
fields but the planner's own is a key, with its help, its checks and its way to the planner."""

from __future__ import annotations

import dataclasses

import pytest

from slide_scheduler import Overrides
from slide_train import config, launch
from slide_train.config import KEY_HELP, describe_keys, load_config, placement_keys
from slide_train.errors import ConfigError
from slide_train.launch import overrides_of

# A value of each key, as the command line gives it, and as the planner gets it (where they differ)
VALUES = {"window": ("3", 3), "resident": ("[edges, block.1]", (0, 2)), "device_update_share": ("0.5", 0.5),
          "speculate": ("auto", "auto"), "synchronous": ("true", True), "sequence_tile": ("1024", 1024),
          "landing_sets": ("2", 2), "edges_early": ("false", False), "disk_grads": ("true", True),
          "disk_staging": ("4", 4), "speculation_pause": ("false", False), "query_tiles": ("true", True)}


def test_every_overrides_field_but_the_planners_own_is_a_key_that_reaches_the_planner():
    planner_only = {f.name for f in dataclasses.fields(Overrides) if "planner_only" in f.metadata}
    assert planner_only == {"held_grads", "share_grads", "split", "nvme_fraction", "disk_loads", "disk_boundaries",
                            "defer_updates", "device_first", "early_streams"}
    keys = placement_keys()
    assert set(keys) == {f.name for f in dataclasses.fields(Overrides)} - planner_only == set(VALUES)
    assert all(keys.values())  # each with its help, which --help lists too
    assert all(name in KEY_HELP["engine.placement"] for name in keys)
    cfg = load_config(None, ["--model=tiny-llama"] + [f"--engine.placement.{k}={v}" for k, (v, _) in VALUES.items()])
    o = overrides_of(cfg, num_blocks=4)
    assert {k: getattr(o, k) for k in VALUES} == {k: planned for k, (_, planned) in VALUES.items()}
    assert overrides_of(load_config(None, ["--model=tiny-llama"]), 4) == Overrides()


def test_a_field_added_to_overrides_is_a_key_checked_by_its_type_and_reaches_the_planner(monkeypatch):
    from slide_scheduler import expert

    wider = dataclasses.make_dataclass(
        "Overrides", [("prefetch_depth", int | None, dataclasses.field(
            default=None, metadata=expert("blocks loaded ahead", least=1))),
                      ("pin_everything", bool | None, dataclasses.field(default=None))],
        bases=(Overrides,), frozen=True)
    monkeypatch.setattr(config, "Overrides", wider)
    monkeypatch.setattr(launch, "Overrides", wider)
    assert list(placement_keys())[-2:] == ["prefetch_depth", "pin_everything"]
    cfg = load_config(None, ["--engine.placement.prefetch_depth=3", "--engine.placement.pin_everything=true"])
    o = overrides_of(cfg, num_blocks=4)
    assert (o.prefetch_depth, o.pin_everything, o.window) == (3, True, None)
    with pytest.raises(ConfigError, match=r"engine.placement.prefetch_depth must be an integer of at least 1, got 0"):
        load_config(None, ["--engine.placement.prefetch_depth=0"])
    with pytest.raises(ConfigError, match=r"engine.placement.pin_everything must be true or false, got 'yes please'"):
        load_config(None, ["--engine.placement.pin_everything=yes please"])
    with pytest.raises(ConfigError, match="the expert overrides are window: .*; prefetch_depth: blocks loaded ahead"):
        load_config(None, ["--engine.placement.prefetch=3"])


def test_help_lists_engine_placement_with_every_key():
    (row,) = [r for r in describe_keys() if r[0] == "engine.placement"]
    assert row[2] == "expert overrides: " + ", ".join(placement_keys()) + " (docs/placement.md)"
