"""`slide-train`: finetune | data | plan | probe | export | presets. Every subcommand that takes a config
accepts `--key=value` overrides of any config key (see `slide-train finetune --help`)."""

from __future__ import annotations

import argparse
import os
import sys

from .config import describe_keys, load_config
from .errors import ConfigError, SlideError, plural
from .log import console, say
from .preflight import check_data, check_finetune


def _keys_help() -> str:
    rows = describe_keys()
    key_width = max(len(k) for k, _, _ in rows)
    value_width = max(len(v) for _, v, _ in rows)
    return "config keys (YAML or --key=value), default, meaning:\n" + "\n".join(
        f"  {k.ljust(key_width)}  {v.ljust(value_width)}  {text}" for k, v, text in rows)


def _config_parser(sub, name: str, help: str, config_help: str = "YAML file (optional: every key has a default)"):
    p = sub.add_parser(name, help=help, description=help, epilog=_keys_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help=config_help)
    return p


def cmd_finetune(args, overrides) -> int:
    from .distributed import leave
    from .progress import hide_bars
    from .resume import resumed_config
    from .trainer import Trainer

    cfg, checkpoint = resumed_config(args.config, overrides)  # (a resume: the run's own config, as overridden)
    check_finetune(cfg)  # before minutes of loading and tokenizing
    machine = _machine(args.machine)
    if args.no_progress:  # checkpoints and the export included
        hide_bars()
    try:
        trainer = Trainer(cfg, progress=not args.no_progress, machine=machine, checkpoint=checkpoint)
        if cfg.resume == "auto" and trainer.resumed_from is None:
            say(f"resume=auto: no checkpoint in {trainer.checkpoints}, so the run starts from step 0")
        trainer.fit()
    finally:
        leave()  # (data-parallel ranks: their process group)
    return 0


def _machine(path: str | None):
    from .machines import load_machine

    return load_machine(path) if path else None


def cmd_data(args, overrides) -> int:
    from .data import build_data, render_examples
    from .models.build import load_model

    cfg = load_config(args.config, overrides)
    check_data(cfg)
    model = load_model(cfg.model, cfg.seed, need_tokenizer=cfg.data.format != "tokens")
    data = build_data(cfg.data, model.tokenizer, cfg.seq_len, cfg.micro_batch_size, cfg.seed,
                      vocab_size=model.hf_config.vocab_size)
    print(data.summary())  # (the examples below without a summary of their own)
    print(render_examples(cfg.data, model.tokenizer, cfg.seq_len, n=args.n, loaded=data.loaded, summary=False))
    return 0


