"""apply_to on tiny Qwen3-MoE, Mixtral and OLMoE models: every experts module runs `moe_experts` (its forward is
MoEExperts.forward, and the op runs once per sparse layer), the router stays transformers' own, and the loss
(with the load-balancing loss) and every gradient are the unpatched model's in fp32 (1e-5)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import slide_kernels as sk

transformers = pytest.importorskip("transformers")
moe_module = importlib.import_module("slide_kernels.ops.moe_experts")

VOCAB = 97
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=6,
    max_position_embeddings=64,
    output_router_logits=True,
    router_aux_loss_coef=0.1,
)
# Five experts, two per token; odd widths (H 24, expert I 20 or Mixtral's 40).
MOE = {
    "qwen3_moe": dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=5, num_experts_per_tok=2),
    "olmoe": dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=False),
}


@pytest.fixture
def restore_rope():
    """apply_to replaces the modeling modules' apply_rotary_pos_emb process-wide: HF's comes back afterwards."""
    before = {
        name: mod.apply_rotary_pos_emb
        for name, mod in list(sys.modules.items())
        if name.startswith("transformers.models.") and hasattr(mod, "apply_rotary_pos_emb")
    }
    yield
    for name, fn in before.items():
        sys.modules[name].apply_rotary_pos_emb = fn


def tiny_moe(model_type: str):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **(BASE | MOE[model_type]))
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    importlib.import_module(type(model).__module__)  # (its rotary function is restored after the test)
    with torch.no_grad():  # a router initialized to zeros would tie every top-k
        for name, param in model.named_parameters():
            if "gate" in name or "experts" in name:
                param.normal_(0.0, 0.3)
    return model


def loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def experts_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


@pytest.mark.parametrize("model_type", list(MOE))
def test_experts_run_moe_experts_and_keep_hf_loss_and_gradients(path, model_type, restore_rope, monkeypatch):
    model = tiny_moe(model_type)
    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = loss_and_grads(model, ids)

    patched = sk.apply_to(model)
    model.train()
    experts = experts_modules(model)
    assert len(experts) == model.config.num_hidden_layers
    for m in experts:
        assert m.forward.__func__ is sk.MoEExperts.forward, type(m).__name__
    assert sum("slide_kernels.moe_experts" in p for p in patched) == len(experts)
    calls = {"triton": 0, "torch": 0}
    for name, kind in (("moe_experts_forward", "triton"), ("moe_experts_torch", "torch")):
        original = getattr(moe_module, name)

        def counting(*args, _fn=original, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(moe_module, name, counting)
    loss, grads = loss_and_grads(model, ids)

    assert calls == {"triton": 0, "torch": 0} | {path[0]: len(experts)}
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    assert any(".experts." in n for n in grads) and any(".gate." in n for n in grads)
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max().item() <= 1e-5 * g.abs().max().item() + 1e-7, name


def test_experts_false_leaves_them(restore_rope):
    model = tiny_moe("olmoe")
    patched = sk.apply_to(model, experts=False)
    assert not any("moe_experts" in p for p in patched)
    assert not any(getattr(m, "_slide_kernels_patched", False) for m in experts_modules(model))


def test_experts_of_another_layout_are_left(restore_rope):
    """Experts that moe_experts does not compute (here: biases, as gpt-oss has) keep transformers' forward."""
    model = tiny_moe("qwen3_moe")
    experts = experts_modules(model)[0]
    experts.has_bias = True
    patched = sk.apply_to(model)
    assert sum("moe_experts" in p for p in patched) == model.config.num_hidden_layers - 1
    assert not getattr(experts, "_slide_kernels_patched", False)
