import pytest
import torch
import torch.nn.functional as F
from kernels_reference import linear_ce_ref, max_err

import slide_kernels as sk

V, H = 123, 29


def _inputs(shape=(3, 47), dtype=torch.float32, device="cpu", ignore_frac=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(device, dtype).requires_grad_()
    labels = torch.randint(0, V, shape, generator=g)
    labels[torch.rand(shape, generator=g) < ignore_frac] = -100
    return hidden, weight, labels.to(device)


def _check(hidden, weight, labels, tol=2e-5, **kw):
    bias = kw.pop("bias", None)
    loss = sk.linear_cross_entropy(hidden, weight, labels, bias=bias, **kw)
    up = torch.rand_like(loss)
    (loss * up).sum().backward()
    hr, wr = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    br = None if bias is None else bias.detach().double().requires_grad_()
    ref = linear_ce_ref(hr, wr, labels, bias=br, **kw)
    (ref * up.double()).sum().backward()
    assert loss.shape == ref.shape
    assert max_err(loss, ref) < tol * max(1.0, ref.abs().max().item())
    assert hidden.grad.dtype == hidden.dtype and weight.grad.dtype == weight.dtype
    assert max_err(hidden.grad, hr.grad) < tol
    assert max_err(weight.grad, wr.grad) < tol
    if bias is not None:
        assert max_err(bias.grad, br.grad) < tol


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions(path, reduction):
    _check(*_inputs(), reduction=reduction)


@pytest.mark.parametrize("opts", [dict(label_smoothing=0.1), dict(softcap=4.0), dict(z_loss=1e-3),
                                  dict(label_smoothing=0.2, softcap=2.5, z_loss=1e-2, reduction="none")])
def test_options(path, opts):
    _check(*_inputs(seed=1), **opts)


def test_bias_and_normalizer(path):
    hidden, weight, labels = _inputs(seed=2)
    bias = (torch.randn(V) * 0.1).requires_grad_()
    _check(hidden, weight, labels, bias=bias, normalizer=torch.tensor(57.0))
    hidden.grad = weight.grad = None
    _check(hidden, weight, labels, normalizer=31)


def test_many_chunks(path, monkeypatch):
    # Force small token chunks so the fp32 weight-gradient sum runs over first, middle and last chunks.
    monkeypatch.setenv("SLIDE_LCE_CHUNK_TOKENS", "32")
    _check(*_inputs(seed=3), label_smoothing=0.05)


def test_matches_torch_linear_cross_entropy(path):
    hidden, weight, labels = _inputs(seed=4)
    ours = sk.linear_cross_entropy(hidden, weight, labels)
    if hasattr(F, "linear_cross_entropy"):
        theirs = F.linear_cross_entropy(hidden.detach().double().reshape(-1, H), weight.detach().double(),
                                        labels.reshape(-1), ignore_index=-100)
    else:  # older torch: the same thing in two steps
        theirs = F.cross_entropy(hidden.detach().double().reshape(-1, H) @ weight.detach().double().t(),
                                 labels.reshape(-1))
    assert max_err(ours, theirs) < 2e-5


def test_all_ignored_gives_zero(path):
    hidden, weight, labels = _inputs(seed=5)
    labels = torch.full_like(labels, -100)
    for reduction in ("mean", "sum"):
        hidden.grad = weight.grad = None
        loss = sk.linear_cross_entropy(hidden, weight, labels, reduction=reduction)
        loss.backward()
        assert loss.item() == 0.0
        assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().max().item() == 0.0
        assert weight.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("shape", [(0,), (2, 0)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(path, shape, reduction):
    # No tokens at all: like an all-ignored batch, loss 0 (or an empty "none" loss) and zero gradients, never NaN.
    hidden, weight, labels = _inputs(shape=shape)
    bias = torch.randn(V).requires_grad_()
    loss = sk.linear_cross_entropy(hidden, weight, labels, bias=bias, reduction=reduction)
    loss.sum().backward()
    twins = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    ref = linear_ce_ref(*twins[:2], labels, bias=twins[2], reduction=reduction)
    ref.sum().backward()
    assert loss.dtype == torch.float32 and loss.shape == ref.shape == (() if reduction != "none" else shape)
    assert torch.equal(loss.double(), ref)
    for ours, twin in zip((hidden, weight, bias), twins):
        assert ours.grad.dtype == ours.dtype and ours.grad.shape == ours.shape
        assert torch.equal(ours.grad.double(), twin.grad) and not ours.grad.abs().gt(0).any()


def test_fp32_bias_with_bf16_weight_keeps_an_fp32_bias_gradient():
    # The bias joins the logits in the weight's dtype, but its gradient is summed in fp32 and handed back in the
    # bias's own dtype (autograd would cast a bf16 one back, having lost the bits).
    hidden, weight, labels = _inputs(seed=7)
    bias = torch.randn(V).requires_grad_()
    sk.linear_cross_entropy(hidden.detach().bfloat16(), weight.detach().bfloat16(), labels, bias=bias).backward()
    grad = bias.grad.double()
    assert bias.grad.dtype == torch.float32 and (grad - grad.bfloat16().double()).abs().max() > 0


def test_no_grad_and_frozen_weight(path):
    hidden, weight, labels = _inputs(seed=6)
    with torch.no_grad():
        loss = sk.linear_cross_entropy(hidden, weight, labels)
    assert max_err(loss, linear_ce_ref(hidden.detach(), weight.detach(), labels)) < 2e-5
    weight.requires_grad_(False)
    sk.linear_cross_entropy(hidden, weight, labels).backward()
    assert hidden.grad is not None and weight.grad is None


def test_bf16_weight_grad_is_rounded_fp32_sum(monkeypatch):
    # The split-plane fp32 accumulator must give the bf16 rounding of the fp32 sum of per-chunk terms.
    from slide_kernels.ops.linear_cross_entropy import _WeightGradTriton
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton path")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(7)
    acc = _WeightGradTriton(torch.zeros(37, 29, dtype=torch.bfloat16, device=device))
    exact = torch.zeros(37, 29, dtype=torch.float64)
    for i in range(3):
        g = torch.randn(11, 37).bfloat16().to(device)
        x = (torch.randn(11, 29) * 10**i).bfloat16().to(device)
        acc.add(g, x)
        exact += g.double().cpu().t() @ x.double().cpu()
    # Planes 0xFFFF | 0xFFFF: an fp32 NaN, which the rounding once turned into -0.
    acc.hi.view(torch.int16).view(-1)[5], acc.lo.view(-1)[5] = -1, -1
    got = acc.result(torch.full((), 1 / 3, device=device)).cpu()
    assert got.dtype == torch.bfloat16 and got.view(-1)[5].isnan()
    # One bf16 rounding (relative 2^-8 at most) of the exact scaled sum, plus the fp32 sum's own error (~3e-6
    # here). Rounding the sum, then the scale, then their product (as before) broke this on 190 of 1073.
    want = exact / 3
    ok = (got.double() - want).abs() <= want.abs() * (2**-8 + 4e-6) + 1e-6
    ok.view(-1)[5] = True
    assert ok.all()


def test_narrow_in_place():
    # The fp32 sum scaled and narrowed to bf16 in its own storage, range by range: exactly torch's rounding.
    lce_mod = __import__("sys").modules["slide_kernels.ops.linear_cross_entropy"]
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton path")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(9)
    acc = torch.randn(27, 37, device=device) * 100
    # NaN must stay NaN; inf and a large finite value must round as torch rounds them.
    acc.view(-1)[[50, 300, 900]] = torch.tensor([float("nan"), float("inf"), 3.3e38], device=device)
    want = (acc * 0.3).to(torch.bfloat16)
    got = lce_mod.narrow_in_place(acc, torch.tensor(0.3), torch.bfloat16, first=37)  # [37, 74), ... up to 999
    assert got.data_ptr() == acc.data_ptr() and got.shape == acc.shape
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert got.view(-1)[50].isnan()


@pytest.mark.gpu
def test_gpu_cublas_weight_grad_narrowed_in_place():
    # cuBLAS's fp32 sum, scaled and narrowed to bf16 in its own storage (element ranges that double in size).
    lce_mod = __import__("sys").modules["slide_kernels.ops.linear_cross_entropy"]
    _WeightGradCublas = lce_mod._WeightGradCublas
    torch.manual_seed(8)
    v, h = 5000, 40
    acc = _WeightGradCublas(torch.empty(v, h, dtype=torch.bfloat16, device="cuda"))
    exact = torch.zeros(v, h, dtype=torch.float64)
    for i in range(3):
        g = torch.randn(64, v, device="cuda").bfloat16()
        x = (torch.randn(64, h, device="cuda") * 10**i).bfloat16()
        acc.add(g, x)
        exact += g.double().cpu().t() @ x.double().cpu()
    scale = 0.37
    got = lce_mod.narrow_in_place(acc.acc, torch.full((), scale, device="cuda"), torch.bfloat16, first=64)
    got = got.cpu().double()  # ranges [64, 128), [128, 256), ... through the Triton kernel
    want = exact * scale
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-3 * want.abs().max() * 2**-8).all()


def test_fp16_hidden_gradient_under_a_loss_scale(path):
    # GradScaler multiplies the loss by 65536, beyond fp16's range: the upstream gradient must scale in fp32.
    hidden, weight, labels = _inputs(seed=10)
    h16, w16 = (t.detach().half().requires_grad_() for t in (hidden, weight))
    (sk.linear_cross_entropy(h16, w16, labels) * 65536.0).backward()
    hr, wr = h16.detach().double().requires_grad_(), w16.detach().double().requires_grad_()
    (linear_ce_ref(hr, wr, labels) * 65536.0).backward()
    for got, want in ((h16.grad, hr.grad), (w16.grad, wr.grad)):
        assert got.isfinite().all() and max_err(got, want) < 2e-3 * want.abs().max().item()


def test_module(path):
    hidden, weight, labels = _inputs(seed=8)
    m = sk.LinearCrossEntropy(label_smoothing=0.1)
    got = m(hidden, weight, labels)
    assert max_err(got, linear_ce_ref(hidden.detach(), weight.detach(), labels, label_smoothing=0.1)) < 2e-5


def test_bad_arguments():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="reduction"):
        sk.linear_cross_entropy(hidden, weight, labels, reduction="avg")
    with pytest.raises(ValueError, match="in_features"):
        sk.linear_cross_entropy(hidden[..., :5], weight, labels)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(), dict(label_smoothing=0.1, z_loss=1e-4), dict(softcap=30.0)])
