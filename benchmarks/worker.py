"""One measurement in a process of its own: run.py starts this once per system and clip mode, so one system's
memory (host or GPU) never shapes another's figures.

    python benchmarks/worker.py SPEC.json RESULT.json

SPEC's `job` is `slide`, `plain`, `liger` (training), `series` (Slide runs in turn, `runs`), `profile` (a Slide
step under torch.profiler), `io`, `probe` or `gpu_rates`; RESULT gets the figures, or a `status` other than "ok"
with the reason.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import statistics
import sys
import time
import traceback
import warnings

import common  # (first: puts the packages on the path)
import torch

GIB = 2**30
# The engine timeline's figures a suite keeps (medians over timed steps): where a step's time went
TIMELINE = ("gpu_busy_s", "exposed_update_s", "exposed_transfer_s", "copy_busy_s", "update_busy_s", "disk_busy_s",
            "wait_update_s")


def host_pressure() -> tuple[float, int]:
    """The host's available memory (GiB) and its count of major page faults so far: a host short of memory
    reads evicted library pages back from disk, and every lane slows."""
    try:
        meminfo = pathlib.Path("/proc/meminfo").read_text()
        available = int(next(ln.split()[1] for ln in meminfo.splitlines() if ln.startswith("MemAvailable:")))
        vmstat = pathlib.Path("/proc/vmstat").read_text()
        faults = int(next(ln.split()[1] for ln in vmstat.splitlines() if ln.startswith("pgmajfault ")))
        return available / 2**20, faults
    except (OSError, StopIteration, ValueError):  # (not Linux)
        return float("nan"), 0


def clip_value(mode: str) -> float | None:
    return None if mode == "none" else float(mode)


def read_rows(path: str) -> list[torch.Tensor]:
    """The random-token rows of the data file every system of a suite trains on."""
    with open(path) as f:
        return [torch.tensor(json.loads(line)["input_ids"]) for line in f if line.strip()]


def packed_rows(documents: list[torch.Tensor], seq_len: int) -> list[dict[str, torch.Tensor]]:
    """Documents laid end to end into rows of seq_len (a document that does not fit goes on in the next row),
    with position ids that restart at every document and row start, and no label on a document's first token
    (it would be predicted from the previous document). HF attention keeps to each document from the ids."""
    ids = torch.cat(documents)
    positions = torch.cat([torch.arange(len(d)) for d in documents])
    labels = ids.clone()
    labels[positions == 0] = -100
    rows = []
    for start in range(0, len(ids) - seq_len + 1, seq_len):
        pos = positions[start:start + seq_len].clone()
        if pos[0] != 0:  # a document cut at the row's start goes on from position 0 here
            first = int((pos == 0).nonzero()[0]) if bool((pos == 0).any()) else seq_len
            pos[:first] = torch.arange(first)
        row_labels = labels[start:start + seq_len].clone()
        row_labels[0] = -100
        rows.append({"input_ids": ids[start:start + seq_len], "position_ids": pos, "labels": row_labels})
    return rows


def summary(records: list[dict], warmup: int, tokens: int, num_params: int, active: int | None = None,
            attention: float | None = None) -> dict:
    """Median figures over the timed steps (the warm-up steps are kept in the per-step lists only); TFLOP/s
    count the `active` parameters a token computes with (a mixture of experts' routed experts), by default all;
    `tflops_attn` adds causal attention's work: Slide's steps count it, a peer's from `attention` (FLOPs a token)."""
    timed = records[warmup:]
    step_s = statistics.median(r["step_s"] for r in timed)
    flops = 6 * (active or num_params) * tokens
    # (Slide's steps also count causal attention's work: the same TFLOPs per step at the median step time)
    attn = {"tflops_attn": timed[0]["tflops_attn"] * timed[0]["step_s"] / step_s} if "tflops_attn" in timed[0] else {}
    if attention is not None:
        attn = {"tflops_attn": (flops + attention * tokens) / step_s / 1e12}
    return {"step_s": step_s, "tokens_per_s": tokens / step_s, "tflops": flops / step_s / 1e12, **attn,
            "gpu_peak_gib": max(r.get("gpu_peak_gib", 0.0) for r in records),
            "host_rss_gib": max(r["host_rss_gib"] for r in records),
            "num_params": num_params, "tokens_per_step": tokens,
            "step_s_each": [round(r["step_s"], 4) for r in records],
            "losses": [round(r["loss"], 5) for r in records],
            "grad_norms": [None if r["grad_norm"] is None else round(r["grad_norm"], 5) for r in records]}


def slide_args(spec: dict) -> list[str]:
    """The run's slide-train overrides, only keys every version of it accepts (the baseline too)."""
    clip = clip_value(spec["mode"])
    overrides = [f"--model={spec['model']}", f"--seq_len={spec['seq_len']}",
                 f"--micro_batch_size={spec['micro_batch_size']}", f"--grad_accum={spec['grad_accum']}",
                 f"--steps={spec['warmup'] + spec['steps']}", f"--max_grad_norm={'null' if clip is None else clip}",
                 f"--engine.device={spec['device']}", "--checkpoint.keep=0", "--export=false",
                 f"--output_dir={spec['run_dir']}", f"--data.path={spec['data']}", "--data.format=tokens",
                 f"--data.pack={'true' if spec.get('pack') else 'false'}", "--data.shuffle=false",
                 f"--seed={spec.get('seed', 0)}"]
    if spec.get("cap_gib"):
        overrides.append(f"--engine.gpu_memory_limit_gb={spec['cap_gib']}")
    # (and the suite's own settings, such as bf16 states for a model the host cannot hold)
    return overrides + list(spec.get("extra", []))


def slide_trainer(spec: dict, extra: tuple[str, ...] = ()):
    """slide-train's Trainer of `slide_args(spec)` and `extra`."""
    from slide_train.config import load_config
    from slide_train.trainer import Trainer

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="checkpoint.keep=0")  # a benchmark wants no checkpoint
        return Trainer(load_config(None, [*slide_args(spec), *extra]), progress=False)


