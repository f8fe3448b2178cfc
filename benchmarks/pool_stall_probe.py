"""Where a 1-ulp difference comes from: the pool-replacement GPU test, with host copies stalled (GPU only).

The thirteenth session's variant of `test_shared_memory_replaced_on_cuda_keeps_the_gradients_its_queued_copies_read`
(page-locked-in-place pools, a GPU sleep queued on the h2d lane ahead of each step) differed from a gradient buffer
each by one ulp in one loss. This runs the same toy training in every combination of: gradients in the pool or a
buffer each, host memory from torch's pinned allocator or page-locked in place, a stall or none, each twice, and
compares every run's losses and masters with the unstalled buffer-each run. A difference that also shows between
two buffer-each runs, or between two identical runs, is the GPU's arithmetic, not the pool's ordering.

    python3 benchmarks/pool_stall_probe.py --out DIR [--deterministic]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "packages" / "slide-scheduler" / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms and a fixed cuBLAS workspace (set before CUDA starts)")
    parser.add_argument("--stall-ms", type=float, default=50.0)
    parser.add_argument("--lengths", default="10,400", help="sequence lengths of the short and the long steps "
                        "(800,1600: the failed variant's, whose pools are page-locked in place anyway)")
    args = parser.parse_args()
    if args.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    import torch
    from test_engine import VOCAB, Model, ToyStack

    import slide_memory.host
    from slide_memory import AdamWConfig
    from slide_scheduler import EngineConfig, SlidingEngine

    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    cycles = int(args.stall_ms * 2e6)  # torch.cuda._sleep counts GPU clock cycles (about 2 GHz)

    def data():
        g = torch.Generator().manual_seed(5)

        def step(micro, length):
            return [{"ids": torch.randint(0, VOCAB, (3, length), generator=g).cuda(),
                     "targets": torch.randint(0, VOCAB, (3, length), generator=g).cuda()} for _ in range(micro)]

        short, long = (int(x) for x in args.lengths.split(","))
        return [step(3, short), step(2, short), step(3, long), step(3, long), step(2, short)]

    def run(shared: bool, registered: bool, stall: bool):
        slide_memory.host.EXACT_PIN_BYTES = 0 if registered else 1 << 40
        torch.manual_seed(0)
        engine = SlidingEngine(ToyStack(Model(tied=True)), EngineConfig(
            device="cuda", compute_dtype="fp32", window=2, max_grad_norm=0.05, device_update_share=1.0,
            grads_share_activations=shared, split_update=False, optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1)))
        losses, pools = [], []
        for batch in data():
            if stall:
                with torch.cuda.stream(engine.h2d.stream):
                    torch.cuda._sleep(cycles)
            losses.append(engine.step(batch, lr=1e-2, normalizer=10).loss)
            pools.append(engine.pool.nbytes if engine.pool is not None else 0)
        masters = {f"{u}.{n}": t.clone() for u, v in engine.named_masters().items() for n, t in v.items()}
        engine.close()
        return losses, masters, pools

    results = []
    ref_losses, ref_masters, _ = run(False, False, False)
    for registered in (False, True):
        for stall in (False, True):
            for shared in (False, True):
                for repeat in range(2):
                    losses, masters, pools = run(shared, registered, stall)
                    diff = max(float((masters[k] - t).abs().max()) for k, t in ref_masters.items())
                    results.append({"shared": shared, "registered": registered, "stall": stall, "repeat": repeat,
                                    "losses": losses, "pool_bytes": pools,
                                    "losses_equal": losses == ref_losses,
                                    "loss_diffs": [a - b for a, b in zip(losses, ref_losses)],
                                    "masters_equal": all(masters[k].equal(t) for k, t in ref_masters.items()),
                                    "max_master_diff": diff})
                    print(json.dumps({k: v for k, v in results[-1].items() if k not in ("losses", "pool_bytes")}))
    name = f"pool-stall-probe-{args.lengths.replace(',', '-')}" + ("-deterministic" if args.deterministic else "")
    pathlib.Path(args.out, name + ".json").write_text(json.dumps(
        {"lengths": args.lengths, "reference_losses": ref_losses, "deterministic": args.deterministic,
         "stall_ms": args.stall_ms, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
         "runs": results}, indent=1))


if __name__ == "__main__":
    main()
