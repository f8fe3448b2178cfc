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
from slide_train.budgets import budgets_for
from slide_train.config import load_config
from slide_train.errors import ConfigError
from slide_train.launch import advise, facts_of, make_plan, model_shapes, plan_run, refuse
from slide_train.machines import load_machine
from slide_train.models.build import load_model
from slide_train.plan import CONTENT_WORDS, GIB, LANE_WORDS, TIER_WORDS

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
    with nothing on disk it does not fit, and the share of the states on disk the refusal offers first makes it
    fit."""
    small = machine_with(gpu={"memory_gib": 24}, host={"memory_gib": 32})
    cfg = load_config(None, ["--model=llama-3.2-3b", "--seq_len=4096", "--micro_batch_size=2", "--grad_accum=4",
                             "--engine.nvme.fraction=0"])
    model = load_model(cfg.model, 0, need_tokenizer=False)
    shapes = model_shapes(model, model.stack(kernels=False))
    budgets = budgets_for(small, True, None)
    run = facts_of(cfg, "cuda")
    plan = make_plan(cfg, shapes, small, run, budgets)
    assert not plan.fits and plan.placement.bytes(HOST) > budgets.host == pytest.approx(0.95 * 32 * GIB)
    assert any(problem.startswith("host: needs ~") for problem in plan.problems)
    advise(plan, cfg, shapes, small, run, budgets)
    with pytest.raises(ConfigError, match=r"this run cannot fit: host: needs [^\n]*; these settings fit, with "
                                          r"their predicted step:\n    --engine.nvme.fraction=([0-9.]+): [0-9.]+ s "
                                          r"per step, the same training; the masters and AdamW moments of (\d+) of")\
            as no:
        refuse(plan, cfg)
    assert "--engine.states_dtype=bf16" in str(no.value) and "--max_grad_norm=null" in str(no.value)
    fraction = float(re.search(r"engine.nvme.fraction=([0-9.]+)", str(no.value)).group(1))
    fixed = make_plan(cfg, shapes, small, facts_of(cfg, "cuda"), budgets, nvme_fraction=fraction)
    assert fixed.fits and fixed.placement.on_disk and fixed.placement.bytes("disk") > 0
    less = make_plan(cfg, shapes, small, facts_of(cfg, "cuda"), budgets,
                     nvme_fraction=fraction - 1 / len(shapes.unit_numels), disk_loads=False)
    # the least that fits with copies of the parameters in RAM: a smaller share fits only where the planner then
    # slides more blocks (the share is of the sliding ones) and still puts as many on disk
    assert not less.fits or len(less.placement.on_disk) >= len(fixed.placement.on_disk)
    assert not fixed.placement.loads_from_disk
    auto = load_config(None, ["--model=llama-3.2-3b", "--seq_len=4096", "--micro_batch_size=2", "--grad_accum=4"])
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
                     "--max_grad_norm=null", "--engine.activation_offload=disk", "--engine.nvme.fraction=auto",
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
    """The problem names a micro-batch length that fits: planned with it, the GPU side fits; a tenth more not
    (whole rows: tiles of the MLP would fit more)."""
    small = machine_with(gpu={"memory_gib": 8})
    whole = "--engine.placement.sequence_tile=0"
    plan = plan_for(small, "--seq_len=32768", whole)
    found = re.search(r"gpu: needs ~[0-9.]+ GiB, [0-9.]+ GiB usable; at most ~(\d+) tokens per micro-batch would "
                      r"fit", plan.problems[0])
    assert not plan.fits and found
    tokens = int(found.group(1))
    fits = plan_for(small, f"--seq_len={tokens}", "--micro_batch_size=1", whole)
    assert fits.placement.bytes(GPU) <= fits.budgets.gpu
    more = plan_for(small, f"--seq_len={int(1.1 * tokens)}", "--micro_batch_size=1", whole)
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
    assert "predicted step" in text and "-bound: the GPU computes" in text and "GPU ~" in text
    assert "host memory ~" in text


@pytest.mark.parametrize("machine", ["rtx4090-pc.yaml", "rtx4090-pc-raid0.yaml"])
@pytest.mark.parametrize("preset, blocks", [("llama-3.1-70b", 80), ("mistral-large-2", 88)])
def test_70b_and_123b_on_a_24_gib_pc_fit_clipped_with_their_states_on_disk(capsys, preset, blocks, machine):
    """At seq 4096, 8 micro-batches of 1, on a PC with 256 GiB of RAM: neither fits with everything in RAM. With
    engine.nvme.fraction auto, no copy of the parameters of blocks whose master is on disk is kept (their loads
    read the master from disk), and where that is not enough (123B: the gradients exact clipping holds are
    228 GiB) their clipped gradients wait on disk too: both fit with clipping, the disk tier counting the
    gradients, whose bytes the plan's traffic writes and reads each step (and each master on disk for each load
    but the last block's backward, which finds it still in its slot)."""
    from slide_train.cli import main

    base = ["plan", f"--model={preset}", "--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8", "--machine",
            str(DOCS / machine), "--json"]

    def plan(*extra):
        code = main([*base, *extra])
        return code, json.loads(capsys.readouterr().out)

    code, out = plan("--engine.nvme.fraction=0")
    assert code == 2 and not out["fits"] and len(out["units"]) == blocks + 1
    assert out["gpu_bytes"] <= out["budgets"]["gpu"] and out["host_bytes"] > out["budgets"]["host"]
    assert out["bottleneck"] in BOTTLENECKS and out["predicted_step_s"] > 10
    code, auto = plan()  # (engine.nvme.fraction: auto by default; clip 1.0)
    assert code == 0 and auto["fits"] and auto["run"]["clip"] == 1.0 and auto["bottleneck"] == "disk"
    assert "parameters of masters on disk" not in auto["tiers"]["host"]
    assert sum(u["master"] == "disk" for u in auto["units"]) == sum(u["loads"] == "disk" for u in auto["units"])
    on_disk = [u for u in auto["units"] if u["grad"] == "disk"]
    if preset == "llama-3.1-70b":
        assert not on_disk  # (its held gradients fit host memory)
    else:
        assert on_disk and all(u["moments"] == "disk" for u in on_disk)
        masters = [u for u in auto["units"] if u["master"] == "disk"]  # (every block alike: 4 bytes a parameter)
        block_numel = auto["tiers"]["disk"]["masters"] / (4 * len(masters))
        assert auto["tiers"]["disk"]["gradients"] == 2 * block_numel * len(on_disk)  # bf16
        grads = 2 * block_numel * len(on_disk)
        read, written = auto["disk_traffic"]
        states = auto["tiers"]["disk"]["moments"] + auto["tiers"]["disk"]["masters"]
        loads = 2 * len(masters) - (auto["units"][-1] in masters)  # (the last block's backward reads none)
        assert written == states + grads and read == states + grads + 4 * block_numel * loads


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

    from slide_train import launch
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(k, raising=False)
    assert launch.use_expandable_segments() and calls == ["expandable_segments:True"]
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(k, "max_split_size_mb:128")
        assert not launch.use_expandable_segments() and len(calls) == 1  # the user's setting stands
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
    counted = shapes.unit_numels[0] + sum(shapes.active(u) for u in range(1, shapes.num_blocks + 1))
    assert sum(shapes.unit_numels) == pytest.approx(total, rel=1e-3) and counted == pytest.approx(active, rel=1e-2)
    # (of those, the routed experts: the share a machine's experts_tflops prices)
    routed = sum(shapes.routed(u) for u in range(1, shapes.num_blocks + 1))
    assert (routed > 0.5 * (counted - shapes.unit_numels[0])) == (active < total) and (routed == 0) == (active == total)
    machine = load_machine(TEST_MACHINE)
    plan = plan_for(machine, model=preset)
    everything = dc.replace(plan.placement, shapes=dc.replace(plan.placement.shapes, active_numels=()))
    compute, all_experts = price(plan.placement, machine), price(everything, machine)
    if active < total:
        assert compute.lanes["gpu"] < 0.5 * all_experts.lanes["gpu"]
    else:
        assert compute.lanes["gpu"] == all_experts.lanes["gpu"]


