"""`apply_to(model)`: swaps the fused ops into a loaded HF causal LM of a supported family (see FAMILIES; one
family's entry is public as `family_patch(model_type)`).

What it replaces (and nothing else):
- every `*RMSNorm` module's forward -> `rms_norm` with the family's casting and offset (its own weight and
  epsilon): Llama's casting for most, Gemma's `1 + weight` in fp32, OLMo 2/3's fp32 product; q/k norms too,
  per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2/3, OLMoE), and post-norms (Gemma 2/3, OLMo 2/3);
- every gated MLP: `gate_proj`/`up_proj`/`down_proj` with SiLU -> `swiglu`, with tanh-approximate GELU ->
  `geglu` (Gemma); one `gate_up_proj` with SiLU -> `swiglu_gate_up` (Phi-3);
- every mixture's experts module (Qwen3-MoE, Mixtral, OLMoE: 3-D `gate_up_proj` [E, 2I, H] with gate rows first,
  `down_proj` [E, H, I], SiLU, no biases) -> `moe_experts`, whichever experts implementation the config names.
  The router, its top-k and the load-balancing loss stay transformers' own: the experts get the router's
  indices and weights as before;
- the modeling module's `apply_rotary_pos_emb` -> `rope`, or `partial_rope` for Phi-3 (its partial rotary
  factor). This one is module-wide: every model of that architecture in the process uses it from then on, as
  the attention looks the function up by name. Per-layer tables (Gemma 3's local and global bases) come in as
  the cos/sin the model hands each layer;
- the causal-LM forward -> the same forward with the loss from `linear_cross_entropy` on the last hidden
  state (labels shifted as HF does, `num_items_in_batch` as normalizer, Gemma 2/3's final soft-cap inside the
  loss, Granite's `logits_scaling` as a division of the hidden state, the routers' load-balancing loss added as
  HF does where `output_router_logits` is on); in training mode it returns no logits.

Module forwards are patched per instance. transformers is imported here only, lazily: the package does not
depend on it, and the patch targets are found by structure so both 4.56+ and 5.x layouts work.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .modules import GeGLUMLP, MoEExperts, SwiGLUGateUpMLP, SwiGLUMLP
from .ops import linear_cross_entropy, rms_norm


@dataclasses.dataclass(frozen=True)
class FamilyPatch:
    """What apply_to does to a model of one family: the ops its layers run and what differs in each.

    The one record of these facts: slide-train's family table reads them here (`family_patch`).
    """

    norm_casting: str = "llama"  # ops.rms_norm's casting_mode for this family's RMSNorm
    norm_offset: float = 0.0  # Gemma scales by (1 + weight)
    rope: Callable = ops.rope  # what replaces the modeling module's apply_rotary_pos_emb
    # The op of its gated MLPs (swiglu, geglu, swiglu_gate_up) or, in a mixture, of its experts (moe_experts).
    # apply_to still checks each module's structure and activation before it swaps one in.
    mlp: str = "swiglu"
    logits_divisor: str | None = None  # config attribute the logits are divided by (Granite's logits_scaling)

    @property
    def router_loss(self) -> bool:
        """A mixture of experts, whose causal-LM forward may add the routers' load-balancing loss."""
        return self.mlp == "moe_experts"

    @property
    def ops(self) -> tuple[str, ...]:
        """The slide_kernels ops each decoder layer runs once patched (the loss is the causal-LM forward's)."""
        return ("rms_norm", self.rope.__name__, self.mlp)


LLAMA = FamilyPatch()
GEMMA = FamilyPatch(norm_casting="gemma", norm_offset=1.0, mlp="geglu")
# OLMo 2/3 multiply the fp32 normalized row by the weight and round once: Gemma's casting, no offset.
OLMO = FamilyPatch(norm_casting="gemma", rope=ops.rope_cast_back)  # (fp32 rotary tables beside bf16 heads)
MOE = FamilyPatch(mlp="moe_experts")

