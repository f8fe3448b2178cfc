"""A run's plan: slide-scheduler's placement priced on a machine file, in the config's words; `slide-train plan`
and what a run that cannot fit is told."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import re

import pytest
import transformers

import slide_scheduler
from slide_scheduler import GPU, HOST, Machine
from slide_train.config import load_config
from slide_train.errors import ConfigError
from slide_train.machines import load_machine
from slide_train.models.build import load_model
from slide_train.plan import GIB, budgets_for, facts_of, make_plan, model_shapes, refuse, share_on_disk
from slide_train.trainer import plan_run

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "machines"
TEST_MACHINE = pathlib.Path(__file__).with_name("machine.yaml")
BOTTLENECKS = {"gpu", "pcie_h2d", "pcie_d2h", "host_memory", "host_adamw", "disk"}


def machine_with(**sections) -> Machine:
    """The tests' machine with some figures replaced: machine_with(gpu={"memory_gib": 24})."""
    m = load_machine(TEST_MACHINE)
    return dataclasses.replace(m, **{name: dataclasses.replace(getattr(m, name), **figures)
                                     for name, figures in sections.items()})


def plan_for(machine: Machine, *overrides: str, model: str = "llama-3.2-3b"):
    cfg = load_config(None, [f"--model={model}", "--seq_len=4096", "--micro_batch_size=2", "--grad_accum=4",
                             *overrides])
    return plan_run(cfg, load_model(cfg.model, 0, need_tokenizer=False), machine, running=False)[0]


def test_residency_grows_with_the_machines_gpu_and_stays_under_its_budget():
    counts = []
    for gib in (8, 16, 24, 48, 80):
        plan = plan_for(machine_with(gpu={"memory_gib": gib}))
        assert plan.fits and plan.placement.bytes(GPU) <= plan.budgets.gpu == pytest.approx(0.92 * gib * GIB)
        counts.append(len(plan.placement.resident))
    assert counts == sorted(counts) and counts[0] < counts[-1]
    assert counts[-1] == len(plan.placement.units)  # 80 GiB holds a 3B model's every unit and its states


def test_the_config_cap_and_the_machine_file_each_bound_the_budget():
    """Each budget is the smaller of the machine file's figure and the config's cap."""
    m = machine_with(gpu={"memory_gib": 80}, host={"memory_gib": 64})
    assert budgets_for(m, True, 24.0).gpu == pytest.approx(0.92 * 24 * GIB)
    assert budgets_for(m, True, 100.0).gpu == pytest.approx(0.92 * 80 * GIB)
    assert budgets_for(m, True, None, card_gib=40.0).gpu == pytest.approx(0.92 * 40 * GIB)
    assert budgets_for(m, True, None).host == pytest.approx(0.95 * 64 * GIB)
    assert budgets_for(m, False, 24.0).gpu is None
    capped = plan_for(m, "--engine.gpu_memory_limit_gb=12")
    assert capped.budgets.gpu == pytest.approx(0.92 * 12 * GIB) and capped.placement.bytes(GPU) <= capped.budgets.gpu


