"""Tiny models of every supported family, saved as local HF directories (no hub access)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers

from slide_train.data import builtin_tokenizer

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
VOCAB = 320  # the byte tokenizer's 259 tokens, padded


# The families added through the declarative table (models/families.py): hidden 64, windows shorter than the
# tests' 24-token rows where the family slides one, soft-capping on for Gemma 2, pad ids the data contains (the
# pad row gets no gradient in HF) and non-trivial multipliers for Granite.
NEW_FAMILIES = ["phi3", "olmo2", "olmo3", "granite", "gemma", "gemma2", "gemma3_text"]
NEW_FAMILY_CONFIGS = {
    "phi3": dict(num_key_value_heads=2, sliding_window=8, pad_token_id=9, bos_token_id=1, eos_token_id=2,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "olmo2": dict(num_key_value_heads=2, pad_token_id=11, bos_token_id=1, eos_token_id=2),
    "olmo3": dict(num_hidden_layers=4, num_key_value_heads=2, sliding_window=6, pad_token_id=11, bos_token_id=1,
                  eos_token_id=2,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}),
    "granite": dict(num_key_value_heads=2, tie_word_embeddings=True, embedding_multiplier=12.0,
                    residual_multiplier=0.22, attention_multiplier=0.1, logits_scaling=8.0),
    "gemma": dict(num_key_value_heads=2, head_dim=16, pad_token_id=13),
    "gemma2": dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=6, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, pad_token_id=13),
    "gemma3_text": dict(num_hidden_layers=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                        sliding_window=6, pad_token_id=13,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}}),
}


def tiny_config(model_type: str) -> transformers.PretrainedConfig:
    if model_type in NEW_FAMILY_CONFIGS:
        spec = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5)
        return transformers.AutoConfig.for_model(model_type, **(spec | NEW_FAMILY_CONFIGS[model_type]))
    extra = {"tie_word_embeddings": model_type == "qwen2"}  # cover tied and untied embeddings
    if model_type == "qwen3":
        extra["head_dim"] = 16
    if model_type == "mistral":
        extra["sliding_window"] = None
    return transformers.AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5, **extra)


def whole_and_tiled(config_of, tile: int, queries: bool = False, shape_of=lambda stack: None):
    """One layer's block whole and tiled by `tile` (with `queries`, its attention by query tiles too), made from
    `config_of()` with the same float64 parameters, the stack and its float64 edges (the head's rotary tables and
    masks are what the blocks use); `shape_of(stack)` picks the block's shape."""
    from slide_train.models.adapter import HFStack

    blocks = []
    for t in (0, tile):
        config = config_of()
        stack = HFStack(config, None)
        if stack.family.experts:
            config._experts_implementation = "eager"  # (float64: the grouped kernels take no float64)
        stack.tile_sequence(t, queries)
        block = stack.make_block(shape_of(stack))
        block.to_empty(device="cpu")
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        blocks.append(block.double())
    edges = stack.make_edges()
    edges.embed_tokens.to_empty(device="cpu")
    torch.nn.init.zeros_(edges.embed_tokens.weight)
    edges.double()
    return blocks, stack, edges


def save_tiny_model(directory: pathlib.Path, model_type: str, seed: int = 0,
                    changes: dict | None = None) -> transformers.PreTrainedModel:
    """A tiny random model of `model_type` (its config with `changes`), saved with the built-in tokenizer."""
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    for key, value in (changes or {}).items():
        setattr(config, key, value)
    kinds = getattr(config, "layer_types", None)  # (a new depth keeps the family's pattern of attention kinds)
    if kinds and len(kinds) != config.num_hidden_layers and "layer_types" not in (changes or {}):
        config.layer_types = [kinds[i % len(kinds)] for i in range(config.num_hidden_layers)]
    # (SDPA has no attention soft-capping: Gemma 2 runs HF's eager attention)
    config._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    if model_type == "qwen2":  # HF zero-inits biases; random ones make the test see whether they are loaded
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.02)
                layer.self_attn.v_proj.bias.normal_(0, 0.02)
    if model_type in NEW_FAMILY_CONFIGS:  # HF inits norms neutral; random ones show each is loaded and applied
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0 if config.model_type.startswith("gemma") else 1.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    builtin_tokenizer().save_pretrained(directory)
    return model


MACHINE = pathlib.Path(__file__).with_name("machine.yaml")
MACHINE_RAM_GIB = 64  # (its host.memory_gib)


@pytest.fixture(autouse=True)
def fixed_machine(monkeypatch):
    """Every run plans for tests/machine.yaml, not for the host the tests happen to run on (whose RAM a run also
    counts: here the file's)."""
    from slide_train import launch

    monkeypatch.setenv("SLIDE_MACHINE", str(MACHINE))
    monkeypatch.setattr(launch, "host_memory_bytes", lambda: MACHINE_RAM_GIB * 2**30)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def write_token_rows(path: pathlib.Path, rows: list[list[int]], labels: list[list[int]] | None = None) -> None:
    with open(path, "w") as f:
        for i, ids in enumerate(rows):
            row = {"input_ids": ids}
            if labels is not None:
                row["labels"] = labels[i]
            f.write(json.dumps(row) + "\n")


# Mixture-of-experts families (top-2 routing, every layer sparse): Qwen3-MoE with normalized top-k weights,
# Mixtral with a window shorter than the rows, OLMoE with unnormalized ones. save_pretrained writes one tensor per
# expert, so training from these directories also reads experts the way released checkpoints store them.
MOE_FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]
MOE_CONFIGS = {
    "qwen3_moe": dict(num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, pad_token_id=11),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                    sliding_window=8, pad_token_id=11),
    "olmoe": dict(num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                  norm_topk_prob=False, pad_token_id=11, bos_token_id=1, eos_token_id=2),
}
NEW_FAMILY_CONFIGS.update(MOE_CONFIGS)