def test_gpu_bf16_tolerance(opts):
    torch.manual_seed(0)
    n, h, v = 3 * 777, 1024, 32003
    hidden = torch.randn(3, 777, h, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (3, 777), device="cuda")
    labels[:, :50] = -100
    loss = sk.linear_cross_entropy(hidden, weight, labels, **opts)
    loss.backward()
    ours = (loss, hidden.grad, weight.grad)
    hidden.grad = weight.grad = None
    # Same-dtype peer: bf16 logits from torch, fp32 softmax, as eager HF training does.
    z = (hidden @ weight.t()).float()
    if "softcap" in opts:
        z = opts["softcap"] * torch.tanh(z / opts["softcap"])
    peer_loss = F.cross_entropy(z.view(n, v), labels.view(-1), label_smoothing=opts.get("label_smoothing", 0.0),
                                reduction="none")
    peer_loss = peer_loss + opts.get("z_loss", 0.0) * torch.logsumexp(z.view(n, v), -1) ** 2 * (labels.view(-1) >= 0)
    peer_loss = peer_loss.sum() / (labels >= 0).sum()
    peer_loss.backward()
    peer = (peer_loss, hidden.grad, weight.grad)
    hr, wr = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = linear_ce_ref(hr, wr, labels, **opts)
    ref.backward()
    for name, o, p, r in zip(("loss", "grad_hidden", "grad_weight"), ours, peer, (ref, hr.grad, wr.grad)):
        assert max_err(o, r) <= 1.25 * max_err(p, r) + 1e-2 * r.abs().max().item(), name


