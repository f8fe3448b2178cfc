import pytest
import torch
from kernels_reference import geglu_ref, max_err

import slide_kernels as sk


@pytest.mark.parametrize("shape", [(3, 47, 123), (7,)])
def test_forward_backward_fp32(path, shape):
    torch.manual_seed(0)
    a = (torch.randn(shape) * 3).requires_grad_()
    b = torch.randn(shape, requires_grad=True)
    c = sk.geglu(a, b)
    dc = torch.randn_like(c)
    c.backward(dc)
    ar, br = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    cr = geglu_ref(ar, br)
    cr.backward(dc.double())
    assert c.dtype == a.dtype
    assert max_err(c, cr) < 1e-5
    assert max_err(a.grad, ar.grad) < 1e-5
    assert max_err(b.grad, br.grad) < 1e-5


def test_tails_and_zero(path):
    """Far into either tail the tanh approximation is 0 or x (no NaN from an overflowing exp), and at 0 its
    slope is 1/2."""
    a = torch.tensor([-80.0, -30.0, -9.0, 0.0, 9.0, 30.0, 80.0], requires_grad=True)
    b = torch.ones(7, requires_grad=True)
    c = sk.geglu(a, b)
    c.sum().backward()
    ar = a.detach().double().requires_grad_()
    cr = geglu_ref(ar, b.detach())
    cr.sum().backward()
    assert torch.isfinite(c).all() and torch.isfinite(a.grad).all()
    assert max_err(c, cr) < 1e-5 and max_err(a.grad, ar.grad) < 1e-5
    assert a.grad[3].item() == pytest.approx(0.5, abs=1e-7)


def test_non_contiguous_inputs(path):
    torch.manual_seed(1)
    both = torch.randn(5, 2 * 19, requires_grad=True)
    c = sk.geglu(both[:, :19], both[:, 19:])
    c.sum().backward()
    ref = both.detach().double().requires_grad_()
    geglu_ref(ref[:, :19], ref[:, 19:]).sum().backward()
    assert max_err(c, geglu_ref(both[:, :19], both[:, 19:])) < 1e-5
    assert max_err(both.grad, ref.grad) < 1e-5


def test_mlp_module(path):
    torch.manual_seed(2)
    mlp = sk.GeGLUMLP(24, 40)
    x = torch.randn(2, 3, 24)
    expect = mlp.down_proj(torch.nn.functional.gelu(mlp.gate_proj(x), approximate="tanh") * mlp.up_proj(x))
    assert max_err(mlp(x), expect) < 1e-5


def test_shape_mismatch():
    with pytest.raises(ValueError, match="one shape"):
        sk.geglu(torch.randn(3), torch.randn(4))


@pytest.mark.gpu
def test_gpu_bf16_tolerance():
    torch.manual_seed(0)
    a = (torch.randn(3, 477, 1433, device="cuda") * 3).bfloat16().requires_grad_()
    b = torch.randn(3, 477, 1433, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dc = torch.randn(3, 477, 1433, device="cuda", dtype=torch.bfloat16)
    from slide_kernels.ops.geglu import geglu_torch
    outs = []
    for fn in (sk.geglu, geglu_torch):
        a.grad = b.grad = None
        c = fn(a, b)
        c.backward(dc)
        outs.append((c, a.grad, b.grad))
    ar, br = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    cr = geglu_ref(ar, br)
    cr.backward(dc.double())
    for ours, peer, ref in zip(outs[0], outs[1], (cr, ar.grad, br.grad)):
        assert max_err(ours, ref) <= 1.1 * max_err(peer, ref) + 1e-3
