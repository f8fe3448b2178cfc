"""The engine on a toy stack (no model library) against a plain PyTorch training loop."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import pathlib
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slide_memory.adamw
from slide_memory import AdamWConfig, StagingRing
from slide_scheduler import DTYPES, EngineConfig, SlidingEngine, arrange, run_facts, shapes_of
from slide_scheduler.plan import choices
from slide_scheduler.plan import placement as placement_module
from slide_scheduler.run import updates as updates_module
from slide_scheduler.run.lanes import DONE

VOCAB, DIM, DEPTH = 17, 12, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 3 * DIM)
        self.down = nn.Linear(3 * DIM, DIM)

    def forward(self, hidden, ctx):
        return hidden + self.down(F.gelu(self.up(self.norm(hidden)))) * ctx["gain"]


class Edges(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.out.weight = self.embed.weight
        # Only the tail reads these (the engine may update them apart; a tied out.weight does not count).
        self.tail_only = ("norm.weight", "norm.bias", "out.weight")

    def head(self, batch):
        return self.embed(batch["ids"]), {"gain": 0.5}

    def tail(self, hidden, batch, normalizer):
        logits = self.out(self.norm(hidden))
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="sum",
                               ignore_index=-100) / normalizer


class Model(nn.Module):
    """The same network, whole, for the reference loop."""

    def __init__(self, tied: bool):
        super().__init__()
        self.edges = Edges(tied)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, batch, normalizer):
        hidden, ctx = self.edges.head(batch)
        for block in self.blocks:
            hidden = block(hidden, ctx)
        return self.edges.tail(hidden, batch, normalizer)


class ToyStack:
    num_blocks = DEPTH

    def __init__(self, model: Model):
        self.model = model

    def make_edges(self):
        with torch.device("meta"):
            return Edges(tied=self.model.edges.out.weight is self.model.edges.embed.weight)

    def make_block(self):
        with torch.device("meta"):
            return Block()

    def load_edges(self, params):
        src = dict(self.model.edges.named_parameters())
        for name, view in params.items():
            view.copy_(src[name])

    def load_block(self, index, params):
        src = dict(self.model.blocks[index].named_parameters())
        for name, view in params.items():
            view.copy_(src[name])


def batches(seed: int, steps: int, micro: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro):
            ids = torch.randint(0, VOCAB, (3, 10), generator=g)
            targets = torch.randint(0, VOCAB, (3, 10), generator=g)
            targets[torch.rand(3, 10, generator=g) < 0.3] = -100
            step.append({"ids": ids, "targets": targets})
        out.append(step)
    return out


def random_steps(seed: int, shapes: list[tuple[int, int]], device: str = "cpu"):
    """Steps of (micro-batches, tokens per row) each: random ids and targets, 3 rows per micro-batch."""
    g = torch.Generator().manual_seed(seed)
    return [[{"ids": torch.randint(0, VOCAB, (3, length), generator=g).to(device),
              "targets": torch.randint(0, VOCAB, (3, length), generator=g).to(device)} for _ in range(micro)]
            for micro, length in shapes]


PLACEMENT_KEYS = ("window", "resident", "device_update_share", "held_grads", "split_update",
                  "grads_share_activations", "nvme_fraction", "disk_loads", "speculate", "landing", "edges_early",
                  "disk_boundaries", "disk_grads", "staging", "speculation_pause", "defer_updates", "device_first",
                  "early_streams")
FACT_KEYS = ("device", "compute_dtype", "states_dtype", "max_grad_norm", "activation_offload")


def make_engine(stack, **kwargs) -> SlidingEngine:
    """An engine over `stack` with the run's facts (`device`, `compute_dtype`, `states_dtype`, `max_grad_norm`,
    `activation_offload`: `run_facts`' words), EngineConfig keys, and these placement choices: `window` (2),
    `resident` (a count: the edges, then blocks from 0; or units), `device_update_share` (0), `held_grads` (0),
    `split_update` (True), `grads_share_activations` (False), `nvme_fraction` (0), `disk_loads` (False),
    `speculate` (False), `landing` (0: the rule), `edges_early` (True), `disk_boundaries` (0), `disk_grads`
    (False), `staging` (0: the disk tier's default), `speculation_pause` (True), `defer_updates` (False: none; True:
    all; a number: the first that many sliding blocks), `device_first` (False), `early_streams` (0: the share of
    the streamed blocks, the last ones, that update early without clipping)."""
    choices = {k: kwargs.pop(k) for k in PLACEMENT_KEYS if k in kwargs}
    loaded = kwargs.pop("loaded", None)
    run = run_facts(**{k: kwargs.pop(k) for k in FACT_KEYS if k in kwargs})
    resident = choices.get("resident", 0)
    placement = arrange(shapes_of(stack), placement_module.StepShape(0, 0), run,
                        resident=range(resident) if isinstance(resident, int) else resident,
                        window=choices.get("window", 2), share=choices.get("device_update_share") or 0.0,
                        shared=choices.get("grads_share_activations", False), held=choices.get("held_grads", 0),
                        split=choices.get("split_update", True), speculate=choices.get("speculate", False),
                        nvme_fraction=choices.get("nvme_fraction", 0.0), disk_loads=choices.get("disk_loads", False),
                        landing=choices.get("landing", 0), edges_early=choices.get("edges_early", True),
                        disk_boundaries=choices.get("disk_boundaries", 0),
                        disk_grads=choices.get("disk_grads", False), staging=choices.get("staging", 0),
                        speculation_pause=choices.get("speculation_pause", True),
                        defer=choices.get("defer_updates", False),
                        device_first=choices.get("device_first", False),
                        early_streams=choices.get("early_streams", 0.0))
    return SlidingEngine(stack, placement, EngineConfig(**kwargs), loaded=loaded)


def run_both(window, offload, clip, tied, steps=3, micro=2, **choices):
    """The engine (with these placement choices, `make_engine`'s keys) and a plain PyTorch AdamW loop over the
    same steps."""
    torch.manual_seed(0)
    model = Model(tied)
    ref = copy.deepcopy(model)
    opt_cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    engine = make_engine(ToyStack(model), device="cpu", window=window, activation_offload=offload,
                         max_grad_norm=clip, optimizer=opt_cfg, **choices)
    opt = torch.optim.AdamW(ref.parameters(), lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps,
                            weight_decay=opt_cfg.weight_decay)
    stats, ref_losses, ref_norms = [], [], []
    for step in batches(seed=1, steps=steps, micro=micro):
        n = sum(int((b["targets"] != -100).sum()) for b in step)
        stats.append(engine.step(step, lr=1e-2, normalizer=n))
        opt.zero_grad()
        loss = sum(ref(b, n) for b in step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else float("inf"))
        opt.step()
        ref_losses.append(loss.item())
        ref_norms.append(norm.item())
    return engine, ref, stats, ref_losses, ref_norms


@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("offload", ["gpu", "host"])
@pytest.mark.parametrize("clip", [0.1, None])
def test_engine_matches_plain_loop(window, offload, clip):
    engine, ref, stats, ref_losses, ref_norms = run_both(window, offload, clip, tied=window == 2)
    assert [s.loss for s in stats] == pytest.approx(ref_losses, rel=1e-6)
    assert [s.grad_norm for s in stats] == pytest.approx(ref_norms, rel=1e-5)
    if clip:
        assert all(n > clip for n in ref_norms), "clipping must be active"
    masters = engine.named_masters()
    for name, p in ref.edges.named_parameters():
        torch.testing.assert_close(masters["edges"][name], p.detach(), rtol=1e-5, atol=1e-6)
    for i, block in enumerate(ref.blocks):
        for name, p in block.named_parameters():
            torch.testing.assert_close(masters[f"block.{i}"][name], p.detach(), rtol=1e-5, atol=1e-6)


def test_evaluate_equals_the_reference_loss_and_changes_nothing():
    engine, ref, *_ = run_both(window=2, offload="host", clip=1.0, tied=False, steps=1)
    step = batches(seed=9, steps=1, micro=2)[0]
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}
    n = sum(int((b["targets"] != -100).sum()) for b in step)
    with torch.no_grad():
        expected = sum(ref(b, n) for b in step).item()
    assert engine.evaluate(step, normalizer=n) == pytest.approx(expected, rel=1e-6)
    for unit, params in engine.named_masters().items():
        for name, t in params.items():
            assert t.equal(before[unit][name])


def test_each_block_is_reported_once_its_weights_are_in():
    """`loaded(index)` comes once per block, in order, as the engine reads the stack's weights (a progress bar)."""
    seen = []
    stack = ToyStack(Model(tied=True))
    make_engine(stack, device="cpu", window=2, resident=1, loaded=seen.append)
    assert seen == list(range(stack.num_blocks))


def test_each_block_visits_a_slot_once_per_pass():
    engine, *_ = run_both(window=2, offload="gpu", clip=None, tied=False, steps=1)
    loads = []
    original = engine.stage

    def spy(block):
        loads.append(block)
        return original(block)

    engine.stage = spy
    step = batches(seed=2, steps=1, micro=3)[0]
    engine.step(step, lr=1e-3, normalizer=10)
    # Layer-major: one visit per block in forward, one in backward, whatever the number of micro-batches; the
    # backward's first block is the forward's last, still in its slot
    assert loads == [0, 1, 2, 3, 2, 1, 0]


@pytest.mark.parametrize("resident, order", [
    (0, ["stage 0", "stage 1", "forward 0", "stage 2", "forward 1", "stage 3", "forward 2", "forward 3"]),
    (3, ["stage 0", "stage 1", "stage 2", "stage 3", "forward 0", "forward 1", "forward 2", "forward 3"])])
def test_forward_keeps_every_slot_loading_a_block_ahead(resident, order):
    """Every slot starts loading a sliding block at once, and each block's forward frees a slot for the next
    one; resident blocks (edges + blocks 0..1 here) need no slot, so the first sliding blocks load while they
    compute, not a window before their own turn."""
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, resident=resident)
    events: list[str] = []
    stage, span = engine.stage, engine.timeline.span

    def spy_stage(block):
        events.append(f"stage {block}")
        return stage(block)

    def spy_span(lane, label, stream):
        events.append(label)
        return span(lane, label, stream)

    engine.stage, engine.timeline.span = spy_stage, spy_span
    engine.step(batches(seed=2, steps=1, micro=2)[0], lr=1e-3, normalizer=10)
    engine.close()
    assert events[: events.index("tail")] == ["head", *order]