def test_a_machine_file_with_less_host_memory_plans_as_that_host_and_the_refusal_says_what_fits():
    """A machine file with 32 GiB of RAM makes the 3B run behave as on a 32 GiB host, whatever runs the test:
    it does not fit, and the share of AdamW moments on disk the refusal offers makes it fit."""
    small = machine_with(gpu={"memory_gib": 24}, host={"memory_gib": 32})
    cfg = load_config(None, ["--model=llama-3.2-3b", "--seq_len=4096", "--micro_batch_size=2", "--grad_accum=4"])
    model = load_model(cfg.model, 0, need_tokenizer=False)
    shapes = model_shapes(model, model.stack(kernels=False))
    budgets = budgets_for(small, True, None)
    plan = make_plan(cfg, shapes, small, facts_of(cfg, "cuda"), budgets)
    assert not plan.fits and plan.placement.bytes(HOST) > budgets.host == pytest.approx(0.95 * 32 * GIB)
    assert any(problem.startswith("host: needs ~") for problem in plan.problems)
    with pytest.raises(ConfigError, match=r"this run cannot fit: host: needs .*What would: host memory: "
                                          r"engine.nvme.fraction=([0-9.]+) \(or auto\) keeps the fp32 masters "
                                          r"and AdamW moments of (\d+) of") as no:
        refuse(plan, cfg, share=lambda: share_on_disk(cfg, shapes, small, facts_of(cfg, "cuda"), budgets))
    assert "engine.states_dtype=bf16" in str(no.value) and "max_grad_norm=null" in str(no.value)
    fraction = float(re.search(r"engine.nvme.fraction=([0-9.]+)", str(no.value)).group(1))
    fixed = make_plan(cfg, shapes, small, facts_of(cfg, "cuda"), budgets, nvme_fraction=fraction)
    assert fixed.fits and fixed.placement.on_disk and fixed.placement.bytes("disk") > 0
    less = make_plan(cfg, shapes, small, facts_of(cfg, "cuda"), budgets,
                     nvme_fraction=fraction - 1 / len(shapes.unit_numels), disk_loads=False)
    # the least that fits with copies of the parameters in RAM: a smaller share fits only where the planner then
    # slides more blocks (the share is of the sliding ones) and still puts as many on disk
    assert not less.fits or len(less.placement.on_disk) >= len(fixed.placement.on_disk)
    assert not fixed.placement.loads_from_disk
    auto = load_config(None, ["--model=llama-3.2-3b", "--seq_len=4096", "--micro_batch_size=2", "--grad_accum=4",
                              "--engine.nvme.fraction=auto"])
    chosen = make_plan(auto, shapes, small, facts_of(auto, "cuda"), budgets)  # auto: that same least share
    assert chosen.fits and chosen.placement.on_disk == fixed.placement.on_disk
    roomy = make_plan(auto, shapes, machine_with(gpu={"memory_gib": 24}, host={"memory_gib": 512}),
                      facts_of(auto, "cuda"),
                      budgets_for(machine_with(host={"memory_gib": 512}), True, 24.0))
    assert roomy.fits and not roomy.placement.on_disk  # nothing on disk where RAM holds it all
    big = make_plan(cfg, shapes, machine_with(gpu={"memory_gib": 24}, host={"memory_gib": 512}),
                    facts_of(cfg, "cuda"),
                    budgets_for(machine_with(host={"memory_gib": 512}), True, 24.0))
    assert big.fits


def test_auto_takes_the_least_share_the_host_needs_even_where_the_disk_cannot_hold_every_block():
    """A disk smaller than every block's states but larger than the share the host needs: `auto` finds that
    share (the disk is not what bounds it); a disk smaller than that share leaves no share that fits."""
    def plan(disk_gib, fraction):
        machine = machine_with(gpu={"memory_gib": 24}, host={"memory_gib": 32}, disk={"free_gib": disk_gib})
        return plan_for(machine, f"--engine.nvme.fraction={fraction}", "--engine.gpu_memory_limit_gb=24")

    every = plan(1000, 1)
    least = plan(1000, "auto")
    assert least.fits and 0 < least.placement.bytes("disk") < every.placement.bytes("disk")
    between = (least.placement.bytes("disk") + every.placement.bytes("disk")) / 2 / GIB
    assert not plan(between, 1).fits  # every block on disk overflows this disk...
    chosen = plan(between, "auto")
    assert chosen.fits and chosen.placement.on_disk == least.placement.on_disk  # ...the least share does not
    short = plan(0.5 * least.placement.bytes("disk") / GIB, "auto")
    assert not short.fits


def test_plan_json_prices_a_checkpoint_of_the_disk_tier(capsys):
    """A checkpoint writes 12 bytes per parameter (8 with bf16 states) at the disk's write rate and reads the
    tier's share back at its read rate: checkpoint_bytes and checkpoint_s from those figures."""
    from slide_train.cli import main

    for states, per_param in (("fp32", 12), ("bf16", 8)):
        code = main(["plan", "--model=llama-3.1-70b", "--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8",
                     "--max_grad_norm=null", "--engine.activation_offload=nvme", "--engine.nvme.fraction=auto",
                     f"--engine.states_dtype={states}", "--machine", str(DOCS / "rtx4090-pc.yaml"), "--json"])
        out = json.loads(capsys.readouterr().out)
        disk = out["machine"]["disk"]
        assert code == 0 and out["fits"] and out["tiers"]["disk"]["masters"] > 0
        assert out["checkpoint_bytes"] == per_param * out["params"]
        assert out["checkpoint_s"] == pytest.approx(out["checkpoint_bytes"] / (disk["write_gbps"] * 1e9)
                                                    + out["disk_bytes"] / (disk["read_gbps"] * 1e9))
    main(["plan", "--model=llama-3.1-70b", "--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8",
          "--machine", str(DOCS / "rtx4090-pc-raid0.yaml")])
    assert re.search(r"a checkpoint writes ~[0-9.]+ GiB: ~\d+ s at the disk's 24 GB/s", capsys.readouterr().out)


