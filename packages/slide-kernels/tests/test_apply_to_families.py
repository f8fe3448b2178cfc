"""apply_to on tiny real HF models of every family beyond Llama's (transformers is a test-only dependency): the
patched model gives the unpatched model's loss and gradients in fp32, each fused op runs as often as the family
has such modules, and each family's norm casts as HF's does."""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch

import slide_kernels as sk

# The op modules (the package exports functions of the same names).
geglu_module, rms_norm_module, rope_module, swiglu_module = (
    importlib.import_module(f"slide_kernels.ops.{name}") for name in ("geglu", "rms_norm", "rope", "swiglu"))

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 97, 2, 11
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
# Per family: the config (windows shorter than SEQ, soft-caps, partial rotary, multipliers, router loss on where
# the family has them), and per layer the number of norms and the gated MLP op it uses (None: experts only).
FAMILIES = {
    "gemma": (dict(head_dim=8), 2, "geglu"),
    "gemma2": (dict(head_dim=8, query_pre_attn_scalar=12, sliding_window=6, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0), 4, "geglu"),
    "gemma3_text": (dict(num_hidden_layers=3, head_dim=8, query_pre_attn_scalar=8, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                             "rope_theta": 1000000.0}}), 6, "geglu"),
    "phi3": (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  pad_token_id=0), 2, "swiglu_gate_up"),
    "olmo2": (dict(), 4, "swiglu"),
    "olmo3": (dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"]), 4, "swiglu"),
    "granite": (dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.1,
                     logits_scaling=8.0), 2, "swiglu"),
    "qwen3_moe": (dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       output_router_logits=True, router_aux_loss_coef=0.1), 4, None),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6, output_router_logits=True,
                     router_aux_loss_coef=0.1), 2, None),
    "olmoe": (dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False), 4, None),
}
MLP_OPS = {"swiglu": (swiglu_module, "swiglu_forward", "swiglu_torch"),
           "geglu": (geglu_module, "geglu_forward", "geglu_torch"),
           "swiglu_gate_up": (swiglu_module, "swiglu_gate_up_forward", "swiglu_gate_up_torch")}


HF_ROPE: dict = {}  # modeling module -> its own apply_rotary_pos_emb


def tiny_model(model_type: str):
    torch.manual_seed(0)
    spec = FAMILIES[model_type][0]
    config = transformers.AutoConfig.for_model(model_type, **(BASE | spec))
    config._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    for m in model.modules():  # before apply_to replaces it module-wide (see restore_rope)
        mod = sys.modules[type(m).__module__]
        if hasattr(mod, "apply_rotary_pos_emb"):
            HF_ROPE.setdefault(mod, mod.apply_rotary_pos_emb)
    with torch.no_grad():  # HF inits norms neutral: random ones show each weight is applied as the family does
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if model_type.startswith("gemma") else 1.0, 0.2)
    return model


@pytest.fixture
def restore_rope():
    """apply_to replaces the modeling modules' apply_rotary_pos_emb process-wide: put HF's back afterwards."""
    yield
    for mod, fn in HF_ROPE.items():
        mod.apply_rotary_pos_emb = fn


class Calls:
    """Counts the forward launches of one op through its Triton launcher and through its torch fallback."""

    def __init__(self, monkeypatch, module, launcher, fallback):
        self.triton = self.torch = 0
        monkeypatch.setattr(module, launcher, self._counting(getattr(module, launcher), "triton"))
        monkeypatch.setattr(module, fallback, self._counting(getattr(module, fallback), "torch"))

    def _counting(self, fn, path):
        def wrapper(*args, **kwargs):
            if not kwargs.get("backward"):  # RoPE's launcher also runs the backward
                setattr(self, path, getattr(self, path) + 1)
            return fn(*args, **kwargs)

        return wrapper

    def on(self, path) -> int:
        """The launches on `path`; none may have gone the other way."""
        assert getattr(self, "torch" if path == "triton" else "triton") == 0
        return getattr(self, path)


