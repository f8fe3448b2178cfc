"""moe_experts against a float64 reference in plain torch (one expert at a time, no sorting): forward and the
gradients of the hidden states, the routing weights and both expert weights, on odd shapes (H and I not
multiples of 16, one expert, experts that receive no pair, all pairs on one expert, indices of no expert).
fp32 tolerance: 1e-5 of the largest reference value (the products are fp32 sums of at most a few hundred terms)."""

import importlib

import pytest
import torch
from kernels_reference import max_err

import slide_kernels as sk

moe_module = importlib.import_module("slide_kernels.ops.moe_experts")


def moe_ref(x, index, weights, gate_up, down):
    """float64: y[t] = sum_j w[t, j] down[e] (silu(gate[e] x[t]) * up[e] x[t]), e = index[t, j] in [0, E)."""
    x, weights, gate_up, down = x.double(), weights.double(), gate_up.double(), down.double()
    inter = down.shape[2]
    y = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, j = (index == e).nonzero(as_tuple=True)
        gate, up = (x[token] @ gate_up[e].t()).split(inter, dim=-1)
        act = gate * torch.sigmoid(gate) * up
        y = y.index_add(0, token, weights[token, j, None] * (act @ down[e].t()))
    return y


def inputs(tokens, k, experts, hidden, inter, seed=0, index=None, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    if index is None:  # k distinct experts per token, the last expert never chosen where there are more than k
        pool = max(k, experts - 1)
        index = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    leaves = [t.to(device, dtype).requires_grad_() for t in (x, weights, gate_up, down)]
    return leaves[0], index.to(device), *leaves[1:]


def check(x, index, weights, gate_up, down, tol=1e-5):
    y = sk.moe_experts(x, index, weights, gate_up, down)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(y)
    y.backward(dy)
    leaves = (x, weights, gate_up, down)
    twins = [t.detach().double().requires_grad_() for t in leaves]
    yr = moe_ref(twins[0], index, *twins[1:])
    yr.backward(dy.double())
    assert y.shape == x.shape and y.dtype == x.dtype
    for name, ours, ref in zip(
        ("y", "dx", "dweights", "dgate_up", "ddown"), (y, *(t.grad for t in leaves)), (yr, *(t.grad for t in twins))
    ):
        assert max_err(ours, ref) <= tol * max(1.0, ref.abs().max().item()), name


# (tokens, k, experts, hidden, inter): one expert; several row and column tiles of the interpreter's 16, with
# H and I not multiples of 16; more experts than pairs (most receive none).
SHAPES = [(5, 1, 1, 17, 5), (9, 3, 6, 24, 20), (41, 2, 3, 40, 36), (3, 2, 11, 19, 9)]


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_backward_fp32(path, shape):
    check(*inputs(*shape))


def test_backward_from_the_saved_gate_up_projections(path, monkeypatch):
    """SAVE_GATE_UP: the forward keeps the pairs' gate/up projections and the backward reads them."""
    monkeypatch.setattr(moe_module, "SAVE_GATE_UP", True)
    check(*inputs(41, 2, 3, 40, 36))


def test_every_pair_on_one_expert_and_pairs_of_no_expert(path):
    """Skewed routing (all of the tokens' first choice is expert 2), and indices outside [0, E), transformers'
    expert-parallel sentinels, which contribute nothing and get no routing-weight gradient."""
    index = torch.tensor([[2, 0], [2, 4], [2, -1], [2, 1], [2, 4], [2, 3]])
    x, index, weights, gate_up, down = inputs(6, 2, 4, 21, 18, index=index)
    check(x, index, weights, gate_up, down)
    assert torch.all(weights.grad[index >= 4] == 0) and torch.all(weights.grad[index < 0] == 0)


def test_batch_and_sequence_dims(path):
    x, index, weights, gate_up, down = inputs(12, 2, 4, 20, 12)
    y = sk.moe_experts(x.view(3, 4, 20), index.view(3, 4, 2), weights.view(3, 4, 2), gate_up, down)
    assert y.shape == (3, 4, 20)
    ref = moe_ref(x, index, weights, gate_up, down)
    assert max_err(y.view(12, 20), ref) <= 1e-5 * ref.abs().max().item()


def test_module_holds_transformers_parameters(path):
    torch.manual_seed(3)
    experts = sk.MoEExperts(num_experts=3, hidden_size=20, intermediate_size=12)
    assert experts.gate_up_proj.shape == (3, 24, 20) and experts.down_proj.shape == (3, 20, 12)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(7, 20)
    index, weights = torch.randint(0, 3, (7, 2)), torch.rand(7, 2)
    ref = moe_ref(x, index, weights, experts.gate_up_proj, experts.down_proj)
    assert max_err(experts(x, index, weights), ref) <= 1e-5 * ref.abs().max().item()


def test_shapes_are_checked():
    x, index, weights, gate_up, down = inputs(4, 2, 3, 16, 8)
    with pytest.raises(ValueError, match="down_proj"):
        sk.moe_experts(x, index, weights, gate_up, down[:, :, :7])
    with pytest.raises(ValueError, match="top_k_weights"):
        sk.moe_experts(x, index, weights[:, :1], gate_up, down)
    with pytest.raises(ValueError, match="one dtype"):
        sk.moe_experts(x, index, weights, gate_up, down.double())


@pytest.mark.gpu
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
def test_gpu_bf16_tolerance(weights_dtype):
    """bf16 on CUDA (Qwen3-MoE and OLMoE hand bf16 routing weights, Mixtral fp32 ones): each output's error
    against the float64 reference is at most the torch path's own bf16 error, times 1.25, plus a small margin."""
    from slide_kernels.ops.moe_experts import moe_experts_torch

    x, index, weights, gate_up, down = inputs(1000, 4, 16, 520, 264, device="cuda", dtype=torch.bfloat16)
    index[:, 0] = 5  # one expert takes every token, two take none
    index[index == 7] = 6
    index[index == 8] = 6
    weights = weights.detach().to(weights_dtype).requires_grad_()
    leaves = (x, weights, gate_up, down)
    dy = torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()
    outs = []
    for fn in (sk.moe_experts, moe_experts_torch):
        for t in leaves:
            t.grad = None
        y = fn(x, index, weights, gate_up, down)
        y.backward(dy)
        outs.append((y, *(t.grad for t in leaves)))
    twins = [t.detach().double().requires_grad_() for t in leaves]
    yr = moe_ref(twins[0], index, *twins[1:])
    yr.backward(dy.double())
    refs = (yr, *(t.grad for t in twins))
    for name, ours, peer, ref in zip(("y", "dx", "dweights", "dgate_up", "ddown"), outs[0], outs[1], refs):
        assert ours.dtype == peer.dtype, name
        assert max_err(ours, ref) <= 1.25 * max_err(peer, ref) + 1e-3 * ref.abs().max().item(), name
