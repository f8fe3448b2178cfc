"""The benchmark suites: each writes one JSON, `<out>/<suite>.json`, the latest run (git keeps the history).

    python benchmarks/run.py b1 b3 b8 [--baseline DIR] [--steps 5] [--warmup 2]
    python benchmarks/run.py kernels io probe
    python benchmarks/run.py tiny            # a CPU check of the harness itself (writes to a temp folder)

Training suites (b1, b3, b8, tiny) run Slide with clip 1.0, clip 1e6 (on, never acting) and no clipping, and the
peers (a plain GPU-resident HF run, and the same with Liger-Kernel), each system and mode in its own process;
`--baseline DIR` adds an older version's Slide (DIR/packages/*/src first on PYTHONPATH) per mode, run beside this
checkout's. This process never touches the GPU, so it holds none of its memory while the systems run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
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
    "b1": dict(model="llama-3.2-1b", seq_len=2048, micro_batch_size=1, grad_accum=4, cap_gib=24.0, device="cuda"),
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
    "moe-256k": dict(model="olmoe-1b-7b", seq_len=4096, micro_batch_size=1, grad_accum=64, cap_gib=24.0,
                     device="cuda"),
    # soft-capped attention (transformers' eager path); bf16 AdamW states, as the plan asks on a 125 GiB host
    "gemma2": dict(model="gemma-2-9b", seq_len=4096, micro_batch_size=1, grad_accum=8, cap_gib=24.0, device="cuda",
                   peers_fit=False, slide_args=("--engine.states_dtype=bf16",)),
    # the harness itself on a CPU: the smallest preset, a step or two
    "tiny": dict(model="tiny-llama", seq_len=64, micro_batch_size=2, grad_accum=2, cap_gib=None, device="cpu",
                 warmup=1, steps=2),
}
OTHER_SUITES = ("kernels", "io", "probe")
MODES = ("1.0", "1e6", "none")  # max_grad_norm: acting, on but never acting, off
SYSTEMS = {
    "slide": "Slide",
    "baseline": "Slide (baseline)",
    "slide-nospec": "Slide without speculative updates (engine.placement.speculate=false)",
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
               quiet: bool = False) -> dict:
    """Run worker.py on `spec` in a fresh process; its output streams through, its result comes back (a crash or
    a timeout comes back as a `failed` result with the output's last lines)."""
    spec_path, result_path = work / f"{name}.spec.json", work / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    tail: deque[str] = deque(maxlen=30)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(HERE / "worker.py"), str(spec_path), str(result_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=common.ROOT)
    timed_out = False
    try:
        for line in proc.stdout:
            tail.append(line.rstrip())
            if not quiet:
                print(f"    | {line.rstrip()}", flush=True)
            if timeout and time.perf_counter() - start > timeout:
                timed_out = True
                proc.kill()
                break
        proc.wait()
    except KeyboardInterrupt:
        proc.kill()
        raise
    if result_path.is_file():
        result = json.loads(result_path.read_text())
    else:
        why = f"ran past --timeout {timeout:.0f} s" if timed_out else f"exited with status {proc.returncode}"
        result = {"status": "failed", "reason": f"the process {why}; its last lines: " + " / ".join(list(tail)[-8:])}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def suite_doc(suite: str, config: dict, figures: list, device: str | None) -> dict:
    return {"suite": suite, "commit": common.git_commit(), "date": common.now(), "device": device,
            "host": common.host(), "versions": common.versions(), "config": config, "figures": figures}


def merge(old_path: pathlib.Path, doc: dict) -> dict:
    """A run of some systems or modes only replaces those entries of the suite's file, if its config matches."""
    if not old_path.is_file():
        return doc
    old = json.loads(old_path.read_text())
    if old.get("config") != doc["config"]:
        print(f"  {old_path} holds another config: replaced, not merged", flush=True)
        return doc
    ran = {(f["system"], f.get("mode")) for f in doc["figures"]}
    doc["figures"] = [f for f in old["figures"] if (f["system"], f.get("mode")) not in ran] + doc["figures"]
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
        plan += [("slide", mode), ("slide-nospec", mode)] + ([("baseline", mode)] if args.baseline else [])
    for system in ("plain", "liger"):
        plan += [(system, mode) for mode in args.modes]
    plan = [(s, m) for s, m in plan if s in args.systems]
    for system, mode in plan:
        name = f"{suite}-{system}-clip-{mode}"
        print(f"  {name} ...", flush=True)
        spec = {**base, "mode": mode, "run_dir": str(work / name)}
        if system in ("slide", "baseline", "slide-nospec"):
            off = ["--engine.placement.speculate=false"] if system == "slide-nospec" else []
            spec.update(job="slide", extra=slide_args + off)
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
                 "date": common.now(), **r}
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