def run_slide(spec: dict) -> dict:
    """Slide's figures over the spec's warm-up and timed steps."""
    import slide_train

    trainer = slide_trainer(spec)
    try:
        records = []
        ranks = rank_figures(trainer)  # (before the first step: what the run holds once built)
        for _ in range(spec["warmup"] + spec["steps"]):  # (a line a step: a slow run shows where it is)
            before = host_pressure()[1]
            records.append(trainer.step())
            r = records[-1]
            r["host_available_gib"], faults = host_pressure()
            r["major_faults"] = faults - before
            print(f"step {r['step']}: {r['step_s']:.2f} s, loss {r['loss']:.4f}, host RSS {r['host_rss_gib']:.1f} GiB"
                  + (f", disk read {r['disk_read_gb']:.1f} GB, written {r['disk_written_gb']:.1f} GB"
                     if r.get("disk_read_gb") else ""), flush=True)
        ranks = rank_figures(trainer, ranks)
    finally:
        trainer.close()
    timed = records[spec["warmup"]:]
    tokens = statistics.median(r["tokens"] for r in timed)
    out = summary(records, spec["warmup"], tokens, trainer.num_params, getattr(trainer, "active_params", None))
    # Exposed: GPU idle inside the engine's step, waiting for transfers or updates (the timeline's figure).
    if all("exposed_s" in r for r in timed):
        out["exposed_share"] = statistics.median(r["exposed_s"] / r["step_s"] for r in timed)
    else:
        out["exposed_share"] = None
    out["timeline_s"] = {key: round(statistics.median(r[key] for r in timed), 3) for key in TIMELINE
                         if all(key in r for r in timed)} or None
    out["host_available_gib_min"] = round(min(r["host_available_gib"] for r in records), 2)
    out["major_faults_per_step"] = statistics.median(r["major_faults"] for r in timed)
    out["speculation"] = sorted({r["speculation"] for r in timed if "speculation" in r}) or None
    # A mixture of experts: each timed step's least and most loaded expert, as multiples of an even share
    out["expert_load"] = [[round(r["expert_load_min"], 3), round(r["expert_load_max"], 3)] for r in timed] \
        if timed and all("expert_load_min" in r for r in timed) else None
    # The NVMe tier: how its store moves bytes, and the bytes a timed step moved (an older version has no tier)
    stores = getattr(trainer.engine, "disk_stores", lambda: [])()
    out["disk_path"] = ", ".join(sorted({f"{s.path}{'' if s.direct else ' (page cache)'}" for s in stores})) or None
    for key in ("disk_read_gb", "disk_written_gb"):
        moved = [r[key] for r in timed if key in r]
        out[key] = statistics.median(moved) if stores and moved else None
    predicted = [r["predicted_step_s"] for r in timed if r.get("predicted_step_s") is not None]
    out["predicted_step_s"] = statistics.median(predicted) if predicted else None
    plan = getattr(trainer, "memory_plan", None)
    estimate = getattr(plan, "estimate", None)  # (an older version's plan has none)
    out["predicted_bottleneck"] = getattr(estimate, "bottleneck", None)
    out["predicted_lanes_s"] = getattr(estimate, "lanes", None)
    if out["predicted_step_s"]:
        out["predicted_over_measured"] = out["predicted_step_s"] / out["step_s"]
    out["source"] = str(pathlib.Path(slide_train.__file__).resolve().parents[2])
    # What the plan was made of, so it can be made again elsewhere: the run's arguments and the machine's figures
    # (a probe's or a machine file's, the GPU's measured rates filled in)
    out["args"] = slide_args(spec)
    machine = getattr(trainer, "machine", None)
    out["machine"] = machine.to_dict() if hasattr(machine, "to_dict") else None
    if ranks:  # data-parallel: each rank's host bytes of masters and moments, and its PSS (shared pages split)
        out["per_rank"] = ranks
        out["state_bytes_total"] = sum(r["state_bytes"] for r in ranks)
    return out


