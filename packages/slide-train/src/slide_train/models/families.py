"""The model families the adapter serves: one entry each, saying what differs around the decoder layers.

Every family here keeps the usual layout of an HF causal LM: `model.embed_tokens`, `model.layers[i]`,
`model.norm`, `model.rotary_emb` and `lm_head`. The decoder layer is always the HF class itself, so what happens
inside it (fused qkv and gate/up projections, q/k norms, post-norms, residual and attention multipliers,
attention soft-capping, query_pre_attn_scalar) needs no entry. An entry declares what the adapter does outside
the layers: the embedding's scale, the logits' soft-cap, and attention's soft-cap (a need the attention backends
meet: backends.py). What slide-kernels' patch of the family declares is read from there
(`slide_kernels.family_patch`), not repeated here: the fused ops in the layers with engine.kernels on, the logits'
divisor, and the norm's offset (hence its neutral weight). Which layers slide a window, and with which rotary base,
comes from the config's `layer_types` (or, with `window_everywhere`, from `sliding_window` alone).

Adding a family with that layout is one entry in FAMILIES and one in slide-kernels' table, the source of its fused
ops, logits' divisor and norm offset (see docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers

import slide_kernels

from ..errors import ModelError


@dataclass(frozen=True)
class Family:
    model_type: str
    title: str  # the checkpoints' own name for them, in messages and docs
    # Module paths in the HF model, which are also the checkpoint's tensor name prefixes.
    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    norm: str = "model.norm"
    lm_head: str = "lm_head"
    rotary: str = "model.rotary_emb"
    # The embedding times sqrt(hidden_size), that factor first rounded to the activations' dtype (Gemma).
    embed_sqrt_hidden: bool = False
    # Config attributes (None: the family has none).
    embed_multiplier: str | None = None  # the embedding is multiplied by it (Granite)
    final_softcap: str | None = None  # logits -> c * tanh(logits / c) before the loss (Gemma 2)
    attn_softcap: str | None = None  # attention's soft-cap: a need of its layers (backends.py chooses who meets it)
    # Without `layer_types`, `sliding_window` applies to every layer (Mistral, Phi-3).
    window_everywhere: bool = False
    # Mixture of experts: the config attribute holding the number of experts (None: a dense family). The layer's
    # router and experts are transformers' own (with "moe_experts" fused, the experts' forward is slide-kernels'
    # moe_experts over the same parameters); a block holds all of its layer's experts.
    experts: str | None = None
    # Where a checkpoint stores a block parameter under other names (released checkpoints, and transformers 5's
    # save_pretrained, keep one tensor per expert; the layer fuses them): our name -> the checkpoint's tensors,
    # concatenated along dim 0 of each expert's slice, `{e}` the expert's index. Read only when the block's own
    # name is not in the checkpoint.
    checkpoint: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def describe(self) -> str:
        return f"{self.model_type} ({self.title})"

    @property
    def patch(self) -> slide_kernels.FamilyPatch | None:
        """slide-kernels' patch of this family (None: it has none, and the blocks run the torch path)."""
        return slide_kernels.family_patch(self.model_type)

    @property
    def fused(self) -> tuple[str, ...]:
        """slide-kernels' ops that `apply_to` swaps into this family's blocks (and the final norm) with
        engine.kernels on; on CUDA they run as fused Triton kernels. Names of slide_kernels ops (see OP_TITLES)."""
        ops = self.patch.ops if self.patch else ()
        return ops if FUSED_EXPERTS else tuple(op for op in ops if op != "moe_experts")

    @property
    def unfused(self) -> str | None:
        """What still runs the torch path in the blocks with kernels on (None: nothing)."""
        mixture = self.patch is not None and "moe_experts" in self.patch.ops
        return "the experts (transformers' grouped matmuls)" if mixture and not FUSED_EXPERTS else None

    @property
    def kernels(self) -> bool:
        return bool(self.fused)

    @property
    def logits_divisor(self) -> str | None:
        """The config attribute the logits are divided by (Granite's logits_scaling)."""
        return self.patch.logits_divisor if self.patch else None

    @property
    def norm_init(self) -> float:
        """A norm weight's neutral value, for random init: Gemma's norms scale by (1 + weight)."""
        return 1.0 - (self.patch.norm_offset if self.patch else 0.0)


# RMSNorm covers every norm of a layer: q/k norms and post-norms too, each with the family's casting (Gemma's
# 1 + weight, OLMo 2/3's fp32 product).
OP_TITLES = {"rms_norm": "RMSNorm", "rope": "RoPE", "partial_rope": "partial RoPE",
             "rope_cast_back": "RoPE (fp32 tables, cast back)", "swiglu": "SwiGLU",
             "swiglu_gate_up": "SwiGLU over the fused gate/up projection", "geglu": "GeGLU (tanh GELU)",
             "moe_experts": "MoE experts (grouped GEMMs, SwiGLU between them)"}
# The mixtures' experts through slide-kernels' moe_experts (True), or transformers' own grouped matmuls (False):
# the one switch. benchmarks/results/kernels.json shows the fused kernel faster on an H100, and the mixtures' bf16
# GPU tests (test_gpu.py) pass with it.
FUSED_EXPERTS = True