def test_forward_runs_ready_blocks_while_a_host_update_is_still_running():
    """The thread that queues the forward stages a block whose host update is still running only when nothing
    else is left to queue: resident block 0 runs while sliding block 1's clipped update is still on the host.
    (It used to wait for that update while staging block 1, before block 0's forward.)"""
    engine = make_engine(ToyStack(Model(tied=True)),
        device="cpu", window=2, resident=2, max_grad_norm=0.05, device_update_share=0.0)
    engine.updater.delay = 0.2  # each host update sleeps first: step 2 begins with all three still to do
    first, second = batches(seed=2, steps=2, micro=2)
    engine.step(first, lr=1e-3, normalizer=10)
    spans = engine.step(second, lr=1e-3, normalizer=10).spans
    engine.close()
    forward = {s.label: s for s in spans if s.lane == "compute"}
    update = {s.label: s for s in spans if s.lane == "optimizer"}
    assert forward["forward 0"].end < update["update 1"].end < forward["forward 1"].start
    assert forward["forward 1"].end < update["update 2"].end < forward["forward 2"].start


def on_disk(nvme) -> dict:
    """EngineConfig keys for AdamW moments on disk: `nvme` is (nvme_fraction, directory), or None for none."""
    return {"nvme_fraction": nvme[0], "nvme_dir": str(nvme[1])} if nvme else {}


def run_engine(pipeline: bool, window: int, clip, delays: dict | None = None, steps: int = 3, patch=None,
               resident: int = 0, dtype: str = "auto", device_share: float = 0.0, tied: bool = True,
               held: int = 0, split: bool = True, shared: bool = False, steps_data=None, nvme=None, acts_dir=None,
               states: str = "fp32", speculate: bool = False, disk_loads: bool = False, device: str = "cpu",
               landing: int = 0, edges_early: bool = True, disk_grads: bool = False, staging: int = 0,
               defer: bool | int = False, device_first: bool = False, early: float = 0.0):
    torch.manual_seed(0)
    model = Model(tied=tied)
    engine = make_engine(ToyStack(model), device=device, window=window,
                                                         activation_offload="disk" if acts_dir else "host",
                                                         activation_dir=acts_dir and str(acts_dir),
                                                         max_grad_norm=clip, pipeline=pipeline, resident=resident,
                                                         optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1),
                                                         compute_dtype=dtype, device_update_share=device_share,
                                                         held_grads=held, split_update=split,
                                                         grads_share_activations=shared, states_dtype=states,
                                                         speculate=speculate, disk_loads=disk_loads,
                                                         landing=landing, edges_early=edges_early,
                                                         disk_grads=disk_grads, staging=staging,
                                                         defer_updates=defer, device_first=device_first,
                                                         early_streams=early, **on_disk(nvme))
    for name, seconds in (delays or {}).items():
        getattr(engine, name).delay = seconds
    if patch:
        patch(engine)
    losses = []
    for step in steps_data or batches(seed=4, steps=steps, micro=3):
        n = sum(int((b["targets"] != -100).sum()) for b in step)
        losses.append(engine.step([{k: v.to(device) for k, v in b.items()} for b in step], lr=1e-2,
                                  normalizer=n).loss)
    masters = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}
    engine.close()
    return losses, masters


@pytest.mark.parametrize("slow", ["h2d", "land", "d2h", "updater"])
@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("clip", [0.05, None])
def test_pipeline_is_bitwise_the_synchronous_engine_whatever_is_slow(slow, window, clip):
    """Delays in one worker shift every overlap; ordering rules (no update before its gradient has arrived, no
    load of a block before its update is done, no slot reuse before compute and copy-out are done) keep the
    result identical to the synchronous schedule."""
    ref_losses, ref = run_engine(pipeline=False, window=window, clip=clip)
    losses, got = run_engine(pipeline=True, window=window, clip=clip, delays={slow: 0.004})
    assert losses == ref_losses
    for unit, params in ref.items():
        for name, t in params.items():
            assert got[unit][name].equal(t), f"{unit}.{name}"


@pytest.mark.parametrize("slow", ["h2d", "d2h", "updater"])
@pytest.mark.parametrize("clip", [0.05, None])
def test_the_plans_other_choices_give_the_same_weights(monkeypatch, slow, clip):
    """One set of activation landing buffers (each block's activations fetched after the backward of the block
    after it), and streamed edges updated whole rather than their tail-only part early: the same weights as the
    synchronous engine with the rule's choices, whichever worker is slow."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    share = 0.5  # (the edges and some blocks stream, with clipping or without)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=clip, device_share=share)
    for choice in ({"landing": 1}, {"edges_early": False}):
        losses, got = run_engine(pipeline=True, window=2, clip=clip, device_share=share, delays={slow: 0.004},
                                 **choice)
        assert losses == ref_losses, choice
        for unit, params in ref.items():
            for name, t in params.items():
                assert got[unit][name].equal(t), f"{choice}: {unit}.{name}"


@pytest.mark.parametrize("slow", ["h2d", "d2h", "land", "updater"])
@pytest.mark.parametrize("early, held, defer", [(1.0, 0, False), (0.5, 0, 1), (1.0, 2, 2), (0.5, 1, True)])
def test_streamed_blocks_updated_early_in_the_backward_give_the_same_weights(monkeypatch, slow, early, held, defer):
    """Unclipped, the last streamed blocks' device updates run in the backward as soon as their gradients are home
    (from a host buffer or one held on the device), beside host updates in the backward or deferred; their next
    loads take the new master. Bit for bit the synchronous engine's weights with every streamed update at its next
    load, whichever lane is slow."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=None, device_share=0.5)
    seen = {}

    def record(engine):
        seen["early"], seen["streamed"] = engine.placement.early, engine.placement.streamed - {0}

    losses, got = run_engine(pipeline=True, window=2, clip=None, device_share=0.5, held=held, defer=defer,
                             early=early, delays={slow: 0.004}, patch=record)
    assert seen["early"] == set(sorted(seen["streamed"])[len(seen["streamed"]) - round(early * len(seen["streamed"])):])
    assert seen["early"]
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("tier", ["host", "gpu"])
@pytest.mark.parametrize("slow", ["h2d", "d2h"])
def test_boundary_activations_in_a_tier_per_block_give_the_same_weights(tmp_path, tier, slow):
    """The first blocks' boundary activations on disk, the others in host memory or on the device: the same
    losses and weights as every boundary in host memory, synchronous, whichever copy lane is slow."""
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=0.05)
    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, activation_offload=tier,
                         activation_dir=str(tmp_path), max_grad_norm=0.05, disk_boundaries=2,
                         optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1))
    assert engine.placement.boundary_tiers == ("disk", "disk", tier, tier)
    getattr(engine, slow).delay = 0.004
    losses = []
    for step in batches(seed=4, steps=3, micro=3):
        n = sum(int((b["targets"] != -100).sum()) for b in step)
        losses.append(engine.step(step, lr=1e-2, normalizer=n).loss)
    got = engine.named_masters()
    assert len(list(tmp_path.rglob("*.bin"))) == 2 * 3  # (a file per disk boundary and micro-batch)
    engine.close()
    assert losses == ref_losses
    for unit, params in ref.items():
        for name, t in params.items():
            assert got[unit][name].equal(t), f"{unit}.{name}"


@pytest.mark.parametrize("clip", [0.05, None])
def test_the_disk_tier_read_further_ahead_gives_the_same_weights(tmp_path, clip):
    """Four staging slots of the disk tier's states (its reads four updates ahead) instead of two: the same
    weights, with the updater slow."""
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=clip, nvme=(1.0, tmp_path / "two"))
    losses, got = run_engine(pipeline=True, window=2, clip=clip, nvme=(1.0, tmp_path / "four"), staging=4,
                             delays={"updater": 0.004})
    assert losses == ref_losses
    for unit, params in ref.items():
        for name, t in params.items():
            assert got[unit][name].equal(t), f"{unit}.{name}"


@pytest.mark.parametrize("clip", [0.05, 1e6])  # clipping that acts, and that never does
@pytest.mark.parametrize("slow", ["d2h", "updater"])
def test_gradients_waiting_on_disk_give_the_weights_of_gradients_in_memory(tmp_path, clip, slow):
    """Clipped gradients of the blocks whose states are on disk written to files during the backward and read
    back with those states for their updates: bit for bit the run whose gradients wait in host memory, with
    clipping acting or not, whichever lane is slow (test_placement checks the files against the plan's bytes)."""
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=clip, nvme=(1.0, tmp_path / "ram"))
    seen = {}

    def count(engine):
        seen["placed"] = engine.placement.grads_on_disk

    losses, got = run_engine(pipeline=True, window=2, clip=clip, nvme=(1.0, tmp_path / "disk"), disk_grads=True,
                             delays={slow: 0.004}, patch=count)
    assert seen["placed"] == {1, 2, 3, 4}
    assert losses == ref_losses
    for unit, params in ref.items():
        for name, t in params.items():
            assert got[unit][name].equal(t), f"{unit}.{name}"


