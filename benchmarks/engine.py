"""Engine benchmark: slide-train's engine vs the plain GPU-resident HF peer, random-init HF shapes, bf16.

    python benchmarks/engine.py --model llama-3.2-1b --seq 2048 --micro 1 --accum 4 --cap 24 --peer plain

Writes one JSON (commit, date, device, config, figures) to --out (default benchmarks/results/). The peer runs
first without a cap (as in ANCHORS.md); then the process is capped with set_per_process_memory_fraction and our
engine runs. TFLOP/s count 6·N·T (no recompute), as the peers' figures do.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import threading
import time

import common
import torch
from common import ROOT


def random_batches(vocab: int, micro: int, seq: int, accum: int, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (micro, seq), generator=g) for _ in range(accum)] for _ in range(steps)]


def run_plain_peer(args, hf_config) -> dict:
    """HF model on the GPU: fp32 weights, bf16 autocast, activation checkpointing, fused AdamW."""
    import transformers

    torch.manual_seed(0)
    hf_config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(hf_config).cuda()
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    n_params = sum(p.numel() for p in model.parameters())
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in random_batches(hf_config.vocab_size, args.micro, args.seq, args.accum, args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for ids in step:
            ids = ids.cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / args.accum
            loss.backward()
        if args.clip != "none":
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(args.clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    tokens = args.micro * args.seq * args.accum
    step_s = statistics.median(times[args.warmup :])
    out = {"system": "plain GPU-resident (HF, fp32 weights + bf16 autocast, activation checkpointing, fused AdamW)",
           "cap_gib": None, "step_s": step_s, "tokens_per_s": tokens / step_s,
           "tflops": 6 * n_params * tokens / step_s / 1e12, "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def alloc_conf(device: str) -> str | None:
    """The CUDA allocator's settings for slide's run (the peer's, before it, are the allocator's defaults)."""
    from slide_train.trainer import ALLOC_CONF, ALLOC_ENV

    if device != "cuda":
        return None
    for key in ALLOC_ENV:
        if key in os.environ:
            return f"{key}={os.environ[key]}"
    return f"{ALLOC_CONF} (slide-train's default)"


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each of this process's threads, by native thread id (Linux)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_by_role(before: dict[int, float], after: dict[int, float], roles: dict[str, int]) -> dict[str, float]:
    """CPU seconds spent between two `thread_cpu()` readings: by the named threads, and by all others together
    (torch's intra-op workers, the CUDA driver's threads), with the busiest of those and how many there are."""
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    named = {role: spent.pop(tid, 0.0) for role, tid in roles.items()}
    return {**{f"{role}_cpu_s": s for role, s in named.items()}, "other_cpu_s": sum(spent.values()),
            "busiest_other_cpu_s": max(spent.values(), default=0.0), "other_threads": len(spent)}


def run_slide(args) -> dict:
    from slide_train.config import load_config
    from slide_train.trainer import Trainer

    overrides = [f"--model={args.model}", f"--seq_len={args.seq}", f"--micro_batch_size={args.micro}",
                 f"--grad_accum={args.accum}", f"--steps={args.warmup + args.steps}", f"--engine.device={args.device}",
                 f"--engine.window={'null' if args.window is None else args.window}", "--export=false",
                 "--data.pack=true",
                 f"--output_dir={args.run_dir}", "--overwrite=true", "--checkpoint.keep=0",  # fresh, no checkpoint
                 "--profile=false",  # the last step's profile is written after the timed steps (below)
                 f"--engine.pipeline={str(bool(args.pipeline)).lower()}", f"--optimizer.lr={args.lr}"]
    if args.clip != "1.0":
        overrides.append(f"--max_grad_norm={'null' if args.clip == 'none' else args.clip}")
    if args.resident is not None:
        overrides.append(f"--engine.resident={args.resident}")
    if args.device_share is not None:
        overrides.append(f"--engine.device_update_share={args.device_share}")
    if args.cap:
        overrides.append(f"--engine.gpu_memory_limit_gb={args.cap}")
    if not args.split:
        overrides.append("--engine.split_update=false")
    if args.share_acts is not None:
        overrides.append(f"--engine.grads_share_activations={str(bool(args.share_acts)).lower()}")
    if args.states != "fp32":
        overrides.append(f"--engine.states_dtype={args.states}")
    if args.nvme:  # (in <run-dir>/optimizer-states)
        overrides.append(f"--engine.optimizer_offload.nvme_fraction={args.nvme}")
    if args.acts != "cpu":  # (nvme: in <run-dir>/activations)
        overrides.append(f"--engine.activation_offload={args.acts}")
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if args.threads:  # before the optimizer thread starts: it takes torch's count then
        torch.set_num_threads(args.threads)
    if args.stream_buffers:  # (the planner reads the engine's count)
        import slide_scheduler.engine

        slide_scheduler.engine.STREAM_BUFFERS = args.stream_buffers
    if args.host_block:
        from slide_memory import adamw

        adamw.BLOCK_PER_THREAD = args.host_block
    t0 = time.perf_counter()
    trainer = Trainer(load_config(None, overrides), progress=False)
    setup_s = time.perf_counter() - t0
    roles = {"training": threading.main_thread().native_id}
    if (worker := getattr(trainer.engine.updater, "_thread", None)) is not None:  # (none when synchronous)
        roles["optimizer"] = worker.native_id
    # Written between steps, a profile would give the next step's clipped updates a head start (and the trace
    # and PNG take a second of Python): the last step's is written once every step is timed.
    step, last = trainer.engine.step, {}

    def step_and_keep(*a, **kw):
        last["stats"] = step(*a, **kw)
        return last["stats"]

    trainer.engine.step = step_and_keep
    records = []
    for _ in range(args.warmup + args.steps):
        before, start = thread_cpu(), time.perf_counter()
        records.append(trainer.step())  # (the CPU seconds include the trainer's own work around the engine step)
        records[-1].update(cpu_by_role(before, thread_cpu(), roles), trainer_step_s=time.perf_counter() - start)
    timed = records[args.warmup :]
    # The trainer's whole step (from 2026-11-30; before, the engine's step alone, which left out 25-70 ms per step
    # of data preparation and timeline reading: `trainer_step_s` in cpu_per_step_s shows it)
    step_s = statistics.median(r["step_s"] for r in timed)
    tokens = statistics.median(r["tokens"] for r in timed)
    timeline = {k: statistics.median(r[k] for r in timed if k in r)
                for k in ("gpu_busy_s", "exposed_s", "exposed_update_s", "exposed_transfer_s", "copy_busy_s",
                          "land_busy_s", "update_busy_s", "wait_update_s", "engine_step_s", "outside_engine_s")}
    memory = [{k: r.get(k) for k in ("allocated_bytes_at_start", "alloc_retries", "cuda_mallocs")} for r in records]
    cpu = {k: statistics.median(r[k] for r in timed)
           for k in ("trainer_step_s", "training_cpu_s", "optimizer_cpu_s", "other_cpu_s", "busiest_other_cpu_s",
                     "other_threads") if k in timed[0]}
    trainer.write_profile(last["stats"])
    for name in ("timeline.png", "trace.json"):
        src = pathlib.Path(args.run_dir) / name
        if src.is_file():
            (pathlib.Path(args.out) / f"{args.tag or 'run'}-{name}").write_bytes(src.read_bytes())
    trainer.close()
    share = "" if args.device_share is None else f", device_update_share {args.device_share}"
    share += "" if args.split else ", whole updates"
    share += "" if args.states == "fp32" else f", {args.states} states"
    share += f", {args.threads} torch threads" if args.threads else ""
    share += f", host block {args.host_block}/thread" if args.host_block else ""
    share += f", {args.stream_buffers} device-update buffers" if args.stream_buffers else ""
    pool = trainer.engine.pool
    share += f", gradients sharing the activations' memory ({pool.nbytes / 2**30:.1f} GiB)" if pool else ""
    return {"system": f"slide ({'pipelined' if args.pipeline else 'synchronous'} engine, clip {args.clip}{share})",
            "cap_gib": args.cap,
            # whether the run's held gradients shared the activations' memory (--share-acts left to slide-train)
            "pool_gib": pool.nbytes / 2**30 if pool else 0.0,
            "setup_s": setup_s, "step_s": step_s, "plan": trainer.memory_plan.text(),
            "window": trainer.memory_plan.window,
            # exposed: in the engine's step, GPU idle waiting for transfers and updates; outside: the rest of the
            # trainer's step (the GPU idles then too)
            "exposed_fraction": timeline["exposed_s"] / step_s,
            "outside_engine_fraction": timeline.get("outside_engine_s", 0.0) / step_s,
            "timeline_s": timeline, "memory_per_step": memory,
            # every step, warm-up included (a machine whose host stalls shows it in one step, not in the median)
            "step_s_each": [round(r["step_s"], 3) for r in records],
            "exposed_s_each": [round(r["exposed_s"], 3) for r in records if "exposed_s" in r],
            "torch_threads": torch.get_num_threads(), "cpu_per_step_s": cpu,
            "tokens_per_s": tokens / step_s, "tflops": 6 * trainer.num_params * tokens / step_s / 1e12,
            "gpu_peak_gib": max(r["gpu_peak_gib"] for r in records),
            "host_rss_gib": max(r["host_rss_gib"] for r in records),
            "losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records],
            "num_params": trainer.num_params}


def scheduler_src() -> str:
    """Where slide_scheduler was imported from, relative to the checkout (run_gpu.sh compare swaps it)."""
    import slide_scheduler

    path = pathlib.Path(slide_scheduler.__file__).resolve().parents[1]
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--window", type=int, default=None, help="engine.window (default: the planner's choice)")
    p.add_argument("--cap", type=float, default=24.0)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (with --peer none)")
    p.add_argument("--peer", choices=["plain", "none"], default="plain")
    p.add_argument("--clip", default="1.0", help="max_grad_norm, or 'none' to train without clipping")
    p.add_argument("--resident", type=int, default=None, help="override the planner (units resident on the GPU)")
    p.add_argument("--pipeline", type=int, default=1, help="0: the synchronous reference schedule")
    p.add_argument("--device-share", type=float, default=None,
                   help="engine.device_update_share (clipped updates streamed through the GPU); default: auto")
    p.add_argument("--states", choices=["fp32", "bf16"], default="fp32", help="engine.states_dtype (AdamW m and v)")
    p.add_argument("--nvme", type=float, default=0.0,
                   help="engine.optimizer_offload.nvme_fraction (AdamW m, v of that share of sliding blocks on disk)")
    p.add_argument("--acts", choices=["none", "cpu", "nvme"], default="cpu",
                   help="engine.activation_offload (nvme: the boundary activations in files under --run-dir)")
    p.add_argument("--split", type=int, default=1, help="0: engine.split_update=false (whole clipped updates)")
    p.add_argument("--share-acts", type=int, default=None,
                   help="engine.grads_share_activations: 1 shares clipped host gradients' memory with the "
                        "activations, 0 never (default: slide-train's: on with clipping, offloaded activations and "
                        "sliding blocks)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads before the engine (0: leave it)")
    p.add_argument("--host-block", type=int, default=0,
                   help="slide_memory.adamw.BLOCK_PER_THREAD (host AdamW elements per thread per call; 0: default)")
    p.add_argument("--stream-buffers", type=int, default=0,
                   help="slide_scheduler.engine.STREAM_BUFFERS, device-update buffers (0: the default)")
    p.add_argument("--lr", type=float, default=1e-5,
                   help="both systems (runs before 2026-11-29 13:00 trained ours at the config default 1e-3)")
    p.add_argument("--tag", default="")
    p.add_argument("--run-dir", default="/tmp/slide-bench-run",
                   help="scratch run directory: its earlier outputs (metrics, checkpoints, export) are deleted")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    if args.stream_buffers < 0:
        p.error("--stream-buffers must be 1 or more (0: the engine's default)")

    from slide_train.models.presets import preset_config

    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    results = []
    if args.peer == "plain":
        results.append(run_plain_peer(args, preset_config(args.model)))
        print(json.dumps(results[-1]), flush=True)
    results.append(run_slide(args))
    print(json.dumps({k: v for k, v in results[-1].items() if k not in ("losses", "grad_norms")}), flush=True)
    record = {
        **common.header("engine"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
        "config": {"model": args.model, "seq": args.seq, "micro": args.micro, "accum": args.accum,
                   "tokens_per_step": args.seq * args.micro * args.accum, "steps_timed": args.steps,
                   "warmup": args.warmup, "window": args.window, "cap_gib": args.cap, "max_grad_norm": args.clip,
                   "device_update_share": args.device_share, "split_update": bool(args.split), "lr": args.lr,
                   "grads_share_activations": args.share_acts, "nvme_fraction": args.nvme,
                   "activation_offload": args.acts,
                   "alloc_conf": alloc_conf(args.device), "scheduler_src": scheduler_src()},
        "results": results,
    }
    out = pathlib.Path(args.out)
    name = f"engine-{args.model}-{args.tag or 'run'}-{record['commit'][:7]}.json"
    (out / name).write_text(json.dumps(record, indent=2))
    print(f"wrote {out / name}")
    for r in results:
        print(f"{r['system'][:40]:40s} {r['tokens_per_s']:>10,.0f} tok/s {r['tflops']:7.1f} TFLOP/s "
              f"{r['gpu_peak_gib']:6.1f} GiB {[round(g, 3) for g in r.get('grad_norms', [])]}")


if __name__ == "__main__":
    main()