FAMILIES: dict[str, FamilyPatch] = {
    "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA,
    "granite": FamilyPatch(logits_divisor="logits_scaling"),
    "phi3": FamilyPatch(rope=ops.partial_rope, mlp="swiglu_gate_up"),
    "olmo2": OLMO, "olmo3": OLMO,
    "gemma": GEMMA, "gemma2": GEMMA, "gemma3_text": GEMMA,
    "qwen3_moe": MOE, "mixtral": MOE, "olmoe": MOE,
}
SUPPORTED = tuple(FAMILIES)


def family_patch(model_type: str) -> FamilyPatch | None:
    """What apply_to does to a model of this `model_type`, or None where it refuses one."""
    return FAMILIES.get(model_type)


# The activation modules of the gated MLPs the fused ops reproduce, by class name (transformers' SiLUActivation is
# no nn.SiLU). Anything else keeps its MLP: a wrong activation would train silently wrong, a missed one is slower.
_SILU_TYPES = ("SiLU", "SiLUActivation")
_GELU_TANH_TYPES = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh")


def _norm_forward(offset: float, casting: str):
    def forward(self, hidden_states):
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        return rms_norm(hidden_states, self.weight, eps, offset, casting)

    return forward


def _output_class(model: nn.Module, name: str):
    cls = getattr(sys.modules.get(type(model).__module__), name, None)
    if cls is None:
        from transformers import modeling_outputs

        cls = getattr(modeling_outputs, name)
    return cls


def _make_output(model: nn.Module, name: str, outputs, **values):
    """The model's own output class; the cache goes under whichever name the class has (`cache` in newer
    transformers, `past_key_values` before), so no deprecation warning is raised on every step."""
    cls = _output_class(model, name)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in ("cache", "past_key_values", "hidden_states", "attentions", "router_logits"):
        if key in fields:
            value = getattr(outputs, key, None)
            if value is None and key == "cache":
                value = getattr(outputs, "past_key_values", None)
            values[key] = value
    return cls(**{k: v for k, v in values.items() if k in fields})


def _causal_lm_forward(family: FamilyPatch):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        normalizer = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        return_dict = kwargs.pop("return_dict", None)
        router = None
        if family.router_loss:
            router = kwargs.pop("output_router_logits", None)
            router = getattr(self.config, "output_router_logits", False) if router is None else router
            kwargs["output_router_logits"] = router
        # Cache arguments only when given: newer transformers deprecate the `past_key_values` name even as None.
        cache = {k: v for k, v in (("past_key_values", past_key_values), ("use_cache", use_cache)) if v is not None}
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, **cache, **kwargs)
        hidden = outputs[0]
        divisor = getattr(self.config, family.logits_divisor, 1.0) if family.logits_divisor else 1.0
        loss = logits = None
        if labels is not None or shift_labels is not None:
            if shift_labels is None:
                shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            # (h @ W.T) / s as (h / s) @ W.T: the fused loss takes no logit scale, and h is V/H times smaller.
            scaled = hidden / divisor if divisor != 1.0 else hidden
            loss = linear_cross_entropy(scaled, self.lm_head.weight, shift_labels.to(hidden.device),
                                        bias=self.lm_head.bias, ignore_index=ignore_index, normalizer=normalizer,
                                        softcap=getattr(self.config, "final_logit_softcapping", None))
        if loss is None or not self.training:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden[:, keep, :])
            if divisor != 1.0:
                logits = logits / divisor
            cap = getattr(self.config, "final_logit_softcapping", None)
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
        aux = None
        if router:  # the routers' load-balancing loss, computed and weighted as the model's own forward does
            balance = sys.modules[type(self).__module__].load_balancing_loss_func
            aux = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
            if loss is not None:
                loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        kind = "MoeCausalLMOutputWithPast" if family.router_loss else "CausalLMOutputWithPast"
        out = _make_output(self, kind, outputs, loss=loss, aux_loss=aux, logits=logits)
        return out.to_tuple() if return_dict is False else out

    return forward


def _is_rms_norm(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1
            and (hasattr(m, "variance_epsilon") or hasattr(m, "eps")))


def _activation(fn) -> str | None:
    """'silu', 'gelu_tanh' or None (another activation, or none) for an MLP's activation module."""
    name = type(fn).__name__
    if isinstance(fn, nn.SiLU) or name in _SILU_TYPES:
        return "silu"
    if (isinstance(fn, nn.GELU) and fn.approximate == "tanh") or name in _GELU_TANH_TYPES:
        return "gelu_tanh"
    return None


