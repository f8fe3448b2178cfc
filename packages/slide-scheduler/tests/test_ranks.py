"""Data-parallel ranks (gloo, one process per rank) against one process and against plain PyTorch."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from test_engine import Model, batches

WORKER = pathlib.Path(__file__).with_name("ranks_worker.py")


def run_ranks(tmp_path: pathlib.Path, world: int, **spec) -> dict:
    """Run the toy stack's engine in `world` processes; what rank 0 saw."""
    spec = {"clip": 0.05, "pipeline": True, "steps": 3, "micro": 4, **spec,
            "out": str(tmp_path / f"ranks-{world}-{len(list(tmp_path.iterdir()))}.pt")}
    init = f"file://{tmp_path / f'rendezvous-{len(list(tmp_path.iterdir()))}'}"
    env = {**os.environ, "SLIDE_TEST_INIT": init, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out}"
    return torch.load(spec["out"], weights_only=True)


def plain_pytorch(clip, steps: int = 3, micro: int = 4):
    """The same model trained by torch: every micro-batch of a step, one AdamW step, global clipping."""
    torch.manual_seed(0)
    model = Model(tied=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)  # (the engine's)
    norms = []
    for step in batches(seed=1, steps=steps, micro=micro):
        n = sum(int((b["targets"] != -100).sum()) for b in step)
        opt.zero_grad()
        sum(model(b, n) for b in step).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))))
        opt.step()
    return model, norms


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return float((a - b).norm()) <= rel * float(b.norm()) + 1e-12


@pytest.mark.parametrize("pipeline, delays", [(False, {}), (True, {}), (True, {"land": 0.003, "d2h": 0.003})])
def test_two_ranks_train_as_one_process_and_as_plain_pytorch(tmp_path, pipeline, delays):
    """Clipping acts in every step (norms far above 0.05): the reduce-scattered gradients, the shards' updates
    and the gathers give one process's weights, and torch's."""
    one = run_ranks(tmp_path, 1, pipeline=pipeline)
    two = run_ranks(tmp_path, 2, pipeline=pipeline, delays=delays)
    ref, ref_norms = plain_pytorch(0.05)
    assert min(ref_norms) > 0.05  # the clip acted
    for a, b, c in zip(two["norms"], one["norms"], ref_norms):
        assert a == pytest.approx(b, rel=2e-5) and a == pytest.approx(c, rel=2e-5)
    assert two["losses"] == pytest.approx(one["losses"], rel=2e-5)
    params = {"edges": dict(ref.edges.named_parameters())} | {
        f"block.{i}": dict(b.named_parameters()) for i, b in enumerate(ref.blocks)}
    for unit, named in two["masters"].items():
        for name, t in named.items():
            assert close(t, one["masters"][unit][name], 2e-5), f"{unit}.{name} vs one process"
            assert close(t, params[unit][name].detach(), 2e-5), f"{unit}.{name} vs torch"


def test_each_rank_holds_half_of_the_masters_and_moments(tmp_path):
    one = run_ranks(tmp_path, 1, steps=1, micro=2)
    two = run_ranks(tmp_path, 2, steps=1, micro=2)
    assert two["held_bytes"] * 2 == one["held_bytes"]
    for a, b in zip(two["states"], one["states"]):  # the gathered states are the whole unit's, as one process's
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].shape == b[k].shape


def test_speculation_across_two_ranks_is_bitwise_the_run_without_it(tmp_path):
    """Clip at 3.8 with norms near it: steps whose clipping acts and steps where it does not, in one run. Each
    rank speculates its shards' updates during the backward and keeps or discards them by the global norm: the
    weights and AdamW states are those of the same two ranks without speculation, bit for bit."""
    plain = run_ranks(tmp_path, 2, clip=3.8, steps=5)
    spec = run_ranks(tmp_path, 2, clip=3.8, steps=5, speculate=True, delays={"updater": 0.003, "h2d": 0.002})
    assert {"held", "discarded"} <= set(spec["speculation"]), spec["speculation"]
    assert spec["losses"] == plain["losses"] and spec["norms"] == plain["norms"]
    for unit, named in plain["masters"].items():
        for name, t in named.items():
            assert spec["masters"][unit][name].equal(t), f"{unit}.{name}"
    for a, b in zip(spec["states"], plain["states"]):
        assert all(a[k].equal(b[k]) for k in b)