# -- what a plan advises, and what binds it -------------------------------------------------------------------------

PC = DOCS / "rtx4090-pc.yaml"
LLAMA_70B = ["--model=llama-3.1-70b", "--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8"]
SUGGESTION = re.compile(r"^    (--\S+(?: --\S+)*): ([0-9.]+) s per step, (the same training|changes the training)\b")


def plan_cli(capsys, *args: str) -> tuple[int, str]:
    from slide_train.cli import main

    code = main(["plan", *args])
    return code, capsys.readouterr().out


def plan_json(capsys, *args: str) -> tuple[int, dict]:
    code, out = plan_cli(capsys, *args, "--json")
    return code, json.loads(out)


@pytest.mark.parametrize("machine, run", [
    ("pc", [*LLAMA_70B, "--engine.nvme.fraction=0"]),  # the host's memory
    ("32 GiB host", ["--model=llama-3.2-3b", "--seq_len=4096", "--micro_batch_size=2", "--grad_accum=4",
                     "--engine.nvme.fraction=0"]),
    ("8 GiB GPU", ["--model=llama-3.2-3b", "--seq_len=65536", "--micro_batch_size=2", "--grad_accum=1"]),  # its GPU
])
def test_every_setting_a_refused_plan_offers_fits_when_applied_at_the_step_time_it_says(tmp_path, capsys, machine,
                                                                                         run):
    """Each suggestion line's overrides, added to the run's own and planned again, fit; the plan then predicts
    the step time the line printed. The lines that keep the training come before those that change it."""
    files = {"pc": PC, "32 GiB host": tmp_path / "small.yaml", "8 GiB GPU": tmp_path / "small.yaml"}
    if machine != "pc":
        from slide_train.machines import save_machine

        save_machine(machine_with(gpu={"memory_gib": 24}, host={"memory_gib": 32}) if machine == "32 GiB host"
                     else machine_with(gpu={"memory_gib": 8}), files[machine])
    base = [*run, "--machine", str(files[machine])]
    code, out = plan_cli(capsys, *base)
    lines = [SUGGESTION.match(line) for line in out.splitlines() if line.startswith("    --")]
    assert code == 2 and "does NOT fit" in out and lines and all(lines)
    same = [m.group(3) == "the same training" for m in lines]
    assert same == sorted(same, reverse=True) and "1 rows" not in out
    for m in lines:
        code, planned = plan_json(capsys, *base, *m.group(1).split())
        assert code == 0 and planned["fits"], m.group(1)
        assert planned["predicted_step_s"] == pytest.approx(float(m.group(2)), abs=0.051), m.group(1)


