from __future__ import annotations

import pytest
import torch
from torch import nn

from slide_memory import ALIGN, FlatLayout, HostArena, Slot, SlotQueue, StagingRing


def make_net() -> nn.Module:
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Linear(3, 7, bias=False))
    net[3].weight = nn.Parameter(net[2].weight.detach().t().contiguous())
    return net


def test_layout_is_aligned_and_covers_every_parameter():
    net = make_net()
    layout = FlatLayout(net)
    names = [e.name for e in layout.entries]
    assert names == [n for n, _ in net.named_parameters()]
    assert all(e.offset % ALIGN == 0 for e in layout.entries)
    ends = [e.offset + e.numel for e in layout.entries]
    assert all(end <= nxt.offset for end, nxt in zip(ends, layout.entries[1:]))
    assert layout.numel >= sum(p.numel() for p in net.parameters())


def test_pack_then_views_round_trip_and_padding_is_zero():
    net = make_net()
    layout = FlatLayout(net)
    flat = layout.pack(net, torch.full((layout.numel,), float("nan")))
    for name, view in layout.views(flat).items():
        assert view.equal(dict(net.named_parameters())[name])
    used = torch.zeros(layout.numel, dtype=torch.bool)
    for e in layout.entries:
        used[e.offset : e.offset + e.numel] = True
    assert flat[~used].eq(0).all()


def test_tied_parameters_stay_tied_after_binding():
    net = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11, bias=False))
    net[1].weight = net[0].weight
    layout = FlatLayout(net)
    assert [e.name for e in layout.entries] == ["0.weight"]
    with torch.device("meta"):
        meta = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11, bias=False))
    meta[1].weight = meta[0].weight
    slot = Slot(layout, meta, torch.device("cpu"), torch.float32)
    assert slot.module[1].weight is slot.module[0].weight
    slot.load(layout.pack(net, torch.empty(layout.numel)), unit=0)
    ids = torch.tensor([[1, 4, 9]])
    torch.testing.assert_close(slot.module(ids), net(ids), rtol=0, atol=0)


def test_slot_runs_any_block_and_accumulates_grads_in_place():
    torch.manual_seed(0)
    blocks = [make_net() for _ in range(3)]
    layout = FlatLayout(blocks[0])
    with torch.device("meta"):
        template = make_net()
    queue = SlotQueue(layout, lambda: template, count=1, device=torch.device("cpu"), dtype=torch.float64)
    x = torch.randn(4, 5, dtype=torch.float64)
    for i, block in enumerate(blocks):
        block.double()
        slot = queue.next()
        slot.load(layout.pack(block, torch.empty(layout.numel, dtype=torch.float64)), unit=i)
        slot.grads.zero_()
        slot.module(x).sum().backward()
        slot.module(2 * x).sum().backward()  # a second micro-batch adds into the same buffer
        block(x).sum().backward()
        block(2 * x).sum().backward()
        grads = layout.views(slot.grads)
        for name, p in block.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-12)
        assert slot.module[0].weight.grad.data_ptr() == grads["0.weight"].data_ptr()


def test_a_slot_holds_blocks_of_several_shapes_in_one_pair_of_buffers():
    """Two block shapes share a slot: the buffers are sized for the larger, each shape's module is bound to their
    start, and each runs and accumulates its gradient in place as a module of its own would."""
    torch.manual_seed(0)
    small, large = nn.Linear(5, 3).double(), nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 5)).double()
    layouts = {"small": FlatLayout(small), "large": FlatLayout(large)}
    with torch.device("meta"):
        queue = SlotQueue(layouts["small"], lambda: nn.Linear(5, 3), count=1, device=torch.device("cpu"),
                          dtype=torch.float64, shape="small",
                          more={"large": (layouts["large"], lambda: nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 5)))})
    slot = queue.next()
    assert slot.params.numel() == layouts["large"].numel > layouts["small"].numel
    x = torch.randn(4, 5, dtype=torch.float64)
    for shape, block in (("small", small), ("large", large), ("small", small)):
        layout = layouts[shape]
        slot.params[:layout.numel].copy_(layout.pack(block, torch.empty(layout.numel, dtype=torch.float64)))
        slot.grads.zero_()
        slot.module_of(shape)(x).sum().backward()
        block.zero_grad()
        block(x).sum().backward()
        grads = layout.views(slot.grads[:layout.numel])
        for name, p in block.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-12)
        assert slot.grads[layout.numel:].abs().sum() == 0  # (the rest of the buffer is the other shape's)


def test_slot_queue_is_a_ring():
    layout = FlatLayout(nn.Linear(2, 2))
    queue = SlotQueue(layout, lambda: nn.Linear(2, 2), count=3, device=torch.device("cpu"), dtype=torch.float32)
    seen = [queue.next() for _ in range(6)]
    assert seen[:3] == seen[3:] and len({id(s) for s in seen[:3]}) == 3
    assert queue.nbytes == 3 * 2 * layout.numel * 4


def test_arena_hands_out_aligned_disjoint_tensors():
    arena = HostArena(4096, pinned=False)
    a = arena.take(10, torch.float32)
    b = arena.take(7, torch.bfloat16)
    assert a.data_ptr() % 128 == 0 and b.data_ptr() % 128 == 0
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.eq(1.0).all() and b.eq(2.0).all()
    try:
        arena.take(4096, torch.float32)
    except MemoryError as e:
        assert "cannot hold" in str(e)
    else:
        raise AssertionError("an over-full arena must refuse")


@pytest.mark.parametrize("numel", [1, 7, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_slot_loads_fp32_masters_through_its_gradient_buffer(numel, dtype):
    layout = FlatLayout(nn.Linear(numel, 1, bias=False))
    slot = Slot(layout, nn.Linear(numel, 1, bias=False), torch.device("cpu"), dtype)
    assert slot.landing.numel() == layout.numel // 2  # the fp32 landing zone is the gradient buffer's own bytes
    master = torch.randn(layout.numel) * 3
    slot.load(master, unit=5)
    assert slot.unit == 5
    assert slot.params.equal(master.to(dtype))  # the same rounding as a host-side conversion
    assert slot.module.weight.data_ptr() == slot.params.data_ptr()


def test_staging_ring_hands_out_buffers_round_robin_and_names_their_last_owner():
    ring = StagingRing(2, 10, torch.bfloat16)
    first, before = ring.take("block 3")
    assert before is None and first.numel() == 10 and first.dtype == torch.bfloat16
    second, _ = ring.take("block 2")
    third, before = ring.take("block 1")
    assert third.data_ptr() == first.data_ptr() and second.data_ptr() != first.data_ptr()
    assert before == "block 3" and len(ring) == 2 and ring.nbytes == 40
