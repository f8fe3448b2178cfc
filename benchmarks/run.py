"""The benchmark suites: each writes one JSON, `<out>/<suite>.json`, the latest run (git keeps the history).

    python benchmarks/run.py b1 b3 b8 [--baseline DIR] [--steps 5] [--warmup 2]
    python benchmarks/run.py kernels io probe
    python benchmarks/run.py nvme largest    # the NVMe tier on a GPU machine; `plans` prices shapes on paper
    python benchmarks/run.py long --variants 8b-128k --modes 1.0   # long sequences, a part at a time
    python benchmarks/run.py tiny            # a CPU check of the harness itself (writes to a temp folder)

Training suites (b1, b3, b8, tiny) run Slide with clip 1.0, clip 1e6 (on, never acting) and no clipping, and the
peers (a plain GPU-resident HF run, and the same with Liger-Kernel), each system and mode in its own process;
`--baseline DIR` adds an older version's Slide (DIR/packages/*/src first on PYTHONPATH) per mode, run beside this
checkout's. This process never touches the GPU, so it holds none of its memory while the systems run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque

import common
import tables

HERE = pathlib.Path(__file__).resolve().parent

# The shapes of the three anchored benchmarks (random-init HF configs of slide-train's presets). The cap is the GPU
# memory Slide may use (a consumer card's size); the peers run uncapped.
TRAIN_SUITES = {
    # one micro-batch of 4 x 2048: the shape of the published peer figures for this model
    "b1": dict(model="llama-3.2-1b", seq_len=2048, micro_batch_size=4, grad_accum=1, cap_gib=24.0, device="cuda"),
    "b3": dict(model="llama-3.2-3b", seq_len=4096, micro_batch_size=2, grad_accum=4, cap_gib=24.0, device="cuda"),
    # fp32 weights + gradients + AdamW moments of 8B parameters (120 GiB) leave a 141 GB card no room to train
    "b8": dict(model="llama-3.1-8b", seq_len=4096, micro_batch_size=1, grad_accum=8, cap_gib=16.0, device="cuda",
               peers_fit=False),
    # few tokens per step under a small cap: the model predicts a step bound by host-to-device copies
    "pcie": dict(model="llama-3.2-3b", seq_len=1024, micro_batch_size=1, grad_accum=1, cap_gib=12.0, device="cuda",
                 peers_fit=False),
    # a mixture of experts (6.9B parameters, 1.3B active) at 32k and 256k tokens per step: every parameter crosses
    # PCIe and the host optimizer each step, and only the active ones compute
    "moe": dict(model="olmoe-1b-7b", seq_len=4096, micro_batch_size=1, grad_accum=8, cap_gib=24.0, device="cuda"),
    # three times the tokens per step: the parameters' traffic over PCIe and the host optimizer spread over more
    # compute (the byte floor of 32k tokens is the step's)
    "moe-96k": dict(model="olmoe-1b-7b", seq_len=4096, micro_batch_size=1, grad_accum=24, cap_gib=24.0,
                    device="cuda"),
    "moe-256k": dict(model="olmoe-1b-7b", seq_len=4096, micro_batch_size=1, grad_accum=64, cap_gib=24.0,
                     device="cuda"),
    # soft-capped attention (FlexAttention with the cap on CUDA); bf16 AdamW states, as the plan asks on a 125 GiB host
    "gemma2": dict(model="gemma-2-9b", seq_len=4096, micro_batch_size=1, grad_accum=8, cap_gib=24.0, device="cuda",
                   peers_fit=False, slide_args=("--engine.states_dtype=bf16",)),
    # Gemma 3's local layers (a window of 1,024) five to one global, head_dim 256, no soft-cap; bf16 AdamW states
    "gemma3": dict(model="gemma-3-12b", seq_len=4096, micro_batch_size=1, grad_accum=8, cap_gib=24.0, device="cuda",
                   peers_fit=False, slide_args=("--engine.states_dtype=bf16",)),
    # the harness itself on a CPU: the smallest preset, a step or two
    "tiny": dict(model="tiny-llama", seq_len=64, micro_batch_size=2, grad_accum=2, cap_gib=None, device="cpu",
                 warmup=1, steps=2),
}
# The NVMe tier against the same run in RAM, in one run: B3 with every sliding block's master and moments on disk
# (and with its clipped gradients there too),
# and B8 with the share `auto` picks on a machine file whose host has 64 GiB (each a separate Slide process).
NVME_RUNS = (("b3", "ram", (), None), ("b3", "disk", ("--engine.nvme.fraction=1",), None),
             # held gradients on disk too (clip 1.0): written in the backward, read back with the states
             ("b3", "disk-grads", ("--engine.nvme.fraction=1", "--engine.placement.disk_grads=true"), None),
             # the tier striped over two folders (one per drive where a host has two; `{work}`: the suite's folder)
             ("b3", "disk-two-folders", ("--engine.nvme.fraction=1", "--engine.nvme.dir=[{work}/drive-a, "
                                         "{work}/drive-b]"), None),
             ("b8", "ram", (), None), ("b8", "disk-auto-host-64gib", ("--engine.nvme.fraction=auto",), 64.0))
# The largest Llama-architecture shape the plan puts at LARGEST["step_limit_s"] or less with the disk tier: the
# widths of Llama 3.1 8B and 70B at any depth, fp32 or bf16 states; B8's tokens per step under a consumer card's cap.
LARGEST = dict(seq_len=4096, micro_batch_size=1, grad_accum=8, cap_gib=24.0, device="cuda", step_limit_s=40.0,
               widths=("llama-3.1-8b", "llama-3.1-70b"))
# The headline shapes planned on paper (no GPU, no weights): each model on each machine file, as a recipe has it
# (clip 1.0) and without clipping with the boundary activations on disk, engine.nvme.fraction auto throughout.
PLANS = dict(models=("llama-3.1-70b", "mistral-large-2"),
             machines=("docs/machines/rtx4090-pc.yaml", "docs/machines/rtx4090-pc-raid0.yaml"),
             settings={"clip 1.0": ("--max_grad_norm=1.0",),
                       "no clipping, activations on disk": ("--max_grad_norm=null",
                                                            "--engine.activation_offload=disk")},
             seq_len=4096, micro_batch_size=1, grad_accum=8)
# Long sequences under a consumer card's cap: Llama-3.1-8B at 4 x 32,768 and 1 x 131,072 tokens per step (the same
# tokens, only the row length differs) and at the longest rows the plan fits, Llama-3.2-3B at its longest; one
# warm-up and two timed steps each. Rows past a model's 131,072 positions run its -256k preset. A run is planned to
# fit one sitting: where the longest rows' predicted time would not (`sitting_s`: setup and every step, each step
# `margin` times its prediction, or as the 131,072-token run of the same mode measured it against its own), it runs
# the longest rows that do, and records both. The peer (GPU-resident HF + Liger-Kernel, uncapped) trains Llama-3.2-3B
# at `peer_lengths` until it runs out of memory; 8B's fp32 states alone outgrow any GPU (recorded, not run).
LONG = dict(cap_gib=24.0, device="cuda", warmup=1, steps=2, modes=("1.0", "none"), micro_batch_size=1,
            runs={"8b-32k": dict(model="llama-3.1-8b", seq_len=32768, grad_accum=4),
                  "8b-128k": dict(model="llama-3.1-8b", seq_len=131072, grad_accum=1),
                  "8b-longest": dict(model="llama-3.1-8b", seq_len=None, grad_accum=1),
                  "3b-longest": dict(model="llama-3.2-3b", seq_len=None, grad_accum=1, modes=("1.0",))},
            peer_model="llama-3.2-3b", peer_lengths=(16384, 32768, 65536, 98304, 131072), peer_mode="1.0",
            no_peer="llama-3.1-8b", positions=131072, long_suffix="-256k", sitting_s=480.0, setup_s=120.0,
            margin=2.0, granule=8192)
# Data parallel: a bench's shape (tokens per step and cap per GPU) on 1 and on 2 GPUs of one host, in one run.
DP = dict(bench="b8", ranks=(1, 2))
# The machine file given as $SLIDE_MACHINE when this process started (main may point it at a filled-in copy)
MACHINE_SOURCE: str | None = None
OTHER_SUITES = ("kernels", "attention", "io", "probe", "gpu-rates", "nvme", "largest", "plans", "dp2", "long")
# The GPU rates a machine file may lack (0: not measured), which gpu-rates.json of the same GPU fills in for planning
MEASURED_LATER = ("attention_tflops", "experts_tflops")
MODES = ("1.0", "1e6", "none")  # max_grad_norm: acting, on but never acting, off
SYSTEMS = {
    "slide": "Slide",
    "baseline": "Slide (baseline)",
    "slide-nospec": "Slide without speculative updates (engine.placement.speculate=false)",
    "slide-spec": "Slide asked to speculate (engine.placement.speculate=true)",
    "plain": "plain GPU-resident (HF, fp32 weights, bf16 autocast, activation checkpointing, fused AdamW)",
    "liger": "plain GPU-resident + Liger-Kernel (RMSNorm, RoPE, SwiGLU, fused linear CE)",
}


def random_rows(path: pathlib.Path, vocab: int, seq_len: int, rows: int, seed: int = 0) -> None:
    """jsonl rows of exactly seq_len uniform random token ids: Slide reads them as data format `tokens`, the peers
    read the same file."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": torch.randint(0, vocab, (seq_len,), generator=g).tolist()}) + "\n")


