import pytest
import torch
from kernels_reference import max_err, partial_rope_ref, rope_ref

import slide_kernels as sk
from slide_kernels.ops.rope import rope_cast_back


def _inputs(bsz, hq, hk, t, d, unsqueeze_dim, cos_batch, dtype=torch.float32, device="cpu"):
    if unsqueeze_dim == 1:
        q = torch.randn(bsz, hq, t, d, dtype=dtype, device=device)
        k = torch.randn(bsz, hk, t, d, dtype=dtype, device=device)
    else:
        q = torch.randn(bsz, t, hq, d, dtype=dtype, device=device)
        k = torch.randn(bsz, t, hk, d, dtype=dtype, device=device)
    pos = torch.arange(t, device=device, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    freqs = torch.outer(pos, inv)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    if cos_batch:
        cos, sin = cos.expand(cos_batch, t, d).contiguous(), sin.expand(cos_batch, t, d).contiguous()
    return q.requires_grad_(), k.requires_grad_(), cos, sin


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("cos_batch", [None, 1, 3])
def test_forward_backward_fp32(path, unsqueeze_dim, cos_batch):
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(3, 5, 3, 47, 10, unsqueeze_dim, cos_batch)
    qo, ko = sk.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    ((qo * dq).sum() + (ko * dk).sum()).backward()
    qr, kr = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    c, s = (cos, sin) if cos_batch else (cos[None], sin[None])
    qor, kor = rope_ref(qr, kr, c, s, unsqueeze_dim)
    ((qor * dq.double()).sum() + (kor * dk.double()).sum()).backward()
    assert qo.shape == q.shape and ko.shape == k.shape
    for a, b in ((qo, qor), (ko, kor), (q.grad, qr.grad), (k.grad, kr.grad)):
        assert max_err(a, b) < 1e-5


def test_transposed_views(path):
    # HF builds q as view(B, T, H, D).transpose(1, 2): a non-contiguous input must work and keep its layout.
    torch.manual_seed(1)
    base = torch.randn(2, 9, 4, 8, requires_grad=True)
    q = base.transpose(1, 2)
    kbase = torch.randn(2, 9, 2, 8, requires_grad=True)
    k = kbase.transpose(1, 2)
    _, _, cos, sin = _inputs(2, 4, 2, 9, 8, 1, 2)
    qo, ko = sk.rope(q, k, cos, sin)
    (qo.sum() + 2 * ko.sum()).backward()
    qr, kr = rope_ref(q.detach(), k.detach(), cos, sin)
    assert max_err(qo, qr) < 1e-5 and max_err(ko, kr) < 1e-5
    b2 = base.detach().double().requires_grad_()
    k2 = kbase.detach().double().requires_grad_()
    qr2, kr2 = rope_ref(b2.transpose(1, 2), k2.transpose(1, 2), cos, sin)
    (qr2.sum() + 2 * kr2.sum()).backward()
    assert max_err(base.grad, b2.grad) < 1e-5 and max_err(kbase.grad, k2.grad) < 1e-5


@pytest.mark.parametrize("unsqueeze_dim, rotary, cos_batch", [(1, 12, None), (2, 6, 2), (1, 16, 1)])
def test_partial_rotary_forward_backward_fp32(path, unsqueeze_dim, rotary, cos_batch):
    """Phi-3's partial rotary: of 16 dims per head the first `rotary` rotate and the rest pass (16 of 16: all
    rotate, as `rope` does)."""
    torch.manual_seed(3)
    q, k, _, _ = _inputs(2, 5, 3, 13, 16, unsqueeze_dim, None)
    _, _, cos, sin = _inputs(2, 1, 1, 13, rotary, 1, cos_batch)
    qo, ko = sk.partial_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    ((qo * dq).sum() + (ko * dk).sum()).backward()
    qr, kr = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    c, s = (cos, sin) if cos_batch else (cos[None], sin[None])
    qor, kor = partial_rope_ref(qr, kr, c, s, unsqueeze_dim)
    ((qor * dq.double()).sum() + (kor * dk.double()).sum()).backward()
    assert qo.shape == q.shape and ko.shape == k.shape
    for a, b in ((qo, qor), (ko, kor), (q.grad, qr.grad), (k.grad, kr.grad)):
        assert max_err(a, b) < 1e-5
    if rotary == 16:
        qf, kf = sk.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        assert torch.equal(qf, qo) and torch.equal(kf, ko)
    else:  # the passed dims are the inputs' own values, and their gradient is the upstream one
        assert torch.equal(qo[..., rotary:], q[..., rotary:]) and torch.equal(k.grad[..., rotary:], dk[..., rotary:])


def test_partial_rotary_on_transposed_views(path):
    torch.manual_seed(4)
    base = torch.randn(2, 9, 4, 10, requires_grad=True)
    kbase = torch.randn(2, 9, 2, 10, requires_grad=True)
    _, _, cos, sin = _inputs(2, 1, 1, 9, 4, 1, 2)
    qo, ko = sk.partial_rope(base.transpose(1, 2), kbase.transpose(1, 2), cos, sin)
    (qo.sum() + 2 * ko.sum()).backward()
    b2, k2 = base.detach().double().requires_grad_(), kbase.detach().double().requires_grad_()
    qr, kr = partial_rope_ref(b2.transpose(1, 2), k2.transpose(1, 2), cos, sin)
    (qr.sum() + 2 * kr.sum()).backward()
    assert max_err(qo, qr) < 1e-5 and max_err(ko, kr) < 1e-5
    assert max_err(base.grad, b2.grad) < 1e-5 and max_err(kbase.grad, k2.grad) < 1e-5


@pytest.mark.gpu
def test_gpu_partial_bf16_tolerance():
    torch.manual_seed(0)
    q, k, _, _ = _inputs(2, 24, 8, 333, 128, 1, None, torch.bfloat16, "cuda")
    _, _, cos, sin = _inputs(2, 1, 1, 333, 96, 1, 2, torch.bfloat16, "cuda")
    from slide_kernels.ops.rope import partial_rope_torch
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    outs = []
    for fn in (sk.partial_rope, partial_rope_torch):
        q.grad = k.grad = None
        qo, ko = fn(q, k, cos, sin)
        ((qo * dq).sum() + (ko * dk).sum()).backward()
        outs.append((qo, ko, q.grad, k.grad))
    qr, kr = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    qor, kor = partial_rope_ref(qr, kr, cos, sin)
    ((qor * dq.double()).sum() + (kor * dk.double()).sum()).backward()
    for ours, peer, ref in zip(outs[0], outs[1], (qor, kor, qr.grad, kr.grad)):
        assert max_err(ours, ref) <= 1.1 * max_err(peer, ref) + 1e-3


@pytest.mark.gpu
def test_gpu_bf16_tolerance():
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(2, 32, 8, 333, 128, 1, 2, torch.bfloat16, "cuda")
    from slide_kernels.ops.rope import rope_torch
    dq = torch.randn_like(q)
    dk = torch.randn_like(k)
    outs = []
    for fn in (sk.rope, rope_torch):
        q.grad = k.grad = None
        qo, ko = fn(q, k, cos, sin)
        ((qo * dq).sum() + (ko * dk).sum()).backward()
        outs.append((qo, ko, q.grad, k.grad))
    qr, kr = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    qor, kor = rope_ref(qr, kr, cos, sin)
    ((qor * dq.double()).sum() + (kor * dk.double()).sum()).backward()
    for ours, peer, ref in zip(outs[0], outs[1], (qor, kor, qr.grad, kr.grad)):
        assert max_err(ours, ref) <= 1.1 * max_err(peer, ref) + 1e-3


def test_what_the_kernel_does_not_take_goes_the_torch_way(path):
    """cos/sin narrower than the heads raise (as HF's formula does) instead of reading out of bounds; mixed
    dtypes promote as HF's formula does; an odd head dim splits as HF's rotate_half does."""
    torch.manual_seed(2)
    q, k, cos, sin = _inputs(2, 4, 2, 9, 16, 1, None)
    with pytest.raises(RuntimeError):
        sk.rope(q, k, cos[:, :8], sin[:, :8])
    qo, ko = sk.rope(q.detach().bfloat16(), k.detach().bfloat16(), cos, sin)
    qr, kr = rope_ref(q.detach().bfloat16(), k.detach().bfloat16(), cos[None], sin[None])
    assert qo.dtype == ko.dtype == torch.float32 and max_err(qo, qr) < 1e-5 and max_err(ko, kr) < 1e-5
    q7, k7 = torch.randn(2, 4, 9, 7), torch.randn(2, 2, 9, 7)
    c7, s7 = torch.randn(9, 7), torch.randn(9, 7)
    qo, ko = sk.rope(q7, k7, c7, s7)
    qr, kr = rope_ref(q7, k7, c7[None], s7[None])
    assert max_err(qo, qr) < 1e-5 and max_err(ko, kr) < 1e-5


def test_fp32_tables_with_bf16_heads_give_bf16_heads(path):
    """OLMo 2/3 keep cos/sin in fp32 beside bf16 q and k: the result is in q's and k's dtype (HF computes at the
    wider one and casts back), within bf16 rounding of the float64 truth, and gradients reach q and k in it."""
    torch.manual_seed(0)
    q, k, cos, sin = _inputs(2, 4, 2, 9, 16, 1, None)
    q = q.detach().bfloat16().requires_grad_()
    k = k.detach().bfloat16().requires_grad_()
    q_out, k_out = rope_cast_back(q, k, cos, sin)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    q_ref, k_ref = rope_ref(q, k, cos[None], sin[None])
    torch.testing.assert_close(q_out.double(), q_ref, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(k_out.double(), k_ref, rtol=2**-7, atol=2**-7)
    (q_out.float().sum() + k_out.float().sum()).backward()
    assert q.grad.dtype == k.grad.dtype == torch.bfloat16
