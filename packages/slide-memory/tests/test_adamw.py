from __future__ import annotations

import pytest
import torch
from torch import nn

from slide_memory import (
    AdamWConfig,
    FlatAdamW,
    FlatLayout,
    HostAdamW,
    StreamedStep,
    device_scratch,
    device_scratch_bytes,
    host_scratch_bytes,
    streamed_step_bytes,
)


def test_flat_host_adamw_matches_torch_adamw_on_the_unflattened_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 4))
    ref = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 4))
    ref.load_state_dict(net.state_dict())
    layout = FlatLayout(net)
    master = layout.pack(net, torch.empty(layout.numel))
    cfg = AdamWConfig(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
    opt = HostAdamW([master], cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=False)
    for step in range(5):
        x = torch.randn(8, 6)
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        lr = cfg.lr * (0.5 if step >= 3 else 1.0)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        # The same gradient, computed at the master's values, laid out flat.
        layout.bind(net, master.clone())
        for p in net.parameters():
            p.grad = None
        net(x).pow(2).mean().backward()
        opt.step_unit(0, _flat_grad(layout, net), lr)
    views = layout.views(master)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(views[name], p.detach(), rtol=1e-6, atol=1e-7)


def _flat_grad(layout: FlatLayout, net: nn.Module) -> torch.Tensor:
    out = torch.zeros(layout.numel)
    grads = {n: p.grad for n, p in net.named_parameters()}
    for name, view in layout.views(out).items():
        view.copy_(grads[name])
    return out


def test_grad_scale_is_clipping_and_state_round_trips():
    master = torch.randn(128)
    twin = master.clone()
    grad = torch.randn(128)
    a = HostAdamW([master], AdamWConfig(lr=0.1))
    b = HostAdamW([twin], AdamWConfig(lr=0.1))
    a.step_unit(0, grad.clone(), lr=0.1, grad_scale=0.25)
    b.step_unit(0, grad.clone() * 0.25, lr=0.1)
    assert master.equal(twin)
    state = {k: v.clone() for k, v in a.state_tensors(0).items()}
    assert set(state) >= {"exp_avg", "exp_avg_sq", "step"}
    c = HostAdamW([master.clone()], AdamWConfig(lr=0.1))
    c.load_state_tensors(0, state)
    g2 = torch.randn(128)
    a.step_unit(0, g2.clone(), lr=0.1)
    c.step_unit(0, g2.clone(), lr=0.1)
    assert c.masters[0].equal(a.masters[0])


def test_rejects_non_fp32_masters():
    try:
        HostAdamW([torch.zeros(4, dtype=torch.bfloat16)], AdamWConfig())
    except ValueError as e:
        assert "fp32" in str(e)
    else:
        raise AssertionError("bf16 masters must be refused")


def test_bf16_states_halve_memory_and_track_fp32_states():
    torch.manual_seed(1)
    master = torch.randn(3000) * 0.02
    wide, narrow = master.clone(), master.clone()
    a = FlatAdamW(wide, AdamWConfig(lr=1e-3, weight_decay=0.01), chunk=1024)
    b = FlatAdamW(narrow, AdamWConfig(lr=1e-3, weight_decay=0.01), chunk=1024, states_dtype=torch.bfloat16)
    assert b.state_tensors() == {}
    for _ in range(5):
        g = torch.randn(3000).to(torch.bfloat16)
        a.step(g, 1e-3, 0.7)
        b.step(g, 1e-3, 0.7)
    sa, sb = a.state_tensors(), b.state_tensors()
    assert sb["exp_avg"].dtype == torch.bfloat16 and sb["exp_avg"].nbytes * 2 == sa["exp_avg"].nbytes
    assert float(sb["step"]) == float(sa["step"]) == 5.0
    for key in ("exp_avg", "exp_avg_sq"):  # bf16 keeps ~3 significant digits of each state
        assert ((sb[key].float() - sa[key]).norm() / sa[key].norm()).item() < 1e-2
    # Parameters move by ~lr per step; bf16 states change the update by well under a percent of that.
    assert ((narrow - wide).abs().max() / (wide - master).abs().max()).item() < 0.02
    c = FlatAdamW(narrow.clone(), AdamWConfig(lr=1e-3, weight_decay=0.01), chunk=1024, states_dtype=torch.bfloat16)
    c.load_state_tensors(sb)
    g = torch.randn(3000).to(torch.bfloat16)
    b.step(g, 1e-3)
    c.step(g, 1e-3)
    assert c.master.equal(b.master)


def test_a_bf16_states_checkpoint_resumes_with_fp32_states():
    master = torch.randn(500) * 0.02
    narrow = FlatAdamW(master.clone(), AdamWConfig(lr=1e-3), chunk=128, states_dtype=torch.bfloat16)
    narrow.step(torch.randn(500), 1e-3)
    wide = FlatAdamW(narrow.master.clone(), AdamWConfig(lr=1e-3), chunk=128)
    wide.load_state_tensors(narrow.state_tensors())
    wide.step(torch.randn(500), 1e-3)  # fp32 states from bf16 ones: no dtype error
    assert wide.state_tensors()["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("piece", [64, 192, 4096])
def test_streamed_steps_equal_host_steps_bit_for_bit(piece):
    """A unit stepped piece by piece through a StreamedStep buffer (the engine's device path) ends with the
    same master and states as the host path, whatever the piece size, chunk tails and clipping scale."""
    torch.manual_seed(0)
    config = AdamWConfig(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    master = torch.randn(1000)
    host = FlatAdamW(master.clone(), config, chunk=384)
    streamed = FlatAdamW(master.clone(), config, chunk=384)
    buffer = StreamedStep(piece, config, torch.device("cpu"), torch.bfloat16)
    for k in range(4):
        grad = torch.randn(1000).bfloat16()
        lr, scale = 1e-2 / (k + 1), 0.5 if k % 2 else 1.0
        host.step(grad, lr, scale)
        for (a, b), step in zip(streamed.ranges, streamed.steps):
            for start in range(a, b, piece):
                end = min(start + piece, b)
                buffer.load(streamed, start, end, grad)
                buffer.step(start, end, grad, int(step), lr, scale)
                buffer.store(streamed, start, end)
            step += 1
    assert streamed.master.equal(host.master)
    for key, value in host.state_tensors().items():
        assert streamed.state_tensors()[key].equal(value), key


def test_streamed_pieces_must_be_aligned():
    with pytest.raises(ValueError, match="multiple of 64"):
        StreamedStep(100, AdamWConfig(), torch.device("cpu"), torch.bfloat16)


def test_chunks_are_cut_at_bounds_and_the_math_is_unchanged():
    """Parts of a unit updated at different times (bounds) never share a chunk; a chunk boundary is only where
    the loop splits, so the result is torch's AdamW over the whole tensor, whatever the cuts."""
    torch.manual_seed(0)
    master = torch.randn(1000)
    ref = master.clone().requires_grad_()
    cfg = AdamWConfig(lr=1e-2, weight_decay=0.1)
    opt = FlatAdamW(master, cfg, chunk=256, bounds=(640, 0, 5000))
    assert opt.ranges == [(0, 256), (256, 512), (512, 640), (640, 896), (896, 1000)]
    ref_opt = torch.optim.AdamW([ref], lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, foreach=False)
    for _ in range(3):
        grad = torch.randn(1000)
        ref.grad = grad.clone()
        ref_opt.step()
        opt.step(grad, lr=cfg.lr)
    torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("states", [torch.float32, torch.bfloat16])
def test_host_blocks_change_where_the_work_runs_not_the_result(monkeypatch, states):
    """The host works through cache-sized blocks of each chunk: the same kernel on the same elements, so the
    result is bit for bit whole-chunk steps' and, with fp32 states, torch.optim.AdamW(fused=True)'s."""
    import slide_memory.adamw as adamw

    torch.manual_seed(0)
    master = torch.randn(5000)
    grads = [torch.randn(5000).to(torch.bfloat16) for _ in range(3)]
    cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    results = []
    for per_thread in (64, 1 << 20):  # blocks of 64 elements per thread, or whole chunks
        monkeypatch.setattr(adamw, "BLOCK_PER_THREAD", per_thread)
        opt = FlatAdamW(master.clone(), cfg, chunk=2048, states_dtype=states)
        assert (opt.block < 2048) == (per_thread == 64)
        for g in grads:
            opt.step(g, lr=1e-2, grad_scale=0.5)
        results.append((opt.master, opt.exp_avg, opt.exp_avg_sq))
    assert all(a.equal(b) for a, b in zip(*results))
    if states == torch.float32:
        ref = master.clone().requires_grad_()
        ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True)
        for g in grads:
            ref.grad = g.float() * 0.5
            ref_opt.step()
        assert results[0][0].equal(ref.detach())


@pytest.mark.parametrize("states", [torch.float32, torch.bfloat16])
def test_a_step_split_into_params_then_moments_is_the_whole_step(states):
    """The "params" part writes the new master and leaves m and v as they were; the "moments" part then writes
    m and v and leaves the master alone. Together: bit for bit one whole step, and with fp32 states
    torch.optim.AdamW(fused=True)'s, over steps with changing lr and clipping scale."""
    torch.manual_seed(0)
    cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    master = torch.randn(3000)
    whole = FlatAdamW(master.clone(), cfg, chunk=1024, states_dtype=states)
    split = FlatAdamW(master.clone(), cfg, chunk=1024, states_dtype=states)
    ref = master.clone().requires_grad_()
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True)
    for k in range(3):
        grad = torch.randn(3000).bfloat16()
        lr, scale = 1e-2 / (k + 1), 0.3 if k % 2 else 1.0
        whole.step(grad, lr, scale)
        before = split.exp_avg.clone(), split.exp_avg_sq.clone()
        split.step(grad, lr, scale, part="params")
        assert split.master.equal(whole.master)
        assert split.exp_avg.equal(before[0]) and split.exp_avg_sq.equal(before[1])
        params = split.master.clone()
        split.step(grad, lr, scale, part="moments")
        assert split.master.equal(params) and split.step_count == whole.step_count == k + 1
        assert split.exp_avg.equal(whole.exp_avg) and split.exp_avg_sq.equal(whole.exp_avg_sq)
        ref.grad = grad.float() * scale
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
    if states == torch.float32:
        assert split.master.equal(ref.detach())
        assert split.exp_avg.equal(ref_opt.state[ref]["exp_avg"])
        assert split.exp_avg_sq.equal(ref_opt.state[ref]["exp_avg_sq"])
    with pytest.raises(ValueError, match="part"):
        split.step(grad, lr, part="half")


def test_external_states_bound_before_each_step_give_the_same_steps():
    """A unit whose m and v live elsewhere (the scheduler's disk tier) keeps none itself; bound before each step,
    they are stepped exactly as its own would be, and a wrong buffer is refused."""
    torch.manual_seed(0)
    master = torch.randn(1000)
    own = FlatAdamW(master.clone(), AdamWConfig(lr=1e-2, weight_decay=0.1), chunk=256)
    other = FlatAdamW(master.clone(), AdamWConfig(lr=1e-2, weight_decay=0.1), chunk=256, external_states=True)
    assert other.exp_avg is None and other.exp_avg_sq is None
    m, v = torch.zeros(1000), torch.zeros(1000)
    for _ in range(3):
        grad = torch.randn(1000).to(torch.bfloat16)
        own.step(grad, 1e-2, 0.5)
        other.bind_states(m, v)
        other.step(grad, 1e-2, 0.5)
    assert other.master.equal(own.master) and m.equal(own.exp_avg) and v.equal(own.exp_avg_sq)
    with pytest.raises(ValueError, match="bound states"):
        other.bind_states(torch.zeros(999), v)


@pytest.mark.parametrize("states", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("into", [torch.float32, torch.bfloat16])
def test_a_speculative_step_writes_the_next_steps_parameters_and_changes_nothing(states, into):
    """"speculate" writes the parameters the following whole step (same gradient, lr, scale) will give, rounded
    to `into`'s dtype, and leaves master, m, v and the step count as they were: bit for bit, across chunks cut at
    a bound, for every step of a run."""
    torch.manual_seed(0)
    cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = FlatAdamW(torch.randn(3000), cfg, chunk=1024, states_dtype=states, bounds=(1500,))
    for k in range(3):
        grad = torch.randn(3000).bfloat16()
        lr = 1e-2 / (k + 1)
        before = [t.clone() for t in (opt.master, opt.exp_avg, opt.exp_avg_sq)]
        guess = torch.empty(3000, dtype=into)
        opt.step(grad, lr, part="speculate", into=guess)
        assert all(t.equal(b) for t, b in zip((opt.master, opt.exp_avg, opt.exp_avg_sq), before))
        assert opt.step_count == k
        opt.step(grad, lr)
        assert guess.equal(opt.master.to(into)) and not guess.equal(before[0].to(into))
    with pytest.raises(ValueError, match="speculative step"):
        opt.step(grad, lr, part="speculate")
    with pytest.raises(ValueError, match="a split one may not"):
        opt.step(grad, lr, part="params", into=guess)


@pytest.mark.parametrize("states", [torch.float32, torch.bfloat16])
def test_a_master_brought_for_each_step_steps_as_one_kept_here_and_writes_its_parameters(states):
    """A unit whose master and moments live elsewhere (on disk): each step binds the three, brought into staging
    buffers that other units' steps reuse in between, and writes the new parameters `into` a compute-dtype copy;
    masters, moments and parameters are bit for bit those of a unit that keeps everything here."""
    torch.manual_seed(0)
    cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    start = torch.randn(3000)
    kept = FlatAdamW(start.clone(), cfg, chunk=1024, states_dtype=states, bounds=(1500,))
    away = FlatAdamW(torch.zeros(3000), cfg, chunk=1024, states_dtype=states, bounds=(1500,), external_states=True)
    stored = {"master": start.clone(), "m": torch.zeros(3000, dtype=states), "v": torch.zeros(3000, dtype=states)}
    staging = [(torch.empty(3000), torch.empty(3000, dtype=states), torch.empty(3000, dtype=states))
               for _ in range(2)]
    params = torch.empty(3000, dtype=torch.bfloat16)
    for k in range(4):
        grad = torch.randn(3000).bfloat16()
        kept.step(grad, 1e-2, 0.5)
        master, m, v = staging[k % 2]
        for t in staging[k % 2]:
            t.fill_(float("nan"))  # what another unit left there
        master.copy_(stored["master"]), m.copy_(stored["m"]), v.copy_(stored["v"])
        away.bind_states(m, v, master)
        away.step(grad, 1e-2, 0.5, into=params)
        stored = {"master": master.clone(), "m": m.clone(), "v": v.clone()}
        assert stored["master"].equal(kept.master) and params.equal(kept.master.bfloat16())
        assert stored["m"].equal(kept.exp_avg) and stored["v"].equal(kept.exp_avg_sq)
    with pytest.raises(ValueError, match="bound master"):
        away.bind_states(m, v, torch.zeros(3000, dtype=torch.bfloat16))


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("chunk", [128, 1 << 25])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_exported_byte_counts_are_what_the_optimizers_allocate(monkeypatch, chunk, threads):
    """The placement counts these optimizers' buffers through the same functions that size them."""
    import slide_memory.adamw

    monkeypatch.setattr(slide_memory.adamw, "CHUNK", chunk)
    monkeypatch.setattr(slide_memory.adamw, "BLOCK_PER_THREAD", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    numels = [1000, 300, 7]
    host = HostAdamW([torch.zeros(n) for n in numels], AdamWConfig())
    unit = host.units[0]
    assert _bytes(unit.scratch, unit._wide) == host_scratch_bytes(max(numels), threads)
    scratch = device_scratch(numels, torch.device("cpu"))  # a CPU device's resident units, sharing one scratch
    units = [FlatAdamW(torch.zeros(n), AdamWConfig(), scratch) for n in numels]
    assert _bytes(scratch, *(u._wide for u in units)) == device_scratch_bytes(numels, True, threads)
    assert scratch.numel() * 4 == device_scratch_bytes(numels, False)  # (fp32 states on a GPU widen nothing)
    step = StreamedStep(640, AdamWConfig(), torch.device("cpu"), torch.bfloat16)
    assert _bytes(step.grad_in, step.param, step.exp_avg, step.exp_avg_sq, step.grad) == \
        streamed_step_bytes(640, 2)
