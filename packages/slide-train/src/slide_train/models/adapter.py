"""Hugging Face decoder-only models as a `Stack`: edges (embedding, final norm, lm head) and decoder blocks.

Every supported family has the same outer shape (`model.embed_tokens`, `model.layers`, `model.norm`,
`model.rotary_emb`, `lm_head`); what differs inside a decoder layer (Qwen2 biases, Qwen3 q/k norms) is left to
the HF layer class itself, so one adapter serves them all.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

import slide_kernels

from ..data import document_attention_mask
from ..errors import ModelError
from .loss import causal_lm_loss

# model_type -> notes; the HF classes do the family-specific work.
FAMILIES = {
    "llama": "Llama 2 / 3.x",
    "mistral": "Mistral",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3 (dense)",
}

# Edge parameter name -> HF checkpoint name.
EDGE_PREFIXES = {"embed_tokens.": "model.embed_tokens.", "norm.": "model.norm.", "lm_head.": "lm_head."}


def check_supported(config: transformers.PretrainedConfig) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        names = ", ".join(f"{k} ({v})" for k, v in FAMILIES.items())
        raise ModelError(f"model_type {model_type!r} has no adapter yet; supported: {names}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:
        raise ModelError(f"{model_type} with mixed layer types {sorted(set(layer_types))} is not supported yet: "
                         "the engine runs structurally identical blocks")


def sliding_window(config: transformers.PretrainedConfig) -> int | None:
    """The attention window all layers use, or None for full causal attention."""
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        return window
    layer_types = getattr(config, "layer_types", None) or []
    return window if layer_types and layer_types[0] == "sliding_attention" else None


class Edges(nn.Module):
    """Embedding + rotary tables (head) and final norm + lm head + loss (tail)."""

    def __init__(self, embed_tokens: nn.Embedding, rotary: nn.Module, norm: nn.Module, lm_head: nn.Linear,
                 window: int | None):
        super().__init__()
        self.embed_tokens, self.rotary, self.norm, self.lm_head = embed_tokens, rotary, norm, lm_head
        self.window = window
        # Read by the tail only: the engine may update them while backward runs (a tied lm head is left out).
        self.tail_only = tuple(name for name, _ in self.named_parameters(remove_duplicate=False)
                               if name.startswith(("norm.", "lm_head.")))

    def head(self, batch):
        ids = batch["input_ids"]
        hidden = self.embed_tokens(ids)
        positions = batch["position_ids"]
        ctx = {
            "position_embeddings": self.rotary(hidden, positions),
            "position_ids": positions,
            "attention_mask": attention_mask(batch.get("document_ids"), self.window, ids.shape[1], ids.device),
        }
        return hidden, ctx

    def tail(self, hidden, batch, normalizer: float):
        targets = batch["targets"]
        if "loss_rows" in batch:  # only the tokens with a target go through the norm and the lm head
            rows = batch["loss_rows"]
            hidden, targets = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), targets.reshape(-1)[rows]
        return causal_lm_loss(self.norm(hidden), self.lm_head.weight, targets) / normalizer


def attention_mask(document_ids: torch.Tensor | None, window: int | None, seq: int, device) -> torch.Tensor | None:
    """A boolean [B, 1, S, S] mask (True = may attend), or None when plain causal attention is exact.

    Packed rows use the data pipeline's document mask (causal, within one document; padding sees only itself, so
    no row is empty); a sliding window narrows it further, never below the diagonal.
    """
    if document_ids is None and (window is None or seq <= window):
        return None
    q = torch.arange(seq, device=device)
    if document_ids is None:
        allowed = (q[:, None] >= q[None, :])[None, None]
    else:
        allowed = document_attention_mask(document_ids)
    if window is not None:
        allowed = allowed & (q[:, None] - q[None, :] < window)
    return allowed


class DecoderBlock(nn.Module):
    """One HF decoder layer with the engine's block signature: forward(hidden, ctx) -> hidden."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, ctx: dict) -> torch.Tensor:
        out = self.layer(hidden, **ctx)
        return out[0] if isinstance(out, tuple) else out  # transformers 4.x returns a tuple


class HFStack:
    """`slide_scheduler.Stack` for an HF causal LM given its config and a weight source."""

    def __init__(self, config: transformers.PretrainedConfig, weights, kernels: bool = False):
        check_supported(config)
        self.kernels = kernels  # swap slide-kernels' fused RMSNorm / RoPE / SwiGLU into every block
        config._attn_implementation = "sdpa"  # masks above are for SDPA; eager would ignore a None mask
        self.config = config
        self.weights = weights
        self.num_blocks = config.num_hidden_layers
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        self._layer_cls = type(skeleton.model.layers[0])
        self._rotary_cls = type(skeleton.model.rotary_emb)
        self._skeleton = skeleton

    def make_edges(self) -> Edges:
        cfg = self.config
        with torch.device("meta"):
            embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            norm = type(self._skeleton.model.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps)
            lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            lm_head.weight = embed.weight
        rotary = self._rotary_cls(config=cfg)  # real buffers (inv_freq), built on the host
        edges = Edges(embed, rotary, norm, lm_head, sliding_window(cfg))
        if self.kernels:
            slide_kernels.apply_to(_Patchable(cfg, edges))
        return edges

    def make_block(self) -> DecoderBlock:
        with torch.device("meta"):
            block = DecoderBlock(self._layer_cls(self.config, layer_idx=0))
        if self.kernels:
            slide_kernels.apply_to(_Patchable(self.config, block))
        return block

    def load_edges(self, params: dict[str, torch.Tensor]) -> None:
        for name, view in params.items():
            self.weights.read_into(edge_hf_name(name), view)

    def load_block(self, index: int, params: dict[str, torch.Tensor]) -> None:
        for name, view in params.items():
            self.weights.read_into(block_hf_name(index, name), view)



class _Patchable(nn.Module):
    """What `slide_kernels.apply_to` expects to see: modules under something that has the HF config."""

    def __init__(self, config, module: nn.Module):
        super().__init__()
        self.config = config
        self.inner = module


def edge_hf_name(name: str) -> str:
    for ours, theirs in EDGE_PREFIXES.items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    raise KeyError(name)


def block_hf_name(index: int, name: str) -> str:
    return f"model.layers.{index}." + name.removeprefix("layer.")