def test_70b_with_nothing_on_disk_is_refused_with_the_settings_that_fit(capsys):
    """engine.nvme.fraction=0 on the 24 GiB PC: one error line, then one line per setting, the share of the
    states on disk first (the same training), then bf16 states and no clipping, each saying what it changes."""
    code, out = plan_cli(capsys, *LLAMA_70B, "--engine.nvme.fraction=0", "--machine", str(PC))
    assert code == 2
    offered = [line for line in out.splitlines() if line.startswith("    --")]
    assert re.match(r"    --engine\.nvme\.fraction=0\.\d+: [0-9.]+ s per step, the same training; the masters and "
                    r"AdamW moments of \d+ of the 80 sliding blocks on disk", offered[0])
    assert any(line.startswith("    --engine.states_dtype=bf16") and "changes the training: AdamW's m and v in "
               "bf16" in line for line in offered)
    assert any(line.startswith("    --max_grad_norm=null") and "changes the training: no gradient clipping" in line
               for line in offered)
    # A run that cannot start is told the same, as one error line and then those lines
    cfg = load_config(None, [*LLAMA_70B, "--engine.nvme.fraction=0"])
    plan = plan_run(cfg, load_model(cfg.model, 0, need_tokenizer=False, need_weights=False), load_machine(PC),
                    running=False)[0]
    with pytest.raises(ConfigError) as no:
        refuse(plan, cfg)
    head, *rest = str(no.value).splitlines()
    assert head.startswith("this run cannot fit: host: needs ~") and head.endswith("these settings fit, with "
                                                                                   "their predicted step:")
    assert rest == offered


def test_70b_fits_the_pc_by_default_and_the_plan_says_what_the_disk_moves(capsys):
    """engine.nvme.fraction is auto by default: the 70B run fits with states on disk, and its plan says the tier's
    folder, the bytes it reads and writes per step (its moments and masters once each way, and each master read
    again for each of the two loads, but the last block's backward, which finds it still in its slot) and its busy
    time. One block streams its update: counted in the singular."""
    assert load_config(None, []).engine.nvme.fraction == "auto"
    code, out = plan_json(capsys, *LLAMA_70B, "--machine", str(PC))
    assert code == 0 and out["fits"] and out["disk_bytes"] > 0
    _, text = plan_cli(capsys, *LLAMA_70B, "--machine", str(PC))
    disk = out["tiers"]["disk"]
    found = re.search(r"host memory alone does not hold this run: the disk tier in (\S+) reads (\d+) GiB and writes "
                      r"(\d+) GiB per step, busy ([0-9.]+) s of the ([0-9.]+) s step", text)
    assert found and found.group(1) == "runs/default/nvme"
    assert int(found.group(3)) == round((disk["masters"] + disk["moments"]) / GIB)
    on_disk = [u for u in out["units"] if u["master"] == "disk"]
    assert all(u["loads"] == "disk" for u in on_disk) and out["units"][-1] in on_disk
    again = disk["masters"] / len(on_disk)  # (the last block's master, not read for its backward: blocks alike)
    assert int(found.group(2)) == round((3 * disk["masters"] - again + disk["moments"]) / GIB)
    # One unit for amounts of memory and data (GiB); GB only in rates (GB/s)
    assert re.findall(r"\b(?:GB|TB|MB)\b(?!/s)", text) == [] and " GiB" in text
    assert float(found.group(4)) == pytest.approx(out["lanes_s"]["disk"], abs=0.051)
    assert float(found.group(5)) == pytest.approx(out["predicted_step_s"], abs=0.051)
    assert "1 sliding block updates on the GPU" in text and "1 sliding blocks" not in text


def test_with_data_parallel_ranks_auto_keeps_the_states_in_memory_and_the_refusal_says_so(capsys):
    code, out = plan_cli(capsys, *LLAMA_70B, "--machine", str(PC), "--nproc=2")
    assert code == 2
    assert "with data-parallel ranks engine.nvme.fraction=auto keeps every state in host memory" in out
    code, planned = plan_json(capsys, *LLAMA_70B, "--machine", str(PC), "--nproc=2")
    assert planned["disk_bytes"] == 0 and not any(s["settings"].get("engine.nvme.fraction")
                                                  for s in planned["suggestions"])