def test_a_missing_wait_is_caught_by_the_delay_tests():
    """The check above can fail: drop the wait for a block's update before loading it, slow the updater down,
    and stale parameters reach the next forward."""
    _, ref = run_engine(pipeline=False, window=2, clip=0.05)

    def forget_update_waits(engine):
        engine.updater.wait = lambda index, params_only=False: None

    _, got = run_engine(pipeline=True, window=2, clip=0.05, delays={"updater": 0.01}, patch=forget_update_waits)
    assert any(not got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("share, slow", [(0.0, lane) for lane in ("h2d", "land", "d2h", "updater")]
                         + [(0.5, lane) for lane in ("h2d", "land", "d2h", "store", "updater")])
def test_split_updates_give_the_whole_updates_result(monkeypatch, share, slow):
    """Clipped updates split into a params part (before the next forward's load) and a moments part (after
    that forward): the same kernel on the same inputs, so bit for bit whole updates' result, whichever worker
    is slow. Host and device-updated blocks, and host-updated edges (share 0: nothing for the store lane),
    take the split path."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=0.05, device_share=share, split=False)
    moments = []

    def count_moments(engine):
        submit = engine.updater.submit
        engine.updater.submit = lambda index, *a, part="all", **kw: (
            moments.append(index) if part == "moments" else None, submit(index, *a, part=part, **kw))

    losses, got = run_engine(pipeline=True, window=2, clip=0.05, device_share=share,
                             delays={slow: 0.01 if slow == "updater" else 0.003}, patch=count_moments)
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())
    # every step, every unit but the edges updated on the device from their gradient there
    assert sorted(moments) == sorted(list(range(int(share > 0), DEPTH + 1)) * 3)


def test_a_gradient_buffer_is_reused_only_after_the_moments_part_read_it():
    """The check above can fail: let a block's gradient buffer be reused once the last update's params part is
    done (not its moments part), slow the updater down as above, and the next backward overwrites gradients the
    moments part has not read yet."""
    _, ref = run_engine(pipeline=False, window=2, clip=0.05, split=False)

    def reuse_after_params_part(engine):
        take = engine.homes.ring.take

        def take_early(owner):
            buffer, previous = take(owner)
            if previous is not None:
                engine.updater.wait(previous, params_only=True)
            return buffer, None

        engine.homes.ring.take = take_early

    # Each update first sleeps 50 ms: the moments parts queued after the forward then run well after the next
    # backward has reused their buffers, even on a loaded machine (at 10 ms, a run beside two other test
    # processes saw no overwrite).
    _, got = run_engine(pipeline=True, window=2, clip=0.05, delays={"updater": 0.05}, patch=reuse_after_params_part)
    assert any(not got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


def one_gradient_buffer(engine):
    engine.homes.ring = StagingRing(1, engine.homes.ring.buffers[0].numel(), engine.dtype)


def test_one_gradient_buffer_for_all_blocks_is_enough_and_its_wait_matters():
    """Without clipping, blocks share a ring of host gradient buffers: a buffer is reused only once the update
    that reads it is done. Shrunk to one buffer with a slow updater, the result is still the synchronous one;
    skip that wait and a gradient is overwritten before its update reads it."""
    _, ref = run_engine(pipeline=False, window=2, clip=None)
    _, got = run_engine(pipeline=True, window=2, clip=None, delays={"updater": 0.01}, patch=one_gradient_buffer)
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())

    def no_wait(engine):
        one_gradient_buffer(engine)
        take = engine.homes.ring.take
        engine.homes.ring.take = lambda owner: (take(owner)[0], None)

    # 50 ms per update, as above: at 10 ms, runs beside two busy processes saw no overwrite 6 times in 10 (the
    # next backward and copy-out took longer than the sleep), and CI's machine has two cores.
    _, got = run_engine(pipeline=True, window=2, clip=None, delays={"updater": 0.05}, patch=no_wait)
    assert any(not got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("slow", ["h2d", "land"])
@pytest.mark.parametrize("clip", [0.05, None])
def test_bf16_slots_load_fp32_masters_through_the_gradient_buffer(clip, slow):
    """A bf16 engine keeps no bf16 copy on the host: slots narrow the fp32 master on arrival, piece by piece
    through the two halves of the landing zone (copied on h2d, narrowed on land). Pipelined with either lane
    slow it equals the synchronous engine, and it tracks the fp32 engine within bf16 rounding."""
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=clip, dtype="bf16")
    losses, got = run_engine(pipeline=True, window=2, clip=clip, dtype="bf16", delays={slow: 0.004})
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())
    fp32_losses, _ = run_engine(pipeline=False, window=2, clip=clip)
    assert ref_losses != fp32_losses  # the bf16 path really ran
    torch.testing.assert_close(torch.tensor(ref_losses), torch.tensor(fp32_losses), rtol=2e-2, atol=0)


def test_a_landing_half_reused_before_it_is_narrowed_is_caught():
    """The check above can fail: when every piece claims a landing buffer of its own (so no copy waits for the
    narrowing of the piece before it in the same half) and the land lane is slow, a copy overwrites a half
    before it is narrowed, and wrong parameters reach compute."""
    def unique_buffers(engine):
        for slot in [*engine.slots.slots, engine.edge_slot]:
            pieces = slot.pieces
            slot.pieces = lambda numel, pieces=pieces: [(a, b, k, view) for k, (a, b, _, view) in
                                                         enumerate(pieces(numel))]

    _, ref = run_engine(pipeline=False, window=2, clip=None, dtype="bf16")
    _, got = run_engine(pipeline=True, window=2, clip=None, dtype="bf16", delays={"land": 0.004},
                        patch=unique_buffers)
    assert any(not got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("share", [0.0, 0.3, 0.5, 0.5625, 2 / 3, 1.0])
@pytest.mark.parametrize("resident", [0, 3])
def test_the_engine_updates_on_the_device_the_blocks_the_planner_counts(share, resident):
    """The clipped engine updates int(sliding * share) sliding blocks on the device, the count the planner
    sizes held gradients by (`device_updated`), no two of them more than one host block apart, and never the
    first sliding block unless every block goes to the device."""
    engine = make_engine(ToyStack(Model(tied=True)),
        device="cpu", window=2, max_grad_norm=1.0, device_update_share=share, resident=resident)
    first = max(resident - 1, 0)  # resident = 1 + k keeps the edges and blocks 0..k-1
    blocks = sorted(u - 1 - first for u in engine.streamed if u)
    engine.close()
    sliding = DEPTH - first
    assert blocks == choices.device_updated(sliding, share) and len(blocks) == int(sliding * share)
    assert all(b - a <= 2 for a, b in zip(blocks, blocks[1:])) or share < 0.5
    assert (0 in blocks) == (share == 1.0)


@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("slow", ["h2d", "land", "d2h", "store", "updater"])
@pytest.mark.parametrize("resident", [0, 2])
def test_clipped_updates_streamed_through_the_device_equal_host_updates(monkeypatch, share, slow, resident):
    """With clipping, a share of the sliding blocks updates on the device as the next forward loads them
    (master, states and gradient streamed in pieces, stored back on the store lane). Same AdamW arithmetic, so
    the result is bit for bit the host optimizer's, whichever worker is slow."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)  # many pieces per block, two buffers taking turns
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=0.05)
    losses, got = run_engine(pipeline=True, window=2, clip=0.05, resident=resident, device_share=share,
                             delays={slow: 0.003}, patch=expect_streamed(share, resident))
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("buffers", [1, 3])
@pytest.mark.parametrize("slow", ["h2d", "land", "d2h", "store"])
def test_streamed_updates_take_any_number_of_device_buffers(monkeypatch, buffers, slow):
    """With one device-update buffer every piece's copy waits for the last piece's store; with three, for the
    store three pieces back. Either way the result is the synchronous engine's, bit for bit."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    monkeypatch.setattr(placement_module, "STREAM_BUFFERS", buffers)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=0.05)
    losses, got = run_engine(pipeline=True, window=2, clip=0.05, device_share=1.0, delays={slow: 0.003},
                             patch=lambda engine: assert_buffers(engine, buffers))
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("share, held, resident", [(0.5, 0, 0), (0.5, 1, 2), (1.0, 2, 0), (1.0, 0, 2)])
@pytest.mark.parametrize("slow", ["h2d", "land", "d2h", "store", "updater"])
def test_three_slots_with_device_updates_and_held_gradients_give_the_synchronous_result(
        monkeypatch, share, held, resident, slow):
    """The planner's choice for clipped runs with room to spare: 3 slots, with blocks updated on the device (some
    keeping their gradient there) beside resident and host-updated ones; bit for bit the synchronous engine."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=3, clip=0.05, device_share=share, held=held,
                                 resident=resident)
    losses, got = run_engine(pipeline=True, window=3, clip=0.05, device_share=share, held=held,
                             resident=resident, delays={slow: 0.003})
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


def overlaps(engine) -> list[tuple[int, int]]:
    """(block, boundary) pairs whose host gradient and saved activation share bytes, from the tensors themselves."""
    def span(t):
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    pairs = set()
    for block in engine.homes.pool.blocks:
        g0, g1 = span(engine.homes.pool.gradient(block))
        for (boundary, _), (saved, _) in engine.activations._saved.items():
            a0, a1 = span(saved)
            if a0 < g1 and g0 < a1:
                pairs.add((block, boundary))
    return sorted(pairs)


@pytest.mark.parametrize("share, held, resident", [(0.0, 0, 0), (0.5, 1, 0), (0.5, 0, 2), (1.0, 2, 0)])
@pytest.mark.parametrize("slow", ["h2d", "land", "d2h", "store", "updater"])
def test_gradients_sharing_the_activations_memory_give_the_synchronous_result(monkeypatch, share, held, resident,
                                                                              slow):
    """With clipping, host gradients may lie over boundary activations the backward has read and the next
    forward has not written yet (`grads_share_activations`): bit for bit the synchronous engine with a gradient
    buffer each (and split updates, where these update whole), whichever worker is slow. The memory is really
    shared: some gradient lies over an activation, and only ever over a boundary above its block."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=0.05, device_share=share, held=held,
                                 resident=resident)
    seen = []

    def check(engine):
        streamed = sorted(u for u in engine.streamed if u)
        assert sorted(engine.homes.held) == streamed[len(streamed) - min(held, len(streamed)):]
        assert engine.homes.ring is None and engine.homes.pool.blocks == [
            b for b in range(max(resident - 1, 0), DEPTH) if b + 1 not in engine.homes.held]
        step = engine.step

        def step_and_look(*args, **kwargs):
            stats = step(*args, **kwargs)
            seen.append(overlaps(engine))
            return stats

        engine.step = step_and_look

    losses, got = run_engine(pipeline=True, window=2, clip=0.05, device_share=share, held=held, resident=resident,
                             shared=True, delays={slow: 0.003}, patch=check)
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())
    assert all(pairs for pairs in seen) and all(boundary > block for pairs in seen for block, boundary in pairs)


def test_a_split_update_over_shared_memory_reads_activations_and_is_caught():
    """The check above can fail: let pooled blocks' clipped updates split, and their moments parts, which run
    after the next forward, read gradients that forward has written activations over."""
    _, ref = run_engine(pipeline=False, window=2, clip=0.05)

    def split_anyway(engine):
        engine.host_updates.split = set(engine.host_updates.units)

    _, got = run_engine(pipeline=True, window=2, clip=0.05, shared=True, patch=split_anyway)
    assert any(not got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


def test_shared_memory_follows_steps_of_other_shapes():
    """Fewer micro-batches re-lay the activations in the same allocation; longer ones take a new allocation
    while the previous step's updates still read gradients in the old one: the same result either way."""
    data = random_steps(5, [(3, 10), (2, 10), (3, 40), (3, 40)])
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=0.05, steps_data=data)
    sizes, kept = [], []

    def record_allocations(engine):
        fit, drop = engine.homes.pool.fit, engine.homes.pool.drop_replaced

        def fit_and_record(micro_bytes):
            new = fit(micro_bytes)
            sizes.append((new, engine.homes.pool.nbytes))
            return new

        def drop_and_record():  # a replaced allocation is kept to the end of the step that replaced it: on
            kept.append(len(engine.homes.pool._replaced))  # CUDA, queued copies of its gradients hold no reference
            drop()

        engine.homes.pool.fit, engine.homes.pool.drop_replaced = fit_and_record, drop_and_record

    losses, got = run_engine(pipeline=True, window=2, clip=0.05, shared=True, steps_data=data,
                             delays={"updater": 0.003}, patch=record_allocations)
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())
    assert [new for new, _ in sizes] == [True, False, True, False] and sizes[2][1] > sizes[0][1]
    assert kept == [0, 0, 1, 0]


def test_gradients_share_activations_needs_offloaded_activations():
    with pytest.raises(ValueError, match="activations on the host"):
        make_engine(ToyStack(Model(tied=True)), device="cpu", activation_offload="none",
                                                               max_grad_norm=1.0, grads_share_activations=True)


def masters_and_states(engine):
    """Copies of every unit's fp32 master and AdamW state (after pending updates)."""
    masters = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}
    return masters, [engine.optimizer_state(u) for u in range(len(engine.units))]