@pytest.mark.gpu
def test_gpu_fp32_weight_gradient_is_full_fp32():
    # The Triton GEMM's fp32 products are IEEE fp32, as torch's fp32 matmuls (tf32 would miss by ~1e-3).
    torch.manual_seed(0)
    hidden = torch.randn(4, 300, 256, device="cuda").requires_grad_()
    weight = (torch.randn(5003, 256, device="cuda") * 0.05).requires_grad_()
    labels = torch.randint(0, 5003, (4, 300), device="cuda")
    sk.linear_cross_entropy(hidden, weight, labels).backward()
    hr, wr = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    linear_ce_ref(hr, wr, labels).backward()
    assert max_err(weight.grad, wr.grad) < 1e-5 * wr.grad.abs().max().item()
    assert max_err(hidden.grad, hr.grad) < 1e-5 * hr.grad.abs().max().item()


@pytest.mark.gpu
def test_gpu_int64_offsets():
    # N * V > 2^31 (the whole logits would not fit int32 indexing); the logits are never materialized.
    torch.manual_seed(0)
    n, h, v = 17000, 64, 128256
    hidden = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    assert n * v > 2**31
    loss = sk.linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    ref = torch.zeros((), dtype=torch.float64, device="cuda")
    for s in range(0, n, 2048):
        z = (hidden[s:s + 2048].double() @ weight.double().t())
        ref += F.cross_entropy(z, labels[s:s + 2048], reduction="sum")
    ref /= n
    assert abs(loss.item() - ref.item()) < 2e-3 * abs(ref.item())
    assert torch.isfinite(weight.grad.float()).all() and torch.isfinite(hidden.grad.float()).all()
    # The last rows' gradient is as large as the first rows' (no wrapped offsets writing elsewhere).
    assert hidden.grad[-100:].float().abs().mean() > 0.1 * hidden.grad[:100].float().abs().mean()


