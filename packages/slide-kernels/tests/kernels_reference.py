"""Independent float64 references in plain torch (no slide_kernels code, no transformers)."""

import math

import torch


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def rms_norm_ref(x, w, eps=1e-6, offset=0.0):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)


def rope_ref(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    q, k = q.double(), k.double()
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def partial_rope_ref(q, k, cos, sin, unsqueeze_dim=1):
    """The first cos.shape[-1] dims rotate, the rest pass (Phi-3's partial rotary)."""
    rot = cos.shape[-1]
    qr, kr = rope_ref(q[..., :rot], k[..., :rot], cos, sin, unsqueeze_dim)
    return torch.cat([qr, q[..., rot:].double()], -1), torch.cat([kr, k[..., rot:].double()], -1)


def swiglu_ref(a, b):
    a = a.double()
    return a * torch.sigmoid(a) * b.double()


def gelu_tanh_ref(a):
    a = a.double()
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))


def geglu_ref(a, b):
    return gelu_tanh_ref(a) * b.double()


def linear_ce_ref(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean", normalizer=None,
                  label_smoothing=0.0, softcap=None, z_loss=0.0):
    """Materializes the float64 logits: the textbook definition."""
    z = hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lab = labels.reshape(-1)
    valid = lab != ignore_index
    lse = torch.logsumexp(z, -1)
    safe = torch.where(valid, lab, 0)
    nll = lse - z.gather(1, safe[:, None])[:, 0]
    smooth = lse - z.mean(-1)
    loss = (1 - label_smoothing) * nll + label_smoothing * smooth + z_loss * lse**2
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    denom = valid.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=torch.float64)
    return loss.sum() / denom.clamp(min=1)