def run_kernels_suite(args, work: pathlib.Path) -> dict:
    result = work / "kernels.json"
    cmd = [sys.executable, str(HERE / "kernels.py"), "--json", str(result), "--rounds", str(args.rounds)]
    rc = subprocess.call(cmd, cwd=common.ROOT)
    if rc != 0 or not result.is_file():
        raise RuntimeError(f"benchmarks/kernels.py exited with status {rc}")
    doc = json.loads(result.read_text())
    return suite_doc("kernels", doc["config"], [{"system": "kernels", "status": "ok", "results": doc["results"],
                                                 "targets": doc["targets"]}], doc["gpu"])


def run_io_suite(args, work: pathlib.Path) -> dict:
    disk = pathlib.Path(args.disk or work / "disk")
    disk.mkdir(parents=True, exist_ok=True)
    spec = {"job": "io", "sizes_mib": args.io_mib, "rounds": args.rounds, "disk_dir": str(disk)}
    r = run_worker(spec, work, "io", args.timeout, quiet=args.quiet)
    if r["status"] != "ok":
        raise RuntimeError(r["reason"])
    config = {"sizes_mib": args.io_mib, "rounds": args.rounds, "disk_dir": str(disk),
              "measure": "median seconds of a store.write / store.read of one tensor (pinned when CUDA is there)"}
    return suite_doc("io", config, [{"system": p["path"], **p} for p in r["paths"]], r["device"])


def run_probe_suite(args, work: pathlib.Path) -> dict:
    disk = pathlib.Path(args.disk or work / "disk")
    disk.mkdir(parents=True, exist_ok=True)
    r = run_worker({"job": "probe", "disk_dir": str(disk)}, work, "probe", args.timeout, quiet=args.quiet)
    if r["status"] != "ok":
        raise RuntimeError(r["reason"])
    return suite_doc("probe", {"disk_dir": str(disk)}, [{"system": "machine", "status": "ok", **r["machine"]}],
                     r["device"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suites", nargs="+", choices=[*TRAIN_SUITES, *OTHER_SUITES])
    p.add_argument("--baseline", type=pathlib.Path, help="a folder holding an older version's packages/")
    p.add_argument("--baseline-name", help="what the baseline is called in results (default: the folder's name)")
    p.add_argument("--out", type=pathlib.Path,
                   help="where <suite>.json goes (default: benchmarks/results/, and a temp folder for tiny)")
    p.add_argument("--steps", type=int, help="timed steps per run (default 5; tiny 2)")
    p.add_argument("--warmup", type=int, help="untimed steps before them (default 2; tiny 1)")
    p.add_argument("--systems", default="slide,baseline,plain,liger",  # (slide-nospec: on request)
                   help="which systems to run (a subset is merged into the suite's existing file)")
    p.add_argument("--modes", default=",".join(MODES), help="which clip modes to run: 1.0,1e6,none")
    p.add_argument("--try-peers", action="store_true", help="run peers even where their states cannot fit (b8)")
    p.add_argument("--timeout", type=float, default=None, help="seconds one process may run (default: no limit)")
    p.add_argument("--disk", help="folder on the disk to measure (io, probe; default: a temp folder)")
    p.add_argument("--io-mib", default="64,1024", help="tensor sizes of the io suite, MiB")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the io and kernels suites (median)")
    p.add_argument("--work", type=pathlib.Path, help="scratch folder for run directories and data (default: temp)")
    p.add_argument("--quiet", action="store_true", help="do not echo each process's output")
    p.add_argument("--data", choices=("rows", "documents"), default="rows",
                   help="training suites: unpacked rows of exactly seq_len (default), or documents of long-tailed "
                        "lengths packed into rows (results in <suite>-documents.json)")
    args = p.parse_args()
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
        for suite in args.suites:
            out = args.out or (pathlib.Path(tempfile.mkdtemp(prefix="slide-bench-tiny-")) if suite == "tiny"
                               else common.RESULTS)
            print(f"{suite}:", flush=True)
            try:
                if suite in TRAIN_SUITES:
                    doc = run_train_suite(suite, args, work, out)
                else:
                    doc = {"kernels": run_kernels_suite, "io": run_io_suite, "probe": run_probe_suite}[suite](
                        args, work)
            except Exception as e:  # one suite failing leaves the others' results
                print(f"{suite} failed: {e}", file=sys.stderr, flush=True)
                failed.append(suite)
                continue
            # A run of some systems or modes only is merged into the suite's file instead of replacing it.
            absent = {"slide-nospec"} | (set() if args.baseline else {"baseline"})
            partial = suite in TRAIN_SUITES and (set(args.systems) - absent != set(SYSTEMS) - absent
                                                 or set(args.modes) != set(MODES))
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