def rank_figures(trainer, before: list[dict] | None = None) -> list[dict] | None:
    """Every rank's host bytes of masters and AdamW moments (the engine's tensors) and its PSS, on every rank;
    None for an engine without ranks (an older version)."""
    import torch.distributed as dist

    engine = trainer.engine
    if not hasattr(engine, "ranks"):
        return None
    state = sum(u.master.nbytes for u in engine.units if u.master is not None) + sum(
        t.nbytes for opt in engine.optimizer.units if opt is not None
        for t in (getattr(opt, "exp_avg", None), getattr(opt, "exp_avg_sq", None)) if t is not None)
    mine = {"rank": engine.ranks.rank, "state_bytes": state, "pss_gib": pss_gib(),
            "rss_gib": round(common.rss_gib(), 3)}
    if before is not None:
        mine["pss_gib_before_steps"] = before[engine.ranks.rank]["pss_gib"]
    if not engine.ranks.sharded:
        return [mine]
    every: list = [None] * engine.ranks.size
    dist.all_gather_object(every, mine, group=engine.ranks.host_group)
    return every


def pss_gib() -> float | None:
    """This process's proportional set size (shared pages split between the processes mapping them)."""
    try:
        for line in pathlib.Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return round(int(line.split()[1]) * 1024 / 2**30, 3)
    except OSError:
        pass
    return None


def active_params(model: str) -> int:
    """The parameters a token computes with, as slide-train's plan counts them (all of them but a mixture of
    experts' experts it is not routed to)."""
    from slide_train.launch import model_shapes
    from slide_train.models.build import load_model

    bundle = load_model(model, 0, need_tokenizer=False, need_weights=False)
    s = model_shapes(bundle, bundle.stack(kernels=False))
    return s.unit_numels[0] + sum(s.active(u) for u in range(1, s.num_blocks + 1))