def same_state(a, b) -> bool:
    """Whether two `masters_and_states` are equal, bit for bit."""
    (ma, sa), (mb, sb) = a, b
    return all(ma[u][n].equal(t) for u, params in mb.items() for n, t in params.items()) and all(
        x.keys() == y.keys() and all(x[k].equal(y[k]) for k in y) for x, y in zip(sa, sb))


def assert_buffers(engine, count):
    assert len(engine.stream.buffers) == count


@pytest.mark.parametrize("share, held", [(0.5, 1), (1.0, 2), (1.0, DEPTH)])
@pytest.mark.parametrize("slow", ["h2d", "land", "d2h", "store", "updater"])
def test_gradients_held_on_the_device_for_device_updates_give_the_same_result(monkeypatch, share, held, slow):
    """With clipping, blocks updated on the device may keep their gradient there until the next forward runs
    the update: a device copy instead of the host ring, fewer ring buffers, the same result bit for bit."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=0.05)

    def check(engine):
        blocks = sorted(u for u in engine.streamed if u)
        assert sorted(engine.homes.held) == blocks[:held] and len(blocks) >= held
        ring = len(engine.homes.ring.buffers) if engine.homes.ring else 0
        assert ring == DEPTH - held

    losses, got = run_engine(pipeline=True, window=2, clip=0.05, device_share=share, held=held,
                             delays={slow: 0.003}, patch=check)
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("share, held, resident", [(0.0, 0, 0), (0.0, 0, 2), (1.0, 2, 0)])
def test_a_clipped_step_with_a_non_finite_norm_changes_nothing(monkeypatch, pipeline, share, held, resident):
    """With clipping every update waits for the global norm, so a step whose gradients overflowed (a NaN loss
    here) is seen before it changes anything: it reports the non-finite norm and leaves masters and AdamW states
    as they were, and the next step is the one a run without the bad step would have taken."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    steps = list(batches(seed=4, steps=2, micro=3))

    def make():
        torch.manual_seed(0)
        return make_engine(ToyStack(Model(tied=True)),
            device="cpu", window=2, max_grad_norm=0.05, pipeline=pipeline, resident=resident,
            device_update_share=share, held_grads=held, optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1))

    ref = make()
    for step in steps:
        ref.step(step, lr=1e-2, normalizer=10)
    expected = masters_and_states(ref)
    ref.close()

    engine = make()
    engine.step(steps[0], lr=1e-2, normalizer=10)
    before = masters_and_states(engine)
    tail = engine.edges.tail
    engine.edges.tail = lambda h, batch, normalizer: tail(h, batch, normalizer) * float("nan")
    stats = engine.step(steps[1], lr=1e-2, normalizer=10)
    assert not math.isfinite(stats.grad_norm)
    assert same_state(masters_and_states(engine), before)
    engine.edges.tail = tail
    engine.step(steps[1], lr=1e-2, normalizer=10)
    assert same_state(masters_and_states(engine), expected)
    engine.close()


def test_a_held_gradient_is_what_the_device_update_reads(monkeypatch):
    """test_gradients_held_on_the_device_for_device_updates_give_the_same_result can fail: a held gradient
    zeroed before the next forward's update reads it changes the result."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    _, ref = run_engine(pipeline=False, window=2, clip=0.05, device_share=1.0, held=2)

    def zero_held_before_updates(engine):
        update = engine.stream.update_on_device

        def zeroed(unit, slot, chunks=None):
            if unit in engine.homes.held:
                engine.homes.held[unit].zero_()
            update(unit, slot, chunks)
        engine.stream.update_on_device = zeroed

    _, got = run_engine(pipeline=False, window=2, clip=0.05, device_share=1.0, held=2,
                        patch=zero_held_before_updates)
    assert any(not got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


def expect_streamed(share, resident):
    def check(engine):
        sliding = DEPTH - max(resident - 1, 0)
        blocks = int(sliding * share)
        assert len(engine.streamed) == blocks + (resident == 0) and len(engine.stream.buffers) == 2
        assert (engine.homes.own is None) == (0 in engine.streamed or resident > 0)  # no host copy of it
    return check


@pytest.mark.parametrize("slow", ["h2d", "land", "d2h", "store", "updater"])
def test_updates_stream_through_the_device_without_clipping_too(monkeypatch, slow):
    """Without clipping, sliding edges and a share of the blocks update on the device as they next load (at a
    scale of 1.0): bit for bit the synchronous engine's host updates, whichever worker is slow."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=None)
    losses, got = run_engine(pipeline=True, window=2, clip=None, device_share=0.5, delays={slow: 0.003},
                             patch=expect_streamed(0.5, 0))
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


# Unclipped placements a clipped run has: device updates with gradients held or pooled, host updates that wait for
# the step's end (`defer_updates`), pooled and split as clipped ones are
UNCLIPPED = {
    "streamed, ring": {"device_share": 1.0},
    "streamed, pooled": {"device_share": 0.5, "shared": True},
    "streamed, held and pooled, resident": {"device_share": 1.0, "held": 2, "shared": True, "resident": 2},
    "deferred, pooled": {"defer": True, "shared": True},
    "deferred, split, streamed": {"defer": True, "device_share": 0.5},
    # the first blocks' updates wait for the step's end, the later ones' run during the backward
    "first deferred": {"defer": 2},
    "first deferred, pooled": {"defer": 1, "shared": True},
    "first deferred, streamed first": {"defer": 3, "device_share": 0.5, "device_first": True},
}


def expect_unclipped(choices):
    """A patch checking that the engine runs the placement asked for: streamed blocks, pooled gradients, deferred
    host updates."""
    def check(engine):
        p = engine.placement
        assert not p.clips and bool(p.deferred - {0}) == bool(choices.get("defer", False))
        assert len(p.streamed - {0}) == int((DEPTH - max(choices.get("resident", 0) - 1, 0))
                                             * choices.get("device_share", 0.0))
        assert bool(p.pooled) == choices.get("shared", False) and bool(p.held) == bool(choices.get("held"))
        # (deferred updates split where their gradient has a host buffer of its own, as clipped ones do)
        assert any(u.split for u in p.units[1:]) == (bool(choices.get("defer")) and not choices.get("shared"))
        deferring = choices.get("defer", 0)
        first = [u for u in range(1, DEPTH + 1) if not p.units[u].resident][:DEPTH if deferring is True else deferring]
        assert p.deferred - {0} == {u for u in first if p.units[u].update == "host"}
        if choices.get("device_first"):  # (the first block of each group streams)
            assert 1 in p.streamed
    return check


@pytest.mark.parametrize("choices", UNCLIPPED.values(), ids=UNCLIPPED)
@pytest.mark.parametrize("slow", [None, "h2d", "d2h", "store", "updater"])
def test_unclipped_device_updates_and_pooled_gradients_equal_host_updates(monkeypatch, choices, slow):
    """Without clipping the scale is exactly 1.0, so a run may take every placement a clipped one has: its weights
    are bit for bit those of host updates during backward (the synchronous engine), whichever worker is slow."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=None)
    losses, got = run_engine(pipeline=True, window=2, clip=None, delays={slow: 0.003} if slow else None,
                             patch=expect_unclipped(choices), device_share=choices.get("device_share", 0.0),
                             **{k: v for k, v in choices.items() if k != "device_share"})
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("slow", [None, "updater", "d2h", "store"])
def test_a_clipped_placement_run_unclipped_gives_the_weights_of_updates_during_the_backward(monkeypatch, slow):
    """The planner's unclipped plan may be the clipped run's placement, run without clipping (`run_unclipped`):
    the block that speculated updates during the backward, the other host-updated one at the step's end, split,
    and the streamed blocks split too. Bit for bit the synchronous engine's weights with every update during the
    backward."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=None)

    def clipped_then_unclipped(shapes, step, run, **kwargs):
        return choices.run_unclipped(choices.arrange(shapes, step, dataclasses.replace(run, clip=1.0), **kwargs))

    def check(engine):
        p = engine.placement
        assert not p.clips and not p.speculated and p.deferred - {0} == {3} and p.streamed == {0, 2, 4}
        assert {u for u, unit in enumerate(p.units) if unit.split} == {2, 3, 4}

    monkeypatch.setattr(sys.modules[__name__], "arrange", clipped_then_unclipped)
    losses, got = run_engine(pipeline=True, window=2, clip=None, device_share=0.5, speculate=1, patch=check,
                             delays={slow: 0.003} if slow else None)
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("choices", UNCLIPPED.values(), ids=UNCLIPPED)
def test_unclipped_device_updates_and_pooled_gradients_match_plain_pytorch(choices):
    """The same placements against torch's AdamW over the whole model (fp32 on the CPU, no clipping)."""
    names = {"device_share": "device_update_share", "shared": "grads_share_activations", "held": "held_grads",
             "defer": "defer_updates", "resident": "resident", "device_first": "device_first"}
    engine, ref, stats, ref_losses, ref_norms = run_both(2, "host", None, tied=False,
                                                         **{names[k]: v for k, v in choices.items()})
    assert engine.placement.streamed or engine.placement.deferred
    assert [s.loss for s in stats] == pytest.approx(ref_losses, rel=1e-6)
    masters = engine.named_masters()
    engine.close()
    for name, p in ref.edges.named_parameters():
        torch.testing.assert_close(masters["edges"][name], p.detach(), rtol=1e-5, atol=1e-6)
    for i, block in enumerate(ref.blocks):
        for name, p in block.named_parameters():
            torch.testing.assert_close(masters[f"block.{i}"][name], p.detach(), rtol=1e-5, atol=1e-6)


def test_a_device_update_still_on_its_way_home_is_waited_for(monkeypatch):
    """Drop the wait for a device update's store before the block's backward load, slow the store lane down,
    and the backward reads a stale master: the delay test above would see it. (Buffers enough that the copies in
    never wait for a store: with few, the last pieces' stores alone are in flight, and those are of the last
    block, which the backward does not load again.)"""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    monkeypatch.setattr(placement_module, "STREAM_BUFFERS", 64)
    _, ref = run_engine(pipeline=False, window=2, clip=0.05)

    class Forgetful(dict):
        def get(self, key, default=None):
            return default

    def forget(engine):
        engine.stream.written = Forgetful()
        # The edges' tail-only update at the end of the forward shares the device buffers with the blocks', and
        # waiting for a free buffer would order the backward loads after every store: keep the edges whole here.
        engine.stream.tail = []

    _, got = run_engine(pipeline=True, window=2, clip=0.05, device_share=1.0, delays={"store": 0.01}, patch=forget)
    assert any(not got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("resident", [1, 3, DEPTH + 1])
@pytest.mark.parametrize("clip", [0.05, None])
def test_resident_units_give_the_same_result(resident, clip):
    """Edges and the first blocks kept on the device with their optimizer there (the window adapting to a
    larger budget) change where the work runs, not the result."""
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=clip)
    losses, got = run_engine(pipeline=True, window=2, clip=clip, resident=resident, delays={"updater": 0.002})
    assert losses == ref_losses
    for unit, params in ref.items():
        for name, t in params.items():
            assert got[unit][name].equal(t), f"{unit}.{name}"


