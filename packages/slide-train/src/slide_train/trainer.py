"""The trainer: the loop of a launched run (launch.py builds its model, data and engine from one `TrainConfig`),
with its checkpoints, metrics and export.

    trainer = Trainer(load_config(overrides=["--steps=10"]))
    for _ in range(3):
        print(trainer.step())        # one optimizer step -> its metrics
    trainer.fit()                    # the rest of the run, with progress, checkpoints and export
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import shutil
import signal
import sys
import time
import warnings

import torch
import yaml

from slide_scheduler import DISK, Machine, plot_timeline, write_trace

from . import checkpoint as ckpt
from .batches import count_targets, prepare
from .config import TrainConfig, to_dict
from .disk_tier import ACTIVATIONS_DIR, STATES_DIR, default_disk_folders, nvme_dirs, on_drives, slow_disk_warning
from .errors import TrainingError, plural
from .export import base_dir, export_dtype, export_hf, save_base_files
from .launch import launch
from .log import open_run_log, say
from .metrics import MetricsLog, gpu_peak_gib, host_rss_gib, plot_loss, read_metrics, step_figures
from .models.build import BASE_MODEL_DIR, saved_model_source
from .plan import aux_loss_text, describe, params_text
from .resume import saved_config
from .schedule import lr_at


def attention_flops_per_token(hf_config, seq_len: int) -> float:
    """Causal attention's FLOPs per token over forward and backward, as PaLM counts them with the causal half:
    6 x layers x (heads x head_dim) x the sequence length (rows of seq_len tokens; packed documents do less)."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 6 * hf_config.num_hidden_layers * heads * head_dim * seq_len


