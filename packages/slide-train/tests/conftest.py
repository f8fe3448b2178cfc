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


def tiny_config(model_type: str) -> transformers.PretrainedConfig:
    extra = {"tie_word_embeddings": model_type == "qwen2"}  # cover tied and untied embeddings
    if model_type == "qwen3":
        extra["head_dim"] = 16
    if model_type == "mistral":
        extra["sliding_window"] = None
    return transformers.AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5, **extra)


def save_tiny_model(directory: pathlib.Path, model_type: str, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    if model_type == "qwen2":  # HF zero-inits biases; random ones make the test see whether they are loaded
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.02)
                layer.self_attn.v_proj.bias.normal_(0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    builtin_tokenizer().save_pretrained(directory)
    return model


MACHINE = pathlib.Path(__file__).with_name("machine.yaml")


@pytest.fixture(autouse=True)
def fixed_machine(monkeypatch):
    """Every run plans for tests/machine.yaml, not for the host the tests happen to run on."""
    monkeypatch.setenv("SLIDE_MACHINE", str(MACHINE))


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