def test_a_failed_copy_on_a_worker_lane_surfaces_and_close_still_stops_threads():
    def break_block_one(engine):
        engine.units[2].master = torch.zeros(3)  # the h2d copy of block 1 will fail in the lane's thread

    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=None)
    break_block_one(engine)
    step = batches(seed=4, steps=1, micro=2)[0]
    with pytest.raises(RuntimeError, match="lane failed") as failure:  # (the land lane waits for h2d's copies)
        engine.step(step, lr=1e-2, normalizer=10)
    causes = [failure.value]
    while causes[-1].__cause__ is not None:
        causes.append(causes[-1].__cause__)
    assert any("h2d lane failed" in str(e) for e in causes)
    engine.close()
    threads = [engine.updater._thread, *(t for lane in engine.lanes[1:] for t in lane._pool._threads)]
    assert threads and not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="closed"):
        engine.step(step, lr=1e-2, normalizer=10)


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_failed_params_part_surfaces_and_its_moments_part_does_not_hide_it(pipeline):
    """A split update's params part that fails on the optimizer thread leaves the master as it was: the error
    must reach the training thread, not be overwritten when the moments part later runs."""
    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=0.05,
                                                                    pipeline=pipeline, device_update_share=0.0)
    step_unit = engine.optimizer.step_unit

    def fail_block_one_params(unit, grad, lr, grad_scale=1.0, before_chunk=None, part="all", into=None):
        if unit == 2 and part == "params":
            raise ValueError("params part failed")
        step_unit(unit, grad, lr, grad_scale, before_chunk, part, into)

    engine.optimizer.step_unit = fail_block_one_params
    with pytest.raises(RuntimeError, match="optimizer worker failed") as failure:
        for step in batches(seed=4, steps=2, micro=2):
            engine.step(step, lr=1e-2, normalizer=10)
        engine.synchronize()
    assert isinstance(failure.value.__cause__, ValueError)
    with pytest.raises(RuntimeError, match="optimizer worker failed"):
        engine.close()  # still stops the threads


@pytest.mark.parametrize("clip, share", [(None, 0.0), (0.05, 0.0), (0.05, 0.5)])
def test_gradients_arrive_and_update_chunk_by_chunk(monkeypatch, clip, share):
    """Gradients leave the slot in the host optimizer's chunks and each chunk's update waits only for its own
    piece; with a slow d2h lane the result is still the synchronous engine's. Drop the per-chunk waits (keep
    only the last) and an update reads chunks that have not arrived."""
    monkeypatch.setattr(slide_memory.adamw, "CHUNK", 128)  # ~8 chunks per toy block
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    _, ref = run_engine(pipeline=False, window=2, clip=clip)

    def chunked(engine):
        assert len(engine.optimizer.units[1].ranges) > 4

    _, got = run_engine(pipeline=True, window=2, clip=clip, device_share=share, delays={"d2h": 0.002},
                        patch=chunked)
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())
    if clip:
        return  # clipped updates start after backward: every piece has arrived by then anyway

    def last_wait_only(engine):
        copy_out = engine.homes.copy_out
        engine.homes.copy_out = lambda *a: [DONE] * (len(p := copy_out(*a)) - 1) + p[-1:]

    _, got = run_engine(pipeline=True, window=2, clip=clip, delays={"d2h": 0.004}, patch=last_wait_only)
    assert any(not got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


def test_evaluate_between_steps_applies_pending_device_updates_once(monkeypatch):
    """An evaluation right after a clipped step loads blocks whose device updates are still pending: it runs
    them (the loss it reports is the updated model's) and the next step does not run them again."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    evaluated = []

    def run(share):
        torch.manual_seed(0)
        engine = make_engine(ToyStack(Model(tied=True)),
            device="cpu", window=2, max_grad_norm=0.05, device_update_share=share,
            optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1))
        engine.d2h.delay = engine.store.delay = 0.002
        losses = []
        probe = batches(seed=9, steps=1, micro=2)[0]
        for step in batches(seed=4, steps=3, micro=3):
            losses.append(engine.step(step, lr=1e-2, normalizer=10).loss)
            losses.append(engine.evaluate(probe, normalizer=10))
        masters = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}
        engine.close()
        evaluated.append(losses)
        return masters

    host, device = run(0.0), run(1.0)
    assert evaluated[0] == evaluated[1]
    assert all(device[u][n].equal(t) for u, params in host.items() for n, t in params.items())


@pytest.mark.gpu
def test_device_updates_on_cuda_track_host_updates():
    """On a GPU the streamed path runs CUDA's fused AdamW instead of the CPU's: the same formula, rounded by
    other hardware, so fp32 masters agree to a few ulps after several clipped steps (two of the device-updated
    blocks keeping their gradient on the device), split updates or whole ones."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")
    results = []
    for share, split in ((0.0, True), (1.0, True), (1.0, False)):
        torch.manual_seed(0)
        engine = make_engine(ToyStack(Model(tied=True)),
            device="cuda", compute_dtype="fp32", window=2, max_grad_norm=0.05, device_update_share=share,
            held_grads=2 if share else 0, split_update=split, optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1))
        assert len(engine.streamed) == (DEPTH + 1 if share else 0) and len(engine.homes.held) == (2 if share else 0)
        for step in batches(seed=4, steps=4, micro=3):
            engine.step([{k: v.cuda() for k, v in b.items()} for b in step], lr=1e-2, normalizer=10)
        results.append({k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()})
        engine.close()
    host = results[0]
    for device in results[1:]:
        for unit, params in host.items():
            for name, t in params.items():
                torch.testing.assert_close(device[unit][name], t, rtol=1e-5, atol=1e-6, msg=f"{unit}.{name}")


@pytest.mark.gpu
def test_gradients_sharing_the_activations_memory_on_cuda_give_the_same_result():
    """On a GPU (CUDA streams, a pinned pool), with the host optimizer slowed down: host gradients over the
    activations' memory give bit for bit the result of a buffer each when every update runs on the host, and
    track it to a few ulps with device updates (two of them keeping their gradient on the device)."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")
    results = {}
    for share, shared in ((0.0, False), (0.0, True), (1.0, True)):
        torch.manual_seed(0)
        engine = make_engine(ToyStack(Model(tied=True)),
            device="cuda", compute_dtype="fp32", window=2, max_grad_norm=0.05, device_update_share=share,
            held_grads=2 if share else 0, grads_share_activations=shared,
            optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1))
        assert (engine.homes.pool is not None) == shared and (engine.homes.ring is None) == shared
        engine.updater.delay = 0.005
        losses = [engine.step([{k: v.cuda() for k, v in b.items()} for b in step], lr=1e-2, normalizer=10).loss
                  for step in batches(seed=4, steps=4, micro=3)]
        results[share, shared] = losses, {k: {n: t.clone() for n, t in v.items()}
                                          for k, v in engine.named_masters().items()}
        engine.close()
    (ref_losses, ref), (losses, got) = results[0.0, False], results[0.0, True]
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())
    _, device = results[1.0, True]
    for unit, params in ref.items():
        for name, t in params.items():
            torch.testing.assert_close(device[unit][name], t, rtol=1e-5, atol=1e-6, msg=f"{unit}.{name}")


@pytest.mark.gpu
def test_shared_memory_replaced_on_cuda_keeps_the_gradients_its_queued_copies_read():
    """On a GPU, a step whose activations outgrow the pool takes a new allocation while that step's device
    updates still copy gradients from the old one on the host-to-device stream (queued copies hold no Python
    reference; a GPU sleep queued ahead of each step holds that stream back, so they run late). The old
    allocation (page-locked in place, as pools of this size are) is kept until the step ends: bit for bit the
    result of a buffer each (whole updates there too: a split one steps the moments on the host, which rounds
    differently). Deterministic algorithms: at these sizes CUDA's own kernels otherwise differ by an ulp from one
    identical run to the next."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")
    from slide_memory.host import EXACT_PIN_BYTES

    data = random_steps(5, [(3, 800), (2, 800), (3, 1600), (3, 1600), (2, 800)], "cuda")
    results, allocations = {}, []
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for shared in (False, True):
            torch.manual_seed(0)
            engine = make_engine(ToyStack(Model(tied=True)),
                device="cuda", compute_dtype="fp32", window=2, max_grad_norm=0.05, device_update_share=1.0,
                grads_share_activations=shared, split_update=False,
                optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1))
            losses = []
            for batch in data:
                with torch.cuda.stream(engine.h2d.stream):  # ~50 ms of GPU sleep ahead of the step's copies in
                    torch.cuda._sleep(100_000_000)
                losses.append(engine.step(batch, lr=1e-2, normalizer=10).loss)
                if shared:
                    allocations.append(engine.homes.pool.nbytes)
            results[shared] = losses, {k: {n: t.clone() for n, t in v.items()}
                                       for k, v in engine.named_masters().items()}
            engine.close()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert allocations[0] >= EXACT_PIN_BYTES and allocations[2] > allocations[0], "the longer steps must outgrow it"
    (ref_losses, ref), (losses, got) = results[False], results[True]
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.gpu
def test_cuda_land_lane_runs_its_kernels_ahead_of_compute():
    """The kernels that turn landed bytes into slot contents (narrowing, a streamed AdamW step) run on a stream
    of their own with the higher priority (the lower number): a copy stream never waits behind them."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")
    engine = make_engine(ToyStack(Model(tied=True)), device="cuda", window=2)
    assert engine.land.stream.priority < engine.compute.stream.priority
    assert len({lane.stream for lane in engine.lanes}) == len(engine.lanes) == 5
    engine.close()


@pytest.mark.gpu
def test_cuda_landing_buffers_wait_for_the_backward_that_reads_them(monkeypatch):
    """Resident blocks wait for no slot, so only the landing buffers' own wait keeps the h2d lane from
    overwriting activations a slow backward still reads: with every block resident and compute slowed on the
    GPU, offloaded activations give the same result, bit for bit, as activations kept on the device."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")
    forward = Block.forward

    def slow_forward(self, hidden, ctx):
        torch.cuda._sleep(2_000_000)  # about a millisecond of GPU time before each block (and its recompute)
        return forward(self, hidden, ctx)

    monkeypatch.setattr(Block, "forward", slow_forward)
    results = []
    for offload in ("gpu", "host"):
        torch.manual_seed(0)
        engine = make_engine(ToyStack(Model(tied=False)),
            device="cuda", compute_dtype="fp32", window=1, resident=DEPTH + 1, activation_offload=offload,
            max_grad_norm=None, optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1))
        losses = [engine.step([{k: v.cuda() for k, v in b.items()} for b in step], lr=1e-2, normalizer=10).loss
                  for step in batches(seed=4, steps=3, micro=3)]
        results.append((losses, {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}))
        engine.close()
    (kept_losses, kept), (offloaded_losses, offloaded) = results
    assert offloaded_losses == kept_losses
    assert all(offloaded[u][n].equal(t) for u, params in kept.items() for n, t in params.items())


