"""A look inside one step of a suite, in one sitting: each op's GPU time (torch.profiler) beside the engine's lane
timeline of the same step (which lane was busy when, and what the GPU waited for).

    python3 benchmarks/profile.py gemma2 [--mode none] [--top 30] [--out DIR]
    python3 benchmarks/profile.py long-8b-128k --mode 1.0 --warmup 1
    python3 benchmarks/profile.py b8 --dry-run     # what it would run, on any machine
    python3 benchmarks/profile.py tiny             # on a CPU: each op's host time

It writes, under --out (default results/profiles/): `profile-<suite>-clip-<mode>.json` (the step's time and
timeline split, each lane's busy time, the top ops), `.ops.txt` (torch.profiler's table) and `.lanes.json` (the
engine's spans as a Chrome trace: open it in https://ui.perfetto.dev). The profiled step runs under the profiler's
overhead: its time is the profile's, not the suite's figure.
"""

from __future__ import annotations

import os
import sys

# Imported as `profile` (cProfile does so, and torch's compiler imports cProfile) in a process started from this
# folder, this file hides the standard library's module of that name: then it is that module.
if __name__ != "__main__":
    import importlib.util
    import sysconfig

    _spec = importlib.util.spec_from_file_location(__name__, os.path.join(sysconfig.get_paths()["stdlib"],
                                                                          "profile.py"))
    _stdlib = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_stdlib)
    globals().update({k: v for k, v in vars(_stdlib).items() if not k.startswith("__")})
else:
    import argparse
    import json
    import pathlib
    import shlex
    import shutil
    import tempfile

    import common
    import run


def suites() -> dict[str, dict]:
    """What can be profiled: run.py's training suites, and the long suite's runs of fixed rows (`long-<run>`)."""
    out = {name: dict(shape) for name, shape in run.TRAIN_SUITES.items()}
    for name, r in run.LONG["runs"].items():
        if r["seq_len"] is not None:
            out[f"long-{name}"] = {"model": r["model"], "seq_len": r["seq_len"], "grad_accum": r["grad_accum"],
                                   "micro_batch_size": run.LONG["micro_batch_size"], "cap_gib": run.LONG["cap_gib"],
                                   "device": run.LONG["device"], "warmup": run.LONG["warmup"]}
    return out


def profile_spec(suite: str, mode: str, warmup: int | None, top: int, data: str, run_dir: str) -> dict:
    """worker.py's `profile` job for `suite`: its shape, Slide's settings for it, `warmup` steps before the
    profiled one (the suite's own, at most 2)."""
    shape = suites()[suite]
    warmup = min(2, shape.get("warmup", 2)) if warmup is None else warmup
    return {"job": "profile", "model": shape["model"], "seq_len": shape["seq_len"],
            "micro_batch_size": shape["micro_batch_size"], "grad_accum": shape["grad_accum"],
            "cap_gib": shape.get("cap_gib"), "device": shape["device"], "extra": list(shape.get("slide_args", ())),
            "mode": mode, "warmup": warmup, "steps": 1, "top": top, "data": data, "seed": 0, "pack": False,
            "run_dir": run_dir}


def write(result: dict, out: pathlib.Path, stem: str) -> list[pathlib.Path]:
    """The profile's three files under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.ops.txt", out / f"{stem}.lanes.json"]
    summary = {k: v for k, v in result.items() if k not in ("ops_table", "lane_trace")}
    paths[0].write_text(json.dumps(summary, indent=1) + "\n")
    paths[1].write_text(result["ops_table"])
    paths[2].write_text(json.dumps(result["lane_trace"]))
    return paths


def report(result: dict, top: int) -> str:
    step = result["step"]
    lines = [f"step {step.get('step')}: {step.get('step_s', 0):.3f} s under the profiler"
             + (f", GPU busy {step['gpu_busy_s']:.3f} s, exposed {step['exposed_s']:.3f} s"
                if "gpu_busy_s" in step and "exposed_s" in step else ""),
             "lanes (busy s, spans): " + ", ".join(f"{lane} {v['busy_s']:.3f} ({v['spans']})"
                                                  for lane, v in result["lanes"].items()),
             f"top {top} ops by {result['ops_by']} of {result['ops_total_s']:.3f} s:"]
    key = result["ops_by"]
    lines += [f"  {op[key]:9.4f} s  {op['calls']:6d} x  {op['name'][:90]}" for op in result["ops"][:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suite", choices=sorted(suites()))
    p.add_argument("--mode", default="none", choices=run.MODES, help="max_grad_norm: 1.0, 1e6 or none (default)")
    p.add_argument("--warmup", type=int, choices=(1, 2), help="steps before the profiled one (default: the suite's, "
                                                              "at most 2)")
    p.add_argument("--top", type=int, default=30, help="ops listed, by their own GPU time (host time on a CPU)")
    p.add_argument("--out", type=pathlib.Path, default=common.RESULTS / "profiles", help="where the files go")
    p.add_argument("--timeout", type=float, help="seconds the process may run (default: no limit)")
    p.add_argument("--dry-run", action="store_true", help="print what it would run and write; run nothing")
    args = p.parse_args(argv)
    stem = f"profile-{args.suite}-clip-{args.mode}"
    work = pathlib.Path(tempfile.mkdtemp(prefix="slide-profile-"))
    try:
        spec = profile_spec(args.suite, args.mode, args.warmup, args.top, str(work / "rows.jsonl"),
                            str(work / "run"))
        source = os.environ.get("SLIDE_MACHINE")
        if args.dry_run:
            print(f"would run: {shlex.join([sys.executable, str(run.HERE / 'worker.py'), 'SPEC', 'RESULT'])}")
            print(f"with SPEC: {json.dumps(spec)}")
            print(f"planned with: {source or 'this host' + chr(39) + 's probe'}")
            files = [str(args.out / f"{stem}{x}") for x in (".json", ".ops.txt", ".lanes.json")]
            print(f"would write: {', '.join(files)}")
            return
        from slide_train.models.build import load_model

        vocab = load_model(spec["model"], 0, need_tokenizer=False, need_weights=False).hf_config.vocab_size
        run.random_rows(pathlib.Path(spec["data"]), vocab, spec["seq_len"],
                        (spec["warmup"] + 1) * spec["micro_batch_size"] * spec["grad_accum"])
        machine = run.planning_machine(work, common.RESULTS, run.gpu_name(), source) if source else None
        result = run.run_worker(spec, work, stem, args.timeout, machine=machine)
        if result.get("status") != "ok":
            sys.exit(f"{stem}: {result.get('status')}: {result.get('reason')}")
        result.update(suite=args.suite, mode=args.mode, commit=common.git_commit(), date=common.now(),
                      versions=common.versions(), host=common.host(), machine_file=source or "this host's probe",
                      spec={k: v for k, v in spec.items() if k not in ("data", "run_dir")})
        print(report(result, min(args.top, 15)))
        print("wrote " + ", ".join(str(path) for path in write(result, args.out, stem)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
