"""A mixture of experts' load-balancing loss follows either of HF's two training loops, as router_aux_loss says:
`trainer` (the default) the loop transformers.Trainer runs, where each micro-batch's term enters whole beside a
language-model loss divided by the step's label tokens (num_items_in_batch); `per_micro_batch` the plain loop of
`model(ids, labels=ids).loss / grad_accum`. A tiny Qwen3-MoE with a dense layer among the sparse ones trains three
clipped steps, fp32 on the CPU, to each loop's weights; the plan names the loop in use."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from conftest import tiny_config, write_token_rows

from slide_train.cli import main
from slide_train.config import load_config
from slide_train.data import builtin_tokenizer
from slide_train.export import hf_tensors
from slide_train.trainer import Trainer

ROWS, SEQ, MICRO, ACCUM, STEPS = 12, 33, 2, 2, 3
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 0.5


def save_model(directory) -> transformers.PreTrainedModel:
    """Hidden 64, 3 layers (the middle one dense), 4 heads, 2 KV heads, head_dim 16, vocab 512, untied; 4 experts,
    top-2, moe_intermediate_size 32, normalized top-k, load-balancing loss on at 0.02."""
    torch.manual_seed(0)
    config = tiny_config("qwen3_moe")
    for key, value in dict(vocab_size=512, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
                           output_router_logits=True, router_aux_loss_coef=0.02).items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(directory)
    builtin_tokenizer().save_pretrained(directory)
    assert [hasattr(layer.mlp, "experts") for layer in model.model.layers] == [True, False, True]
    return model


def hf_loop(model, rows: torch.Tensor, trainer_loop: bool):
    """Three steps of HF's model with torch AdamW and clip_grad_norm_: `trainer_loop` passes num_items_in_batch
    (the step's label tokens) as transformers.Trainer does, else each micro-batch's loss is divided by grad_accum."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(STEPS):
        chunk = rows[step * MICRO * ACCUM:(step + 1) * MICRO * ACCUM]
        opt.zero_grad()
        for m in range(ACCUM):
            ids = chunk[m * MICRO:(m + 1) * MICRO]
            if trainer_loop:
                loss = model(ids, labels=ids, num_items_in_batch=chunk.shape[0] * (SEQ - 1)).loss
            else:
                loss = model(ids, labels=ids).loss / ACCUM
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return model


def slide_run(tmp_path, name: str, extra: list[str]) -> dict[str, torch.Tensor]:
    cfg = load_config(None, [
        f"--model={tmp_path / 'model'}", f"--data.path={tmp_path / 'rows.jsonl'}", "--data.format=tokens",
        "--data.shuffle=false", "--data.pack=false", f"--seq_len={SEQ}", f"--micro_batch_size={MICRO}",
        f"--grad_accum={ACCUM}", f"--steps={STEPS}", f"--optimizer.lr={LR}", f"--optimizer.betas=[{BETAS[0]}, "
        f"{BETAS[1]}]", f"--optimizer.eps={EPS}", f"--optimizer.weight_decay={WD}", f"--max_grad_norm={CLIP}",
        "--schedule.decay=constant", "--engine.device=cpu", f"--output_dir={tmp_path / name}", *extra])
    trainer = Trainer(cfg, progress=False)
    records = [trainer.step() for _ in range(STEPS)]
    assert all(r["grad_norm"] > CLIP for r in records), "clipping must act in this case"
    trainer.engine.synchronize()
    masters = dict(hf_tensors(trainer.engine.named_masters()))
    trainer.close()
    return masters


def distance(ours: dict[str, torch.Tensor], ref) -> float:
    """The largest relative distance of a tensor from the loop's."""
    theirs = ref.state_dict()
    return max(((w - theirs[n]).norm() / theirs[n].norm()).item() for n, w in ours.items())


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("aux")
    model = save_model(tmp_path / "model")
    rows = torch.randint(0, 512, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))
    write_token_rows(tmp_path / "rows.jsonl", rows.tolist())
    loops = {"trainer": hf_loop(model, rows, trainer_loop=True), "per_micro_batch": hf_loop(model, rows, False)}
    return tmp_path, loops


@pytest.mark.parametrize("choice, args", [("trainer", []), ("trainer", ["--router_aux_loss=trainer"]),
                                          ("per_micro_batch", ["--router_aux_loss=per_micro_batch"])])
def test_the_load_balancing_loss_follows_the_chosen_hf_loop(case, choice, args):
    tmp_path, loops = case
    other = loops["per_micro_batch" if choice == "trainer" else "trainer"]
    assert distance(dict(other.named_parameters()), loops[choice]) > 1e-4  # the two loops differ in this case
    masters = slide_run(tmp_path, f"run-{choice}-{len(args)}", args)
    assert distance(masters, loops[choice]) < 1e-5
    assert distance(masters, other) > 1e-4


def test_the_plan_names_the_loop_in_use(case, capsys):
    tmp_path, _ = case
    base = [f"--model={tmp_path / 'model'}", f"--seq_len={SEQ}", f"--micro_batch_size={MICRO}", "--engine.device=cpu"]
    main(["plan", *base])
    assert ("load-balancing loss x 0.02: each micro-batch's whole, as transformers.Trainer adds it "
            "(router_aux_loss=trainer)") in capsys.readouterr().out
    main(["plan", *base, "--router_aux_loss=per_micro_batch"])
    assert ("load-balancing loss x 0.02: their mean over the step's micro-batches, as a loop of "
            "model(ids, labels=ids).loss / grad_accum has it (router_aux_loss=per_micro_batch)"
            ) in capsys.readouterr().out
    main(["plan", "--model=tiny-llama"])
    assert "load-balancing" not in capsys.readouterr().out  # (no mixture of experts)
