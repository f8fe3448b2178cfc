"""Data-parallel runs: `torchrun --nproc-per-node 2 -m slide_train finetune` on CPUs (gloo) against one process and
a plain PyTorch loop on the same global batch; host bytes per rank; a mixture of experts with its auxiliary loss;
checkpoints resumed in two processes and in one."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import save_tiny_model, write_token_rows
from safetensors.torch import load_file
from test_equivalence import CLIP, SEQ, make_rows, reference_run

from slide_train import checkpoint as ckpt
from slide_train.config import load_config
from slide_train.errors import ConfigError
from slide_train.export import hf_tensors
from slide_train.models.build import load_model
from slide_train.trainer import Trainer

STEPS = 3  # reference_run's; rows per step: MICRO x ACCUM there, ranks x micro x accum here


def overrides(tmp_path: pathlib.Path, run: str, **extra) -> list[str]:
    cfg = {"model": tmp_path / "model", "data.path": tmp_path / "data.jsonl", "data.format": "tokens",
           "data.shuffle": "false", "data.pack": "false", "seq_len": SEQ, "steps": STEPS,
           "optimizer.lr": 3e-3, "optimizer.betas": "[0.9,0.95]", "optimizer.eps": 1e-6,
           "optimizer.weight_decay": 0.1, "max_grad_norm": CLIP, "schedule.decay": "constant",
           "engine.device": "cpu", "output_dir": tmp_path / run, "export": "false"} | extra
    return [f"--{k}={v}" for k, v in cfg.items()]


def finetune(args: list[str], ranks: int) -> None:
    """`slide-train finetune` in `ranks` processes started by torchrun (one: a plain process)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, "-m", "slide_train", "finetune", "--no-progress", *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def masters(run: pathlib.Path, step: int) -> dict[str, torch.Tensor]:
    path = run / "checkpoints" / f"step-{step}"
    return {name: load_file(str(path / ckpt.unit_file(name)))["master"]
            for name in ["edges"] + [f"block.{i}" for i in range(3)]}


def states(run: pathlib.Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    path = run / "checkpoints" / f"step-{step}"
    return {f.name: load_file(str(f)) for f in sorted(path.glob("*.safetensors"))}


def records(run: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return float((a - b).norm()) <= rel * float(b.norm())


def test_two_ranks_train_as_one_process_and_as_plain_pytorch(tmp_path):
    """Two ranks of 1 x 2 micro-batches are the step of one process with 2 x 2, and of torch's loop over the HF
    model with HF's loss: 2e-5 relative, clipping acting in every step."""
    model = save_tiny_model(tmp_path / "model", "llama")
    rows, labels = make_rows(seed=1, n=STEPS * 4)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    finetune(overrides(tmp_path, "two", micro_batch_size=1, grad_accum=2), ranks=2)
    finetune(overrides(tmp_path, "one", micro_batch_size=2, grad_accum=2), ranks=1)
    two, one = records(tmp_path / "two"), records(tmp_path / "one")
    ref_model, ref_losses, ref_norms = reference_run(model, rows, labels)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=2e-5)
    assert [r["grad_norm"] for r in two] == pytest.approx(ref_norms, rel=2e-5)
    assert [r["loss"] for r in two] == pytest.approx(ref_losses, rel=2e-5)
    assert all(n > CLIP for n in ref_norms), "clipping must act in this test"
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]  # the global step's, counted once
    want = masters(tmp_path / "one", STEPS)
    for name, t in masters(tmp_path / "two", STEPS).items():
        assert t.shape == want[name].shape and close(t, want[name], 2e-5), name
    stack = load_model(str(tmp_path / "model"), 0, need_tokenizer=False).stack(kernels=False)
    ours = dict(hf_tensors(ckpt.read_masters(tmp_path / "two" / "checkpoints" / f"step-{STEPS}",
                                             ckpt.unit_layouts(stack))))
    ref = ref_model.state_dict()
    for name, t in ours.items():
        assert close(t, ref[name], 2e-5), name