# Experts as Qwen2/3-MoE and OLMoE checkpoints store them (transformers' conversion mapping fuses gate and up).
PER_EXPERT = (
    ("mlp.experts.gate_up_proj", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    ("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)),
)
# Mixtral's checkpoints: w1 gate, w3 up, w2 down, under `block_sparse_moe`.
MIXTRAL_EXPERTS = (
    ("mlp.experts.gate_up_proj", ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight")),
    ("mlp.experts.down_proj", ("block_sparse_moe.experts.{e}.w2.weight",)),
    ("mlp.gate.weight", ("block_sparse_moe.gate.weight",)),
)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "Llama 2 / 3.x"),
    Family("mistral", "Mistral", window_everywhere=True),
    Family("qwen2", "Qwen2 / Qwen2.5"),
    Family("qwen3", "Qwen3 (dense)"),
    Family("phi3", "Phi-3 / Phi-3.5 / Phi-4", window_everywhere=True),
    Family("olmo2", "OLMo 2"),
    Family("olmo3", "OLMo 3"),
    Family("granite", "Granite 3.x", embed_multiplier="embedding_multiplier"),
    Family("gemma", "Gemma", embed_sqrt_hidden=True),
    Family("gemma2", "Gemma 2", embed_sqrt_hidden=True, final_softcap="final_logit_softcapping",
           attn_softcap="attn_logit_softcapping"),
    Family("gemma3_text", "Gemma 3 text", embed_sqrt_hidden=True, final_softcap="final_logit_softcapping",
           attn_softcap="attn_logit_softcapping"),
    Family("qwen3_moe", "Qwen3 MoE", window_everywhere=True, experts="num_experts", checkpoint=PER_EXPERT),
    Family("mixtral", "Mixtral", window_everywhere=True, experts="num_local_experts", checkpoint=MIXTRAL_EXPERTS),
    Family("olmoe", "OLMoE", experts="num_experts", checkpoint=PER_EXPERT),
)}

# Model types that are known and deliberately refused, with the reason.
REFUSED = {
    "gemma3": "Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration, model_type gemma3) are not "
              "supported: only the text models are (model_type gemma3_text, Gemma3ForCausalLM, such as "
              "gemma-3-1b); the vision tower and the image-text model around the layers are not adapted",
}

LAYER_TYPES = ("full_attention", "sliding_attention")
# Dropout would draw different masks in a block's forward and in the recompute its backward runs.
DROPOUT_KEYS = ("attention_dropout", "resid_pdrop")  # what the HF layers of these families read


def supported_text() -> str:
    return ", ".join(f.describe() for f in FAMILIES.values())


def family_of(config: transformers.PretrainedConfig) -> Family:
    """The config's family, or a ModelError saying why it is not supported (and what is)."""
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        raise ModelError(f"{REFUSED[model_type]}. Supported: {supported_text()}")
    if model_type not in FAMILIES:
        raise ModelError(f"model_type {model_type!r} has no adapter yet; supported: {supported_text()}")
    family = FAMILIES[model_type]
    types = getattr(config, "layer_types", None) or []
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ModelError(f"{model_type} with layer types {unknown} is not supported: only full and sliding-window "
                         "attention layers are")
    if getattr(config, "use_bidirectional_attention", None):
        raise ModelError(f"{model_type} with use_bidirectional_attention=true is an encoder, not a causal LM; only "
                         "causal attention is supported")
    dropout = {k: getattr(config, k) for k in DROPOUT_KEYS if (getattr(config, k, 0) or 0) > 0}
    if dropout:
        shown = ", ".join(f"{k}={v}" for k, v in dropout.items())
        raise ModelError(f"{model_type} with dropout ({shown}) is not supported: each block's backward recomputes "
                         "its forward, which would draw other dropout masks; set them to 0 in config.json")
    if family.experts:
        check_experts(config, family)
    return family


def check_experts(config: transformers.PretrainedConfig, family: Family) -> None:
    """Refuse what a mixture-of-experts config asks that the engine cannot train exactly. (Dense layers among the
    sparse ones, Qwen3-MoE's mlp_only_layers and decoder_sparse_step, are blocks of another shape.)"""
    name = family.model_type
    if (getattr(config, "router_jitter_noise", 0) or 0) > 0:
        raise ModelError(f"{name} with router_jitter_noise={config.router_jitter_noise} is not supported: each "
                         "block's backward recomputes its forward, which would draw other noise and may route "
                         "tokens to other experts; set it to 0 in config.json")


def layer_types(config: transformers.PretrainedConfig, family: Family) -> list[str]:
    """Each layer's attention type, 'full_attention' or 'sliding_attention'."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)[: config.num_hidden_layers]
    sliding = family.window_everywhere and getattr(config, "sliding_window", None)
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def kernel_note(family: Family) -> str:
    """What runs in the blocks on CUDA with engine.kernels on."""
    if not family.fused:
        return "the torch path (slide-kernels has no fused ops for it)"
    names = [OP_TITLES[op] for op in family.fused]
    listed = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
    fused = f"slide-kernels' fused {listed}"
    return fused if family.unfused is None else f"{fused}; {family.unfused} run the torch path"