def test_a_failed_device_update_stops_the_lane_that_would_store_it(monkeypatch):
    """A piece whose step fails on the land lane must not be stored back into the host master by the store lane
    (which only waits for it): the failure stops that lane too and surfaces in the training thread."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=0.05,
                                                                    device_update_share=1.0)
    step = batches(seed=4, steps=1, micro=2)[0]
    engine.step(step, lr=1e-2, normalizer=10)  # leaves every block's update pending for the next loads

    def broken(*args):
        raise RuntimeError("device step failed")

    monkeypatch.setattr(updates_module, "step_piece", broken)
    with pytest.raises(RuntimeError, match="lane failed"):
        engine.step(step, lr=1e-2, normalizer=10)
    engine.updater.close()
    for lane in engine.lanes:
        lane.close()  # lets each lane finish (or skip) what it had queued
    assert isinstance(engine.land.error, RuntimeError) and engine.store.error is not None


@pytest.mark.parametrize("clip", [0.05, None])
@pytest.mark.parametrize("slow", ["h2d", "land", "d2h", "store", "updater"])
def test_the_edges_tail_only_part_updates_apart_with_the_same_result(monkeypatch, clip, slow):
    """Untied edges updated on the device split into what the head reads (embedding) and what only the tail
    reads (final norm, output projection). Without clipping the tail part updates during backward, with
    clipping during the next forward, a chunk per block either way; the head part at the next load. Same
    arithmetic per element, so the result is the synchronous host-updated engine's bit for bit, whichever
    worker is slow, and every update covers each chunk exactly once."""
    monkeypatch.setattr(slide_memory.adamw, "CHUNK", 64)  # several chunks in each part of the edges
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=clip, tied=False)
    calls = []

    def record_calls(engine):
        opt = engine.optimizer.units[0]
        embed = engine.edge_slot.layout.entries[0]
        assert embed.name == "embed.weight" and len(engine.stream.tail) > 2
        assert all((a >= embed.numel) == (k in engine.stream.tail) for k, (a, _) in enumerate(opt.ranges))
        calls.append(engine)
        original = engine.stream.update_on_device
        engine.stream.update_on_device = lambda unit, slot, chunks=None: (
            calls.append((unit, list(engine.stream.pending[unit].chunks if chunks is None else chunks))),
            original(unit, slot, chunks))

    losses, got = run_engine(pipeline=True, window=2, clip=clip, tied=False, device_share=0.5,
                             delays={slow: 0.003}, patch=record_calls)
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())
    engine, *calls = calls
    tail = engine.stream.tail
    head = [k for k in range(len(engine.optimizer.units[0].ranges)) if k not in tail]
    # Each of the 3 updates: the tail part a chunk per block (then the rest at once), and the head part in one
    # call, tail first without clipping (during backward) and head first with it (at the next load).
    done = [chunk for unit, chunks in calls if unit == 0 for chunk in chunks]
    n = len(head) + len(tail)
    updates = [done[k : k + n] for k in range(0, len(done), n)]
    assert len(done) == 3 * n
    for update in updates:
        assert update == (head + tail if clip else tail + head)
    singles = [len(chunks) for unit, chunks in calls if unit == 0 and chunks and chunks[0] in tail]
    assert singles[:DEPTH] == [1] * DEPTH  # one chunk per block, while there are blocks left


def test_a_tied_output_projection_is_not_tail_only():
    """The head reads a tied embedding: only the final norm is left to update apart."""
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", device_update_share=1.0)
    names = [e.name for e in engine.edge_slot.layout.entries]
    assert names == ["embed.weight", "norm.weight", "norm.bias"]
    norm = engine.edge_slot.layout.entries[1]
    assert [engine.optimizer.units[0].ranges[k][0] for k in engine.stream.tail] == [norm.offset]
    engine.close()


def test_fetched_activations_land_in_the_same_buffers_every_step():
    """Backward's boundary activations come back into buffers kept per slot and micro-batch: after the first
    step no fetch allocates, and only a window's worth of them exists."""
    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=False)), device="cpu", window=2, resident=2,
                                                                     activation_offload="host")
    seen = []
    fetch = engine.activations.fetch
    engine.activations.fetch = lambda *a, **k: seen[-1].add((out := fetch(*a, **k)).data_ptr()) or out
    for step in batches(seed=4, steps=3, micro=3):
        seen.append(set())
        engine.step(step, lr=1e-2, normalizer=10)
    assert seen[1] == seen[2] == seen[0]
    assert len(seen[0]) == (engine.window + 1) * 3 == len(engine.activations._landing)
    engine.step(batches(seed=5, steps=1, micro=1)[0], lr=1e-2, normalizer=10)  # fewer micro-batches: fewer kept
    assert len(engine.activations._landing) == engine.window + 1
    engine.close()
    assert not engine.activations._landing


@pytest.mark.parametrize("clip, nvme", [(1.0, 0.0), (1.0, 1.0), (None, 1.0)])
def test_a_script_that_never_closes_its_engine_finishes_its_updates_and_exits_cleanly(tmp_path, clip, nvme):
    """The README's example never calls close(): at exit the optimizer worker, a daemon thread, must not be
    left inside a torch call when the interpreter finalizes (that can abort the process), so an exit handler
    finishes what was queued (here the clipped updates' params parts) and stops it. An exit hook that runs
    after it and closes the engine (which queues the moments parts) must not wait on the stopped worker. With
    moments on disk, the handler runs before the pools the disk tier reads and writes through are shut down
    (else an update's write-back could not be queued and the next read waited for it forever), and the state
    files are gone after."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "import atexit\n"
        "state = {}\n"
        "def report():  # registered before slide_scheduler's own handler, so it runs after it\n"
        "    engine, units = state['engine'], range(len(state['engine'].units))\n"
        "    print('params', all(engine.updater.ready(u, params_only=True) for u in units))\n"
        "    engine.close()\n"
        "    print('done', all(engine.updater.ready(u) for u in units))\n"
        "atexit.register(report)\n"
        "from test_engine import Model, ToyStack, batches\n"
        "from test_engine import make_engine\n"
        "engine = state['engine'] = make_engine(ToyStack(Model(tied=True)), \n"
        f"    device='cpu', window=2, max_grad_norm={clip}, nvme_fraction={nvme}, nvme_dir={str(tmp_path)!r})\n"
        "engine.updater.delay = 0.2  # the last step's updates are still queued when the script ends\n"
        "engine.step(batches(seed=4, steps=1, micro=2)[0], lr=1e-2, normalizer=10)\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            cwd=pathlib.Path(__file__).parent, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(pathlib.Path(__file__).parent), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-4:] == ["params", "True", "done", "True"], result.stdout + result.stderr
    assert not list(tmp_path.glob("slide-io-*"))


def slow_disk(monkeypatch, seconds: float = 0.004) -> None:
    """Every read and write-back of the disk tier's states takes a while longer."""
    from slide_scheduler.run import disk_states

    for name in ("_read", "_write"):
        original = getattr(disk_states.DiskStates, name)

        def slowed(self, *args, _original=original):
            time.sleep(seconds)
            return _original(self, *args)

        monkeypatch.setattr(disk_states.DiskStates, name, slowed)


@pytest.mark.parametrize("clip", [0.05, None])
@pytest.mark.parametrize("fraction, slow, share, resident", [
    (0.0, None, 0.0, 0), (0.5, None, 0.0, 0), (1.0, "updater", 0.0, 0), (0.5, "d2h", 0.5, 0), (0.5, "h2d", 0.0, 2),
    (1.0, None, 1.0, 0), (1.0, "disk", 0.0, 0), (0.5, "disk", 0.0, 2)])
