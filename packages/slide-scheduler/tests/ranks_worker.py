"""One rank of a data-parallel engine run on the toy stack (test_ranks.py starts one process per rank).

argv: a JSON spec (out, clip, pipeline, delays, steps, micro, speculate); the rendezvous comes from SLIDE_TEST_INIT and
RANK / WORLD_SIZE. Rank r runs micro-batches r, r + ranks, ... of each step; rank 0 writes what it saw to `out`.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_engine import Model, ToyStack, batches  # noqa: E402

from slide_memory import AdamWConfig  # noqa: E402
from slide_scheduler import EngineConfig, Ranks, SlidingEngine, StepShape, arrange, run_facts, shapes_of  # noqa: E402


def main(spec: dict) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", init_method=os.environ["SLIDE_TEST_INIT"], rank=int(os.environ["RANK"]),
                                world_size=world)
    ranks = Ranks()
    torch.manual_seed(0)
    model = Model(tied=spec.get("tied", True))
    config = EngineConfig(pipeline=spec["pipeline"],
                          optimizer=AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))
    stack = ToyStack(model)
    # Every unit sliding and updated on the host (what data parallelism runs), speculating where asked
    run = run_facts(device="cpu", max_grad_norm=spec["clip"], ranks=ranks.size)
    placement = arrange(shapes_of(stack, ranks=ranks.size), StepShape(0, 0), run, resident=(), window=2, share=0.0,
                        shared=False, held=0, speculate=bool(spec.get("speculate")))
    assert bool(placement.speculated) == bool(spec.get("speculate"))
    engine = SlidingEngine(stack, placement, config, ranks)
    for lane, seconds in spec.get("delays", {}).items():
        getattr(engine, lane).delay = seconds
    losses, norms, speculation = [], [], []
    for step in batches(seed=1, steps=spec["steps"], micro=spec["micro"]):
        n = sum(int((b["targets"] != -100).sum()) for b in step)  # the global step's targets
        stats = engine.step(step[ranks.rank::ranks.size], lr=1e-2, normalizer=n)
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
        speculation.append(stats.speculation)
    masters = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}
    held = sum(u.master.nbytes for u in engine.units) + sum(
        opt.exp_avg.nbytes + opt.exp_avg_sq.nbytes for opt in engine.optimizer.units if opt is not None)
    states = [engine.optimizer_state(u) for u in range(len(engine.units))]
    engine.close()
    if ranks.rank == 0:
        torch.save({"losses": losses, "norms": norms, "masters": masters, "held_bytes": held, "states": states,
                    "speculation": speculation}, spec["out"])
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