WORD_LANES = {word: lane for lane, word in LANE_WORDS.items()}
LANE_NAMES = "|".join(re.escape(word) for word in sorted(WORD_LANES, key=len, reverse=True))
ENGINE_WORDS = ("gradient in pool", "gradient in ring", "gradient in own", "gradient in slot", "update on stream",
                "update on device", "update on host", "step readout", "activation landing", "pcie_h2d", "pcie_d2h",
                "host_memory", "host_adamw", "gpu_link", "exposed_updates", "host_backlog")


def lane_figures(text: str) -> dict[str, float]:
    """`copies to the GPU 0.33 + CPU AdamW 0.49` (or with units) as {lane: seconds}, lanes by their engine name."""
    return {WORD_LANES[word]: float(s) for word, s in re.findall(rf"({LANE_NAMES}) ([0-9.]+)", text)}


def binding(text: str) -> dict:
    """The prediction's figures as printed: the step, what binds it, the device's compute and what each stall
    adds; each phase and its parts; each lane's busy time; the line that says why, if any."""
    head = re.search(r"predicted step ([0-9.]+) s[^\n]*?, (GPU-bound|bound by ([^:\n]+)): the GPU computes ([0-9.]+) s "
                     r"of it \((\d+)%\)(?:; stalls add ([0-9.]+) s: ([^\n]*)|; nothing stalls it)\n", text)
    phases = re.search(r"\n    (forward [^\n]*)\n", text).group(1)
    busy = re.search(r"\n    busy per step: ([^\n]*)\n", text).group(1)
    why = re.search(rf"\n    ((?:{LANE_NAMES}): busy (?:less|longer) than [^\n]*)\n", text)
    return {"step": float(head.group(1)), "bound": "gpu" if head.group(2) == "GPU-bound" else WORD_LANES[head.group(3)],
            "gpu": float(head.group(4)), "share": int(head.group(5)),
            "stalls": float(head.group(6) or 0), "adds": lane_figures(head.group(7) or ""),
            "phases": {name: (float(length), lane_figures(parts))
                       for name, length, parts in re.findall(r"(\w[\w ]*?) ([0-9.]+) s = ([^;]*)", phases)},
            "busy": lane_figures(busy),
            "why": why.group(1) if why else None}


@pytest.mark.parametrize("machine, run, bound", [
    ("rtx4090-pc.yaml", ["--model=olmoe-1b-7b", "--grad_accum=8", "--micro_batch_size=1", "--seq_len=4096",
                         "--max_grad_norm=1.0"], "pcie_h2d"),
    ("h200-host.yaml", ["--model=llama-3.1-8b", "--engine.gpu_memory_limit_gb=24", "--micro_batch_size=1",
                        "--seq_len=32768", "--grad_accum=1"], "host_memory"),
    ("rtx4090-pc.yaml", ["--model=llama-3.1-8b", "--engine.gpu_memory_limit_gb=16", "--micro_batch_size=1",
                         "--seq_len=1024", "--grad_accum=1"], "pcie_h2d"),
    ("h100-host.yaml", ["--model=llama-3.1-8b", "--micro_batch_size=1", "--seq_len=4096", "--grad_accum=16"], "gpu"),
])
def test_what_a_plan_says_binds_it_is_what_its_printed_figures_show(capsys, machine, run, bound):
    """Plans whose named bottleneck once contradicted their own figures (one printed "bound by host_memory" where
    the GPU computes 5.42 of the step's 5.81 s). From what is printed: the step is the GPU's compute plus what
    each stall adds, and the sum of its phases, each the sum of its parts. The lane named is the cost model's
    bottleneck, as --json has it: the stall that adds the most where that is over 5% of the step, else the GPU.
    No lane adds more than it is busy. Where the lane named is not the busiest, a line says why, naming both."""
    code, text = plan_cli(capsys, *run, "--machine", str(DOCS / machine))
    shown = binding(text)
    assert code == 0 and shown["bound"] == bound
    assert shown["step"] == pytest.approx(shown["gpu"] + sum(shown["adds"].values()), abs=0.03)
    assert shown["stalls"] == pytest.approx(sum(shown["adds"].values()), abs=0.03)
    assert shown["share"] == pytest.approx(100 * shown["gpu"] / shown["step"], abs=1)
    assert shown["step"] == pytest.approx(sum(length for length, _ in shown["phases"].values()), abs=0.03)
    for length, parts in shown["phases"].values():
        assert length == pytest.approx(sum(parts.values()), abs=0.02)
    most = max(shown["adds"], key=shown["adds"].get, default=None)
    if bound == "gpu":
        assert most is None or shown["adds"][most] <= 0.05 * shown["step"] + 0.01
    else:
        assert most == bound and shown["adds"][bound] > 0.05 * shown["step"]
    assert all(added <= shown["busy"][lane] + 0.01 for lane, added in shown["adds"].items())
    assert shown["gpu"] == pytest.approx(shown["busy"]["gpu"], abs=0.01)
    busiest = max(shown["busy"], key=shown["busy"].get)
    if busiest != bound:
        assert shown["why"] and shown["why"].startswith(LANE_WORDS[busiest if bound == "gpu" else bound])
        assert ("GPU's compute" if "gpu" in (bound, busiest) else LANE_WORDS[busiest]) in shown["why"]
    else:
        assert shown["why"] is None
    assert plan_json(capsys, *run, "--machine", str(DOCS / machine))[1]["bottleneck"] == bound
    assert not [word for word in ENGINE_WORDS if word in text]