def test_masters_and_moments_on_disk_give_the_host_memory_result(tmp_path, monkeypatch, clip, fraction, slow,
                                                                 share, resident):
    """fp32 masters and AdamW moments of the last sliding blocks kept in files (read into a staging slot ahead of
    each update, written back after; the blocks load from a copy of their parameters their update writes): bit
    for bit the synchronous engine's result with everything in memory, with a slow lane or a slow disk, device
    updates of the other blocks and resident blocks beside them."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=clip, device_share=share, resident=resident)
    seen = {}

    def record(engine):
        seen["on_disk"], seen["streamed"] = set(engine.on_disk), set(engine.streamed)
        seen["masters"] = {u for u, unit in enumerate(engine.units) if unit.master is None}

    if slow == "disk":
        slow_disk(monkeypatch)
    losses, got = run_engine(pipeline=True, window=2, clip=clip, device_share=share, resident=resident,
                             delays={slow: 0.004} if slow not in (None, "disk") else None,
                             nvme=(fraction, tmp_path) if fraction else None, patch=record)
    sliding = DEPTH - max(resident - 1, 0)
    assert len(seen["on_disk"]) == round(fraction * sliding) and not seen["on_disk"] & seen["streamed"]
    assert seen["masters"] == seen["on_disk"]  # no fp32 master of theirs in host memory
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())
    assert not list(tmp_path.glob("slide-io-*")), "closing the engine removes its files"


@pytest.mark.parametrize("fraction, defer, slow", [(0.5, 2, None), (1.0, 2, "updater"), (1.0, 3, "disk"),
                                                   (0.5, 3, "d2h"), (1.0, True, "updater")])
def test_the_first_blocks_deferred_with_moments_on_disk_give_the_host_memory_result(tmp_path, monkeypatch, fraction,
                                                                                    defer, slow):
    """Unclipped, the first blocks' updates wait for the step's end and the others' run during the backward, some
    of either with their states on disk (read in the order the updates run): bit for bit the synchronous engine's
    result with every update during the backward and everything in memory."""
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=None)
    seen = {}

    def record(engine):
        seen["deferred"], seen["on_disk"] = engine.placement.deferred - {0}, set(engine.on_disk)

    if slow == "disk":
        slow_disk(monkeypatch)
    losses, got = run_engine(pipeline=True, window=2, clip=None, defer=defer, nvme=(fraction, tmp_path), patch=record,
                             delays={slow: 0.004} if slow not in (None, "disk") else None)
    assert seen["deferred"] == set(range(1, 1 + (DEPTH if defer is True else defer)))
    assert seen["on_disk"] == set(range(DEPTH + 1 - round(fraction * DEPTH), DEPTH + 1))
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("clip", [0.05, None])
@pytest.mark.parametrize("fraction, window, slow, resident", [
    (1.0, 2, None, 0), (1.0, 1, "disk", 0), (0.5, 3, "h2d", 0), (1.0, 2, "updater", 0), (0.5, 2, "disk", 2)])
def test_loads_that_read_their_master_from_disk_give_the_host_memory_result(tmp_path, monkeypatch, clip, fraction,
                                                                            window, slow, resident):
    """Blocks whose master is on disk and whose parameters have no copy in host memory: each load reads the
    master from disk (after the write-back of the update it waits for) into one of two buffers, and crosses
    from there. Bit for bit the synchronous engine's result with everything in memory, with one to three slots,
    a slow lane or a slow disk."""
    ref_losses, ref = run_engine(pipeline=False, window=window, clip=clip, resident=resident)
    seen = {}

    def record(engine):
        seen["bare"] = {u for u, unit in enumerate(engine.units) if unit.master is None and unit.params is None}
        seen["on_disk"], seen["placed"] = set(engine.on_disk), engine.placement.loads_from_disk

    if slow == "disk":
        slow_disk(monkeypatch)
    losses, got = run_engine(pipeline=True, window=window, clip=clip, resident=resident,
                             delays={slow: 0.004} if slow not in (None, "disk") else None,
                             nvme=(fraction, tmp_path), disk_loads=True, patch=record)
    assert seen["bare"] and seen["bare"] == seen["on_disk"] == seen["placed"]  # nothing of theirs in host memory
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [0.05, None])
def test_loads_that_read_their_master_from_disk_on_cuda_give_the_host_memory_result(tmp_path, monkeypatch, clip):
    """On a GPU, through the machine's NVMe store path (kvikio where installed): every sliding block's master
    and moments on disk, each load reading the master into a pinned buffer and crossing from there, with a slow
    disk. Bit for bit the same engine on the GPU with everything in host memory (deterministic algorithms: the
    two runs must differ only in where the bytes wait)."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ref_losses, ref = run_engine(pipeline=True, window=2, clip=clip, device="cuda")
        seen = {}

        def record(engine):
            seen["bare"] = {u for u, unit in enumerate(engine.units) if unit.master is None and unit.params is None}
            seen["on_disk"], seen["path"] = set(engine.on_disk), engine.disk.store.path

        slow_disk(monkeypatch)
        losses, got = run_engine(pipeline=True, window=2, clip=clip, nvme=(1.0, tmp_path), disk_loads=True,
                                 patch=record, device="cuda")
    finally:
        torch.use_deterministic_algorithms(deterministic)
    print(f"NVMe store path: {seen['path']}")
    assert seen["bare"] and seen["bare"] == seen["on_disk"]
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("clip", [0.05, None])
@pytest.mark.parametrize("slow", [None, "updater"])
def test_bf16_moments_on_disk_give_the_bf16_in_memory_result(tmp_path, clip, slow):
    """states_dtype=bf16 with masters and moments on disk: the moments are stored there in bf16 (half the bytes
    of fp32 ones), the masters in fp32, and the result is bit for bit the synchronous engine's with bf16 states in
    memory."""
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=clip, states="bf16")
    fp32_losses, _ = run_engine(pipeline=False, window=2, clip=clip)
    sizes, expected = [], []

    def record(engine):
        step = engine.step
        # m and v, 2 bytes each, and the fp32 masters of those blocks
        expected.append(engine.disk.numel * (len(engine.on_disk) * 2 * 2 + len(engine.disk.masters) * 4))

        def step_and_measure(*args, **kwargs):
            stats = step(*args, **kwargs)
            engine.synchronize()
            for unit in engine.on_disk:  # (each unit's write-back is on disk)
                engine.disk.wait(unit)
            sizes.append(sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()))
            return stats

        engine.step = step_and_measure

    losses, got = run_engine(pipeline=True, window=2, clip=clip, states="bf16", nvme=(0.5, tmp_path),
                             delays={slow: 0.004} if slow else None, patch=record)
    assert ref_losses != fp32_losses  # (bf16 states round differently: they are what ran)
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())
    assert expected[0] > 0 and sizes == expected * 3
    assert not list(tmp_path.glob("slide-io-*")), "closing the engine removes its files"


def test_a_read_that_does_not_wait_for_the_last_write_back_is_caught(tmp_path, monkeypatch):
    """The check above can fail: let a block's moments be read without waiting for the write-back of its last
    update, slow the writes down, and an update steps from stale moments."""
    from slide_scheduler.run import disk_states

    _, ref = run_engine(pipeline=False, window=2, clip=None)
    write = disk_states.DiskStates._write

    def slow_write(self, *args):
        time.sleep(0.05)
        write(self, *args)

    monkeypatch.setattr(disk_states.DiskStates, "_write", slow_write)
    read = disk_states.DiskStates._read
    monkeypatch.setattr(disk_states.DiskStates, "_read", lambda self, unit, slot, after: read(self, unit, slot, ()))
    _, got = run_engine(pipeline=True, window=2, clip=None, nvme=(1.0, tmp_path))
    assert any(not got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("states", ["fp32", "bf16"])
def test_moments_on_disk_checkpoint_like_moments_in_memory(tmp_path, states):
    """optimizer_state of a unit whose moments are on disk is what the same run keeps in memory (in the states'
    dtype), and load_optimizer_state puts it back where the next update reads it."""
    engines = []
    for nvme in (None, (1.0, tmp_path)):
        torch.manual_seed(0)
        engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=0.05,
                                                                        states_dtype=states, **on_disk(nvme))
        assert engine.optimizer_state(DEPTH) == {}, "no state before the first update"
        for step in batches(seed=4, steps=2, micro=2):
            engine.step(step, lr=1e-2, normalizer=10)
        engine.synchronize()
        engines.append(engine)
    memory, disk = engines
    for u in range(DEPTH + 1):
        a, b = memory.optimizer_state(u), disk.optimizer_state(u)
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a), u
    assert disk.optimizer_state(DEPTH)["exp_avg"].dtype == DTYPES[states]
    # swap the moments of two blocks on disk and give one a later step count (its bias correction changes):
    # the state read back, and the next step, follow
    first, last = disk.optimizer_state(1), disk.optimizer_state(DEPTH)
    first = {**first, "step": first["step"] + 3}
    disk.load_optimizer_state(1, last)
    disk.load_optimizer_state(DEPTH, first)
    assert disk.optimizer_state(1)["exp_avg"].equal(last["exp_avg"])
    assert float(disk.optimizer_state(DEPTH)["step"]) == 5
    memory.load_optimizer_state(1, last)
    memory.load_optimizer_state(DEPTH, first)
    step = batches(seed=7, steps=1, micro=2)[0]
    assert memory.step(step, lr=1e-2, normalizer=10).loss == disk.step(step, lr=1e-2, normalizer=10).loss
    a, b = memory.named_masters(), disk.named_masters()
    assert all(a[u][n].equal(t) for u, params in b.items() for n, t in params.items())
    for engine in engines:
        engine.close()


def test_fp32_states_load_into_bf16_moments_on_disk_as_into_bf16_ones_in_memory(tmp_path):
    """A bf16-states run resumed from an fp32 checkpoint: the states narrowed onto disk step exactly as the same
    states narrowed into memory."""
    torch.manual_seed(0)
    source = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=0.05)
    for step in batches(seed=4, steps=2, micro=2):
        source.step(step, lr=1e-2, normalizer=10)
    source.synchronize()
    states = [source.optimizer_state(u) for u in range(DEPTH + 1)]
    masters = {u: unit.master.clone() for u, unit in enumerate(source.units)}
    source.close()
    engines = []
    for nvme in (None, (1.0, tmp_path)):
        engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=0.05,
                                                                        states_dtype="bf16", **on_disk(nvme))
        for u in range(len(engine.units)):
            engine.load_master(u, masters[u])
            engine.load_optimizer_state(u, states[u])
        engine.refresh()
        engines.append(engine)
    memory, disk = engines
    assert disk.on_disk and states[DEPTH]["exp_avg"].dtype == torch.float32
    for u in range(DEPTH + 1):
        a, b = memory.optimizer_state(u), disk.optimizer_state(u)
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a), u
    assert disk.optimizer_state(DEPTH)["exp_avg"].dtype == torch.bfloat16
    for step in batches(seed=7, steps=2, micro=2):
        assert memory.step(step, lr=1e-2, normalizer=10).loss == disk.step(step, lr=1e-2, normalizer=10).loss
    a, b = memory.named_masters(), disk.named_masters()
    assert all(a[u][n].equal(t) for u, params in b.items() for n, t in params.items())
    for engine in engines:
        engine.close()


def test_moments_on_disk_need_a_directory_with_room_for_them(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="nvme_dir"):
        make_engine(ToyStack(Model(tied=True)), device="cpu", nvme_fraction=0.5)
    import slide_io.disk

    monkeypatch.setattr(slide_io.disk, "free_bytes", lambda directory: 1000)
    with pytest.raises(OSError, match="preflight") as error:
        make_engine(ToyStack(Model(tied=True)), device="cpu", nvme_fraction=0.5,
                                                               nvme_dir=str(tmp_path))
    assert str(tmp_path) in str(error.value)


@pytest.mark.parametrize("states_dtype", ["fp32", "bf16"])
def test_each_step_reads_and_writes_the_disk_tier_once_and_the_engine_counts_it(tmp_path, states_dtype):
    """Every block's master and moments on disk: a step writes every stored byte once, and reads it once before
    the update (the first step reads only the masters: moments start at zero). The steps' timelines count what
    finished during them: all of it but what the last step left running."""
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=1.0,
                         nvme_fraction=1.0, nvme_dir=str(tmp_path), states_dtype=states_dtype)
    numel = sum(engine.units[u].layout.numel for u in engine.on_disk)
    per_param = 4 + 2 * (4 if states_dtype == "fp32" else 2)
    before = engine.disk_traffic()
    stats = [engine.step(step, lr=1e-2, normalizer=10) for step in batches(seed=6, steps=4, micro=2)]
    (store,) = engine.disk_stores()
    assert store.nbytes == per_param * numel
    engine.close()  # (the last write-backs finish)
    read, written = (now - then for now, then in zip(engine.disk_traffic(), before))
    assert (read, written) == (3 * per_param * numel + 4 * numel, 4 * per_param * numel)
    for moved, key in ((read, "disk_read_gb"), (written, "disk_written_gb")):
        counted = sum(s.timeline[key] for s in stats) * 1e9
        assert moved - per_param * numel <= counted + 1 and counted <= moved + 1, (key, counted, moved)