def cmd_plan(args, overrides) -> int:
    import json

    from .disk_tier import nvme_dirs, on_drives
    from .launch import measured_machine, plan_run
    from .machines import resolve_machine
    from .models.build import check_fits, load_model
    from .plan import advice, aux_loss_text, checkpoint_cost, describe, drive_figures, params_text

    cfg = load_config(args.config, overrides)
    named = args.machine or os.environ.get("SLIDE_MACHINE")
    machine = resolve_machine(args.machine)  # (this machine's disk is measured once the plan puts something there)

    def measure_disk():
        nonlocal machine
        machine = measured_machine(cfg)
        return machine

    if cfg.engine.device.startswith("cuda") and not machine.has_gpu:  # (plan_run would plan for the CPU)
        where = f"the machine file {named} has no GPU" if named else "no CUDA device is available here"
        raise ConfigError(f"engine.device={cfg.engine.device}, but {where}: `slide-train plan --machine FILE` "
                          "prices a GPU machine (FILE from `slide-train probe --out FILE` on it)")
    model = load_model(cfg.model, cfg.seed, need_tokenizer=False, need_weights=False)  # config.json is enough
    if args.longest:
        cfg = longest(cfg, model, machine, args.nproc)
    check_fits(model, cfg.seq_len)
    plan, _, _ = plan_run(cfg, model, machine, running=False, ranks=args.nproc,
                          measure_disk=None if named else measure_disk)
    machine = on_drives(machine, nvme_dirs(cfg, machine))  # (the drives the plan put the tier's folders on)
    if args.json:
        print(json.dumps({"model": cfg.model, "params": sum(plan.placement.shapes.unit_numels),
                          "ranks": args.nproc,
                          "tokens_per_step": cfg.micro_batch_size * cfg.seq_len * cfg.grad_accum * args.nproc,
                          "machine": machine.to_dict(), **plan.to_dict(), **advice(plan),
                          **dict(zip(("checkpoint_bytes", "checkpoint_s"), checkpoint_cost(plan, machine))),
                          **({"drives": drive_figures(plan, machine)} if len(machine.drives) > 1 else {})},
                         indent=1))
    else:
        shapes = plan.placement.shapes
        ranks = f" per rank, {args.nproc} ranks (host memory below: one rank)" if args.nproc > 1 else ""
        print(f"model: {cfg.model} ({model.hf_config.model_type}, {params_text(sum(shapes.unit_numels))} params, "
              f"{plural(shapes.num_blocks, 'block')}); {cfg.grad_accum} x {cfg.micro_batch_size} x {cfg.seq_len} "
              f"tokens per step{ranks}; machine: {named or 'this one (last probe)'}"
              f"{aux_loss_text(cfg, model.hf_config)}")
        print(describe(plan, machine, cfg))
    return 0 if plan.fits else 2


# What lifts each tier's limit, for the line that says which one binds the next length
LIFTS = {"gpu": "a larger engine.gpu_memory_limit_gb (or GPU)",
         "host": "engine.nvme.fraction=auto with a drive for engine.nvme.dir, engine.activation_offload=disk, or more "
                 "host memory",
         "disk": "more free space under engine.nvme.dir (or another drive beside it)"}


def longest(cfg, model, machine, nproc: int):
    """The config with the longest seq_len (a multiple of 128) whose plan fits on `machine`, the other settings as
    they are (the planner's search over one stack, every tier choice included where the config leaves it to the
    plan); it says so in one line, and what binds the next length."""
    import dataclasses

    from slide_scheduler import StepShape, longest_rows, place

    from .launch import overrides_of, plan_run

    limit = getattr(model.hf_config, "max_position_embeddings", None) or 1 << 22
    plan = plan_run(cfg, model, machine, running=False, ranks=nproc)[0]  # (the stack, the run and the budgets)
    p = plan.placement
    # (`auto` stays the planner's choice at each length: the plan above froze the tier of the configured one)
    run = dataclasses.replace(p.run, activations="auto") if cfg.engine.activation_offload == "auto" else p.run
    overrides = overrides_of(cfg, p.shapes.num_blocks)
    step = StepShape(cfg.micro_batch_size * cfg.seq_len, cfg.grad_accum, cfg.seq_len)
    found = longest_rows(p.shapes, step, run, plan.budgets, machine, overrides, limit=limit)
    if found is None:
        raise ConfigError(f"not even rows of 128 tokens fit this machine with micro_batch_size="
                          f"{cfg.micro_batch_size}: see `slide-train plan` for what would")
    print(f"longest: rows of {found:,} tokens fit (micro_batch_size {cfg.micro_batch_size}, the model's limit "
          f"{limit:,}); its plan:")
    if found + 128 <= limit:
        longer = found + 128
        beyond = place(p.shapes, StepShape(cfg.micro_batch_size * longer, cfg.grad_accum, longer), run, plan.budgets,
                       machine, overrides)
        for problem in beyond.problems:
            tier = problem.split(":")[0]
            print(f"  at {longer:,} tokens, what binds: {problem}" + (f"; {LIFTS[tier]} would lift it"
                                                                       if tier in LIFTS else ""))
    else:
        print("  the model's position limit binds (max_position_embeddings)")
    return dataclasses.replace(cfg, seq_len=found)