def run_peer(spec: dict, liger: bool) -> dict:
    """An HF model trained GPU-resident: fp32 weights, bf16 autocast, activation checkpointing, fused AdamW."""
    import transformers

    from slide_train.models.build import load_model

    device = torch.device(spec["device"])
    if liger:
        model_type = load_model(spec["model"], 0, need_tokenizer=False).hf_config.model_type
        if model_type != "llama":  # (the patches applied below are Llama's)
            return {"status": "skipped",
                    "reason": f"this harness applies Liger-Kernel to Llama models, not to {model_type}"}
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except Exception as e:  # (a missing wheel, or one whose Triton does not load)
            return {"status": "skipped", "reason": f"liger_kernel is not importable: {type(e).__name__}: {e}"}
        if device.type != "cuda":
            return {"status": "skipped", "reason": "Liger-Kernel's Triton kernels need a GPU"}
        # Patches the Llama classes before the model is built: RMSNorm, RoPE, SwiGLU and the fused linear CE.
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True,
                                    cross_entropy=False)
    hf_config = load_model(spec["model"], spec.get("seed", 0), need_tokenizer=False).hf_config
    # Packed documents: on CUDA FlexAttention, whose block mask follows the documents (SDPA would need a dense
    # mask, as Slide's own attention does); on a CPU SDPA with the mask HF derives from the position ids.
    packed = bool(spec.get("pack"))
    hf_config._attn_implementation = "flex_attention" if packed and device.type == "cuda" else "sdpa"
    with torch.device("meta"):
        num_params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_config).parameters())
    if spec.get("peers_fit") is False:
        states = 16 * num_params / GIB
        return {"status": "does not fit", "num_params": num_params,
                "reason": f"fp32 weights, gradients and AdamW moments alone take 16 bytes/param = {states:.0f} GiB "
                          f"for {num_params / 1e9:.2f} B parameters, before activations and logits "
                          "(not run; pass --try-peers to try)"}
    torch.manual_seed(spec.get("seed", 0))
    model = transformers.AutoModelForCausalLM.from_config(hf_config).to(device)
    # (transformers renamed gradient checkpointing to activation checkpointing; both versions are met)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    clip = clip_value(spec["mode"])
    rows = read_rows(spec["data"])
    rows = packed_rows(rows, spec["seq_len"]) if packed else [{"input_ids": r, "labels": r} for r in rows]
    micro, accum = spec["micro_batch_size"], spec["grad_accum"]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    records, at = [], 0
    for _ in range(spec["warmup"] + spec["steps"]):
        batches = []
        for _ in range(accum):
            picked = [rows[(at + i) % len(rows)] for i in range(micro)]
            at += micro
            batches.append({k: torch.stack([r[k] for r in picked]) for k in picked[0]})
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        total = 0.0
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(**batch).loss / accum
            loss.backward()
            total += loss.detach()
        # Without clipping no norm is taken at all: that pass over every gradient is part of what clipping costs.
        norm = None if clip is None else float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        records.append({"step_s": time.perf_counter() - start, "loss": float(total), "grad_norm": norm,
                        "host_rss_gib": common.rss_gib(),
                        "gpu_peak_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else 0.0})
    return summary(records, spec["warmup"], micro * accum * spec["seq_len"], num_params, active_params(spec["model"]),
                   attention_flops(hf_config, spec["seq_len"]))


def attention_flops(hf_config, seq_len: int) -> float | None:
    """Causal attention's FLOPs a token, as slide-train's metrics count them (None: a version without the count)."""
    try:
        from slide_train.trainer import attention_flops_per_token
    except ImportError:
        return None
    return attention_flops_per_token(hf_config, seq_len)


def run_io(spec: dict) -> dict:
    """slide-io's disk store: write and read rates of tensors of the given sizes, bytes checked."""
    from slide_io import NVMeStore

    cuda = torch.cuda.is_available()
    out = {"sizes_mib": spec["sizes_mib"], "rounds": spec["rounds"], "disk_dir": spec["disk_dir"], "paths": []}
    for want in spec.get("paths", ("auto", "posix")):
        store = NVMeStore(spec["disk_dir"], path=want)
        if want == "posix" and out["paths"] and out["paths"][0]["path"] == "posix":
            store.close()
            break  # auto took the POSIX path already
        entry = {"want": want, "path": store.path, "reason": store.path_reason,
                 "o_direct": bool(getattr(store, "direct", False)), "sizes": []}
        try:
            for mib in spec["sizes_mib"]:
                n = mib * 2**20
                src = torch.randint(0, 256, (n,), dtype=torch.uint8)
                dst = torch.empty_like(src)
                if cuda:  # pinned, as the engine's staging buffers are
                    src, dst = src.pin_memory(), dst.pin_memory()
                writes, reads = [], []
                for r in range(spec["rounds"]):
                    key = f"t{mib}-{r}"
                    t0 = time.perf_counter()
                    store.write(key, src).result()
                    writes.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    store.read(key, dst).result()
                    reads.append(time.perf_counter() - t0)
                    store.delete(key)
                entry["sizes"].append({"mib": mib, "write_gbps": n / statistics.median(writes) / 1e9,
                                       "read_gbps": n / statistics.median(reads) / 1e9,
                                       "bytes_equal": bool(torch.equal(src, dst))})
            if spec.get("tier_gib"):
                entry["tier"] = tier_rates(store, spec["tier_gib"], cuda)
        finally:
            store.close()
        out["paths"].append(entry)
    return out


def tier_rates(store, tier_gib: float, cuda: bool, file_mib: int = 512) -> dict:
    """The disk as the NVMe tier uses it: a working set of `tier_gib` in files of a block's size, larger than
    any cache in front of the drive, written in one pass, read back in another, then each file read and written
    back in turn, as a step's updates do (GB/s: bytes moved over the pass's time)."""
    n = file_mib * 2**20
    files = max(1, round(tier_gib * 1024 / file_mib))
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8)
    buf = buf.pin_memory() if cuda else buf
    keys = [f"tier-{i}" for i in range(files)]
    t0 = time.perf_counter()
    for key in keys:
        store.write(key, buf).result()
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for key in keys:
        store.read(key, buf).result()
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for key in keys:
        store.read(key, buf).result()
        store.write(key, buf).result()
    turns_s = time.perf_counter() - t0
    other = torch.empty_like(buf)
    t0 = time.perf_counter()
    for i, key in enumerate(keys):  # a file read while the one before it is written: both directions at once
        pending = [store.read(key, buf if i % 2 else other)]
        if i:
            pending.append(store.write(keys[i - 1], other if i % 2 else buf))
        for future in pending:
            future.result()
    store.write(keys[-1], other if len(keys) % 2 else buf).result()  # (the buffer the last read filled)
    mixed_s = time.perf_counter() - t0
    for key in keys:
        store.delete(key)
    total = files * n
    return {"gib": total / 2**30, "file_mib": file_mib, "write_gbps": total / write_s / 1e9,
            "read_gbps": total / read_s / 1e9, "read_then_write_gbps": 2 * total / turns_s / 1e9,
            "read_while_write_gbps": 2 * total / mixed_s / 1e9,
            "reads_plus_writes_gbps": 2 * total / (read_s + write_s) / 1e9}  # (what the cost model assumes)


def run_probe(spec: dict) -> dict:
    try:
        from slide_scheduler import probe_machine as probe
    except ImportError as e:
        return {"status": "failed", "reason": f"slide_scheduler has no probe in this checkout ({e}): the probe "
                                              "suite needs a slide-scheduler that measures machines"}
    machine = probe(disk_dir=spec["disk_dir"])
    return {"machine": machine.to_dict()}


def run_gpu_rates(spec: dict) -> dict:
    """The GPU's rates alone (dense GEMMs, causal attention, a mixture's routed MLP), on a host that need not be
    fresh: the probe's GPU part."""
    import dataclasses

    from slide_scheduler import probe_gpu

    return {"gpu": dataclasses.asdict(probe_gpu(torch.device("cuda")))}


def run_series(spec: dict) -> dict:
    """Slide runs (`runs`, each a `slide` spec) in turn in this one process, so the imports, the CUDA context and
    compiled kernels are set up once; each run's figures or its failure, its wall time, and the host memory this
    process held before it (what the runs before it left)."""
    results = []
    for run in spec["runs"]:
        start, before = time.perf_counter(), common.rss_gib()
        result = attempt(run_slide, run)
        results.append({**result, "wall_s": round(time.perf_counter() - start, 1),
                        "host_rss_before_gib": round(before, 2)})
        gc.collect()  # (the next run gets back what this one cached: GPU blocks, pinned host blocks)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()
    return {"runs": results}


# What a profile keeps of the profiled step's metrics line: its time and the engine timeline's split of it
PROFILE_STEP = ("step", "step_s", "engine_step_s", "predicted_step_s", "tokens", "tflops", "gpu_busy_s", "exposed_s",
                *TIMELINE[1:])


def run_profile(spec: dict) -> dict:
    """One Slide step under torch.profiler after `warmup` steps, beside the engine's lane timeline of the same step
    (the trace.json a run with `profile` on writes of its step min(3, steps)): per-op device time (host time on a
    CPU), the `top` ops by their own time, and each lane's busy time."""
    from torch.profiler import ProfilerActivity, profile

    if spec["warmup"] > 2:
        raise ValueError("warmup: at most 2 (the trainer writes the lane timeline of step 3 at the latest)")
    trainer = slide_trainer({**spec, "steps": 1}, extra=("--profile=true",))
    try:
        for _ in range(spec["warmup"]):
            trainer.step()
        cuda = trainer.engine.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            record = trainer.step()
        if cuda:
            torch.cuda.synchronize()
    finally:
        trainer.close()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"  # (microseconds)
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:spec.get("top", 30)]
    ops = [{"name": e.key, "calls": e.count, "self_device_s": e.self_device_time_total / 1e6,
            "device_s": e.device_time_total / 1e6, "self_cpu_s": e.self_cpu_time_total / 1e6,
            "cpu_s": e.cpu_time_total / 1e6} for e in top]
    trace = json.loads((pathlib.Path(spec["run_dir"]) / "trace.json").read_text())
    return {"step": {k: record[k] for k in PROFILE_STEP if k in record},
            "ops_by": "self_device_s" if cuda else "self_cpu_s",
            "ops_total_s": sum(getattr(e, key) for e in events) / 1e6, "ops": ops,
            "ops_table": events.table(sort_by=key, row_limit=spec.get("top", 30)), "lanes": lane_busy(trace),
            "lane_trace": trace}


