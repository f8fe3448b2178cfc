"""Random initial weights of the built-in presets: HF's init, reproducible tensor by tensor."""

from __future__ import annotations

import pytest
import torch
import transformers

from slide_train.errors import ModelError
from slide_train.models.random_init import RandomWeights


def config():
    return transformers.AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=300)


def test_values_depend_on_seed_and_name_only_and_follow_hf_init():
    """Norms are ones, biases zeros, every other tensor N(0, initializer_range) from a generator of its own: the
    same values whatever the order tensors are read in, other values under another seed."""
    cfg = config()
    weights = RandomWeights(cfg, seed=3)
    names = list(weights.keys())
    first = {n: torch.empty(weights.shapes[n]) for n in names}
    for n in names:
        weights.read_into(n, first[n])
    for n in reversed(names):
        again = torch.empty(weights.shapes[n])
        RandomWeights(cfg, seed=3).read_into(n, again)
        assert again.equal(first[n]), n
    assert any(n.endswith(".bias") for n in names)  # qwen2 has q/k/v biases
    for n, t in first.items():
        if n.endswith("norm.weight"):
            assert t.eq(1).all()
        elif n.endswith(".bias"):
            assert t.eq(0).all()
        else:
            assert abs(t.mean().item()) < 3e-3 and t.std().item() == pytest.approx(cfg.initializer_range, rel=0.05)
    other = torch.empty(weights.shapes["model.embed_tokens.weight"])
    RandomWeights(cfg, seed=4).read_into("model.embed_tokens.weight", other)
    assert not other.equal(first["model.embed_tokens.weight"])


def test_unknown_names_and_wrong_shapes_are_refused():
    weights = RandomWeights(config(), seed=0)
    with pytest.raises(ModelError, match="not part of this model"):
        weights.read_into("model.layers.9.mlp.up_proj.weight", torch.empty(3))
    with pytest.raises(ModelError, match="shape"):
        weights.read_into("model.embed_tokens.weight", torch.empty(64, 300))
