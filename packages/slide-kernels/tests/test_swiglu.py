import pytest
import torch
from kernels_reference import max_err, swiglu_ref

import slide_kernels as sk


@pytest.mark.parametrize("shape", [(3, 47, 123), (7,)])
def test_forward_backward_fp32(path, shape):
    torch.manual_seed(0)
    a = (torch.randn(shape) * 3).requires_grad_()
    b = torch.randn(shape, requires_grad=True)
    c = sk.swiglu(a, b)
    dc = torch.randn_like(c)
    c.backward(dc)
    ar, br = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    cr = swiglu_ref(ar, br)
    cr.backward(dc.double())
    assert max_err(c, cr) < 1e-5
    assert max_err(a.grad, ar.grad) < 1e-5
    assert max_err(b.grad, br.grad) < 1e-5


def test_non_contiguous_inputs(path):
    torch.manual_seed(1)
    both = torch.randn(5, 2 * 19, requires_grad=True)
    gate, up = both[:, :19], both[:, 19:]
    c = sk.swiglu(gate, up)
    c.sum().backward()
    ref = both.detach().double().requires_grad_()
    swiglu_ref(ref[:, :19], ref[:, 19:]).sum().backward()
    assert max_err(both.grad, ref.grad) < 1e-5


def test_mlp_module(path):
    torch.manual_seed(2)
    mlp = sk.SwiGLUMLP(24, 40)
    x = torch.randn(2, 3, 24)
    expect = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert max_err(mlp(x), expect) < 1e-5


def test_shape_mismatch():
    with pytest.raises(ValueError, match="one shape"):
        sk.swiglu(torch.randn(3), torch.randn(4))
    with pytest.raises(ValueError, match="even last dim"):
        sk.swiglu_gate_up(torch.randn(3, 5))


@pytest.mark.parametrize("shape", [(3, 7, 2 * 61), (2 * 5,), (4, 2 * 2100)])
def test_gate_up_halves_forward_backward_fp32(path, shape):
    """Phi-3's fused projection output: gate is the first half of the last dim, up the second (the last shape
    spans two column tiles of the kernel)."""
    torch.manual_seed(3)
    x = (torch.randn(shape) * 3).requires_grad_()
    c = sk.swiglu_gate_up(x)
    dc = torch.randn_like(c)
    c.backward(dc)
    xr = x.detach().double().requires_grad_()
    n = shape[-1] // 2
    cr = swiglu_ref(xr[..., :n], xr[..., n:])
    cr.backward(dc.double())
    assert c.shape == (*shape[:-1], n) and c.dtype == x.dtype
    assert max_err(c, cr) < 1e-5
    assert max_err(x.grad, xr.grad) < 1e-5


def test_gate_up_strided_rows(path):
    """Rows further apart than the two halves (a slice of a wider buffer) are read where they lie."""
    torch.manual_seed(4)
    base = torch.randn(6, 50, requires_grad=True)
    x = base[:, 3:3 + 2 * 17]
    c = sk.swiglu_gate_up(x)
    c.sum().backward()
    br = base.detach().double().requires_grad_()
    xr = br[:, 3:3 + 2 * 17]
    cr = swiglu_ref(xr[:, :17], xr[:, 17:])
    cr.sum().backward()
    assert max_err(c, cr) < 1e-5 and max_err(base.grad, br.grad) < 1e-5


def test_gate_up_mlp_module(path):
    torch.manual_seed(5)
    mlp = sk.SwiGLUGateUpMLP(24, 40)
    x = torch.randn(2, 3, 24)
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    expect = mlp.down_proj(up * torch.nn.functional.silu(gate))
    assert max_err(mlp(x), expect) < 1e-5


@pytest.mark.gpu
def test_gpu_bf16_tolerance():
    torch.manual_seed(0)
    a = torch.randn(3, 477, 1433, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(3, 477, 1433, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dc = torch.randn(3, 477, 1433, device="cuda", dtype=torch.bfloat16)
    from slide_kernels.ops.swiglu import swiglu_torch
    outs = []
    for fn in (sk.swiglu, swiglu_torch):
        a.grad = b.grad = None
        c = fn(a, b)
        c.backward(dc)
        outs.append((c, a.grad, b.grad))
    ar, br = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    cr = swiglu_ref(ar, br)
    cr.backward(dc.double())
    for ours, peer, ref in zip(outs[0], outs[1], (cr, ar.grad, br.grad)):
        assert max_err(ours, ref) <= 1.1 * max_err(peer, ref) + 1e-3


@pytest.mark.gpu
def test_gpu_gate_up_bf16_tolerance():
    torch.manual_seed(0)
    x = torch.randn(3, 477, 2 * 1433, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dc = torch.randn(3, 477, 1433, device="cuda", dtype=torch.bfloat16)
    from slide_kernels.ops.swiglu import swiglu_gate_up_torch
    outs = []
    for fn in (sk.swiglu_gate_up, swiglu_gate_up_torch):
        x.grad = None
        c = fn(x)
        c.backward(dc)
        outs.append((c, x.grad))
    xr = x.detach().double().requires_grad_()
    cr = swiglu_ref(xr[..., :1433], xr[..., 1433:])
    cr.backward(dc.double())
    for ours, peer, ref in zip(outs[0], outs[1], (cr, xr.grad)):
        assert max_err(ours, ref) <= 1.1 * max_err(peer, ref) + 1e-3