def test_each_rank_plans_half_of_the_masters_and_moments(tmp_path):
    """`slide-train plan --nproc 2`: a rank's masters and moments are half of one process's (host bytes)."""
    save_tiny_model(tmp_path / "model", "llama")
    write_token_rows(tmp_path / "data.jsonl", *make_rows(seed=1, n=4))

    def host(nproc: int) -> dict:
        done = subprocess.run([sys.executable, "-m", "slide_train", "plan", "--json", f"--nproc={nproc}",
                               *overrides(tmp_path, "plan")], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)["tiers"]["host"]

    one, two = host(1), host(2)
    for kind in ("masters", "moments"):
        assert two[kind] * 2 == pytest.approx(one[kind], rel=0.01)


def test_a_mixture_of_experts_with_its_aux_loss_equals_one_process_with_the_same_micro_batches(tmp_path):
    """HF's load-balancing loss is per micro-batch: two ranks of 2 micro-batches are one process of 4."""
    model = save_tiny_model(tmp_path / "model", "qwen3_moe")
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.5
    model.config.save_pretrained(tmp_path / "model")
    rows, labels = make_rows(seed=2, n=STEPS * 4)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    finetune(overrides(tmp_path, "two", micro_batch_size=1, grad_accum=2), ranks=2)
    finetune(overrides(tmp_path, "one", micro_batch_size=1, grad_accum=4), ranks=1)
    two, one = records(tmp_path / "two"), records(tmp_path / "one")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=2e-5)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=2e-5)
    assert all(r["grad_norm"] > CLIP for r in one)
    want = masters(tmp_path / "one", STEPS)
    for name, t in masters(tmp_path / "two", STEPS).items():
        assert close(t, want[name], 2e-5), name


def test_a_two_rank_checkpoint_resumes_bitwise_in_two_ranks_and_closely_in_one(tmp_path):
    """Checkpoint at step 2 of 3; resumed in two processes, step 3 is the uninterrupted run's bit for bit (masters
    and AdamW states); in one process (grad_accum doubles to keep the rows per step), within 1e-5."""
    save_tiny_model(tmp_path / "model", "llama")
    write_token_rows(tmp_path / "data.jsonl", *make_rows(seed=3, n=STEPS * 4))
    finetune(overrides(tmp_path, "whole", micro_batch_size=1, grad_accum=2, **{"checkpoint.every": 2,
                                                                               "checkpoint.keep": 3}), ranks=2)
    for run in ("again", "alone"):
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-2", tmp_path / run / "checkpoints" / "step-2")
    finetune(overrides(tmp_path, "again", micro_batch_size=1, grad_accum=2, resume="auto"), ranks=2)
    finetune(overrides(tmp_path, "alone", micro_batch_size=1, grad_accum=2, resume="auto"), ranks=1)
    want = states(tmp_path / "whole", STEPS)
    got = states(tmp_path / "again", STEPS)
    assert want.keys() == got.keys()
    for f, tensors in want.items():
        if f.startswith(("edges", "block")):
            assert all(got[f][k].equal(t) for k, t in tensors.items()), f
    alone = masters(tmp_path / "alone", STEPS)
    for name, t in masters(tmp_path / "whole", STEPS).items():
        assert close(alone[name], t, 1e-5), name
    assert "grad_accum 4 keeps its 4 rows per step" in (tmp_path / "alone" / "log.txt").read_text()
    # 4 rows per step in micro-batches of 3: no whole grad_accum gives them
    odd = load_config(None, overrides(tmp_path, "odd", micro_batch_size=3, grad_accum=1,
                                      resume=tmp_path / "whole" / "checkpoints" / "step-2"))
    with pytest.raises(ConfigError, match="no whole grad_accum gives 4 rows"):
        Trainer(odd, progress=False)