def test_no_gradient_work_without_autograd(path, monkeypatch):
    """Under no_grad / inference_mode (an eval loop) the forward makes no gradients it would throw away."""
    import importlib

    lce = importlib.import_module("slide_kernels.ops.linear_cross_entropy")  # the module, not the function
    wants = []
    run = lce._run
    monkeypatch.setattr(lce, "_run", lambda *a: (wants.append(a[9]), run(*a))[1])
    hidden, weight, labels = _inputs(seed=9)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            loss = sk.linear_cross_entropy(hidden, weight, labels)
        assert max_err(loss, linear_ce_ref(hidden.detach(), weight.detach(), labels)) < 2e-5
    sk.linear_cross_entropy(hidden, weight, labels).backward()
    assert wants == [(False, False, False), (False, False, False), (True, True, False)]
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("bad", [V, -1])
def test_a_label_outside_the_vocabulary_is_an_error(path, bad):
    """A label >= V, or negative and not ignore_index, is refused as F.cross_entropy refuses it (the kernel
    would read past the row)."""
    hidden, weight, labels = _inputs(seed=10)
    labels[1, 3] = bad
    with pytest.raises((RuntimeError, IndexError)):
        sk.linear_cross_entropy(hidden, weight, labels)


def test_cublas_probe_raises_out_of_memory_and_warns_on_other_failures(monkeypatch):
    """Out of memory is this moment's state, not the build's: it propagates and nothing is cached. Any other
    failure picks the Triton sum for the process, and says so."""
    lce_mod = __import__("sys").modules["slide_kernels.ops.linear_cross_entropy"]
    probe = lce_mod._cublas_fp32_accumulation
    probe.cache_clear()
    device = torch.device("cpu")

    def fail(error):
        def construct(weight):
            raise error
        return construct

    monkeypatch.setattr(lce_mod, "_WeightGradCublas", fail(torch.OutOfMemoryError("out of memory")))
    with pytest.raises(torch.OutOfMemoryError):
        probe(device)
    assert probe.cache_info().currsize == 0
    monkeypatch.setattr(lce_mod, "_WeightGradCublas", fail(RuntimeError("no fp32 output")))
    with pytest.warns(UserWarning, match="RuntimeError: no fp32 output.*slower Triton weight-gradient sum"):
        assert probe(device) is False
    probe.cache_clear()
