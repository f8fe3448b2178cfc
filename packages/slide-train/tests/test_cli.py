"""The quick start: `slide-train finetune` with no arguments trains the built-in tiny model and its loss falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers


def test_default_finetune_learns_and_exports(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "slide_train.cli", "finetune", f"--output_dir={tmp_path / 'run'}", "--steps=40",
         "--no-progress"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "tokens per step" in out.stdout and "exported to" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "tflops", "gpu_peak_gib",
                "host_rss_gib"):
        assert key in rows[0], key
    # tflops_attn adds causal attention's 6 x layers x heads x head_dim x seq_len FLOPs per token to tflops' 6N
    hf = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 6 * hf["num_hidden_layers"] * hf["num_attention_heads"] * head_dim * 128  # (the default seq_len)
    for r in rows[:3]:
        assert (r["tflops_attn"] - r["tflops"]) * 1e12 * r["step_s"] / r["tokens"] == pytest.approx(per_token)
    first, last = sum(r["loss"] for r in rows[:5]) / 5, sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 1.0, f"loss did not clearly fall: {first:.3f} -> {last:.3f}"
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    assert any((tmp_path / "run" / "tensorboard").iterdir())

    export = tmp_path / "run" / "export"
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    tok = transformers.AutoTokenizer.from_pretrained(export)
    ids = torch.tensor([tok.encode("The cat")])
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)


def test_help_lists_every_key_with_default():
    out = subprocess.run([sys.executable, "-m", "slide_train.cli", "finetune", "--help"], capture_output=True,
                         text=True, check=True)
    for key in ("engine.placement", "optimizer.lr", "schedule.warmup_steps", "data.format", "checkpoint.every"):
        assert key in out.stdout
    engine_keys = [line.split()[0] for line in out.stdout.splitlines() if line.strip().startswith("engine.")]
    assert engine_keys == ["engine.device", "engine.gpu_memory_limit_gb", "engine.host_memory_limit_gb",
                           "engine.compute_dtype",
                           "engine.states_dtype", "engine.kernels", "engine.activation_offload", "engine.nvme.dir",
                           "engine.nvme.fraction", "engine.placement"]  # at most 10, each a user's choice
    assert "docs/placement.md" in next(line for line in out.stdout.splitlines() if "engine.placement" in line)


def test_no_progress_hides_every_bar(tmp_path, monkeypatch):
    """--no-progress reaches the bars of checkpoints and exports too, which callers show on a terminal."""
    from slide_train import progress
    from slide_train.cli import main

    monkeypatch.setattr(progress, "_hidden", False)
    assert not progress.bar(range(2), desc="writing step-1", unit="file", show=True).disable
    assert main(["finetune", "--steps=1", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1",
                 "--export=false", f"--output_dir={tmp_path / 'run'}", "--no-progress"]) == 0
    assert progress.bar(range(2), desc="writing step-1", unit="file", show=True).disable


def test_profile_flag_and_profile_key(tmp_path):
    """`--profile` alone and the config key's `--profile=true|false` (argparse refused the latter two)."""
    from slide_train.cli import main

    base = ["finetune", "--steps=1", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false",
            "--no-progress"]
    for flag, written in (("--profile", True), ("--profile=true", True), ("--profile=false", False)):
        run = tmp_path / flag.strip("-").replace("=", "-")
        assert main([*base, f"--output_dir={run}", flag]) == 0
        assert (run / "timeline.png").is_file() == written, flag
