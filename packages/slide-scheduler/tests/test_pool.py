"""The shared pool's layout, checked region by region against the lifetimes it relies on."""

from __future__ import annotations

import random

import pytest
import torch

from slide_scheduler.plan.choices import device_updated, held_on_device
from slide_scheduler.run.pool import SharedPool, pool_bytes, pool_layout


def test_each_gradient_stays_clear_of_its_own_boundary_and_those_below():
    """Block i's gradient is live from its backward to its next update, while boundaries 0..i are written again
    (boundary i by block i-1's forward, before block i updates); boundaries above i are not. Random layouts:
    no gradient over a boundary at or below its block, no two gradients over each other, all inside the pool,
    and the pool never larger than the activations and gradients side by side."""
    rng = random.Random(0)
    for _ in range(500):
        boundaries = rng.randint(1, 40)
        blocks = sorted(rng.sample(range(boundaries), rng.randint(1, boundaries)))
        grad, boundary = rng.randint(1, 50), rng.randint(0, 50)
        size, offsets = pool_layout(blocks, grad, boundary, boundaries)
        assert sorted(offsets) == blocks
        assert size <= boundaries * boundary + len(blocks) * grad
        assert size >= boundaries * boundary
        spans = sorted((offsets[b], offsets[b] + grad) for b in blocks)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        for b in blocks:
            assert offsets[b] >= 0 and offsets[b] + grad <= size
            assert offsets[b] >= (b + 1) * boundary  # boundaries 0..b end at (b + 1) * boundary


def test_an_8b_clipped_run_shares_most_of_its_gradients():
    """Llama-3.1-8B, 8 x 4096 tokens per step, clipping: 22 blocks' gradients on the host (the engine keeps the
    last 10 device-updated ones on the GPU) take 9.6 GB in buffers of their own; over the 8.6 GB of boundary
    activations they need 1.3 GB more."""
    grad, boundary = 218_112_000 * 2, 8 * 4096 * 4096 * 2
    held = held_on_device(device_updated(32, 0.5625), 10, shared=True)
    assert held == [15, 17, 19, 21, 23, 24, 26, 28, 30, 31]
    host = [b for b in range(32) if b not in held]
    extra = pool_bytes(host, grad, [boundary // 8] * 8, 32) - 32 * boundary
    assert len(host) * grad == pytest.approx(9.60e9, rel=1e-3)
    assert extra == pytest.approx(1.28e9, rel=0.01)


def test_views_are_where_the_layout_puts_them():
    pool = SharedPool([0, 2], grad_numel=1000, dtype=torch.bfloat16, boundaries=3)
    assert pool.fit([3000, 5000])
    like = torch.zeros(2, 1500, dtype=torch.bfloat16)  # 6000 bytes: micro-batch 1's room is 8192
    base = pool.activation(0, 0, like).data_ptr()
    assert pool.activation(2, 1, like).data_ptr() - base == 2 * pool.boundary_bytes + 4096
    _, offsets = pool_layout([0, 2], 4096, pool.boundary_bytes, 3)
    assert [pool.gradient(b).data_ptr() - base for b in (0, 2)] == [offsets[0], offsets[2]]
    assert pool.gradient(2).numel() == 1000 and pool.gradient(2).dtype == torch.bfloat16
    assert not pool.fit([4000, 4000]) and pool.activation(0, 1, like).data_ptr() - base == 4096
    assert pool.fit([20000])  # more than a boundary's room: a new allocation