@pytest.mark.parametrize("disk_loads", [False, True])
def test_the_disk_tier_reads_and_writes_one_at_a_time(tmp_path, monkeypatch, disk_loads):
    """A drive mixing reads and writes moves fewer bytes than one direction at a time, and the cost model prices
    the tier as reads then writes: transfers of the tier (a block's states, its master for a load) take turns,
    though reads run ahead on a thread of their own and every file's transfer takes a while. (A block's m, v and
    master move together, as one transfer.)"""
    from slide_io import NVMeStore

    spans, guard = [], threading.Lock()

    def timed(original, direction):
        def op(self, key, tensor):
            start = time.perf_counter()
            time.sleep(0.002)
            future = original(self, key, tensor)
            future.result()
            with guard:
                spans.append((start, time.perf_counter(), (direction, key.split(".")[1])))
            return future
        return op

    monkeypatch.setattr(NVMeStore, "read", timed(NVMeStore.read, "read"))
    monkeypatch.setattr(NVMeStore, "write", timed(NVMeStore.write, "write"))
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=1.0,
                         nvme_fraction=1.0, nvme_dir=str(tmp_path), disk_loads=disk_loads)
    assert bool(engine.placement.loads_from_disk) == disk_loads
    for step in batches(seed=6, steps=3, micro=2):
        engine.step(step, lr=1e-2, normalizer=10)
    engine.close()
    assert len({what for _, _, what in spans}) == 2 * len(engine.on_disk)
    clusters = []  # spans that overlap in time, merged
    for start, end, what in sorted(spans):
        if clusters and start < clusters[-1][1]:
            clusters[-1] = (clusters[-1][0], max(end, clusters[-1][1]), clusters[-1][2] | {what})
        else:
            clusters.append((start, end, {what}))
    assert all(len(c[2]) == 1 for c in clusters), [c[2] for c in clusters if len(c[2]) > 1][:3]


@pytest.mark.parametrize("backward_reads", [None, "masters for loads", "activations"])
def test_clipped_steps_read_the_first_updates_states_under_the_backward(tmp_path, backward_reads):
    """The states of the first clipped updates do not depend on the norm: their reads are queued as the backward
    starts, as many as the staging slots hold (and only where the backward reads nothing from disk itself, so
    they never hold it up); the others once the step knows its norm."""
    from slide_scheduler.run.disk_states import SLOTS

    acts = {"activation_offload": "disk", "activation_dir": str(tmp_path / "acts")} \
        if backward_reads == "activations" else {}
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=1.0,
                         nvme_fraction=1.0, nvme_dir=str(tmp_path), disk_loads=backward_reads == "masters for loads",
                         **acts)
    events = []
    fetch, queue = engine.disk.fetch, engine.host_updates.norm_known
    main = threading.current_thread()  # (the updater's bind fetches too, a no-op for what is queued)
    engine.disk.fetch = lambda u: (threading.current_thread() is main and events.append(("fetch", u)), fetch(u))[1]
    engine.host_updates.norm_known = lambda *a, **k: (events.append(("norm known", None)), queue(*a, **k))[1]
    steps = batches(seed=6, steps=2, micro=2)
    engine.step(steps[0], lr=1e-2, normalizer=10)
    events.clear()
    engine.step(steps[1], lr=1e-2, normalizer=10)
    engine.close()
    early = [u for what, u in events[:events.index(("norm known", None))] if what == "fetch"]
    assert early == ([] if backward_reads else sorted(engine.on_disk)[:SLOTS])


def test_a_clipped_step_with_a_non_finite_norm_leaves_nothing_staged_on_disk(tmp_path):
    """A step whose norm is not finite runs no update: the states it read ahead for them are let go, so the
    tier's masters and moments can be replaced (a checkpoint loaded) and the next step reads them afresh."""
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=1.0,
                         nvme_fraction=1.0, nvme_dir=str(tmp_path))
    steps = batches(seed=6, steps=3, micro=2)
    engine.step(steps[0], lr=1e-2, normalizer=10)
    tail = engine.edges.tail
    engine.edges.tail = lambda h, batch, normalizer: tail(h, batch, normalizer) * float("nan")
    assert not math.isfinite(engine.step(steps[1], lr=1e-2, normalizer=10).grad_norm)
    engine.edges.tail = tail
    for u in sorted(engine.on_disk):
        engine.load_master(u, engine.master(u).clone())
        engine.load_optimizer_state(u, {k: v.clone() for k, v in engine.optimizer_state(u).items()})
    assert math.isfinite(engine.step(steps[2], lr=1e-2, normalizer=10).grad_norm)
    engine.close()


def test_a_failed_write_back_surfaces_and_close_still_stops_threads(tmp_path, monkeypatch):
    """A disk that fills up while moments go back: the error reaches the training thread (no hang), and the
    engine still closes."""
    from slide_io import NVMeStore, StoreFullError

    write = NVMeStore.write
    calls = []

    def fill_up(self, key, tensor):
        calls.append(key)
        if len(calls) > 4:
            raise StoreFullError(str(tmp_path), tensor.nbytes, 0, what=f"writing key {key!r}")
        return write(self, key, tensor)

    monkeypatch.setattr(NVMeStore, "write", fill_up)
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=None,
                                                                    nvme_fraction=1.0, nvme_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="optimizer worker failed") as error:
        for step in batches(seed=4, steps=4, micro=2):
            engine.step(step, lr=1e-2, normalizer=10)
        engine.synchronize()
    assert isinstance(error.value.__cause__, StoreFullError) and "writing key" in str(error.value.__cause__)
    with pytest.raises(RuntimeError, match="optimizer worker failed"):
        engine.close()  # (it raises the error again, and stops the threads all the same)
    assert not engine.updater._thread.is_alive()
    assert not list(tmp_path.glob("slide-io-*")), "closing the engine removes its files"


@pytest.mark.parametrize("broken", ["synchronize", "updater", "disk", "lane"])
def test_close_stops_every_part_when_one_before_it_raises(tmp_path, broken):
    """Close runs its parts in order (finish the updates, the moments' writes, the lanes, the activations'
    files) and each one runs even when one before it raises; the error still reaches the caller."""
    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)),
        device="cpu", window=2, max_grad_norm=None, nvme_fraction=0.5, nvme_dir=str(tmp_path / "states"),
        activation_offload="disk", activation_dir=str(tmp_path / "acts"))
    engine.step(batches(seed=4, steps=1, micro=2)[0], lr=1e-2, normalizer=10)
    order = []

    def record(name, close):
        def wrapped():
            order.append(name)
            close()
            if name == broken:
                raise RuntimeError(f"{name} broke")
        return wrapped

    engine.synchronize = record("synchronize", engine.synchronize)
    engine.updater.close = record("updater", engine.updater.close)
    engine.disk.close = record("disk", engine.disk.close)
    for i, lane in enumerate(engine.lanes):
        lane.close = record("lane" if i == 0 else f"lane {i}", lane.close)
    engine.activations.close = record("activations", engine.activations.close)
    with pytest.raises(RuntimeError, match=f"{broken} broke"):
        engine.close()
    assert order == ["synchronize", "updater", "disk", "lane", *(f"lane {i}" for i in range(1, len(engine.lanes))),
                     "activations"]
    threads = [engine.updater._thread, *(t for lane in engine.lanes[1:] for t in lane._pool._threads)]
    assert threads and not any(t.is_alive() for t in threads)
    assert not list(tmp_path.glob("*/slide-io-*")), "closing the engine removes the tiers' files"


def test_an_engine_whose_step_failed_before_its_disk_updates_ran_still_closes(tmp_path):
    """A backward that fails after the moments' reads were queued but before any update was: the third read
    waits for the first unit's write-back, which never comes. Closing calls those updates off instead of
    waiting for them."""
    import threading

    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=None,
                                                                    nvme_fraction=0.75, nvme_dir=str(tmp_path))
    assert len(engine.on_disk) == 3 and len(engine.disk.slots) == 2
    send = engine.homes.send
    engine.homes.send = lambda unit, seat, made: (_ for _ in ()).throw(RuntimeError("backward broke"))
    with pytest.raises(RuntimeError, match="backward broke"):
        engine.step(batches(seed=4, steps=1, micro=2)[0], lr=1e-2, normalizer=10)
    engine.homes.send = send
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive(), "close hung on a read waiting for an update that never ran"


def test_a_step_after_one_that_failed_before_its_disk_updates_ran_gives_the_right_result(tmp_path):
    """Unclipped, a backward that fails after one block's update was queued: the reads fetched for the others
    are called off, so the next step neither waits for them forever nor steps from them; it continues as an
    engine with every state in memory does after the same failure."""
    import threading

    results = []
    for nvme in (0.0, 0.75):
        torch.manual_seed(0)
        engine = make_engine(ToyStack(Model(tied=True)),
            device="cpu", window=2, max_grad_norm=None, nvme_fraction=nvme, nvme_dir=str(tmp_path))
        send, sent = engine.homes.send, []

        def fail_second(unit, seat, made, send=send, sent=sent):
            sent.append(unit)
            if len(sent) == 2:
                raise RuntimeError("backward broke")
            return send(unit, seat, made)

        engine.homes.send = fail_second
        data = batches(seed=4, steps=3, micro=2)
        with pytest.raises(RuntimeError, match="backward broke"):
            engine.step(data[0], lr=1e-2, normalizer=10)
        engine.homes.send = send
        losses = []
        stepper = threading.Thread(target=lambda engine=engine, losses=losses, data=data: losses.extend(
            engine.step(step, lr=1e-2, normalizer=10).loss for step in data[1:]), daemon=True)
        stepper.start()
        stepper.join(timeout=60)
        assert not stepper.is_alive(), "the step after the failed one hung"
        results.append((losses, {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}))
        engine.close()
    (ref_losses, ref), (losses, got) = results
    assert losses == ref_losses and len(losses) == 2
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())


@pytest.mark.parametrize("clip", [0.05, None])
def test_moments_on_disk_beside_pooled_and_held_gradients(tmp_path, monkeypatch, clip):
    """The disk tier beside held host gradients sharing the activations' memory and gradients kept on the device
    for device updates: bit for bit the synchronous engine with every state in memory."""
    monkeypatch.setattr(placement_module, "STREAM_PIECE", 64)
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=clip, device_share=1.0, held=1, shared=True)
    losses, got = run_engine(pipeline=True, window=2, clip=clip, device_share=1.0, held=1, shared=True,
                             delays={"updater": 0.004}, nvme=(0.5, tmp_path))
    assert losses == ref_losses
    assert all(got[u][n].equal(t) for u, params in ref.items() for n, t in params.items())



@pytest.mark.parametrize("placement", [{}, {"device_share": 0.5}, {"resident": 2}, {"shared": True},
                                       {"window": 3, "held": 1, "device_share": 1.0}])
@pytest.mark.parametrize("slow", [None, "updater", "d2h"])
def test_clipping_that_never_acts_gives_the_unclipped_result_bit_for_bit(placement, slow):
    """Under the limit torch's clip multiplies by exactly 1: a clipped step that does not act (updates held for
    the norm, split, run in the next forward) leaves the weights an unclipped step leaves (updates in backward)."""
    placement = dict(placement)
    window = placement.pop("window", 2)
    delays = {slow: 0.003} if slow else None
    clipped_losses, clipped = run_engine(pipeline=True, window=window, clip=1e6, delays=delays, **placement)
    losses, unclipped = run_engine(pipeline=True, window=window, clip=None, delays=delays, **placement)
    assert clipped_losses == losses
    assert all(clipped[u][n].equal(t) for u, params in unclipped.items() for n, t in params.items())