class Trainer:
    def __init__(self, cfg: TrainConfig, progress: bool = True, machine: Machine | None = None,
                 checkpoint: pathlib.Path | None = None):  # (one `resumed_config` found and verified)
        self.progress = progress
        run = launch(cfg, progress, machine, checkpoint)
        self.cfg = cfg = run.cfg
        self.ranks, self.model, self.data, self.machine = run.ranks, run.model, run.data, run.machine
        self.engine, self.memory_plan, self._resume_path = run.engine, run.plan, run.resume_path
        self.run_dir = pathlib.Path(cfg.output_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        self.num_params = sum(u.layout.base_numel for u in self.engine.units)
        shapes = self.memory_plan.placement.shapes  # (a mixture of experts computes with its routed experts only)
        self.active_params = shapes.unit_numels[0] + sum(shapes.active(u) for u in range(1, shapes.num_blocks + 1))
        self.attention_flops = attention_flops_per_token(self.model.hf_config, cfg.seq_len)
        per_step = cfg.micro_batch_size * cfg.grad_accum * self.ranks.size
        self.total_steps = math.ceil(self.data.train.rows_in(cfg.epochs) / per_step) if cfg.epochs else cfg.steps
        self.step_index = 0
        self._disk_warned = False  # (the warning that the disk is slower than the machine file says, given once)
        self.ranks.share(0)  # (every rank has looked for an earlier run before the first clears it)
        if self.lead:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for path in run.outputs:  # --overwrite: cleared only now that the new run could be built
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            open_run_log(self.run_dir)  # (the command line's: what it said so far, then the rest)
        self.resumed_from = self._resume() if cfg.resume else None
        # Checkpoints after the one resumed from belong to a course this run replaces: deleted at its first save.
        self._replaces_after = ckpt.step_of(self.resumed_from) if self.resumed_from is not None else None
        # Written once the run is known to go ahead: a refused resume leaves the run's config as it was.
        if self.lead:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            if not save_base_files(self.model, self.run_dir / BASE_MODEL_DIR):  # what `slide-train export` reads
                warnings.warn(f"{self.run_dir / BASE_MODEL_DIR} was not written by slide-train: left alone; "
                              f"`slide-train export` will read {cfg.model} instead", stacklevel=2)
        self.log = MetricsLog(self.run_dir, first_step=self.step_index + 1, writes=self.lead)
        self._stop_signal: int | None = None
        self._eval: tuple[list, int] | None = None
        self._finite_at: int | None = None  # the step whose weights were last checked finite

    # -- checkpoints ----------------------------------------------------------------------------------------------

    @property
    def lead(self) -> bool:
        """Whether this process writes the run's files (the first rank; every rank computes)."""
        return self.ranks.lead

    def _resume(self) -> pathlib.Path | None:
        path = self._resume_path
        if path is not None:
            state = ckpt.load_checkpoint(path, self.engine)
            self.step_index = state["step"]
            self.data.train.load_state_dict(state["data"])
            if state.get("total_steps") != self.total_steps:
                warnings.warn(f"resuming a run planned for {state.get('total_steps')} steps as a run of "
                              f"{self.total_steps}: the learning-rate schedule changes from here on", stacklevel=2)
            started = state.get("model")  # (checkpoints from before it was saved: nothing to compare)
            if started is not None and started != self.model.identity:  # same shapes: the load checked those
                warnings.warn(f"resuming {path} of a run that started from model {started}, now given "
                              f"{self.model.identity}: its weights come from the checkpoint, not from that model",
                              stacklevel=2)
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.is_file() and self.lead:  # drop records of steps after the checkpoint: they will be redone
            kept = [r for r in read_metrics(metrics) if r["step"] <= self.step_index]
            metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
        return path

    def _check_weights(self, what: str) -> None:
        """Non-finite weights (an update that overflowed) never reach a checkpoint or an export. Once per step:
        the last checkpoint (which checks each master as it writes it) and the export read the same weights."""
        if self._finite_at == self.step_index:
            return
        self.engine.synchronize()
        error = None
        for k, name in enumerate(self.engine.unit_names()):
            master = self.engine.master(k)  # (data-parallel: gathered on the first rank, which checks it)
            if error is None and master is not None:
                try:
                    self._check_master(what, name, master)
                except TrainingError as e:
                    error = e
        if self.ranks.share(float(error is not None)) and error is None:
            error = TrainingError(f"after step {self.step_index} the weights are not finite (the first rank's "
                                  f"message names them): no {what} is written")
        if error is not None:
            raise error
        self._finite_at = self.step_index

    def _check_master(self, what: str, name: str, master: torch.Tensor) -> None:
        if not bool(torch.isfinite(master).all()):
            raise TrainingError(f"after step {self.step_index} the weights of {name} are not finite: no {what} is "
                                f"written. Lower optimizer.lr (now {self.cfg.optimizer.lr}) or keep max_grad_norm "
                                "set")

    def save_checkpoint(self, required: bool = True) -> pathlib.Path | None:
        """Checkpoint the current step. A periodic one (`required=False`) that does not fit on the disk is
        skipped with a warning, and training goes on; a final or stopping one raises. None with
        checkpoint.keep=0 (no checkpoints)."""
        if not self.cfg.checkpoint.keep:
            return None
        state = {"step": self.step_index, "total_steps": self.total_steps, "data": self.data.train.state_dict(),
                 "model": self.model.identity, "config": saved_config(self.cfg), "ranks": self.ranks.size}
        checked = self._finite_at == self.step_index
        check = None if checked else lambda name, master: self._check_master("checkpoint", name, master)
        while True:
            try:
                path = ckpt.save_checkpoint(self.checkpoints, self.step_index, self.engine, state, check=check)
                self._finite_at = self.step_index
                break
            except ckpt.DiskFullError as e:
                if not required:
                    warnings.warn(f"{e}. Training goes on; the next checkpoint tries again.", stacklevel=2)
                    return None
                # The last (or stopping) checkpoint holds the run's final weights: others make room for it, once
                # those weights are known to be worth it.
                self._check_weights("checkpoint")
                spare = ckpt.spare(self.checkpoints, self._replaces_after, self.step_index)
                if not self.ranks.share(float(bool(spare))):  # (the first rank's files decide)
                    raise
                if self.lead:
                    warnings.warn(f"{e}. Deleting {spare[0].name} to make room for this one", stacklevel=2)
                    shutil.rmtree(spare[0])
        replaced = ckpt.replaced(self.checkpoints, self._replaces_after, self.step_index) if self.lead else []
        for old in replaced:
            shutil.rmtree(old)
        if replaced:
            warnings.warn(f"deleted {', '.join(p.name for p in replaced)}: checkpoints of the course this run "
                          f"replaced when it resumed from step-{self._replaces_after}", stacklevel=2)
        self._replaces_after = None
        if self.lead:
            ckpt.prune(self.checkpoints, self.cfg.checkpoint.keep)
        return path

    def _on_signal(self, signum, frame) -> None:
        self._stop_signal = signum  # finish the step in flight, then checkpoint and stop

    # -- stepping -----------------------------------------------------------------------------------------------

    def step(self) -> dict:
        cfg = self.cfg
        start = time.perf_counter()  # throughput counts the step from its data to the engine's figures
        # Every rank reads the step's rows and runs its share of the micro-batches (distributed.py)
        r = self.ranks
        batches = [self.data.train.next_micro_batch() for _ in range(cfg.grad_accum * r.size)]
        micro = [prepare(b) for b in batches]
        targets = count_targets(micro)
        tokens = sum(int((b["document_ids"] >= 0).sum()) for b in batches)
        s = cfg.schedule
        lr = lr_at(self.step_index, self.total_steps, cfg.optimizer.lr, s.warmup_steps, s.decay, s.min_lr_ratio)
        stats = self.engine.step(micro[r.rank::r.size], lr=lr, normalizer=max(targets, 1))
        if not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)):
            last = ckpt.list_checkpoints(self.checkpoints)
            kept = f"the latest, {last[-1].name}, is intact" if last else "none was written"
            raise TrainingError(
                f"step {self.step_index + 1}: loss {stats.loss}, gradient norm {stats.grad_norm}: training stops "
                f"before non-finite weights reach a checkpoint ({kept}). Lower optimizer.lr (now "
                f"{cfg.optimizer.lr}), keep max_grad_norm set, or check the data")
        self.step_index += 1
        # (not the profile, diagnostics written once, nor the metrics line: a few milliseconds after this)
        seconds = time.perf_counter() - start
        if cfg.profile and self.step_index == min(3, self.total_steps) and self.lead:
            self.write_profile(stats)
        record = {
            "step": self.step_index,
            "loss": stats.loss,
            "lr": lr,
            "grad_norm": stats.grad_norm,
            "speculation": stats.speculation,
            "tokens": tokens,
            "target_tokens": targets,
            "step_s": seconds,
            "predicted_step_s": (self.memory_plan.estimate_unclipped if stats.speculation == "held"
                                 else self.memory_plan.estimate).step_s,
            "tokens_per_s": tokens / seconds,
            # Model FLOPs only (6 per active parameter per token), as peers and papers count them: no recompute.
            "tflops": 6 * self.active_params * tokens / seconds / 1e12,
            # ... and with causal attention's own work, which grows with the sequence (DESIGN section 8)
            "tflops_attn": (6 * self.active_params + self.attention_flops) * tokens / seconds / 1e12,
            # The engine's own step, and the rest of the step (the GPU idles then): preparing the data,
            # reading the step's timeline.
            "engine_step_s": stats.seconds,
            "outside_engine_s": seconds - stats.seconds,
            "gpu_peak_gib": gpu_peak_gib(self.engine.device),
            "host_rss_gib": host_rss_gib(),
            "epoch": self.data.train.epoch,
            **{f"{k}_s": v for k, v in stats.phases.items()},
            **stats.timeline,
        }
        # A mixture of experts: the experts' least and most load (and its load-balancing loss where on)
        routing = getattr(self.engine.edges, "routing_summary", None)
        record |= (routing() if routing else None) or {}
        self.log.write(record)
        self._check_disk_rate(record)
        return record

    def _check_disk_rate(self, record: dict) -> None:
        """Warn once where the NVMe tier moved its bytes much slower than the machine file's disk figures."""
        if not self._disk_warned and (text := slow_disk_warning(record, self.machine, self.cfg)) is not None:
            self._disk_warned = True
            warnings.warn(text, stacklevel=3)

    def write_profile(self, stats) -> None:
        """timeline.png and trace.json of one engine step (`stats`: what `engine.step` returned) in the run dir."""
        write_trace(stats.spans, self.run_dir / "trace.json")
        t = stats.timeline
        title = (f"step {self.step_index}: {stats.seconds * 1e3:.0f} ms, GPU busy {t['gpu_busy_s'] * 1e3:.0f} ms, "
                 f"exposed {t['exposed_s'] * 1e3:.0f} ms")
        try:
            plot_timeline(stats.spans, self.run_dir / "timeline.png", title)
        except ImportError as e:
            warnings.warn(f"no timeline.png: {e}", stacklevel=2)

    def evaluate(self) -> dict:
        """Validation loss (mean over label tokens) and perplexity on the held-out micro-batches."""
        if self._eval is None:  # the held-out micro-batches are fixed: prepared and counted once
            micro = [prepare(b) for b in self.data.eval]
            self._eval = micro, count_targets(micro)
        micro, targets = self._eval
        r = self.ranks  # (each rank its share of them: the engine sums the loss over ranks)
        group = self.cfg.grad_accum * r.size  # as many micro-batches at once as a training step holds
        loss = sum(self.engine.evaluate(micro[i : i + group][r.rank::r.size], normalizer=max(targets, 1))
                   for i in range(0, len(micro), group))
        record = {"step": self.step_index, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}
        self.log.write(record)
        return record

    # -- the whole run --------------------------------------------------------------------------------------------

    def plan(self) -> str:
        cfg, e = self.cfg, self.engine
        ranks = self.ranks.size
        tokens = cfg.micro_batch_size * cfg.grad_accum * cfg.seq_len * ranks
        return (f"model: {self.model.name} ({self.model.hf_config.model_type}, {params_text(self.num_params)} "
                f"params, {e.num_blocks} blocks){aux_loss_text(cfg, self.model.hf_config)}\n{self.data.summary()}\n"
                f"steps: {self.total_steps} x {cfg.grad_accum} micro-batches of {cfg.micro_batch_size} x "
                f"{cfg.seq_len}{f' on each of {ranks} ranks' if ranks > 1 else ''} = {tokens} tokens per step"
                f"{' (host memory below: one rank)' if ranks > 1 else ''}\n"
                f"engine: {e.device} {str(e.dtype).removeprefix('torch.')} compute, "
                f"{'pipelined' if e.config.pipeline else 'synchronous'}\n"
                f"{describe(self.memory_plan, on_drives(self.machine, nvme_dirs(cfg, self.machine)), cfg)}\n"
                + "".join(f"NVMe tier: {s.directory}, {s.path} ({s.path_reason}), page cache "
                          f"{'bypassed' if s.direct else 'used'}\n" for s in e.disk_stores())
                + f"run dir: {self.run_dir}")

    def fit(self) -> dict | None:
        say(self.plan())
        if self.resumed_from is not None:
            say(f"resumed from {self.resumed_from} at step {self.step_index}")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()

    def _loop(self) -> dict | None:
        from tqdm.auto import tqdm

        cfg = self.cfg
        last = None
        # A bar on a terminal; elsewhere (a log file, CI) a plain line every `line_every` steps, first and last too.
        bar_shown = self.progress and sys.stderr.isatty() and self.lead
        steps = tqdm(total=self.total_steps, initial=self.step_index, disable=not bar_shown, unit="step",
                     dynamic_ncols=True)
        line_every = max(1, self.total_steps // 20)
        start = time.perf_counter()
        while self.step_index < self.total_steps:
            last = self.step()
            steps.update(1)
            figures = step_figures(last, on_gpu=self.engine.device.type == "cuda")
            steps.set_postfix_str(figures)
            i = self.step_index
            if i % line_every == 0 or i == self.total_steps or i == 1:  # log.txt keeps each, bar or --no-progress
                say(f"step {i}/{self.total_steps}: {figures}", screen=self.progress and not bar_shown)
            if cfg.eval_every and self.step_index % cfg.eval_every == 0:
                ev = self.evaluate()
                say(f"step {self.step_index}: validation loss {ev['eval_loss']:.4f} (ppl {ev['eval_ppl']:.2f})")
            # (a signal reaches the ranks at different times: all stop after the step any of them was told to)
            every, stop = cfg.checkpoint.every, self.ranks.any(self._stop_signal is not None)
            if stop or (every and self.step_index % every == 0 and self.step_index < self.total_steps):
                path = self.save_checkpoint(required=stop)  # a periodic one may be skipped; the last one below
                if stop:
                    steps.close()
                    self.log.close()
                    self._stop_signal = self._stop_signal or signal.SIGTERM
                    name = signal.Signals(self._stop_signal).name
                    saved = "no checkpoint (checkpoint.keep=0)" if not cfg.checkpoint.keep else \
                        f"checkpoint {path} (continue with --resume=auto)"
                    say(f"{name}: stopped after step {self.step_index}; {saved}")
                    raise SystemExit(128 + self._stop_signal)
        steps.close()
        self.save_checkpoint()
        if self.data.eval is not None and (not cfg.eval_every or self.step_index % cfg.eval_every):
            self.evaluate()
        self.log.close()
        if self.lead:
            plot_loss(self.log.path, self.run_dir / "loss.png")
        say(f"done: {plural(self.step_index, 'step')} in {time.perf_counter() - start:.1f}s; metrics in "
            f"{self.log.path}")
        if cfg.export:
            out = self.export()
            say(f"exported to {out}")
        return last

    def close(self) -> None:
        """Finish pending updates and stop the engine's worker threads (which removes the state files it kept
        on disk); the NVMe tier's folders are removed once empty, the user's own engine.nvme.dir kept."""
        self.engine.close()
        if self.memory_plan.placement.bytes(DISK):
            folders = nvme_dirs(self.cfg, self.machine)
            for empty in [*(f / sub for f in folders for sub in (STATES_DIR, ACTIVATIONS_DIR)),
                          *map(pathlib.Path, default_disk_folders(self.cfg))]:
                with contextlib.suppress(OSError):
                    os.rmdir(empty)

    def export(self, directory: str | pathlib.Path | None = None) -> pathlib.Path:
        """The current weights as an HF model directory (default RUN_DIR/export), with the base model's generation
        config, tokenizer and chat template files (from the run's copy of them)."""
        dtype = export_dtype(self.cfg.export_dtype, self.model.dtype)
        directory = pathlib.Path(directory or self.run_dir / "export")
        self._check_weights("export")
        if not self.lead:  # its shards gathered for the first rank's files
            self.engine.named_masters()
            return directory
        # On a disk too small for the export the checkpoints stay as they are: say how to finish it elsewhere.
        latest = ckpt.list_checkpoints(self.checkpoints)
        later = f"`slide-train export {self.run_dir} --out DIR`"
        if latest and ckpt.step_of(latest[-1]) == self.step_index:
            hint = (f"checkpoint {latest[-1]} holds these weights and is intact: finish the export on a disk with "
                    f"room with {later}")
        elif self.cfg.checkpoint.keep:
            hint = f"free some space, export elsewhere, or save a checkpoint and export it with {later}"
        else:
            hint = ("free some space or export elsewhere: this run keeps no checkpoint (checkpoint.keep=0) for "
                    f"{later} to read")
        source = base_dir(saved_model_source(self.run_dir, self.model.name))
        return export_hf(directory, self.model.hf_config, self.engine.named_masters(), self.model.tokenizer, dtype,
                         source=source, hint=hint)
