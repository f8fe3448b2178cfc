"""slide_kernels.apply_to on real HF models (here, where transformers is installed): patched loss and gradients
equal the unpatched model's on every supported family."""

from __future__ import annotations

import sys

import torch
import transformers

import slide_kernels as sk


def _loss_and_grads(model, ids, labels):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_apply_to_real_hf_models(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # real HF modules on the torch path: quick on CPU
    torch.manual_seed(0)
    for cfg_cls in ("LlamaConfig", "Qwen3Config", "Qwen2Config", "MistralConfig"):
        cfg = getattr(transformers, cfg_cls)(vocab_size=97, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=8, max_position_embeddings=64)
        model = transformers.AutoModelForCausalLM.from_config(cfg).float()
        ids = torch.randint(0, 97, (2, 11))
        ref_loss, ref_grads = _loss_and_grads(model, ids, ids)
        module = sys.modules[type(model.model.layers[0].self_attn).__module__]
        original = module.apply_rotary_pos_emb
        try:
            patched = sk.apply_to(model)
            assert any("rms_norm" in p for p in patched) and any("linear_cross_entropy" in p for p in patched)
            loss, grads = _loss_and_grads(model, ids, ids)
        finally:
            module.apply_rotary_pos_emb = original
        assert abs(loss.item() - ref_loss.item()) < 1e-5, cfg_cls
        for name, g in ref_grads.items():
            assert (grads[name] - g).abs().max().item() < 1e-4, (cfg_cls, name)
