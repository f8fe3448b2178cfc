"""Mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE) against transformers: three clipped, accumulated steps
equal a plain PyTorch loop over the HF model with HF's own loss; the export loads with `from_pretrained` and gives
the trained masters' logits, and trains again; a resumed run is the uninterrupted one bit for bit; what the engine
cannot train exactly is refused with the reason."""

from __future__ import annotations

import copy
import pathlib
import re

import pytest
import test_equivalence as eq
import torch
import transformers
from conftest import MOE_FAMILIES, save_tiny_model, tiny_config, write_token_rows
from test_equivalence import ACCUM, CLIP, MICRO, SEQ, STEPS, compare, make_rows, reference_run, slide_config
from test_families import assert_resumes_bit_for_bit, eval_batch

from slide_train.errors import ModelError
from slide_train.export import hf_tensors
from slide_train.models.adapter import HFStack
from slide_train.trainer import Trainer


def float64_reference(model, rows, labels):
    """The plain loop in float64: transformers' grouped matmul takes no float64, its eager experts loop does."""
    model = copy.deepcopy(model)
    model.set_experts_implementation("eager")
    return reference_run(model, rows, labels, torch.float64)[0]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_three_steps_match_plain_pytorch_and_the_export_loads(tmp_path, family):
    model = save_tiny_model(tmp_path / "model", family)
    rows, labels = make_rows(seed=1, n=STEPS * MICRO * ACCUM)
    rows[0][SEQ // 2] = rows[5][3] = model.config.pad_token_id  # the pad row's gradient is zero in HF
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                   **{"engine.placement.window": 2}), progress=False)
    experts = trainer.engine.slots.slots[0].module.layer.mlp.experts
    assert experts.config._experts_implementation == "grouped_mm"  # transformers' own, not a loop over experts
    records = [trainer.step() for _ in range(STEPS)]
    ref_model, ref_losses, ref_norms = reference_run(model, rows, labels)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx(ref_norms, rel=1e-5)
    assert all(r["grad_norm"] > CLIP for r in records), "clipping must be active in this test"
    compare(trainer, ref_model, float64_reference(model, rows, labels))

    out = trainer.export(tmp_path / "export")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert loaded.config.model_type == family and type(loaded).__name__ == type(model).__name__
    state = dict(hf_tensors(trainer.engine.named_masters()))
    fresh = transformers.AutoModelForCausalLM.from_config(loaded.config).float()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and not missing
    ids, lab, micro, n = eval_batch(rows, labels)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, fresh(ids).logits, rtol=1e-5, atol=1e-5)
        hf_loss = loaded(ids, labels=lab).loss.item()
    assert trainer.engine.evaluate(micro, normalizer=n) == pytest.approx(hf_loss, rel=1e-5)
    trainer.close()
    # The export (fused experts) is a model slide-train starts from too.
    again = Trainer(slide_config(tmp_path, out, tmp_path / "data.jsonl", output_dir=tmp_path / "again"),
                    progress=False)
    assert again.engine.evaluate(micro, normalizer=n) == pytest.approx(hf_loss, rel=1e-5)
    again.close()


def test_resume_bit_for_bit(tmp_path):
    """Two steps, a checkpoint and one resumed step give the three-step run's masters and AdamW states exactly."""
    save_tiny_model(tmp_path / "model", "qwen3_moe")
    rows, labels = make_rows(seed=4, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    whole = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                 output_dir=tmp_path / "whole"), progress=False)
    assert_resumes_bit_for_bit(tmp_path, whole)


def test_mixtral_router_noise_is_refused():
    """Jitter noise is drawn again in the backward's recompute, and could route tokens to other experts."""
    config = tiny_config("mixtral")
    config.router_jitter_noise = 0.1
    with pytest.raises(ModelError, match=r"router_jitter_noise=0.1 is not supported: each block's backward "
                                         r"recomputes its forward"):
        HFStack(config, None)


@pytest.mark.parametrize("preset, total, block", [("olmoe-1b-7b", 6_919_161_856, 419_569_664),
                                                  ("qwen3-30b-a3b", 30_532_122_624, 623_120_640)])