def test_a_gpu_budget_too_small_is_refused_with_the_tokens_that_would_fit():
    """The problem names a micro-batch length that fits: planned with it, the GPU side fits; a tenth more not."""
    small = machine_with(gpu={"memory_gib": 8})
    plan = plan_for(small, "--seq_len=32768")
    found = re.search(r"gpu: needs ~[0-9.]+ GiB, [0-9.]+ GiB usable; at most ~(\d+) tokens per micro-batch would "
                      r"fit", plan.problems[0])
    assert not plan.fits and found
    tokens = int(found.group(1))
    fits = plan_for(small, f"--seq_len={tokens}", "--micro_batch_size=1")
    assert fits.placement.bytes(GPU) <= fits.budgets.gpu
    more = plan_for(small, f"--seq_len={int(1.1 * tokens)}", "--micro_batch_size=1")
    assert more.placement.bytes(GPU) > more.budgets.gpu
    assert "even short micro-batches do not fit" in plan_for(machine_with(gpu={"memory_gib": 4})).problems[0]


def test_cpu_runs_keep_nothing_resident_unless_asked():
    cpu = load_machine(TEST_MACHINE)
    cpu = dataclasses.replace(cpu, gpu=dataclasses.replace(cpu.gpu, memory_gib=0))
    assert plan_for(cpu).placement.resident == set()
    assert plan_for(cpu, "--engine.placement.resident=3").placement.resident == {0, 1, 2}
    asked = plan_for(cpu, "--engine.placement.resident=[edges, block.2]").placement
    assert asked.resident == {0, 3} and asked.sliding_blocks[:3] == [1, 2, 4] and asked.device_is_host


