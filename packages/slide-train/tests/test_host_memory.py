"""engine.host_memory_limit_gb and the plan's host figure: what the process holds in host memory, counted as the
engine's buffers plus named terms, placed within the cap, and a run that cannot fit refused before it allocates."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
import transformers

from slide_scheduler import DISK, HOST
from slide_train import launch
from slide_train.budgets import GIB, HOST_USABLE
from slide_train.config import load_config
from slide_train.errors import ConfigError
from slide_train.launch import plan_run
from slide_train.machines import load_machine
from slide_train.models.build import load_model
from slide_train.plan import refusal
from slide_train.trainer import Trainer

H100_HOST = pathlib.Path(__file__).resolve().parents[3] / "docs" / "machines" / "h100-host.yaml"
RUN_8B = ["--model=llama-3.1-8b", "--seq_len=131072", "--micro_batch_size=1", "--grad_accum=1",
          "--max_grad_norm=1.0", "--engine.gpu_memory_limit_gb=24"]
EXTRAS = ("runtime", "export shard")  # what the process holds besides the engine's buffers


def plan_8b(*overrides: str):
    cfg = load_config(None, [*RUN_8B, *overrides])
    return plan_run(cfg, load_model(cfg.model, 0, need_tokenizer=False), load_machine(H100_HOST), running=False)[0]


def largest_export_shard(model: str, dtype: torch.dtype, shard_bytes: int = 5 * 2**30) -> int:
    """Counted here from the HF model's own tensors, in the order an HF checkpoint lists them (embedding, layers,
    final norm, lm head): shards of at most `shard_bytes`, the largest one's bytes."""
    config = load_model(model, 0, need_tokenizer=False).hf_config
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    named = dict(hf.named_parameters())
    order = ([n for n in named if "embed_tokens" in n] + [n for n in named if ".layers." in n]
             + [n for n in named if "embed_tokens" not in n and ".layers." not in n])
    shards, size = [0], 0
    for name in order:
        nbytes = math.prod(named[name].shape) * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append(0)
            size = 0
        shards[-1] += nbytes
        size += nbytes
    return max(shards)


def test_the_8b_at_131072_tokens_host_figure_is_the_engines_allocations_and_the_named_terms():
    plan = plan_8b("--export_dtype=bf16")
    p = plan.placement
    listed = sum(a.nbytes for a in p.allocations if a.tier == HOST and a.kind not in EXTRAS)
    shard = largest_export_shard("llama-3.1-8b", torch.bfloat16)
    assert 4.5 * GIB < shard <= 5 * GIB
    assert plan.to_dict()["host_bytes"] == listed + 2 * GIB + shard  # (the runtime: 2 GiB on a CUDA host)
    assert p.tiers()[HOST]["export shard"] == shard
    assert plan.fits and p.bytes(HOST) <= plan.budgets.host == pytest.approx(HOST_USABLE * 126.0 * GIB)
    # An fp32 export writes the masters as they are: nothing more is held
    assert "export shard" not in plan_8b("--export_dtype=fp32").placement.tiers()[HOST]
    assert "export shard" not in plan_8b("--export_dtype=bf16", "--export=false").placement.tiers()[HOST]


def test_the_host_cap_puts_more_on_disk_and_the_plan_stays_within_it():
    free, capped = plan_8b(), plan_8b("--engine.host_memory_limit_gb=80")
    assert capped.budgets.host == pytest.approx(HOST_USABLE * 80 * GIB)
    assert capped.fits and capped.placement.bytes(HOST) <= capped.budgets.host < free.placement.bytes(HOST)
    assert len(capped.placement.on_disk) > len(free.placement.on_disk)
    assert capped.placement.bytes(DISK) > free.placement.bytes(DISK)
    # A cap above the machine file's host changes nothing: the smaller figure is the budget
    assert plan_8b("--engine.host_memory_limit_gb=1000").budgets.host == free.budgets.host


def test_a_cap_too_small_for_any_placement_is_refused_saying_so():
    cfg = load_config(None, [*RUN_8B, "--engine.host_memory_limit_gb=8"])
    plan = plan_run(cfg, load_model(cfg.model, 0, need_tokenizer=False), load_machine(H100_HOST),
                    running=False)[0]
    assert not plan.fits
    text = refusal(plan, cfg)
    assert text.startswith("this run cannot fit: host: needs ~")
    assert "engine.host_memory_limit_gb=8 sets that budget" in text
    assert "even with every sliding block's master and AdamW moments on disk (engine.nvme.fraction=1)" in text
    assert "it needs a larger engine.host_memory_limit_gb or a machine with more memory" in text


def test_the_cap_must_be_positive():
    for value in ("0", "-4"):
        with pytest.raises(ConfigError, match="engine.host_memory_limit_gb must be positive"):
            load_config(None, [f"--engine.host_memory_limit_gb={value}"])


def no_engine(*args, **kwargs):
    raise AssertionError("the engine (and its host buffers) was made for a run that cannot fit")


def test_a_run_over_the_cap_is_refused_before_the_engine_allocates_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "SlidingEngine", no_engine)
    cfg = load_config(None, ["--model=tiny-llama", "--engine.device=cpu", "--steps=1",
                             "--engine.host_memory_limit_gb=0.001", f"--output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"this run cannot fit: host: needs ~[\d.]+ GiB, 0.0 GiB usable; "
                                          r"engine.host_memory_limit_gb=0.001 sets that budget"):
        Trainer(cfg, progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_on_a_host_with_less_ram_than_its_machine_file_plans_for_this_hosts(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "SlidingEngine", no_engine)
    monkeypatch.setattr(launch, "host_memory_bytes", lambda: 2**20)  # (a host of 1 MiB: nothing fits)
    cfg = load_config(None, ["--model=tiny-llama", "--engine.device=cpu", "--steps=1",
                             f"--output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"this run cannot fit: host: needs ~[\d.]+ GiB, 0.0 GiB usable"):
        Trainer(cfg, progress=False)
    monkeypatch.setattr(launch, "host_memory_bytes", lambda: 16 * 2**30)
    cfg = load_config(None, ["--model=tiny-llama", "--engine.device=cpu", "--engine.host_memory_limit_gb=32",
                             f"--output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="engine.host_memory_limit_gb=32 is more than the 16.0 GiB this host has"):
        Trainer(cfg, progress=False)
