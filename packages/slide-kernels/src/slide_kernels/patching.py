"""`apply_to(model)`: swaps the fused ops into a loaded HF Llama / Qwen2 / Qwen3 / Mistral model.

What it replaces (and nothing else):
- every `*RMSNorm` module's forward -> `rms_norm` (its own weight and `variance_epsilon`; Qwen3's q/k norms too);
- every MLP with `gate_proj`/`up_proj`/`down_proj` and a SiLU activation -> `down(swiglu(gate(x), up(x)))`;
- the modeling module's `apply_rotary_pos_emb` -> `rope`. This one is module-wide: every model of that
  architecture in the process uses it from then on, as the attention looks the function up by name;
- the causal-LM forward -> the same forward with the loss from `linear_cross_entropy` on the last hidden
  state (labels shifted as HF does, `num_items_in_batch` as normalizer); in training mode it returns no logits.

Module forwards are patched per instance. transformers is imported here only, lazily: the package does not
depend on it, and the patch targets are found by structure so both 4.56+ and 5.x layouts work.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .modules import SwiGLUMLP
from .ops import linear_cross_entropy, rms_norm

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
_SILU = ("silu", "swish")


def _rms_norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _output_class(model: nn.Module):
    cls = getattr(sys.modules.get(type(model).__module__), "CausalLMOutputWithPast", None)
    if cls is None:
        from transformers.modeling_outputs import CausalLMOutputWithPast as cls
    return cls


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    normalizer = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    return_dict = kwargs.pop("return_dict", None)
    # Cache arguments only when given: newer transformers deprecate the `past_key_values` name even as None.
    cache = {k: v for k, v in (("past_key_values", past_key_values), ("use_cache", use_cache)) if v is not None}
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, **cache, **kwargs)
    hidden = outputs[0]
    loss = logits = None
    if labels is not None or shift_labels is not None:
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = linear_cross_entropy(hidden, self.lm_head.weight, shift_labels.to(hidden.device),
                                    bias=self.lm_head.bias, ignore_index=ignore_index, normalizer=normalizer,
                                    softcap=getattr(self.config, "final_logit_softcapping", None))
    if loss is None or not self.training:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
    out = _output_class(self)(
        loss=loss, logits=logits, past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None), attentions=getattr(outputs, "attentions", None),
    )
    return out.to_tuple() if return_dict is False else out


def _is_rms_norm(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1
            and hasattr(m, "variance_epsilon"))


def _is_swiglu_mlp(m: nn.Module, act: str | None) -> bool:
    parts = all(isinstance(getattr(m, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
    fn = getattr(m, "act_fn", None)
    silu = isinstance(fn, nn.SiLU) or act in _SILU
    return parts and fn is not None and silu


def _patch_forward(m: nn.Module, fn) -> bool:
    if getattr(m, "_slide_kernels_patched", False):
        return False
    m.forward = types.MethodType(fn, m)
    m._slide_kernels_patched = True
    return True


def apply_to(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True,
             cross_entropy: bool = True) -> list[str]:
    """Patch a loaded HF Llama / Qwen2 / Qwen3 / Mistral model in place; returns what was replaced.

    Safe to call twice (the second call patches nothing new). Raises ValueError for other model types.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"apply_to supports model_type in {SUPPORTED}, got {model_type!r}")
    act = getattr(config, "hidden_act", None)
    patched: list[str] = []
    rope_modules: dict[str, types.ModuleType] = {}
    for name, m in model.named_modules():
        if rms_norm and _is_rms_norm(m) and _patch_forward(m, _rms_norm_forward):
            patched.append(f"{name}: {type(m).__name__}.forward -> slide_kernels.rms_norm")
        elif swiglu and _is_swiglu_mlp(m, act) and _patch_forward(m, SwiGLUMLP.forward):
            patched.append(f"{name}: {type(m).__name__}.forward -> slide_kernels.swiglu")
        elif rope and type(m).__name__.endswith("Attention"):
            mod = sys.modules.get(type(m).__module__)
            if mod is not None and callable(getattr(mod, "apply_rotary_pos_emb", None)):
                rope_modules[mod.__name__] = mod
    for mod_name, mod in rope_modules.items():
        if mod.apply_rotary_pos_emb is not ops.rope:  # same signature as HF's
            mod.apply_rotary_pos_emb = ops.rope
            patched.append(f"{mod_name}.apply_rotary_pos_emb -> slide_kernels.rope (module-wide)")
    if (cross_entropy and isinstance(getattr(model, "lm_head", None), nn.Linear)
            and isinstance(getattr(model, "model", None), nn.Module)
            and _patch_forward(model, _causal_lm_forward)):
        patched.append(f"{type(model).__name__}.forward loss -> slide_kernels.linear_cross_entropy")
    return patched