def baseline_pythonpath(base: pathlib.Path) -> str:
    srcs = sorted(str(p / "src") for p in (base / "packages").iterdir() if (p / "src").is_dir())
    if not srcs:
        raise SystemExit(f"--baseline {base}: no packages/*/src under it (make one with "
                         f"`git archive COMMIT packages | tar -x -C {base}`)")
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(srcs + ([rest] if rest else []))


def run_worker(spec: dict, work: pathlib.Path, name: str, timeout: float | None, pythonpath: str | None = None,
               quiet: bool = False, machine: pathlib.Path | None = None) -> dict:
    """Run worker.py on `spec` in a fresh process (`spec["ranks"]` processes started by torchrun); its output
    streams through, its result comes back (a crash or a timeout comes back as a `failed` result with the
    output's last lines)."""
    spec_path, result_path = work / f"{name}.spec.json", work / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    if machine is not None:  # the machine file the run plans for
        env["SLIDE_MACHINE"] = str(machine)
    tail: deque[str] = deque(maxlen=30)
    start = time.perf_counter()
    ranks = spec.get("ranks", 1)
    if ranks > 1:
        env["NCCL_NVLS_ENABLE"] = "0"  # (NVLink multicast can take a shared host's GPUs out of service)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    # (a process group of its own: a kill reaches torchrun's ranks too)
    proc = subprocess.Popen([*launch, str(HERE / "worker.py"), str(spec_path), str(result_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=common.ROOT,
                            start_new_session=True)
    timed_out = False
    try:
        for line in proc.stdout:
            tail.append(line.rstrip())
            if not quiet:
                print(f"    | {line.rstrip()}", flush=True)
            if timeout and time.perf_counter() - start > timeout:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    if result_path.is_file():
        result = json.loads(result_path.read_text())
    else:
        why = f"ran past --timeout {timeout:.0f} s" if timed_out else f"exited with status {proc.returncode}"
        result = {"status": "failed", "reason": f"the process {why}; its last lines: " + " / ".join(list(tail)[-8:])}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def planned_with() -> str:
    """The machine file this run's plans come from: $SLIDE_MACHINE as given (before this GPU's measured rates fill
    it in), else this host's probe."""
    source = MACHINE_SOURCE or os.environ.get("SLIDE_MACHINE")
    if not source:
        return "this host's probe"
    path = pathlib.Path(source).resolve()
    return str(path.relative_to(common.ROOT)) if path.is_relative_to(common.ROOT) else str(path)


def suite_doc(suite: str, config: dict, figures: list, device: str | None) -> dict:
    return {"suite": suite, "commit": common.git_commit(), "date": common.now(), "device": device,
            "host": common.host(), "versions": common.versions(), "machine_file": planned_with(), "config": config,
            "figures": figures}


# What a figure records of its own (its warm-up and timed steps): runs that differ only there merge into one file
PER_FIGURE = ("warmup", "steps")


def merge(old_path: pathlib.Path, doc: dict) -> dict:
    """A run of some systems or modes only replaces those entries of the suite's file, if its config matches."""
    if not old_path.is_file():
        return doc
    old = json.loads(old_path.read_text())

    def shared(config: dict | None) -> dict:
        return {k: v for k, v in (config or {}).items() if k not in PER_FIGURE}

    if shared(old.get("config")) != shared(doc["config"]):
        print(f"  {old_path} holds another config: replaced, not merged", flush=True)
        return doc
    def key(f: dict) -> tuple:
        return f["system"], f.get("mode"), f.get("bench"), f.get("variant")

    ran = {key(f) for f in doc["figures"]}
    kept = [f for f in old["figures"] if key(f) not in ran]
    for f in kept:  # (the tables name the commit of a figure from an earlier run, and what it planned with)
        f.setdefault("commit", old.get("commit"))
        f.setdefault("machine_file", old.get("machine_file"))
        for k in PER_FIGURE:
            f.setdefault(k, (old.get("config") or {}).get(k))
    doc["figures"] = kept + doc["figures"]
    return doc


# Documents of long-tailed lengths, as fine-tuning corpora have them: log-normal, median DOC_MEDIAN tokens, within
# [DOC_MIN, seq_len]; a fixed seed, so every system of a run and every run trains on the same documents.
DOC_MEDIAN, DOC_SIGMA, DOC_MIN = 600, 1.0, 64


def random_documents(path: pathlib.Path, vocab: int, seq_len: int, tokens: int, seed: int = 0) -> list[int]:
    """jsonl documents of random token ids (one per line, as data format `tokens` reads them) until `tokens`
    tokens; returns their lengths."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    with path.open("w") as f:
        while total < tokens:
            drawn = DOC_MEDIAN * math.exp(DOC_SIGMA * float(torch.randn(1, generator=g)))
            length = int(min(seq_len, max(DOC_MIN, drawn)))
            f.write(json.dumps({"input_ids": torch.randint(0, vocab, (length,), generator=g).tolist()}) + "\n")
            lengths.append(length)
            total += length
    return lengths


def run_train_suite(suite: str, args, work: pathlib.Path, out: pathlib.Path) -> dict:
    """Each system and mode in its own process. The figures so far are kept in `<out>/<suite>.partial.json`
    after each process, so a run stopped from outside keeps what it finished; the caller writes the suite's file
    and removes that one."""
    shape = dict(TRAIN_SUITES[suite])
    warmup = args.warmup if args.warmup is not None else shape.pop("warmup", 2)
    steps = args.steps if args.steps is not None else shape.pop("steps", 5)
    shape.pop("warmup", None)
    shape.pop("steps", None)
    peers_fit = shape.pop("peers_fit", True) or args.try_peers
    slide_args = list(shape.pop("slide_args", ()))
    from slide_train.models.build import load_model

    vocab = load_model(shape["model"], 0, need_tokenizer=False).hf_config.vocab_size
    rows = (warmup + steps) * shape["micro_batch_size"] * shape["grad_accum"]
    if args.data == "documents":  # packed into seq_len rows by each system (a tenth more: rows end part-filled)
        data = work / f"{suite}-documents.jsonl"
        lengths = random_documents(data, vocab, shape["seq_len"], int(1.1 * rows * shape["seq_len"]))
        described = (f"{len(lengths)} documents of uniform random token ids, log-normal lengths (median "
                     f"{DOC_MEDIAN}, {DOC_MIN} to seq_len tokens; mean {statistics.mean(lengths):.0f}), packed "
                     "into seq_len rows with attention kept within each document")
    else:
        data = work / f"{suite}-rows.jsonl"
        random_rows(data, vocab, shape["seq_len"], rows)
        described = "uniform random token ids, rows of exactly seq_len (unpacked)"
    base = {**shape, "warmup": warmup, "steps": steps, "data": str(data), "seed": 0,
            "pack": args.data == "documents"}
    config = {**shape, "tokens_per_step": shape["seq_len"] * shape["micro_batch_size"] * shape["grad_accum"],
              "warmup": warmup, "steps": steps, "data": described, "baseline": args.baseline_name}
    figures, device = [], None
    plan = []  # old and new engines alternate per mode, so a drift of the machine touches both alike
    for mode in args.modes:
        plan += [("slide", mode), ("slide-nospec", mode), ("slide-spec", mode)] \
            + ([("baseline", mode)] if args.baseline else [])
    for system in ("plain", "liger"):
        plan += [(system, mode) for mode in args.modes]
    plan = [(s, m) for s, m in plan if s in args.systems]
    for system, mode in plan:
        name = f"{suite}-{system}-clip-{mode}"
        print(f"  {name} ...", flush=True)
        spec = {**base, "mode": mode, "run_dir": str(work / name)}
        if system in ("slide", "baseline", "slide-nospec", "slide-spec"):
            asked = {"slide-nospec": ["--engine.placement.speculate=false"],
                     "slide-spec": ["--engine.placement.speculate=true"]}.get(system, [])
            spec.update(job="slide", extra=slide_args + asked)
        else:
            spec.update(job=system, device=shape["device"], cap_gib=None, peers_fit=peers_fit)
        pythonpath = baseline_pythonpath(args.baseline) if system == "baseline" else None
        r = run_worker(spec, work, name, args.timeout, pythonpath, quiet=args.quiet)
        if system == "baseline" and r.get("status") == "ok" and not pathlib.Path(r["source"]).is_relative_to(
                args.baseline.resolve()):
            r = {"status": "failed", "reason": f"slide_train came from {r['source']}, not from {args.baseline}: "
                                               "an installed copy shadows PYTHONPATH"}
        shutil.rmtree(work / name, ignore_errors=True)
        entry = {"system": system, "label": SYSTEMS[system] + (f" {args.baseline_name}" if system == "baseline"
                                                               else ""),
                 "mode": mode, "cap_gib": shape["cap_gib"] if system not in ("plain", "liger") else None,
                 "date": common.now(), "warmup": warmup, "steps": steps, **r}
        device = device or (r.get("device") if r.get("status") == "ok" else None)
        figures.append(entry)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name_of(suite, args)}.partial.json").write_text(
            json.dumps(suite_doc(name_of(suite, args), config, figures, device), indent=1) + "\n")
        print(f"  {name}: {tables.entry_line(entry)}", flush=True)
    return suite_doc(name_of(suite, args), config, figures, device)


def name_of(suite: str, args) -> str:
    """The name a training suite's results go under: its own, or with `-documents` for packed documents."""
    return suite + ("-documents" if args.data == "documents" else "")


def machine_file(work: pathlib.Path, name: str, host_gib: float | None = None,
                 disk_free_gib: float | None = None, disk: dict | None = None) -> pathlib.Path:
    """This run's machine file ($SLIDE_MACHINE, else this machine's probe) with its host memory, free disk or
    disk rates (`disk`, from measure_disk) replaced, written under `work`."""
    import yaml

    from slide_train.machines import resolve_machine

    sections = resolve_machine(None, work).to_dict()
    if host_gib is not None:
        sections["host"]["memory_gib"] = host_gib
    if disk_free_gib is not None:
        sections["disk"]["free_gib"] = disk_free_gib
    if disk is not None:
        sections["disk"].update(read_gbps=round(disk["read_gbps"], 2), write_gbps=round(disk["write_gbps"], 2))
    path = work / f"{name}.machine.yaml"
    path.write_text(yaml.safe_dump(sections, default_flow_style=None, sort_keys=False))
    return path


def measure_disk(args, work: pathlib.Path) -> dict | None:
    """The disk under `work` as the NVMe tier uses it, through the store's own path (the io suite's tier pass,
    --disk-gib of 512 MiB files), so the plans of the runs after it price this disk as it is now; None with
    --disk-gib 0 (the machine file's rates)."""
    if not args.disk_gib:
        return None
    disk = work / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    r = run_worker({"job": "io", "sizes_mib": [], "rounds": 1, "disk_dir": str(disk), "tier_gib": args.disk_gib,
                    "paths": ["auto"]}, work, "disk", args.timeout, quiet=args.quiet)
    if r["status"] != "ok":
        raise RuntimeError(f"measuring the disk under {work}: {r.get('reason')}")
    path = r["paths"][0]
    measured = {"path": path["path"], **path["tier"]}
    print(f"  disk under {work} ({measured['path']}): read {measured['read_gbps']:.2f} GB/s, write "
          f"{measured['write_gbps']:.2f} GB/s over {measured['gib']:.0f} GiB", flush=True)
    return measured


def disk_free_gib(work: pathlib.Path) -> float:
    """The disk free under `work` now, less a margin for the run's own files (data, logs)."""
    from slide_io import free_bytes

    return round(free_bytes(work) / 2**30 - 2.0, 1)


def slide_entry(suite: str, variant: str, spec: dict, args, work: pathlib.Path, machine=None) -> dict:
    name = f"{suite}-{variant}"
    print(f"  {name} ...", flush=True)
    r = run_worker({**spec, "run_dir": str(work / name)}, work, name, args.timeout, quiet=args.quiet, machine=machine)
    shutil.rmtree(work / name, ignore_errors=True)
    entry = {"system": "slide", "variant": variant, "label": f"Slide, {variant}", "mode": spec["mode"],
             "cap_gib": spec.get("cap_gib"), "date": common.now(), "warmup": spec.get("warmup"),
             "steps": spec.get("steps"), **r}
    print(f"  {name}: {tables.entry_line(entry)}", flush=True)
    return entry


def slide_series(suite: str, runs: list[tuple[str, dict]], args, work: pathlib.Path) -> list[dict]:
    """Slide runs (variant, spec) in turn in one worker process, so what they share (imports, the CUDA context,
    compiled kernels) is set up once; an entry each, as slide_entry makes them. One run is slide_entry's."""
    if len(runs) == 1:
        (variant, spec), = runs
        return [slide_entry(suite, variant, spec, args, work)]
    name = f"{suite}-{'+'.join(v for v, _ in runs)}"
    print(f"  {name} (one process) ...", flush=True)
    specs = [{**spec, "run_dir": str(work / f"{suite}-{variant}")} for variant, spec in runs]
    r = run_worker({"job": "series", "runs": specs}, work, name, args.timeout, quiet=args.quiet)
    results = r.get("runs") or [{"status": r.get("status", "failed"), "reason": r.get("reason", "")}] * len(runs)
    entries = []
    for (variant, spec), result in zip(runs, results):
        shutil.rmtree(work / f"{suite}-{variant}", ignore_errors=True)
        entry = {"system": "slide", "variant": variant, "label": f"Slide, {variant}", "mode": spec["mode"],
                 "cap_gib": spec.get("cap_gib"), "date": common.now(), "device": r.get("device"),
                 "warmup": spec["warmup"], "steps": spec["steps"], "process": name, **result}
        print(f"  {suite}-{variant}: {tables.entry_line(entry)}", flush=True)
        entries.append(entry)
    return entries


def run_nvme_suite(args, work: pathlib.Path, out: pathlib.Path) -> dict:
    """NVME_RUNS (those --variants names), clip 1.0 unless --modes names one mode; warm-up and timed steps as
    the training suites. Finished runs are kept in `<out>/nvme.partial.json`, as a training suite's."""
    from slide_train.models.build import load_model

    mode = args.modes[0] if len(args.modes) == 1 else "1.0"
    warmup, steps = args.warmup if args.warmup is not None else 2, args.steps if args.steps is not None else 5
    runs = [{"bench": bench, "variant": variant, "args": [a.format(work=work) for a in extra], "host_gib": host_gib,
             **{k: v for k, v in TRAIN_SUITES[bench].items() if k not in ("peers_fit", "slide_args")}}
            for bench, variant, extra, host_gib in NVME_RUNS]
    config = {"mode": mode, "warmup": warmup, "steps": steps, "runs": runs}
    figures, device = [], None
    disk = measure_disk(args, work)
    for run in runs:
        if args.variants and f"{run['bench']}-{run['variant']}" not in args.variants:
            continue
        shape = {k: run[k] for k in ("model", "seq_len", "micro_batch_size", "grad_accum", "cap_gib", "device")}
        data = work / f"{run['bench']}-rows.jsonl"
        if not data.exists():
            vocab = load_model(shape["model"], 0, need_tokenizer=False).hf_config.vocab_size
            random_rows(data, vocab, shape["seq_len"], (warmup + steps) * shape["micro_batch_size"]
                        * shape["grad_accum"])
        machine = (machine_file(work, f"{run['bench']}-{run['variant']}", host_gib=run["host_gib"],
                                disk_free_gib=disk_free_gib(work), disk=disk) if run["host_gib"] or disk else None)
        spec = {**shape, "warmup": warmup, "steps": steps, "data": str(data), "seed": 0, "pack": False,
                "mode": mode, "job": "slide", "extra": run["args"]}
        entry = slide_entry(run["bench"], run["variant"], spec, args, work, machine)
        entry.update(bench=run["bench"], host_budget_gib=run["host_gib"], disk_measured=disk)
        figures.append(entry)
        device = device or entry.get("device")
        out.mkdir(parents=True, exist_ok=True)
        (out / "nvme.partial.json").write_text(json.dumps(suite_doc("nvme", config, figures, device), indent=1))
    return suite_doc("nvme", config, figures, device)


def run_dp_suite(args, work: pathlib.Path, out: pathlib.Path) -> dict:
    """DP["bench"]'s shape (or --dp-bench's) on each rank count of DP["ranks"], per GPU as the bench has it, one
    process group each; clip 1.0 unless --modes names one mode."""
    from slide_train.models.build import load_model

    bench = args.dp_bench or DP["bench"]
    shape = {k: v for k, v in TRAIN_SUITES[bench].items() if k in ("model", "seq_len", "micro_batch_size",
                                                                    "grad_accum", "cap_gib", "device")}
    mode = args.modes[0] if len(args.modes) == 1 else "1.0"
    warmup, steps = args.warmup if args.warmup is not None else 2, args.steps if args.steps is not None else 5
    config = {**shape, "bench": bench, "mode": mode, "warmup": warmup, "steps": steps,
              "tokens_per_step_per_rank": shape["seq_len"] * shape["micro_batch_size"] * shape["grad_accum"]}
    data = work / f"dp-{bench}-rows.jsonl"
    random_rows(data, load_model(shape["model"], 0, need_tokenizer=False).hf_config.vocab_size, shape["seq_len"],
                (warmup + steps) * shape["micro_batch_size"] * shape["grad_accum"] * max(DP["ranks"]))
    figures, device = [], None
    for ranks in DP["ranks"]:
        spec = {**shape, "warmup": warmup, "steps": steps, "data": str(data), "seed": 0, "pack": False,
                "mode": mode, "job": "slide", "extra": [], "ranks": ranks}
        entry = slide_entry(bench, f"{ranks}-rank{'s' if ranks > 1 else ''}", spec, args, work)
        entry.update(bench=bench, ranks=ranks)
        figures.append(entry)
        device = device or entry.get("device")
        out.mkdir(parents=True, exist_ok=True)
        (out / "dp2.partial.json").write_text(json.dumps(suite_doc("dp2", config, figures, device), indent=1))
    return suite_doc("dp2", config, figures, device)


def run_largest_suite(args, work: pathlib.Path) -> dict:
    """The shape largest_shape finds, trained for --steps timed steps (default 3) after --warmup (default 1),
    with checkpoint.keep 0 and no export; its plan beside the measurement."""
    from slide_train.models.build import load_model

    warmup, steps = args.warmup if args.warmup is not None else 1, args.steps if args.steps is not None else 3
    free_gib = disk_free_gib(work)
    disk = measure_disk(args, work)
    found = largest_shape(work, LARGEST["step_limit_s"], free_gib, disk)
    name = common.register_shape(found["base"], found["layers"])
    vocab = load_model(name, 0, need_tokenizer=False, need_weights=False).hf_config.vocab_size
    shape = {k: LARGEST[k] for k in ("seq_len", "micro_batch_size", "grad_accum", "cap_gib", "device")}
    data = work / "largest-rows.jsonl"
    random_rows(data, vocab, shape["seq_len"], (warmup + steps) * shape["micro_batch_size"] * shape["grad_accum"])
    spec = {**shape, "model": name, "register": {"base": found["base"], "layers": found["layers"]},
            "warmup": warmup, "steps": steps, "data": str(data), "seed": 0, "pack": False, "mode": "1.0",
            "job": "slide", "extra": ["--engine.nvme.fraction=auto", f"--engine.states_dtype={found['states_dtype']}"]}
    machine = work / "largest.machine.yaml"  # (written by largest_shape: this run's, with the disk found free)
    entry = slide_entry("largest", name, spec, args, work, machine)
    config = {**{k: v for k, v in LARGEST.items() if k != "widths"}, "widths": list(LARGEST["widths"]),
              "disk_free_gib": free_gib, "disk_measured": disk, "warmup": warmup, "steps": steps, "found": found}
    return suite_doc("largest", config, [entry], entry.get("device"))


def largest_shape(work: pathlib.Path, limit_s: float, free_gib: float, disk: dict | None = None) -> dict:
    """The Llama shape (a width of LARGEST["widths"], any depth, fp32 or bf16 states) with the most parameters
    that the plan fits, with engine.nvme.fraction auto, at `limit_s` or less per step on this run's machine file
    with `free_gib` of disk (and the disk's rates as measured, where `disk` holds them)."""
    from slide_train.config import load_config
    from slide_train.launch import plan_run
    from slide_train.machines import load_machine
    from slide_train.models.build import load_model
    from slide_train.models.presets import PRESETS

    machine = load_machine(machine_file(work, "largest", disk_free_gib=free_gib, disk=disk))

    def plan(base: str, layers: int, states: str):
        name = common.register_shape(base, layers)
        cfg = load_config(None, [f"--model={name}", f"--seq_len={LARGEST['seq_len']}",
                                 f"--micro_batch_size={LARGEST['micro_batch_size']}",
                                 f"--grad_accum={LARGEST['grad_accum']}", "--max_grad_norm=1.0",
                                 f"--engine.gpu_memory_limit_gb={LARGEST['cap_gib']}", "--engine.device=cuda",
                                 "--engine.nvme.fraction=auto", f"--engine.states_dtype={states}"])
        return plan_run(cfg, load_model(name, 0, need_tokenizer=False, need_weights=False), machine,
                        running=False)[0]

    def good(base: str, layers: int, states: str) -> bool:
        p = plan(base, layers, states)
        return p.fits and p.estimate.step_s <= limit_s

    best = None
    for base in LARGEST["widths"]:
        for states in ("fp32", "bf16"):
            low, high = 0, PRESETS[base]["num_hidden_layers"]  # good(low) (or low 0), not good(high)
            while good(base, high, states):
                low, high = high, 2 * high
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if good(base, middle, states) else (low, middle)
            if low == 0:
                continue
            p = plan(base, low, states)
            found = {"base": base, "layers": low, "states_dtype": states, "params": sum(p.placement.shapes.unit_numels),
                     "predicted_step_s": p.estimate.step_s, "bottleneck": p.estimate.bottleneck,
                     "predicted_lanes_s": p.estimate.lanes, "planned_disk_gib": p.placement.bytes("disk") / 2**30,
                     "planned_host_gib": p.placement.bytes("host") / 2**30,
                     "blocks_on_disk": len(p.placement.on_disk), "sliding_blocks": len(p.placement.sliding_blocks)}
            print(f"  largest at the width of {base}, {states} states: {low} layers, "
                  f"{p.estimate.step_s:.1f} s predicted", flush=True)
            best = found if best is None or found["params"] > best["params"] else best
    if best is None:
        raise SystemExit(f"no Llama shape fits this machine file at {limit_s} s per step")
    return best


def long_config() -> dict:
    """The long suite's config, the same for every part of it (so each part merges into long.json): LONG, led by
    the shape of the 131,072-token runs, which the training table's header reads."""
    headline = LONG["runs"]["8b-128k"]
    return {"model": headline["model"], "seq_len": headline["seq_len"], "micro_batch_size": LONG["micro_batch_size"],
            "grad_accum": headline["grad_accum"], "tokens_per_step": headline["seq_len"], "cap_gib": LONG["cap_gib"],
            "warmup": LONG["warmup"], "steps": LONG["steps"], "modes": list(LONG["modes"]),
            "runs": {name: {**run, "modes": list(run.get("modes", LONG["modes"]))}
                     for name, run in LONG["runs"].items()},
            "peer": {"model": LONG["peer_model"], "lengths": list(LONG["peer_lengths"]), "mode": LONG["peer_mode"]},
            "sitting_s": LONG["sitting_s"], "data": "uniform random token ids, rows of exactly seq_len (unpacked)"}


def long_overrides(model: str, seq_len: int, grad_accum: int, mode: str) -> list[str]:
    """The settings of a long run that shape its plan, as worker.run_slide gives them to slide-train."""
    clip = "null" if mode == "none" else mode
    return [f"--model={model}", f"--seq_len={seq_len}", f"--micro_batch_size={LONG['micro_batch_size']}",
            f"--grad_accum={grad_accum}", f"--max_grad_norm={clip}", f"--engine.device={LONG['device']}",
            f"--engine.gpu_memory_limit_gb={LONG['cap_gib']}"]


def long_plan(model: str, seq_len: int, mode: str, machine):
    """(config, model, plan) of one micro-batch of `seq_len` on `machine`: slide-train's planner, no weights."""
    from slide_train.config import load_config
    from slide_train.launch import plan_run
    from slide_train.models.build import load_model

    cfg = load_config(None, long_overrides(model, seq_len, 1, mode))
    bundle = load_model(model, 0, need_tokenizer=False, need_weights=False)
    return cfg, bundle, plan_run(cfg, bundle, machine, running=False)[0]


def long_calibration(out: pathlib.Path, mode: str) -> dict:
    """What a long run's time is planned with: each step `margin` times the cost model's prediction, and
    `setup_s` for the process outside its steps. From the 131,072-token 8B run of `mode` in `out`/long.json where
    it ran (its measured step over its prediction, and its setup, each a tenth more), else LONG's."""
    path = out / "long.json"
    figures = json.loads(path.read_text()).get("figures", []) if path.is_file() else []
    for e in figures:
        if (e.get("system"), e.get("variant"), e.get("mode"), e.get("status")) == ("slide", "8b-128k", mode, "ok") \
                and e.get("predicted_step_s") and e.get("wall_s") and e.get("step_s_each"):
            return {"margin": round(1.1 * max(1.0, e["step_s"] / e["predicted_step_s"]), 3),
                    "setup_s": round(1.1 * max(0.0, e["wall_s"] - sum(e["step_s_each"])), 1),
                    "from": f"the 8b-128k run, clip {mode}, of {e.get('date', '?')}"}
    return {"margin": LONG["margin"], "setup_s": LONG["setup_s"], "from": "LONG's defaults"}


def long_length(name: str, mode: str, machine, calibration: dict) -> dict:
    """The rows a `*-longest` run trains: the longest one micro-batch the plan fits under the cap (`plan
    --longest`'s search, on the -256k preset up to its 262,144 positions), and, where that run's time (setup, then
    every step at `margin` times its prediction) would not fit LONG["sitting_s"], the longest rows, in granules, whose
    time does. Rows of up to 131,072 run the model's own preset."""
    from slide_train.cli import longest

    base = LONG["runs"][name]["model"]
    wide = base + LONG["long_suffix"]
    cfg, bundle, _ = long_plan(wide, LONG["granule"], mode, machine)
    fits = longest(cfg, bundle, machine, 1).seq_len
    budget = (LONG["sitting_s"] - calibration["setup_s"]) / (LONG["warmup"] + LONG["steps"]) / calibration["margin"]

    def predicted(length: int) -> float:
        return long_plan(wide, length, mode, machine)[2].estimate.step_s

    length = fits // LONG["granule"] * LONG["granule"]  # (the run's rows: whole granules)
    if predicted(length) > budget:  # (the predicted step grows with the rows: a bisection over granules)
        low, high = 0, fits // LONG["granule"]
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if predicted(middle * LONG["granule"]) <= budget else (low, middle)
        length = low * LONG["granule"]
    found = {"model": wide if length > LONG["positions"] else base, "seq_len": length, "longest_fits": fits,
             "step_budget_s": round(budget, 1), "calibration": calibration}
    if length:
        found["planned_step_s"] = round(predicted(length), 2)
    return found


def long_steps(args) -> tuple[int, int]:
    """The warm-up and timed steps of a long run: --warmup and --steps where given, else LONG's."""
    warmup = getattr(args, "warmup", None)
    steps = getattr(args, "steps", None)
    return (LONG["warmup"] if warmup is None else warmup), (LONG["steps"] if steps is None else steps)


def long_rows(work: pathlib.Path, model: str, seq_len: int, grad_accum: int, steps: int | None = None
              ) -> pathlib.Path:
    """The rows a long run trains on (random token ids; one file per model and length, shared by the modes), for
    `steps` steps in all (LONG's warm-up and timed steps by default)."""
    from slide_train.models.build import load_model

    steps = steps or LONG["warmup"] + LONG["steps"]
    path = work / f"long-{model}-{seq_len}-x{grad_accum}-{steps}.jsonl"
    if not path.exists():
        vocab = load_model(model, 0, need_tokenizer=False, need_weights=False).hf_config.vocab_size
        random_rows(path, vocab, seq_len, steps * LONG["micro_batch_size"] * grad_accum)
    return path


def long_spec(model: str, seq_len: int, grad_accum: int, mode: str, data: pathlib.Path, job: str = "slide",
              warmup: int | None = None, steps: int | None = None) -> dict:
    """worker.py's spec of one long run: Slide under the cap, or the peer uncapped (LONG's steps by default)."""
    spec = {"model": model, "seq_len": seq_len, "micro_batch_size": LONG["micro_batch_size"],
            "grad_accum": grad_accum, "warmup": LONG["warmup"] if warmup is None else warmup,
            "steps": LONG["steps"] if steps is None else steps, "data": str(data), "seed": 0,
            "pack": False, "mode": mode, "device": LONG["device"], "job": job}
    if job == "slide":
        return {**spec, "cap_gib": LONG["cap_gib"], "extra": []}
    return {**spec, "cap_gib": None, "peers_fit": True}


def run_long_suite(args, work: pathlib.Path, out: pathlib.Path) -> dict:
    """LONG's runs that --variants names (all by default: 8b-32k, 8b-128k, 8b-longest, 3b-longest, peer), Slide's
    in the clip modes --modes names of each run's, the peer's where --systems names liger. Finished runs are kept in
    `<out>/long.partial.json`, as a training suite's."""
    variants = args.variants or [*LONG["runs"], "peer"]
    unknown = set(variants) - {*LONG["runs"], "peer"}
    if unknown:
        raise ValueError(f"--variants: no long run {', '.join(sorted(unknown))} (the runs: "
                         f"{', '.join(LONG['runs'])}, peer)")
    machine = None  # (the machine file the workers' runs plan for, as they find it: read where a run is searched)
    figures: list[dict] = []

    def keep(entry: dict) -> None:
        figures.append(entry)
        out.mkdir(parents=True, exist_ok=True)
        doc = suite_doc("long", long_config(), figures, first_device(figures))
        (out / "long.partial.json").write_text(json.dumps(doc, indent=1) + "\n")

    warmup, steps = long_steps(args)
    for mode in [m for m in LONG["modes"] if m in args.modes]:
        fixed, longest = [], []  # (the runs of fixed rows of this mode share one worker process)
        for name, run in LONG["runs"].items():
            if name not in variants or "slide" not in args.systems or mode not in run.get("modes", LONG["modes"]):
                continue
            shape = {"model": run["model"], "seq_len": run["seq_len"], "grad_accum": run["grad_accum"]}
            chosen = {}
            if run["seq_len"] is None:
                from slide_train.errors import ConfigError
                from slide_train.machines import resolve_machine

                machine = machine or resolve_machine(None, work)
                try:
                    chosen = long_length(name, mode, machine, long_calibration(out, mode))
                except ConfigError as e:  # (not even the shortest rows fit: the plan says why)
                    keep({"system": "slide", "variant": name, "label": f"Slide, {name}", "mode": mode,
                          "cap_gib": LONG["cap_gib"], "date": common.now(), "status": "does not fit",
                          "reason": f"{type(e).__name__}: {e}"[:2000], **shape})
                    continue
                shape.update(model=chosen.pop("model"), seq_len=chosen.pop("seq_len"))
                if not shape["seq_len"]:
                    keep({"system": "slide", "variant": name, "label": f"Slide, {name}", "mode": mode,
                          "cap_gib": LONG["cap_gib"], "date": common.now(), "status": "skipped", **shape, **chosen,
                          "reason": f"no rows fit {LONG['sitting_s']:g} s of one sitting by the plan"})
                    continue
            data = long_rows(work, shape["model"], shape["seq_len"], shape["grad_accum"], warmup + steps)
            spec = long_spec(**shape, mode=mode, data=data, warmup=warmup, steps=steps)
            (fixed if run["seq_len"] is not None else longest).append((name, shape, spec, chosen))
        entries = slide_series("long", [(name, spec) for name, _, spec, _ in fixed], args, work) if fixed else []
        for (_, shape, _, _), entry in zip(fixed, entries):
            keep(long_entry(entry, shape))
        for name, shape, spec, chosen in longest:  # (each a process of its own, as its sitting is planned)
            (entry,) = slide_series("long", [(name, spec)], args, work)
            keep(long_entry(entry, shape, chosen))
    if "peer" in variants and "liger" in args.systems:
        for entry in run_long_peer(args, work):
            keep(entry)
    return suite_doc("long", long_config(), figures, first_device(figures))


def long_entry(entry: dict, shape: dict, chosen: dict | None = None) -> dict:
    """A long run's entry with its rows and tokens per step (and, for a longest run, how its rows were chosen)."""
    return {**entry, **shape, "micro_batch_size": LONG["micro_batch_size"],
            "tokens_per_step": shape["seq_len"] * LONG["micro_batch_size"] * shape["grad_accum"], **(chosen or {})}


def first_device(figures: list[dict]) -> str | None:
    return next((e["device"] for e in figures if e.get("status") == "ok" and e.get("device")), None)


def run_long_peer(args, work: pathlib.Path) -> list[dict]:
    """The GPU-resident HF + Liger-Kernel peer on LONG["peer_model"] at each of LONG["peer_lengths"] in turn until
    one does not run (out of memory), then an entry for its longest (its figures there); and LONG["no_peer"]
    recorded as not fitting: its fp32 weights, gradients and AdamW moments alone outgrow the GPU."""
    model, mode = LONG["peer_model"], LONG["peer_mode"]
    entries, best = [], None
    for length in LONG["peer_lengths"]:
        spec = long_spec(model, length, 1, mode, long_rows(work, model, length, 1), job="liger")
        name = f"long-peer-{length}"
        print(f"  {name} ...", flush=True)
        r = run_worker(spec, work, name, args.timeout, quiet=args.quiet)
        entry = {"system": "liger", "variant": f"peer-{length}", "label": f"{SYSTEMS['liger']}, {model} 1 x {length:,}",
                 "mode": mode, "cap_gib": None, "date": common.now(), "model": model, "seq_len": length,
                 "micro_batch_size": 1, "grad_accum": 1, "tokens_per_step": length, **r}
        print(f"  {name}: {tables.entry_line(entry)}", flush=True)
        entries.append(entry)
        if r.get("status") != "ok":
            break
        best = entry
    last = entries[-1]
    if best is None:
        summary = {**last, "variant": "peer-longest", "longest": None}
    else:
        stop = ("the longest length tried" if last is best else
                f"at {last['seq_len']:,}: {last.get('status')}: {last.get('reason', '')}"[:400])
        summary = {**best, "variant": "peer-longest", "longest": best["seq_len"], "stopped": stop}
    entries.append(summary)
    entries.append(peer_does_not_fit(LONG["no_peer"], mode))
    return entries


def peer_does_not_fit(model: str, mode: str) -> dict:
    """The peer's entry for a model whose fp32 weights, gradients and AdamW moments (16 bytes a parameter) alone
    outgrow the GPU: recorded, not run."""
    import torch
    import transformers

    from slide_train.models.build import load_model

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(load_model(model, 0, need_tokenizer=False,
                                                                      need_weights=False).hf_config)
    params = sum(p.numel() for p in hf.parameters())
    return {"system": "liger", "variant": f"peer-{model}", "label": f"{SYSTEMS['liger']}, {model}", "mode": mode,
            "cap_gib": None, "date": common.now(), "model": model, "status": "does not fit", "num_params": params,
            "reason": f"fp32 weights, gradients and AdamW moments alone take 16 bytes/param = "
                      f"{16 * params / 2**30:.0f} GiB for {params / 1e9:.2f} B parameters, before activations "
                      "(not run)"}


def run_plans_suite(args, work: pathlib.Path) -> dict:
    """PLANS: each model, machine file and setting priced by slide-train's planner, with what a checkpoint costs."""
    from slide_scheduler import disk_traffic
    from slide_train.config import load_config
    from slide_train.launch import plan_run
    from slide_train.machines import load_machine
    from slide_train.models.build import load_model
    from slide_train.plan import checkpoint_cost

    figures = []
    for model_name in PLANS["models"]:
        model = load_model(model_name, 0, need_tokenizer=False, need_weights=False)
        for machine_path in PLANS["machines"]:
            machine = load_machine(common.ROOT / machine_path)
            for setting, extra in PLANS["settings"].items():
                args = [f"--model={model_name}", f"--seq_len={PLANS['seq_len']}",
                        f"--micro_batch_size={PLANS['micro_batch_size']}", f"--grad_accum={PLANS['grad_accum']}",
                        "--engine.device=cuda", "--engine.nvme.fraction=auto", *extra]
                cfg = load_config(None, args)
                plan = plan_run(cfg, model, machine, running=False)[0]
                nbytes, seconds = checkpoint_cost(plan, machine)
                p = plan.placement
                figures.append({"system": "plan", "status": "ok", "model": model_name, "machine": machine_path,
                                "setting": setting, "args": args, "params": sum(p.shapes.unit_numels),
                                "fits": plan.fits, "problems": plan.problems, "predicted_step_s": plan.estimate.step_s,
                                "bottleneck": plan.estimate.bottleneck, "lanes_s": plan.estimate.lanes,
                                "host_gib": p.bytes("host") / 2**30, "disk_gib": p.bytes("disk") / 2**30,
                                "blocks_on_disk": len(p.on_disk), "sliding_blocks": len(p.sliding_blocks),
                                "blocks_loading_from_disk": len(p.loads_from_disk),
                                "grads_on_disk": len(p.grads_on_disk),
                                "disk_written_gb": disk_traffic(p)[1] / 1e9,
                                "drive_tbw_steps": machine.disk.tbw * 1e12 / disk_traffic(p)[1]
                                if machine.disk.tbw and disk_traffic(p)[1] else None,
                                "checkpoint_gib": nbytes / 2**30, "checkpoint_s": seconds})
                print(f"  {model_name} on {machine_path}, {setting}: "
                      + (f"{plan.estimate.step_s:.0f} s per step" if plan.fits else "does not fit"), flush=True)
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in PLANS.items()}
    return suite_doc("plans", config, figures, None)


def run_kernels_suite(args, work: pathlib.Path, suite: str = "kernels", ops: tuple[str, ...] = ()) -> dict:
    """kernel_bench.py's ops (`ops`; all but attention when empty), as the suite `suite`."""
    result = work / f"{suite}.json"
    cmd = [sys.executable, str(HERE / "kernel_bench.py"), "--json", str(result), "--rounds", str(args.rounds),
           *(("--ops", ",".join(ops)) if ops else ())]
    rc = subprocess.call(cmd, cwd=common.ROOT)
    if rc != 0 or not result.is_file():
        raise RuntimeError(f"benchmarks/kernel_bench.py exited with status {rc}")
    doc = json.loads(result.read_text())
    return suite_doc(suite, doc["config"], [{"system": suite, "status": "ok", "results": doc["results"],
                                             "targets": doc["targets"], "versions": doc["versions"]}], doc["gpu"])


def run_attention_suite(args, work: pathlib.Path) -> dict:
    """The attention backends at Gemma-2-9B's shape (kernel_bench.py's attention rows)."""
    return run_kernels_suite(args, work, "attention", ("attention",))


def run_io_suite(args, work: pathlib.Path) -> dict:
    disk = pathlib.Path(args.disk or work / "disk")
    disk.mkdir(parents=True, exist_ok=True)
    spec = {"job": "io", "sizes_mib": args.io_mib, "rounds": args.rounds, "disk_dir": str(disk),
            "tier_gib": args.tier_gib}
    r = run_worker(spec, work, "io", args.timeout, quiet=args.quiet)
    if r["status"] != "ok":
        raise RuntimeError(r["reason"])
    config = {"sizes_mib": args.io_mib, "rounds": args.rounds, "disk_dir": str(disk), "tier_gib": args.tier_gib,
              "measure": "median seconds of a store.write / store.read of one tensor (pinned when CUDA is there); "
                         "tier: a working set of tier_gib in 512 MiB files written, read, then read and written "
                         "back file by file"}
    return suite_doc("io", config, [{"system": p["path"], **p} for p in r["paths"]], r["device"])


def run_probe_suite(args, work: pathlib.Path) -> dict:
    disk = pathlib.Path(args.disk or work / "disk")
    disk.mkdir(parents=True, exist_ok=True)
    r = run_worker({"job": "probe", "disk_dir": str(disk)}, work, "probe", args.timeout, quiet=args.quiet)
    if r["status"] != "ok":
        raise RuntimeError(r["reason"])
    return suite_doc("probe", {"disk_dir": str(disk)}, [{"system": "machine", "status": "ok", **r["machine"]}],
                     r["device"])


def run_gpu_rates_suite(args, work: pathlib.Path) -> dict:
    r = run_worker({"job": "gpu_rates", "device": "cuda"}, work, "gpu-rates", args.timeout, quiet=args.quiet)
    if r["status"] != "ok":
        raise RuntimeError(r["reason"])
    return suite_doc("gpu-rates", {}, [{"system": "gpu", "status": "ok", **r["gpu"]}], r["device"])


def gpu_name() -> str | None:
    """This machine's first GPU as nvidia-smi names it (which torch's device name matches), without a CUDA
    context in this process; None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return names[0].strip() if names else None


def planning_machine(work: pathlib.Path, results: pathlib.Path, gpu: str | None,
                     source: str | None) -> pathlib.Path | None:
    """The machine file `source` ($SLIDE_MACHINE) with the GPU rates it has not measured (MEASURED_LATER at 0)
    taken from `results`' gpu-rates.json, where that was measured on this GPU (`gpu`): written under `work`, for
    the runs to plan with. None where there is nothing to fill in."""
    rates = results / "gpu-rates.json"
    if not source or not rates.is_file() or gpu is None:
        return None
    from slide_train.machines import load_machine, save_machine
    doc = json.loads(rates.read_text())
    if doc.get("device") != gpu:
        print(f"  {rates} was measured on {doc.get('device')}, not this {gpu}: planning with {source} as it is",
              flush=True)
        return None
    machine, measured = load_machine(source), doc["figures"][0]
    filled = {k: measured[k] for k in MEASURED_LATER if not getattr(machine.gpu, k) and measured.get(k)}
    if not filled:
        return None
    path = work / "planning.machine.yaml"
    save_machine(dataclasses.replace(machine, gpu=dataclasses.replace(machine.gpu, **filled)), path,
                 measured_by=f"{source}, with {', '.join(filled)} from {rates.name} of {doc.get('date')}")
    print(f"  planning with {source} and this GPU's {', '.join(f'{k} {v}' for k, v in filled.items())} "
          f"({rates.name} of {doc.get('date')})", flush=True)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suites", nargs="+", choices=[*TRAIN_SUITES, *OTHER_SUITES])
    p.add_argument("--baseline", type=pathlib.Path, help="a folder holding an older version's packages/")
    p.add_argument("--baseline-name", help="what the baseline is called in results (default: the folder's name)")
    p.add_argument("--out", type=pathlib.Path,
                   help="where <suite>.json goes (default: benchmarks/results/, and a temp folder for tiny)")
    p.add_argument("--steps", type=int, help="timed steps per run (default 5; tiny 2)")
    p.add_argument("--warmup", type=int, help="untimed steps before them (default 2; tiny 1)")
    p.add_argument("--systems", default="slide,baseline,plain,liger",  # (slide-nospec, slide-spec: on request)
                   help="which systems to run (a subset is merged into the suite's existing file)")
    p.add_argument("--modes", default=",".join(MODES), help="which clip modes to run: 1.0,1e6,none")
    p.add_argument("--try-peers", action="store_true", help="run peers even where their states cannot fit (b8)")
    p.add_argument("--timeout", type=float, default=None, help="seconds one process may run (default: no limit)")
    p.add_argument("--disk", help="folder on the disk to measure (io, probe; default: a temp folder)")
    p.add_argument("--io-mib", default="64,1024", help="tensor sizes of the io suite, MiB")
    p.add_argument("--disk-gib", type=float, default=8.0,
                   help="nvme, largest: measure the disk under --work as the tier uses it (GiB of files) and plan "
                        "with those rates (0: the machine file's)")
    p.add_argument("--tier-gib", type=float, default=8.0,
                   help="io: the working set of the tier-pattern pass (0: none), larger than the drive's cache")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the io and kernels suites (median)")
    p.add_argument("--work", type=pathlib.Path, help="scratch folder for run directories and data (default: temp)")
    p.add_argument("--quiet", action="store_true", help="do not echo each process's output")
    p.add_argument("--data", choices=("rows", "documents"), default="rows",
                   help="training suites: unpacked rows of exactly seq_len (default), or documents of long-tailed "
                        "lengths packed into rows (results in <suite>-documents.json)")
    p.add_argument("--variants", default="", help="nvme: which runs, as bench-variant names (default: all of "
                   + ", ".join(f"{b}-{v}" for b, v, _, _ in NVME_RUNS) + "); a subset is merged into nvme.json. "
                   "long: which of " + ", ".join([*LONG["runs"], "peer"]) + " (default: all), merged into long.json")
    p.add_argument("--dp-bench", default=None, choices=list(TRAIN_SUITES),
                   help=f"dp2: the shape per GPU (default {DP['bench']}; tiny checks the harness on CPUs)")
    args = p.parse_args()
    global MACHINE_SOURCE
    MACHINE_SOURCE = os.environ.get("SLIDE_MACHINE")
    args.variants = [v for v in args.variants.split(",") if v]
    args.systems = [s for s in args.systems.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    args.io_mib = [int(x) for x in args.io_mib.split(",")]
    for s in args.systems:
        if s not in SYSTEMS:
            p.error(f"--systems: unknown system {s!r} (choose from {', '.join(SYSTEMS)})")
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r} (choose from {', '.join(MODES)})")
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
        baseline_pythonpath(args.baseline)  # fail now on a folder with no packages
        args.baseline_name = args.baseline_name or args.baseline.name
    work = pathlib.Path(tempfile.mkdtemp(prefix="slide-bench-", dir=args.work))
    failed = []
    try:
        source, gpu = os.environ.get("SLIDE_MACHINE"), gpu_name()
        for suite in args.suites:
            # The GPU suites plan with this GPU's measured rates where the machine file lacks them (the latest
            # gpu-rates.json, one this run.py wrote too); not beside a baseline engine, which reads only the keys
            # it knows and should plan as the new one does
            if source and suite in {*TRAIN_SUITES, "nvme", "largest", "dp2", "long"} and not args.baseline:
                planning = planning_machine(work, args.out or common.RESULTS, gpu, source)
                os.environ["SLIDE_MACHINE"] = str(planning or source)  # (the runs' processes and this one's plans)
            out = args.out or (pathlib.Path(tempfile.mkdtemp(prefix="slide-bench-tiny-")) if suite == "tiny"
                               else common.RESULTS)
            print(f"{suite}:", flush=True)
            try:
                if suite in TRAIN_SUITES:
                    doc = run_train_suite(suite, args, work, out)
                elif suite == "nvme":
                    doc = run_nvme_suite(args, work, out)
                elif suite == "dp2":
                    doc = run_dp_suite(args, work, out)
                elif suite == "long":
                    doc = run_long_suite(args, work, out)
                else:
                    doc = {"kernels": run_kernels_suite, "attention": run_attention_suite, "io": run_io_suite,
                           "probe": run_probe_suite, "gpu-rates": run_gpu_rates_suite, "largest": run_largest_suite,
                           "plans": run_plans_suite}[suite](args, work)
            except Exception as e:  # one suite failing leaves the others' results
                print(f"{suite} failed: {e}", file=sys.stderr, flush=True)
                failed.append(suite)
                continue
            # A run of some systems or modes only is merged into the suite's file instead of replacing it.
            absent = {"slide-nospec", "slide-spec"} | (set() if args.baseline else {"baseline"})
            partial = (suite in TRAIN_SUITES and (set(args.systems) - absent != set(SYSTEMS) - absent
                                                  or set(args.modes) != set(MODES))) or (suite == "nvme"
                                                                                          and bool(args.variants)) \
                or suite == "long"  # (run in parts, a sitting on a GPU machine each)
            path = out / f"{doc['suite']}.json"
            if partial:
                doc = merge(path, doc)
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=1) + "\n")
            (out / f"{doc['suite']}.partial.json").unlink(missing_ok=True)
            print(tables.suite_table(doc), flush=True)
            print(f"wrote {path}", flush=True)
            # (skipped and does-not-fit entries are results; a crash is not)
            failed += [f"{suite} {e['system']} clip {e.get('mode')}" for e in doc["figures"]
                       if e.get("status") == "failed"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