def test_the_text_and_the_json_of_llama_8b_on_the_h100_host_name_one_bound(capsys):
    """Llama-3.1-8B on the H100 host at 8 micro-batches of 2 x 128 tokens: copies to the GPU add over 5% of the
    step, which --json calls `bottleneck: pcie_h2d`; the text once said GPU-bound there. Now both read the
    estimate's one field, with clipping acting and not."""
    for run in (["--model=llama-3.1-8b"],
                ["--model=llama-3.1-8b", "--seq_len=2048", "--micro_batch_size=1", "--grad_accum=8"]):
        code, text = plan_cli(capsys, *run, "--machine", str(DOCS / "h100-host.yaml"))
        _, plan = plan_json(capsys, *run, "--machine", str(DOCS / "h100-host.yaml"))
        assert code == 0 and plan["bottleneck"] == "pcie_h2d" and binding(text)["bound"] == "pcie_h2d"
        head = re.search(r"predicted step [^\n]*", text).group(0)
        assert "GPU-bound" not in head and "bound by copies to the GPU:" in head
        assert plan["bottleneck_unclipped"] == plan["bottleneck"] and ", then " not in head


def test_a_plan_with_a_stall_over_5_percent_says_at_what_grad_accum_none_would_be(capsys):
    """OLMoE on the PC is stalled by PCIe at 8 micro-batches (1.68 s of a 5.13 s step): the plan names a
    grad_accum; planned again there no stall adds 5% of the step (the cost model's bottleneck is the GPU), and at
    one fewer one does."""
    run = ["--model=olmoe-1b-7b", "--grad_accum=8", "--micro_batch_size=1", "--seq_len=4096", "--machine", str(PC)]
    _, text = plan_cli(capsys, *run)
    found = re.search(r"more tokens per step: at --grad_accum=(\d+) \((\d+) tokens\) every stall would add under 5% "
                      r"of the step", text)
    accum = int(found.group(1))
    assert accum > 8 and int(found.group(2)) == accum * 4096
    assert plan_json(capsys, *run, f"--grad_accum={accum}")[1]["bottleneck"] == "gpu"
    assert plan_json(capsys, *run, f"--grad_accum={accum - 1}")[1]["bottleneck"] != "gpu"


def test_a_cpu_plan_names_its_compute_lane_and_no_gpu_or_pcie(tmp_path, capsys):
    from slide_train.machines import save_machine

    save_machine(machine_with(gpu={"memory_gib": 0}), tmp_path / "cpu.yaml")
    run = ["--model=llama-3.2-3b", "--seq_len=1024", "--micro_batch_size=1", "--machine", str(tmp_path / "cpu.yaml")]
    code, text = plan_cli(capsys, *run)
    busy = re.search(r"busy per step: ([^\n]*)", text).group(1)
    assert code == 0 and "CPU-bound: the CPU computes" in text and "busy per step: CPU compute" in text
    assert "GPU" not in busy and "copies" not in busy and "on the GPU" not in text
    lanes = plan_json(capsys, *run)[1]["lanes_s"]
    assert "compute" in lanes and not any(lane == "gpu" or lane.startswith("pcie") for lane in lanes)


def test_auto_measures_the_disk_only_where_the_plan_puts_something_there():
    """A machine whose disk is not measured: planning a run that RAM holds does not measure it; one that needs
    the disk tier is planned again on the measured machine, whose figures it then carries."""
    measured = machine_with(gpu={"memory_gib": 24}, host={"memory_gib": 256})
    unmeasured = dataclasses.replace(measured, disk=dataclasses.replace(measured.disk, free_gib=0.0, read_gbps=0.0,
                                                                        write_gbps=0.0))
    calls = []

    def measure():
        calls.append(1)
        return measured

    def planned(*args):
        cfg = load_config(None, list(args))
        model = load_model(cfg.model, 0, need_tokenizer=False, need_weights=False)
        return plan_run(cfg, model, unmeasured, running=False, measure_disk=measure)[0]

    small = planned("--model=llama-3.2-3b", "--seq_len=1024", "--micro_batch_size=1")
    assert small.fits and not small.placement.bytes("disk") and not calls
    large = planned(*LLAMA_70B)
    assert calls == [1] and large.fits and large.placement.bytes("disk") and large.budgets.disk == 1000 * GIB


def test_a_run_of_one_step_says_so_and_a_run_ram_holds_measures_no_disk(tmp_path, capsys, monkeypatch):
    """The default engine.nvme.fraction (auto) on a run that fits in RAM: this machine is resolved without its
    disk (no probe of a folder the run never writes), and nothing is left on disk."""
    from slide_train import launch
    from slide_train.cli import main

    asked = []
    monkeypatch.setattr(launch, "resolve_machine",
                        lambda path, disk_dir=None: asked.append(disk_dir) or load_machine(TEST_MACHINE))
    assert main(["finetune", "--steps=1", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1",
                 "--export=false", f"--output_dir={tmp_path / 'run'}", "--no-progress"]) == 0
    assert asked == [None] and not (tmp_path / "run" / "nvme").exists()
    assert "done: 1 step in" in capsys.readouterr().out