def _gated_mlp_forward(m: nn.Module):
    """The fused forward for a gated MLP module, or None where `m` is not one the ops reproduce."""
    def linear(name):
        return isinstance(getattr(m, name, None), nn.Linear)

    if linear("gate_proj") and linear("up_proj") and linear("down_proj"):
        kind = _activation(getattr(m, "act_fn", None))
        return {"silu": SwiGLUMLP.forward, "gelu_tanh": GeGLUMLP.forward}.get(kind)
    if linear("gate_up_proj") and linear("down_proj"):  # Phi-3: gate is the first half, up the second
        fn = getattr(m, "activation_fn", getattr(m, "act_fn", None))
        return SwiGLUGateUpMLP.forward if _activation(fn) == "silu" else None
    return None


def _experts_forward(m: nn.Module):
    """The fused forward for a mixture's experts module, or None where `m` is not one `moe_experts` computes:
    transformers' 3-D parameters in their stored layout (gate rows, then up rows; not transposed, not
    interleaved), SiLU, no biases, no norm after each expert, not split over devices."""
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return None
    if gate_up.dim() != 3 or down.dim() != 3:
        return None
    experts, hidden, inter = down.shape
    if gate_up.shape != (experts, 2 * inter, hidden):
        return None
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_post_expert_norm": False, "_is_expert_parallel": False}
    if any(getattr(m, name, value) != value for name, value in layout.items()):
        return None
    return MoEExperts.forward if _activation(getattr(m, "act_fn", None)) == "silu" else None


_OP_NAMES = {SwiGLUMLP.forward: "swiglu", GeGLUMLP.forward: "geglu", SwiGLUGateUpMLP.forward: "swiglu_gate_up",
             MoEExperts.forward: "moe_experts"}


def _patch_forward(m: nn.Module, fn) -> bool:
    if getattr(m, "_slide_kernels_patched", False):
        return False
    m.forward = types.MethodType(fn, m)
    m._slide_kernels_patched = True
    return True


def apply_to(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True,
             experts: bool = True, cross_entropy: bool = True) -> list[str]:
    """Patch a loaded HF causal LM of a family in FAMILIES in place; returns what was replaced.

    `swiglu` covers every gated MLP (SwiGLU, GeGLU, Phi-3's fused gate/up), `experts` a mixture's experts
    modules. Safe to call twice (the second call patches nothing new). Raises ValueError for other model types.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"apply_to supports model_type in {SUPPORTED}, got {model_type!r}")
    family = FAMILIES[model_type]
    norm_forward = _norm_forward(family.norm_offset, family.norm_casting)
    patched: list[str] = []
    rope_modules: dict[str, types.ModuleType] = {}
    for name, m in model.named_modules():
        mlp = _gated_mlp_forward(m) if swiglu else None
        if mlp is None and experts:
            mlp = _experts_forward(m)
        if rms_norm and _is_rms_norm(m) and _patch_forward(m, norm_forward):
            patched.append(f"{name}: {type(m).__name__}.forward -> slide_kernels.rms_norm")
        elif mlp is not None and _patch_forward(m, mlp):
            patched.append(f"{name}: {type(m).__name__}.forward -> slide_kernels.{_OP_NAMES[mlp]}")
        elif rope and type(m).__name__.endswith("Attention"):
            mod = sys.modules.get(type(m).__module__)
            if mod is not None and callable(getattr(mod, "apply_rotary_pos_emb", None)):
                rope_modules[mod.__name__] = mod
    for mod_name, mod in rope_modules.items():
        if mod.apply_rotary_pos_emb is not family.rope:  # same signature as HF's
            mod.apply_rotary_pos_emb = family.rope
            patched.append(f"{mod_name}.apply_rotary_pos_emb -> slide_kernels.{family.rope.__name__} (module-wide)")
    if (cross_entropy and isinstance(getattr(model, "lm_head", None), nn.Linear)
            and isinstance(getattr(model, "model", None), nn.Module)
            and _patch_forward(model, _causal_lm_forward(family))):
        patched.append(f"{type(model).__name__}.forward loss -> slide_kernels.linear_cross_entropy")
    return patched