def lane_busy(trace: dict) -> dict[str, dict]:
    """Each lane of an engine trace (Chrome trace events): its spans, and the seconds it was busy (overlapping
    spans counted once)."""
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    lanes: dict[str, list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            lanes.setdefault(names[e["tid"]], []).append((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    out = {}
    for lane, spans in sorted(lanes.items()):
        busy, end = 0.0, float("-inf")
        for start, stop in sorted(spans):
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        out[lane] = {"spans": len(spans), "busy_s": busy}
    return out


def attempt(job, spec: dict) -> dict:
    """A job's result, or what stopped it (out of memory: "does not fit"; anything else: "failed")."""
    try:
        result = job(spec)
    except torch.OutOfMemoryError as e:
        result = {"status": "does not fit", "reason": f"out of GPU memory: {str(e).splitlines()[0]}"}
    except MemoryError as e:
        result = {"status": "does not fit", "reason": f"out of host memory: {e}"}
    except Exception as e:
        traceback.print_exc()
        result = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:2000]}
    result.setdefault("status", "ok")
    return result


def device_name(spec: dict) -> str:
    if spec.get("device", "cuda").startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def main() -> None:
    spec = json.loads(pathlib.Path(sys.argv[1]).read_text())
    if "register" in spec:  # a shape of the suite's own (the largest suite's)
        common.register_shape(spec["register"]["base"], spec["register"]["layers"])
    jobs = {"slide": run_slide, "plain": lambda s: run_peer(s, liger=False), "liger": lambda s: run_peer(s, True),
            "series": run_series, "profile": run_profile, "io": run_io, "probe": run_probe,
            "gpu_rates": run_gpu_rates}
    result = attempt(jobs[spec["job"]], spec)
    result["device"] = device_name(spec["runs"][0] if spec["job"] == "series" else spec)
    gc.collect()
    if os.environ.get("RANK", "0") == "0":  # (a data-parallel run's first rank speaks for all)
        pathlib.Path(sys.argv[2]).write_text(json.dumps(result, indent=1) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