def cmd_probe(args, overrides) -> int:
    import yaml

    from .machines import probe_this_machine, written_lines

    machine, written = probe_this_machine(disk_dir=args.disk, quick=args.quick, out=args.out)
    print(written_lines(written, args.out), file=sys.stderr)  # (stdout: the machine file itself)
    print(yaml.safe_dump(machine.to_dict(), sort_keys=False), end="")
    return 0


def cmd_export(args, overrides) -> int:
    from .export import export_run

    out = export_run(args.run_dir, step=args.step, out=args.out)
    print(f"exported to {out}")
    return 0


def cmd_presets(args, overrides) -> int:
    from .models.presets import PRESETS

    rows = [(name, spec["model_type"], f"hidden {spec['hidden_size']},", f"{spec['num_hidden_layers']} layers")
            for name, spec in PRESETS.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:  # (columns as wide as their longest entry)
        print("  ".join(text.ljust(width) for text, width in zip(row, widths)), row[3].rjust(9))
    return 0


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slide-train", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    p = _config_parser(sub, "finetune", "fine-tune every parameter of a model (default: the built-in tiny demo)",
                       "YAML file (optional: every key has a default), or a run's folder with --resume=auto (a "
                       "resume continues with the run's own config; keys given override it)")
    p.add_argument("--machine", default=None,
                   help="a machine file for the placement (default: the last probe of this machine)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars, for training, tokenizing, weights, checkpoints or the export (logs "
                        "still go to metrics.jsonl)")
    p.set_defaults(func=cmd_finetune)
    p = _config_parser(sub, "data", "print a few training rows as the model sees them, with the label mask")
    p.add_argument("-n", type=_positive, default=3, help="how many examples")
    p.set_defaults(func=cmd_data)
    p = _config_parser(sub, "plan", "print a run's placement and predicted step on a machine, without training "
                                    "(exit 0 when it fits, 2 when not)")
    p.add_argument("--machine", default=None, help="a machine file (default: the last probe of this machine)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--longest", action="store_true",
                   help="plan the longest seq_len that fits this machine and the other settings")
    p.add_argument("--nproc", type=_positive, default=1,
                   help="data-parallel ranks on the machine (torchrun --nproc-per-node): each GPU's plan, the host's "
                        "memory shared")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("probe", help="measure this machine (GPU, PCIe, host memory and AdamW, disk) as a machine file")
    p.add_argument("--out", default=None, help="also write the machine file here (the last probe of this machine, "
                                               "which runs use without --machine, is kept either way)")
    p.add_argument("--disk", default=None, action="append",
                   help="measure the disk of this folder (default: the current one); give it once per drive to "
                        "measure several, which the machine file then lists as disks")
    p.add_argument("--quick", action="store_true", help="a few seconds, smaller transfers (rougher figures)")
    p.set_defaults(func=cmd_probe)
    p = sub.add_parser("export", help="write a run's weights as an HF model directory")
    p.add_argument("run_dir", help="the run's folder (its output_dir), which holds config.yaml and checkpoints/")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/export)")
    p.set_defaults(func=cmd_export)
    sub.add_parser("presets", help="list the built-in model presets").set_defaults(func=cmd_presets)

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["finetune"]
    # `--profile` alone is the config key's `--profile=true` (which, like `--profile=false`, is an override)
    argv = ["--profile=true" if a == "--profile" else a for a in argv]
    args, rest = parser.parse_known_args(argv)
    overrides = [a for a in rest if a.startswith("--") and "=" in a]
    unknown = [a for a in rest if a not in overrides]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides look like --key.sub=value)")
    if args.command is None:
        parser.print_help()
        return 2
    with console():
        try:
            return args.func(args, overrides)
        except (SlideError, OSError) as e:  # OSError: a path that cannot be read or written (read-only, ...)
            print(f"slide-train: error: {e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