def test_plan_json_on_a_machine_without_a_gpu_from_a_config_json_alone(tmp_path, capsys):
    """`plan --machine FILE --json` needs no GPU here and no weights: the shapes come from config.json. Its
    bytes are the sums of the placement's allocations, tier by tier."""
    from slide_train.cli import main

    transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=4096).save_pretrained(tmp_path / "model")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json"]
    code = main(["plan", f"--model={tmp_path / 'model'}", "--seq_len=1024", "--machine", str(TEST_MACHINE), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits"] is True and out["bottleneck"] in BOTTLENECKS
    assert out["predicted_step_s"] >= out["predicted_step_s_unclipped"] > 0
    for tier in ("gpu", "host", "disk"):
        assert out[f"{tier}_bytes"] == sum(out["tiers"][tier].values())
    assert out["tiers"]["host"]["masters"] == 4 * out["params"]
    assert len(out["units"]) == 7 and {"resident", "update", "grad", "moments", "master"} <= out["units"][0].keys()
    assert main(["plan", f"--model={tmp_path / 'model'}", "--seq_len=1024", "--machine", str(TEST_MACHINE)]) == 0
    text = capsys.readouterr().out
    assert "predicted step" in text and "bound by" in text and "gpu ~" in text and "host ~" in text


@pytest.mark.parametrize("preset, blocks", [("llama-3.1-70b", 80), ("mistral-large-2", 88)])
def test_70b_and_123b_on_a_24_gib_pc_fit_with_their_states_on_disk_and_say_what_is_missing_otherwise(
        capsys, preset, blocks):
    """At seq 4096, 8 micro-batches of 1, on a PC with 256 GiB of RAM: neither fits with everything in RAM. With
    engine.nvme.fraction auto, no copy of the parameters of blocks whose master is on disk is kept (their loads
    read the master from disk): 70B then fits with clipping, 123B only without it (the gradients exact clipping
    holds are 228 GiB), with its boundary activations on disk too; the plan names what the host would still hold."""
    from slide_train.cli import main

    base = ["plan", f"--model={preset}", "--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8", "--machine",
            str(DOCS / "rtx4090-pc.yaml"), "--json"]

    def plan(*extra):
        code = main([*base, *extra])
        return code, json.loads(capsys.readouterr().out)

    code, out = plan()
    assert code == 2 and not out["fits"] and len(out["units"]) == blocks + 1
    assert out["gpu_bytes"] <= out["budgets"]["gpu"] and out["host_bytes"] > out["budgets"]["host"]
    assert out["bottleneck"] in BOTTLENECKS and out["predicted_step_s"] > 10
    code, auto = plan("--engine.nvme.fraction=auto")
    if preset == "llama-3.1-70b":
        assert code == 0 and auto["fits"] and auto["bottleneck"] == "disk"
        assert "parameters of masters on disk" not in auto["tiers"]["host"] and auto["tiers"]["host"][
            "masters read for loads"] > 0
        assert sum(u["master"] == "disk" for u in auto["units"]) == sum(u["disk_loads"] for u in auto["units"])
    else:
        assert code == 2 and any("even with every sliding block's master and AdamW moments on disk" in p
                                 and "gradients + boundary activations 228" in p for p in auto["problems"])
        code, lean = plan("--engine.nvme.fraction=auto", "--max_grad_norm=null", "--engine.activation_offload=nvme")
        assert code == 0 and lean["fits"] and lean["host_bytes"] <= lean["budgets"]["host"]


def test_slide_train_imports_only_what_slide_scheduler_exports():
    src = pathlib.Path(__file__).resolve().parents[1] / "src"
    used = set()
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not [a.name for a in node.names if a.name.startswith("slide_scheduler.")], path
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("slide_scheduler"):
                assert node.module == "slide_scheduler", f"{path}: from {node.module} import ..."
                used |= {a.name for a in node.names}
    assert used and used <= set(slide_scheduler.__all__), used - set(slide_scheduler.__all__)


def test_finetune_prints_the_plan_and_logs_the_prediction_beside_each_step(tmp_path, capsys):
    from slide_train.cli import main
    from slide_train.metrics import read_metrics

    assert main(["finetune", "--steps=2", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1",
                 "--export=false", f"--output_dir={tmp_path / 'run'}", "--no-progress",
                 "--machine", str(TEST_MACHINE)]) == 0
    out = capsys.readouterr().out
    assert "plan: " in out and "predicted step" in out
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2 and all(r["predicted_step_s"] > 0 and r["step_s"] > 0 for r in steps)


def test_expandable_segments_unless_the_user_configured_the_allocator(monkeypatch):
    import torch

    from slide_train import trainer
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(k, raising=False)
    assert trainer.use_expandable_segments() and calls == ["expandable_segments:True"]
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(k, "max_split_size_mb:128")
        assert not trainer.use_expandable_segments() and len(calls) == 1  # the user's setting stands
        monkeypatch.delenv(k)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_finetune_on_a_cuda_device_on_a_machine_without_one_is_a_config_error(tmp_path, capsys):
    """Exit 2 with the fix in one line, before any model is built."""
    from slide_train.cli import main

    assert main(["finetune", "--engine.device=cuda", f"--output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device is available; use engine.device=cpu" in err and "Traceback" not in err


def test_plan_checks_the_data_settings_too(capsys):
    """`slide-train plan` reads no data, yet checks its settings."""
    from slide_train.cli import main

    assert main(["plan", "--data.eval_fraction=1.5"]) == 2
    assert "data.eval_fraction: must be in [0, 1), got 1.5" in capsys.readouterr().err


@pytest.mark.parametrize("preset, total, active", [("olmoe-1b-7b", 6.92e9, 1.28e9), ("qwen3-30b-a3b", 30.53e9, 3.35e9),
                                                   ("llama-3.1-8b", 8.03e9, 8.03e9)])
def test_a_mixture_of_experts_is_priced_by_the_experts_a_token_is_routed_to(preset, total, active):
    """The published active counts (OLMoE-1B-7B: 1.3B of 6.9B; Qwen3-30B-A3B: 3.3B of 30.5B): the plan prices
    compute, and metrics count TFLOP/s, with those; a dense model's active count is all of it."""
    import dataclasses as dc

    from slide_scheduler import price

    model = load_model(preset, 0, need_tokenizer=False, need_weights=False)
    shapes = model_shapes(model, model.stack(kernels=False))
    counted = shapes.unit_numels[0] + shapes.num_blocks * (shapes.active_block_numel or shapes.block_numel)
    assert sum(shapes.unit_numels) == pytest.approx(total, rel=1e-3) and counted == pytest.approx(active, rel=1e-2)
    machine = load_machine(TEST_MACHINE)
    plan = plan_for(machine, model=preset)
    everything = dc.replace(plan.placement, shapes=dc.replace(plan.placement.shapes, active_block_numel=0))
    compute, all_experts = price(plan.placement, machine), price(everything, machine)
    if active < total:
        assert compute.lanes["gpu"] < 0.5 * all_experts.lanes["gpu"]
    else:
        assert compute.lanes["gpu"] == all_experts.lanes["gpu"]