def test_a_step_of_milliseconds_is_printed_in_milliseconds_phase_by_phase(capsys):
    """The built-in tiny model's step takes milliseconds: its figures are printed in ms, not as zeros, and its
    phases still add up to the step."""
    code, text = plan_cli(capsys, "--machine", str(TEST_MACHINE))
    step = float(re.search(r"predicted step ([0-9.]+) ms", text).group(1))
    phases = re.search(r"\n    (forward [^\n]*)\n", text).group(1)
    lengths = [float(x) for x in re.findall(r"(?:^|; )\w[\w ]*? ([0-9.]+) ms =", phases)]
    assert code == 0 and step > 0 and len(lengths) >= 2 and sum(lengths) == pytest.approx(step, abs=0.15)


def test_plan_longest_finds_the_longest_rows_that_fit(capsys):
    """`plan --longest`: rows of the length it names fit the machine, rows 128 tokens longer do not; Llama-3.1-8B
    (its -256k preset, whose positions go past 131,072) under a 24 GiB cap on the H200 host fits 131,072 or more
    (with query tiles its limit, 262,144, where nothing longer is asked)."""
    from slide_train.cli import main

    machine = pathlib.Path(__file__).parents[3] / "docs" / "machines" / "h200-host.yaml"
    args = ["--model=llama-3.2-1b", "--micro_batch_size=1", "--grad_accum=1", "--engine.gpu_memory_limit_gb=6"]
    assert main(["plan", "--longest", f"--machine={machine}", *args]) == 0
    out = capsys.readouterr().out
    found = int(re.search(r"longest: rows of ([\d,]+) tokens fit", out).group(1).replace(",", ""))
    assert f"1 x 1 x {found} tokens per step" in out
    model = load_model("llama-3.2-1b", 0, need_tokenizer=False, need_weights=False)
    m = load_machine(machine)
    for seq_len, fits in ((found, True), (found + 128, False)):
        cfg = load_config(None, [*args, f"--seq_len={seq_len}"])
        assert plan_run(cfg, model, m, running=False)[0].fits == fits, seq_len
    args = ["--model=llama-3.1-8b-256k", "--micro_batch_size=1", "--grad_accum=1", "--engine.gpu_memory_limit_gb=24"]
    assert main(["plan", "--longest", f"--machine={machine}", *args]) == 0
    found = int(re.search(r"longest: rows of ([\d,]+) tokens fit", capsys.readouterr().out).group(1).replace(",", ""))
    assert found >= 131072
    model = load_model("llama-3.1-8b-256k", 0, need_tokenizer=False, need_weights=False)
    limit = model.hf_config.max_position_embeddings
    for seq_len, fits in ((found, True), (found + 128, False))[:1 if found == limit else 2]:
        cfg = load_config(None, [*args, f"--seq_len={seq_len}"])
        assert plan_run(cfg, model, m, running=False)[0].fits == fits, seq_len


def test_8b_rows_of_262144_tokens_fit_a_24_gib_cap_on_the_h100_host(capsys):
    """Llama-3.1-8B's -256k preset under a 24 GiB cap on the H100 host's file: `plan --longest` answers the
    model's limit, 262,144 tokens (whole-row attention stopped at 131,968), and the plan of rows that long fits
    with each block's attention by query tiles and its MLP by row tiles, the text saying so; without tiles it does
    not fit."""
    from slide_train.cli import main

    machine = str(DOCS / "h100-host.yaml")
    args = ["--model=llama-3.1-8b-256k", "--micro_batch_size=1", "--grad_accum=1", "--engine.gpu_memory_limit_gb=24",
            f"--machine={machine}"]
    assert main(["plan", "--longest", *args]) == 0
    out = capsys.readouterr().out
    assert re.search(r"longest: rows of ([\d,]+) tokens fit", out).group(1) == "262,144"
    assert "each block's attention runs by query tiles and its MLP over tiles of" in out
    code, plan = plan_json(capsys, *args, "--seq_len=262144")
    assert code == 0 and plan["fits"], plan["problems"]
    assert plan["sequence_tile"] and plan["gpu_bytes"] <= 24 * GIB
    code, whole = plan_json(capsys, *args, "--seq_len=262144", "--engine.placement.sequence_tile=0")
    assert not whole["fits"]


