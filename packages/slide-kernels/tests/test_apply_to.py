"""apply_to on a small model built like HF's Llama (plain torch here, so the test needs no transformers),
and on a real HF model where transformers is installed."""

import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slide_kernels as sk


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # HF's reference, looked up by name at call time
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], -1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


_ORIGINAL_ROPE = apply_rotary_pos_emb


@dataclass
class CausalLMOutputWithPast:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: object = None
    hidden_states: object = None
    attentions: object = None

    def to_tuple(self):
        return tuple(v for v in (self.loss, self.logits) if v is not None)


class ToyRMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(n) + 0.5)
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


class ToyMLP(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ToyAttention(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads, self.dim = heads, h // heads
        self.q_proj, self.k_proj = nn.Linear(h, h, False), nn.Linear(h, h, False)
        self.v_proj, self.o_proj = nn.Linear(h, h, False), nn.Linear(h, h, False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = sys.modules[__name__].apply_rotary_pos_emb(q, k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class ToyLayer(nn.Module):
    def __init__(self, h, i, heads):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = ToyRMSNorm(h), ToyRMSNorm(h)
        self.self_attn, self.mlp = ToyAttention(h, heads), ToyMLP(h, i)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class ToyModel(nn.Module):
    def __init__(self, vocab, h, i, heads, layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(ToyLayer(h, i, heads) for _ in range(layers))
        self.norm = ToyRMSNorm(h)
        self.dim = h // heads

    def forward(self, input_ids=None, **kwargs):
        x = self.embed_tokens(input_ids)
        t = x.shape[1]
        inv = 1.0 / (10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))
        emb = torch.cat([torch.outer(torch.arange(t).float(), inv)] * 2, -1)[None]
        for layer in self.layers:
            x = layer(x, emb.cos(), emb.sin())
        return (self.norm(x),)


class ToyForCausalLM(nn.Module):
    def __init__(self, vocab=61, h=16, i=40, heads=2, layers=2):
        super().__init__()
        self.config = types.SimpleNamespace(model_type="llama", hidden_act="silu", vocab_size=vocab)
        self.model = ToyModel(vocab, h, i, heads, layers)
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids)[0])
        loss = None
        if labels is not None:
            shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift.reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.fixture
def restore_rope():
    yield
    sys.modules[__name__].apply_rotary_pos_emb = _ORIGINAL_ROPE


def _loss_and_grads(model, ids, labels):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_toy_llama_matches_unpatched(path, restore_rope):
    torch.manual_seed(0)
    model = ToyForCausalLM()
    ids = torch.randint(0, 61, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100
    ref_loss, ref_grads = _loss_and_grads(model, ids, labels)
    patched = sk.apply_to(model)
    assert sum("rms_norm" in p for p in patched) == 5
    assert sum("swiglu" in p for p in patched) == 2
    assert any("apply_rotary_pos_emb" in p for p in patched)
    assert any("linear_cross_entropy" in p for p in patched)
    assert sk.apply_to(model) == []  # idempotent
    model.train()
    loss, grads = _loss_and_grads(model, ids, labels)
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max().item() < 1e-4, name
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # training: the logits are never built
    model.eval()
    assert model(input_ids=ids, labels=labels).logits.shape == (2, 9, 61)


def test_patched_forward_passes_cache_arguments_only_when_given(path, restore_rope, monkeypatch):
    """transformers 5.24 deprecates the `past_key_values` keyword of the base model's forward, even as None (a
    FutureWarning on every training step); the patched forward hands cache arguments on only when the caller
    gave them."""
    seen = []
    forward = ToyModel.forward
    monkeypatch.setattr(ToyModel, "forward", lambda self, *a, **kw: seen.append(set(kw)) or forward(self, *a, **kw))
    model = ToyForCausalLM()
    sk.apply_to(model)
    ids = torch.randint(0, 61, (1, 5))
    model(input_ids=ids, labels=ids)
    model(input_ids=ids, labels=ids, use_cache=False)
    assert not {"past_key_values", "use_cache"} & seen[0]
    assert "use_cache" in seen[1] and "past_key_values" not in seen[1]


def test_unsupported_model_type():
    model = ToyForCausalLM()
    model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type"):
        sk.apply_to(model)
    assert sk.family_patch("gpt2") is None