def test_presets_have_the_published_size_and_the_plan_counts_every_expert(capsys, preset, total, block):
    """Built on the meta device: OLMoE-1B-7B's 6.9B and Qwen3-30B-A3B's 30.5B parameters; the plan's blocks hold
    every expert of their layer."""
    import json

    from slide_train.cli import main
    from slide_train.models.presets import preset_config

    config = preset_config(preset)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == total
    stack = HFStack(config, None)
    assert sum(p.numel() for p in stack.make_block().parameters()) == block
    main(["plan", f"--model={preset}", "--seq_len=1024", "--micro_batch_size=1", "--json"])  # fits or not
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["params"] == total


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_load_balancing_loss_matches_transformers(tmp_path, family):
    """output_router_logits on: HF's loss adds router_aux_loss_coef times a loss pooled over every layer's routing.
    Three clipped, accumulated steps still equal the plain loop with HF's loss, which includes it; the step record
    carries the loss and the experts' least and most load."""
    model = save_tiny_model(tmp_path / "model", family)
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.5  # large enough to matter
    model.config.save_pretrained(tmp_path / "model")
    model.router_aux_loss_coef = 0.5  # (the HF model copies it from its config when built)
    rows, labels = make_rows(seed=2, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl"), progress=False)
    records = [trainer.step() for _ in range(STEPS)]
    ref_model, ref_losses, ref_norms = reference_run(model, rows, labels)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx(ref_norms, rel=1e-5)
    assert all(r["grad_norm"] > CLIP for r in records), "clipping must be active in this test"
    compare(trainer, ref_model, float64_reference(model, rows, labels))
    for r in records:
        assert r["aux_loss"] > 1.9  # top-k (2) where routing is perfectly even, more where it is not
        assert 0 <= r["expert_load_min"] <= 1.0 <= r["expert_load_max"]
    ids, lab, micro, n = eval_batch(rows, labels)
    with torch.no_grad():
        out = ref_model(ids, labels=lab)
        without = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), lab[:, 1:].flatten())
    assert abs(out.loss.item() - without.item()) > 0.1  # the auxiliary term counts in this test
    assert trainer.engine.evaluate(micro, normalizer=n) == pytest.approx(out.loss.item(), rel=1e-5)
    trainer.close()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_without_the_load_balancing_loss_the_step_record_still_says_the_experts_load(tmp_path, family):
    """output_router_logits off (the loss is HF's language-model loss alone): each step's record has the least and
    most loaded experts' share of the top-k picks over all layers, and no aux_loss; the first step's are those of
    HF's own router logits on the same micro-batches."""
    model = save_tiny_model(tmp_path / "model", family)
    assert not model.config.output_router_logits
    rows, labels = make_rows(seed=2, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl"), progress=False)
    record = trainer.step()
    trainer.close()
    assert "aux_loss" not in record
    with torch.no_grad():
        logits = model(torch.tensor(rows[:MICRO * ACCUM]), output_router_logits=True).router_logits
    experts, top_k = logits[0].shape[-1], model.config.num_experts_per_tok
    picks = torch.cat([torch.softmax(layer, dim=-1).topk(top_k, dim=-1).indices.flatten() for layer in logits])
    load = torch.bincount(picks, minlength=experts).float() * experts / picks.numel()
    assert (record["expert_load_min"], record["expert_load_max"]) == pytest.approx(
        (load.min().item(), load.max().item()), rel=1e-6)
    assert load.min() < 1.0 < load.max()


@pytest.mark.parametrize("padded", [False, True])
def test_router_stats_give_transformers_load_balancing_loss_and_its_gradient(padded):
    """What the blocks record and the tail computes, against transformers' `load_balancing_loss_func` over all
    layers at once (padding excluded through its attention mask): the loss, and the gradient w.r.t. every layer's
    router logits from the closed form the blocks' backward applies."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from slide_train.models.adapter import RouterStats

    layers, batch, seq, experts, top_k, coef = 3, 2, 12, 8, 2, 0.3
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch * seq, experts, generator=g, requires_grad=True) for _ in range(layers)]
    mask = torch.ones(batch, seq)
    if padded:
        mask[1, 7:] = 0
    want = load_balancing_loss_func(tuple(logits), experts, top_k, mask if padded else None)
    (coef * want).backward()
    stats = RouterStats(mask.reshape(-1) if padded else None)
    sums = []
    for index, layer_logits in enumerate(logits):
        counts, prob_sums, rows = stats.sums(layer_logits.detach().requires_grad_(), top_k, experts)
        stats.layers[index] = (counts, prob_sums.detach(), rows)
        sums.append((layer_logits, counts, rows))
    got, _ = stats.loss(coef, experts)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for layer_logits, _, _ in sums:
        mine = layer_logits.detach().requires_grad_()
        _, prob_sums, _ = stats.sums(mine, top_k, experts)
        prob_sums.backward(stats.grad)
        torch.testing.assert_close(mine.grad, layer_logits.grad, rtol=1e-5, atol=1e-8)


def test_the_load_balancing_loss_leaves_padding_out_as_transformers_attention_mask_does(tmp_path):
    """Rows shorter than seq_len are padded (document id -1): the load-balancing loss counts their tokens only,
    as transformers does given the attention mask. Three steps equal the plain loop that passes that mask."""
    model = save_tiny_model(tmp_path / "model", "olmoe")
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.5
    model.config.save_pretrained(tmp_path / "model")
    model.router_aux_loss_coef = 0.5
    rows, labels = make_rows(seed=3, n=STEPS * MICRO * ACCUM)
    lengths = [SEQ if i % 3 else SEQ - 7 for i in range(len(rows))]
    write_token_rows(tmp_path / "data.jsonl", [r[:n] for r, n in zip(rows, lengths)],
                     [x[:n] for x, n in zip(labels, lengths)])
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl"), progress=False)
    records = [trainer.step() for _ in range(STEPS)]

    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=eq.LR, betas=eq.BETAS, eps=eq.EPS, weight_decay=eq.WD)
    ids, lab = torch.tensor(rows), torch.tensor(labels)
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(lengths)[:, None]).long()
    lab = lab.masked_fill(mask == 0, -100)
    losses = []
    for step in range(STEPS):
        chunk = slice(step * MICRO * ACCUM, (step + 1) * MICRO * ACCUM)
        n_items = int((lab[chunk][:, 1:] != -100).sum())
        opt.zero_grad()
        total = 0.0
        for m in range(ACCUM):
            mb = slice(chunk.start + m * MICRO, chunk.start + (m + 1) * MICRO)
            out = ref(input_ids=ids[mb], attention_mask=mask[mb], labels=lab[mb], num_items_in_batch=n_items)
            out.loss.backward()
            total += out.loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        losses.append(total)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)
    compare(trainer, ref)
    trainer.close()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_adapter_counts_the_parameters_one_token_computes_with(family):
    """The plan's active parameters per block come from the adapter: they are those one token's gradient reaches
    in an HF layer (the dense parts, the router, and the slices of the experts it is routed to)."""
    config = tiny_config(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model(torch.tensor([[5]])).logits.square().sum().backward()
    reached = experts = 0
    for name, p in model.model.layers[0].named_parameters():
        if ".experts." in f".{name}" and p.dim() == 3:  # one slice per expert: only the routed ones are reached
            experts += sum(p[e].numel() for e in range(p.shape[0]) if p.grad[e].abs().sum() > 0)
        elif ".experts." in f".{name}":  # one tensor per expert
            experts += p.numel() if p.grad is not None and p.grad.abs().sum() > 0 else 0
        else:
            reached += p.numel()
    stack = HFStack(tiny_config(family), None)
    block = stack.make_block()
    assert stack.active_numel(block) == reached + experts and stack.routed_numel(block) == experts > 0
    assert reached + experts < sum(p.numel() for p in block.parameters())


# Qwen3-MoE with dense layers among the sparse ones: blocks of two shapes in the same slots
MIXED = {
    "mlp_only_layers=[1]": dict(mlp_only_layers=[1]),
    "decoder_sparse_step=2": dict(decoder_sparse_step=2),
    "dense first, middle and last": dict(num_hidden_layers=5, mlp_only_layers=[0, 2, 4]),
}


def save_mixed_model(directory, change: dict, aux: bool):
    aux_loss = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if aux else {}
    return save_tiny_model(directory, "qwen3_moe", changes={**change, **aux_loss})


@pytest.mark.parametrize("name, aux", [("mlp_only_layers=[1]", False), ("mlp_only_layers=[1]", True),
                                       ("decoder_sparse_step=2", False), ("dense first, middle and last", True)])
def test_dense_layers_among_experts_train_as_transformers_and_export(tmp_path, name, aux):
    """Dense and mixture-of-experts layers slide through the same slots: three clipped, accumulated steps equal
    the plain loop with HF's loss (its load-balancing term pooled over the sparse layers only), the export loads
    with the same logits, and the engine's evaluation gives HF's loss."""
    model = save_mixed_model(tmp_path / "model", MIXED[name], aux)
    kinds = ["experts" if hasattr(layer.mlp, "experts") else "dense" for layer in model.model.layers]
    assert "dense" in kinds and "experts" in kinds
    rows, labels = make_rows(seed=1, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                   **{"engine.placement.window": 2}), progress=False)
    stack_shapes = trainer.engine.block_shapes
    assert stack_shapes == kinds
    shapes = trainer.memory_plan.placement.shapes
    assert shapes.mixed and shapes.block_numel == max(shapes.unit_numels[1:])
    records = [trainer.step() for _ in range(STEPS)]
    ref_model, ref_losses, ref_norms = reference_run(model, rows, labels)
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=1e-5)
    assert [r["grad_norm"] for r in records] == pytest.approx(ref_norms, rel=1e-5)
    assert all(r["grad_norm"] > CLIP for r in records), "clipping must be active in this test"
    assert all(("aux_loss" in r) == aux for r in records)
    compare(trainer, ref_model, float64_reference(model, rows, labels))
    out = trainer.export(tmp_path / "export")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert [hasattr(layer.mlp, "experts") for layer in loaded.model.layers] == [k == "experts" for k in kinds]
    ids, lab, micro, n = eval_batch(rows, labels)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref_model(ids).logits, rtol=1e-4, atol=1e-5)
        hf_loss = loaded(ids, labels=lab).loss.item()
    assert trainer.engine.evaluate(micro, normalizer=n) == pytest.approx(hf_loss, rel=1e-5)
    trainer.close()


@pytest.mark.parametrize("name", MIXED)
def test_dense_layers_among_experts_resume_bit_for_bit(tmp_path, name):
    save_mixed_model(tmp_path / "model", MIXED[name], aux=name != "decoder_sparse_step=2")
    rows, labels = make_rows(seed=4, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    whole = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl",
                                 output_dir=tmp_path / "whole"), progress=False)
    assert_resumes_bit_for_bit(tmp_path, whole)


def test_the_plan_of_qwen3_30b_a3b_with_dense_first_layers_prints_each_block_size(tmp_path, capsys):
    """Qwen3-30B-A3B's shape with its first 4 layers dense: the plan counts each block by its own parameters
    (and active ones), prints each size's bytes and a step time."""
    from slide_train.cli import main
    from slide_train.models.presets import preset_config

    config = preset_config("qwen3-30b-a3b")
    config.mlp_only_layers = [0, 1, 2, 3]
    config.save_pretrained(tmp_path / "model")
    machine = pathlib.Path(__file__).parents[3] / "docs" / "machines" / "rtx4090-pc.yaml"
    main(["plan", f"--model={tmp_path / 'model'}", "--seq_len=4096", "--micro_batch_size=1", "--grad_accum=8",
          f"--machine={machine}"])
    out = capsys.readouterr().out
    with torch.device("meta"):
        layers = transformers.AutoModelForCausalLM.from_config(config).model.layers
    dense, sparse = (sum(p.numel() for p in layers[i].parameters()) for i in (0, 4))
    assert (f"4 blocks of {dense / 1e6:.1f}M params" in out and f"44 blocks of {sparse / 1e6:.1f}M params" in out
            and "from block 4" in out), out
    assert re.search(r"predicted step \d+\.\d+ s", out), out


def test_a_checkpoint_of_dense_layers_among_experts_exports(tmp_path):
    """`slide-train export` lays out each block of a checkpoint by its own shape: the export of a checkpoint is
    the trainer's own export, tensor for tensor."""
    from slide_train.export import export_run

    save_mixed_model(tmp_path / "model", MIXED["dense first, middle and last"], aux=False)
    rows, labels = make_rows(seed=4, n=STEPS * MICRO * ACCUM)
    write_token_rows(tmp_path / "data.jsonl", rows, labels)
    trainer = Trainer(slide_config(tmp_path, tmp_path / "model", tmp_path / "data.jsonl"), progress=False)
    trainer.step()
    trainer.save_checkpoint()
    direct = trainer.export(tmp_path / "direct")
    trainer.close()
    out = export_run(tmp_path / "run", out=str(tmp_path / "from-checkpoint"))
    a = transformers.AutoModelForCausalLM.from_pretrained(direct, dtype=torch.float32).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