@pytest.mark.parametrize("bench", [
    ("llama-3.2-3b", "--seq_len=4096", "--micro_batch_size=2", "--grad_accum=4", "--engine.gpu_memory_limit_gb=24"),
    ("llama-3.1-8b", "--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8", "--engine.gpu_memory_limit_gb=16"),
])
def test_speculate_auto_takes_no_speculation_for_b3_and_b8_on_the_h200_host(capsys, bench):
    """B3 and B8 (benchmarks/run.py's shapes) on the H200 host's file: speculating plans measured slower there
    (docs/findings.md), and `auto` takes none, clipping on and never acting alike; `true` still speculates."""
    model, *args = bench
    machine = str(DOCS / "h200-host.yaml")
    for clip in ("1.0", "1e6"):
        code, plan = plan_json(capsys, f"--model={model}", *args, f"--max_grad_norm={clip}", "--machine", machine,
                               "--engine.placement.speculate=auto")
        assert code == 0 and plan["fits"], plan["problems"]
        assert not any(u["speculate"] for u in plan["units"])
    code, plan = plan_json(capsys, f"--model={model}", *args, "--max_grad_norm=1e6", "--machine", machine,
                           "--engine.placement.speculate=true")
    assert code == 0 and any(u["speculate"] for u in plan["units"])


def test_8b_at_131072_tokens_per_row_fits_a_24_gib_cap_on_the_h200_host(capsys):
    """Rows of 131,072 tokens of Llama-3.1-8B under a 24 GiB cap, with fp32 states: the plan tiles each MLP over
    the sequence (its attention whole), takes one set of activation landing buffers, and puts the states that host
    memory cannot hold on disk; each of those is needed (the plan without them does not fit)."""
    run = ["--model=llama-3.1-8b", "--seq_len=131072", "--micro_batch_size=1", "--grad_accum=1",
           "--engine.gpu_memory_limit_gb=24", "--machine", str(DOCS / "h200-host.yaml")]
    code, plan = plan_json(capsys, *run)
    assert code == 0 and plan["fits"], plan["problems"]
    assert plan["landing_sets"] == 1 and plan["sequence_tile"] == 4096 and plan["disk_bytes"] > 0
    assert not plan["query_tiles"]
    assert plan["run"]["state_bytes"] == 4 and plan["gpu_bytes"] <= 0.92 * 24 * GIB
    for without in ("--engine.placement.sequence_tile=0", "--engine.nvme.fraction=0"):
        code, other = plan_json(capsys, *run, without)
        assert not other["fits"], without
    code, more = plan_json(capsys, *run, "--engine.placement.landing_sets=3")  # (more sets: the attention by tiles)
    assert more["fits"] and more["query_tiles"] and more["landing_sets"] == 3


def test_the_plan_says_how_many_steps_the_drives_rated_endurance_lasts(tmp_path, capsys):
    """A machine file with disk.tbw: the plan prints the GiB the disk tier writes per step and the steps
    the drive's rating lasts at that rate (its disk traffic over the rating); without tbw, no such line."""
    from slide_train.machines import save_machine

    run = ["--model=mistral-large-2", "--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8"]
    code, planned = plan_json(capsys, *run, "--machine", str(DOCS / "rtx4090-pc.yaml"))
    _, written = planned["disk_traffic"]
    code, text = plan_cli(capsys, *run, "--machine", str(DOCS / "rtx4090-pc.yaml"))
    found = re.search(r"drive wear: at ([0-9,]+) GiB written per step, the drive's rated 2400 TBW lasts ~([0-9,]+) "
                      r"steps", text)
    assert code == 0 and found and int(found.group(1).replace(",", "")) == round(written / GIB)
    assert int(found.group(2).replace(",", "")) == round(2400e12 / written)
    machine = load_machine(DOCS / "rtx4090-pc.yaml")
    save_machine(dataclasses.replace(machine, disk=dataclasses.replace(machine.disk, tbw=0.0)), tmp_path / "m.yaml")
    code, text = plan_cli(capsys, *run, "--machine", str(tmp_path / "m.yaml"))
    assert code == 0 and "disk tier" in text and "drive wear" not in text


PLAIN_KINDS = {"edges", "slots", "resident blocks", "gradients", "boundary activations", "gradient shards"}


@pytest.mark.parametrize("run", [
    [*LLAMA_70B, "--machine", str(PC)],  # streamed and host updates, pooled gradients, states and loads on disk
    ["--model=olmoe-1b-7b", "--grad_accum=8", "--micro_batch_size=1", "--seq_len=4096", "--machine", str(PC)],  # held
    ["--model=llama-3.2-3b", "--seq_len=4096", "--micro_batch_size=1", "--grad_accum=4", "--max_grad_norm=1.0",
     "--engine.placement.speculate=true", "--engine.activation_offload=disk", "--engine.gpu_memory_limit_gb=16",
     "--machine", str(DOCS / "h200-host.yaml")],  # speculation, activations on disk
])
def test_the_plan_says_each_allocation_and_unit_placement_in_plain_words(capsys, run):
    """Each tier's contents as the plan prints them are those of --json, in the plan's words and GiB (none of
    a few bytes printed as 0.00); every unit line says where its update runs, its gradient waits and its master
    and moments live, with none of the engine's words."""
    _, out = plan_json(capsys, *run)
    _, text = plan_cli(capsys, *run)
    for tier, contents in out["tiers"].items():
        if not contents:
            continue
        assert set(contents) <= PLAIN_KINDS | CONTENT_WORDS.keys()
        line = next(line for line in text.splitlines() if line.startswith(f"  {TIER_WORDS[tier]} ~"))
        shown = [f"{CONTENT_WORDS.get(kind, kind)} {nbytes / GIB:.2f}" for kind, nbytes in contents.items()
                 if nbytes >= 0.005 * GIB]
        assert line.split(": ", 1)[1] == ", ".join(shown)
    # (a plan of more than 8 runs of units placed alike says `plan --json` lists them)
    for line in (line for line in text.splitlines() if re.match(r"    (edges|blocks? \d)", line)):
        assert re.search(r": (resident on the GPU|sliding); AdamW on the (GPU|CPU)[^;]*; gradient [^;]*; master", line)
    assert not [word for word in ENGINE_WORDS if word in text]


