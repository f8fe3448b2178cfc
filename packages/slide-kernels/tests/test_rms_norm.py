import pytest
import torch
from kernels_reference import max_err, rms_norm_ref

import slide_kernels as sk


@pytest.mark.parametrize("shape", [(3, 47, 123), (5, 16)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("mode", ["llama", "gemma"])
def test_forward_backward_fp32(path, shape, offset, mode):
    torch.manual_seed(0)
    x = torch.randn(shape, requires_grad=True)
    w = (torch.rand(shape[-1]) + 0.5).requires_grad_()
    y = sk.rms_norm(x, w, eps=1e-5, offset=offset, casting_mode=mode)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = rms_norm_ref(xr, wr, eps=1e-5, offset=offset)
    yr.backward(dy.double())
    assert y.dtype == x.dtype
    assert max_err(y, yr) < 1e-5
    assert max_err(x.grad, xr.grad) < 1e-5
    assert max_err(w.grad, wr.grad) < 1e-4


@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_backward_skips_gradients_not_asked_for(path, frozen):
    # A frozen weight (adapters) or a frozen input: that gradient is not computed, the other is unchanged.
    torch.manual_seed(3)
    x = torch.randn(3, 5, 37, requires_grad=frozen != "input")
    w = (torch.rand(37) + 0.5).requires_grad_(frozen != "weight")
    y = sk.rms_norm(x, w, eps=1e-5)
    dy = torch.randn_like(y)
    if path[0] == "triton":  # the Function's own outputs: autograd would silently drop an unneeded gradient
        dx, dw = y.grad_fn.apply(dy)[:2]
        assert (dx is None) == (frozen == "input") and (dw is None) == (frozen == "weight")
    y.backward(dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rms_norm_ref(xr, wr, eps=1e-5).backward(dy.double())
    if frozen == "weight":
        assert w.grad is None and max_err(x.grad, xr.grad) < 1e-5
    else:
        assert x.grad is None and max_err(w.grad, wr.grad) < 1e-4


def test_llama_rounds_before_weight(monkeypatch):
    # Llama casts the normalized row to the input dtype before multiplying: check bf16 output matches that.
    # (Torch path: the interpreter's bf16 arithmetic is unreliable; the gpu test covers the kernel in bf16.)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(1)
    x = torch.randn(4, 40).bfloat16()
    w = torch.rand(40).bfloat16() + 0.5
    xf = x.float()
    expect = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert max_err(sk.rms_norm(x, w), expect) <= 2 ** -7 * expect.abs().max().item()


def test_module_matches_function(path):
    torch.manual_seed(2)
    m = sk.RMSNorm(33, eps=1e-6)
    x = torch.randn(2, 3, 33)
    assert torch.allclose(m(x), sk.rms_norm(x, m.weight, 1e-6))


def test_bad_mode():
    with pytest.raises(ValueError, match="casting_mode"):
        sk.rms_norm(torch.randn(2, 3), torch.ones(3), casting_mode="bogus")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["llama", "gemma"])
def test_gpu_bf16_tolerance(mode):
    torch.manual_seed(0)
    x = torch.randn(3, 477, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.rand(4096, device="cuda") + 0.5).bfloat16().requires_grad_()
    dy = torch.randn(3, 477, 4096, device="cuda", dtype=torch.bfloat16)
    from slide_kernels.ops.rms_norm import rms_norm_torch
    outs = []
    for fn in (sk.rms_norm, rms_norm_torch):
        x.grad = w.grad = None
        y = fn(x, w, 1e-6, 0.0, mode)
        y.backward(dy)
        outs.append((y, x.grad, w.grad))
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = rms_norm_ref(xr, wr)
    yr.backward(dy.double())
    for ours, peer, ref in zip(outs[0], outs[1], (yr, xr.grad, wr.grad)):
        assert max_err(ours, ref) <= 1.1 * max_err(peer, ref) + 1e-3 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_gpu_backward_skips_gradients_not_asked_for(frozen):
    # The compiled kernel with WANT_DX or WANT_DW off: None for that gradient, the other one as accurate as ever.
    torch.manual_seed(0)
    x = torch.randn(3, 477, 4096, device="cuda", requires_grad=frozen != "input")
    w = (torch.rand(4096, device="cuda") + 0.5).requires_grad_(frozen != "weight")
    y = sk.rms_norm(x, w)
    dy = torch.randn_like(y)
    dx, dw = y.grad_fn.apply(dy)[:2]
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rms_norm_ref(xr, wr).backward(dy.double())
    if frozen == "weight":
        assert dw is None and max_err(dx, xr.grad) < 1e-5 * xr.grad.abs().max().item()
    else:
        assert dx is None and max_err(dw, wr.grad) < 1e-5 * wr.grad.abs().max().item()


def test_a_strided_weight(path):
    """A weight that is a strided view (e.g. every other element of a buffer) reads the right elements."""
    torch.manual_seed(4)
    x = torch.randn(5, 16, requires_grad=True)
    base = (torch.rand(32) + 0.5).requires_grad_()
    w = base[::2]
    sk.rms_norm(x, w).backward(torch.ones(5, 16))
    xr, br = x.detach().double().requires_grad_(), base.detach().double().requires_grad_()
    rms_norm_ref(xr, br[::2]).backward(torch.ones(5, 16, dtype=torch.float64))
    assert max_err(sk.rms_norm(x, w), rms_norm_ref(xr, br[::2])) < 1e-5
    assert max_err(x.grad, xr.grad) < 1e-5 and max_err(base.grad, br.grad) < 1e-4