def _loss_and_grads(model, ids, labels):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_patched_model_gives_hf_loss_and_gradients(path, model_type, restore_rope, monkeypatch):
    model = tiny_model(model_type)
    _, norms_per_layer, mlp_op = FAMILIES[model_type]
    layers = model.config.num_hidden_layers
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :4] = -100
    ref_loss, ref_grads = _loss_and_grads(model, ids, labels)

    patched = sk.apply_to(model)
    # What was replaced is what the family's patch declares (its MLP's op is found from the module's structure)
    ops = {line.split("-> slide_kernels.")[1].split()[0] for line in patched}
    assert ops == {*sk.family_patch(model_type).ops, "linear_cross_entropy"}
    model.train()
    norms = Calls(monkeypatch, rms_norm_module, "rms_norm_forward", "rms_norm_torch")
    ropes = Calls(monkeypatch, rope_module, "rope_apply", "rope_torch")
    mlps = Calls(monkeypatch, *MLP_OPS[mlp_op]) if mlp_op else None
    loss, grads = _loss_and_grads(model, ids, labels)

    # Each op ran once per module of its kind in the forward (the final norm too), on the path under test, and
    # no module was missed.
    kind = path[0]
    assert norms.on(kind) == layers * norms_per_layer + 1 == sum("rms_norm" in p for p in patched)
    assert ropes.on(kind) == layers and sum("apply_rotary_pos_emb" in p for p in patched) == 1
    if mlps is not None:
        assert mlps.on(kind) == layers == sum(f"slide_kernels.{mlp_op}" in p for p in patched)
    assert any("linear_cross_entropy" in p for p in patched)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max().item() <= 1e-5 * g.abs().max().item() + 1e-7, name


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_norms_cast_as_the_family_does(model_type, restore_rope, monkeypatch):
    """In bf16 the casting order shows (Llama rounds before the weight, Gemma and OLMo 2/3 after it): every
    patched norm gives its HF module's output exactly (the torch path, whose rounding steps are HF's)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model(model_type).bfloat16()
    sk.apply_to(model, rope=False, swiglu=False, cross_entropy=False)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2)).bfloat16() * 3
    layer = model.model.layers[0]
    norms = [m for m in layer.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == FAMILIES[model_type][1]
    for m in norms:
        xs = x[..., : m.weight.shape[0]]  # q/k norms are as wide as a head or the projection, at most 32 here
        assert getattr(m, "_slide_kernels_patched", False)
        assert torch.equal(m(xs), type(m).forward(m, xs)), type(m).__name__


def test_eval_logits_are_hf_logits(restore_rope):
    """Outside training the patched forward returns HF's logits: Granite's divided by logits_scaling, Gemma 2's
    soft-capped."""
    for model_type in ("granite", "gemma2"):
        model = tiny_model(model_type).eval()
        ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            want = model(input_ids=ids).logits
            sk.apply_to(model)
            got = model(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _grads_distance(grads, truth) -> float:
    """Global relative distance of a model's gradients from the truth's (all tensors as one vector)."""
    diff = sum(((grads[n].double() - g.double()) ** 2).sum() for n, g in truth.items())
    return (diff / sum((g.double() ** 2).sum() for g in truth.values())).sqrt().item()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_gpu_bf16_patched_model_tracks_hf(model_type, restore_rope):
    """On the GPU in bf16 (the kernels compiled): the patched model's loss and gradients are as near the fp32
    model's as HF's own bf16 model is, plus a small margin."""
    spec = dict(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=1000)
    config = transformers.AutoConfig.for_model(model_type, **(BASE | FAMILIES[model_type][0] | spec))
    if model_type == "phi3":  # 48 of 64 dims rotate (Phi-4-mini's factor)
        config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.75}
    config._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    torch.manual_seed(0)
    truth = transformers.AutoModelForCausalLM.from_config(config).float().cuda()
    for m in truth.modules():
        mod = sys.modules[type(m).__module__]
        if hasattr(mod, "apply_rotary_pos_emb"):
            HF_ROPE.setdefault(mod, mod.apply_rotary_pos_emb)
    with torch.no_grad():
        for name, param in truth.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if model_type.startswith("gemma") else 1.0, 0.2)
    ids = torch.randint(1, 1000, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    hf16 = copy.deepcopy(truth).bfloat16()
    ours = copy.deepcopy(hf16)
    results = {}
    for name, model in (("truth", truth), ("hf", hf16)):
        results[name] = _loss_and_grads(model, ids, ids)
    sk.apply_to(ours)
    ours.train()
    results["ours"] = _loss_and_grads(ours, ids, ids)
    loss32, grads32 = results["truth"]
    err = {k: (abs(results[k][0].item() - loss32.item()), _grads_distance(results[k][1], grads32))
           for k in ("hf", "ours")}
    assert err["ours"][0] <= 1.5 * err["hf"][0] + 2e-3 * loss32.item(), err
    assert err["ours"][1] <= 1.5 * err["hf"][1] + 1e-3, err
