"""Blocks of different shapes slide through the same slots: a toy stack whose blocks are of two widths, the wider
ones first, in the middle and last, against a plain PyTorch loop, under several placements; the placement's
bytes are what the engine allocates."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_engine import DIM, Edges, ToyStack, batches
from test_placement import STEP, measure
from torch import nn

from slide_memory import AdamWConfig
from slide_scheduler import DISK, HOST, EngineConfig, SlidingEngine, arrange, run_facts, shapes_of

WIDTHS = (5, 3, 3, 5, 3, 5)  # each block's MLP width, in multiples of DIM: the wide shape first, middle, last


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, width * DIM)
        self.down = nn.Linear(width * DIM, DIM)

    def forward(self, hidden, ctx):
        return hidden + self.down(F.gelu(self.up(self.norm(hidden)))) * ctx["gain"]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.edges = Edges(tied=False)
        self.blocks = nn.ModuleList(Block(w) for w in WIDTHS)

    def forward(self, batch, normalizer):
        hidden, ctx = self.edges.head(batch)
        for block in self.blocks:
            hidden = block(hidden, ctx)
        return self.edges.tail(hidden, batch, normalizer)


class MixedStack(ToyStack):
    """The Stack protocol for blocks of several shapes: `block_shape(index)` and `make_block(shape)`."""

    num_blocks = len(WIDTHS)

    def block_shape(self, index: int) -> str:
        return f"width {WIDTHS[index]}"

    def make_block(self, shape: str):
        with torch.device("meta"):
            return Block(int(shape.removeprefix("width ")))


PLACEMENTS = {
    "sliding": {},
    "resident first blocks": {"resident": range(3)},
    "streamed and held": {"share": 0.5, "held": 1},
    "pooled": {"shared": True},
    "on disk": {"nvme_fraction": 0.5},
    "masters read from disk": {"nvme_fraction": 1.0, "disk_loads": True},
    "speculating": {"speculate": True},
}


def engine_for(tmp_path, model: Model, clip, choices: dict, pipeline: bool = True) -> SlidingEngine:
    stack = MixedStack(model)
    run = run_facts(device="cpu", max_grad_norm=clip)
    placement = arrange(shapes_of(stack, hidden=DIM, intermediate=5 * DIM), STEP, run, **choices)
    config = EngineConfig(optimizer=AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), pipeline=pipeline,
                          nvme_dir=str(tmp_path / "states"), activation_dir=str(tmp_path / "acts"))
    return SlidingEngine(stack, placement, config)


@pytest.mark.parametrize("clip", [0.05, None])
@pytest.mark.parametrize("name", PLACEMENTS)
def test_blocks_of_two_shapes_train_as_plain_pytorch(tmp_path, name, clip):
    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    engine = engine_for(tmp_path, model, clip, PLACEMENTS[name])
    assert engine.placement.shapes.mixed
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for step in batches(seed=1, steps=3, micro=2):
        n = sum(int((b["targets"] != -100).sum()) for b in step)
        stats = engine.step(step, lr=1e-2, normalizer=n)
        opt.zero_grad()
        loss = sum(ref(b, n) for b in step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip or float("inf"))
        opt.step()
        assert stats.loss == pytest.approx(loss.item(), rel=1e-6)
        assert stats.grad_norm == pytest.approx(norm.item(), rel=1e-5)
    masters = engine.named_masters()
    engine.close()
    for i, block in enumerate(ref.blocks):
        for pname, p in block.named_parameters():
            torch.testing.assert_close(masters[f"block.{i}"][pname], p.detach(), rtol=1e-5, atol=1e-6)
    for pname, p in ref.edges.named_parameters():
        torch.testing.assert_close(masters["edges"][pname], p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", PLACEMENTS)
def test_the_pipelined_engine_is_bitwise_the_synchronous_one_with_mixed_blocks(tmp_path, name):
    runs = []
    for pipeline in (False, True):
        torch.manual_seed(0)
        engine = engine_for(tmp_path / str(pipeline), Model(), 0.05, PLACEMENTS[name], pipeline=pipeline)
        if pipeline:
            engine.h2d.delay = engine.d2h.delay = 0.002
        losses = [engine.step(step, lr=1e-2, normalizer=20).loss for step in batches(seed=2, steps=3, micro=2)]
        runs.append((losses, engine.named_masters()))
        engine.close()
    (ref_losses, ref), (losses, got) = runs
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("name", PLACEMENTS)
def test_the_placements_bytes_are_what_the_engine_allocates_with_mixed_blocks(tmp_path, name):
    torch.manual_seed(0)
    model = Model()
    engine = engine_for(tmp_path, model, 0.05, PLACEMENTS[name])
    p = engine.placement
    assert len(set(p.shapes.unit_numels[1:])) == 2
    try:
        held = measure(engine, model)  # (the weights it was loaded from are the model's, not the engine's)
    finally:
        engine.close()
    assert held[HOST] == p.bytes(HOST, transient=False), p.tiers()[HOST]
    assert held[DISK] == p.bytes(DISK), p.tiers()[DISK]