def test_plan_longest_with_auto_activations_searches_every_tier_and_names_what_binds_next(capsys):
    """`plan --longest` with engine.activation_offload=auto plans each length with the tier choice open (the plan
    of the configured seq_len chose the device for short rows, which froze a short answer), so it answers what the
    best fixed tier answers; and it names the tier that binds at 128 tokens more, with what would lift it."""
    from slide_train.cli import main

    machine = pathlib.Path(__file__).parents[3] / "docs" / "machines" / "h100-host.yaml"
    base = ["--model=llama-3.2-1b", "--micro_batch_size=1", "--grad_accum=1", "--engine.gpu_memory_limit_gb=6",
            "--seq_len=1024"]

    def longest(tier: str) -> tuple[int, str]:
        assert main(["plan", "--longest", f"--machine={machine}", *base,
                     f"--engine.activation_offload={tier}"]) == 0
        out = capsys.readouterr().out
        return int(re.search(r"longest: rows of ([\d,]+) tokens fit", out).group(1).replace(",", "")), out

    auto, out = longest("auto")
    fixed = {tier: longest(tier)[0] for tier in ("gpu", "host")}
    assert auto == max(fixed.values()) and auto > fixed["gpu"]
    binds = re.findall(rf"at {auto + 128:,} tokens, what binds: (\w+): needs ~[\d.]+ GiB, [\d.]+ GiB usable[^\n]*"
                       r"would lift it", out)
    assert binds and set(binds) <= {"gpu", "host", "disk"}


def test_the_plan_names_each_blocks_attention_backend_in_its_text_and_json(capsys):
    """Gemma-2-9B (soft-capped, head_dim 256) planned for the H100 host's GPU: every block takes a backend that
    computes a soft-cap (flash-attn-4 where installed, else FlexAttention; never SDPA), `--json` lists it per
    block and the text names the same; Llama-3.1-8B's plain causal layers take SDPA, and with packed documents a
    backend that keeps them apart without an [S, S] mask."""
    import json

    from slide_train.cli import main

    machine = pathlib.Path(__file__).parents[3] / "docs" / "machines" / "h100-host.yaml"
    for model, pack, expected in (("gemma-2-9b", "false", {"fa4", "flex"}), ("llama-3.1-8b", "false", {"sdpa"}),
                                  ("llama-3.1-8b", "true", {"fa4", "flex"})):
        args = ["plan", f"--machine={machine}", f"--model={model}", "--seq_len=4096", "--engine.device=cuda",
                "--engine.gpu_memory_limit_gb=24", "--engine.states_dtype=bf16", f"--data.pack={pack}"]
        main([*args, "--json"])
        listed = json.loads(capsys.readouterr().out)["attention"]
        main(args)
        text = capsys.readouterr().out
        assert len(listed) == (42 if model == "gemma-2-9b" else 32) and set(listed) <= expected
        assert f"attention: {listed[0]} for blocks 0..{len(listed) - 1}" in text


def test_where_the_tie_rule_took_a_slower_plan_the_text_and_the_json_say_so(capsys):
    """Llama-3.2-3B, clip 1.0, under 16 GiB on the H100 host: among candidates priced within the cost model's
    uncertainty the planner takes the one with less host memory, here not the fastest; `--json` gives the faster
    one's step and the text names the same figure. Where the fastest was taken, neither says anything."""
    import json

    from slide_train.cli import main

    machine = pathlib.Path(__file__).parents[3] / "docs" / "machines" / "h100-host.yaml"
    base = ["plan", f"--machine={machine}", "--model=llama-3.2-3b", "--seq_len=4096", "--micro_batch_size=1",
            "--grad_accum=8", "--engine.device=cuda", "--max_grad_norm=1.0"]
    for cap, tied in ((16, True), (24, False)):
        args = [*base, f"--engine.gpu_memory_limit_gb={cap}"]
        main([*args, "--json"])
        plan = json.loads(capsys.readouterr().out)
        main(args)
        text = capsys.readouterr().out
        passed = plan["tie_passed_over_s"]
        assert (passed is not None) == tied
        if tied:
            assert passed < plan["predicted_step_s"] <= passed * 1.05
            assert f"took this plan over one priced {passed:.2f} s" in text
        else:
            assert "took this plan over one priced" not in text
