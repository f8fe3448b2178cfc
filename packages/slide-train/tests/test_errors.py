"""Bad input fails early with a message that names what is wrong and what would fix it."""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import re
import warnings

import pytest
import torch
import transformers
from conftest import save_tiny_model, write_token_rows
from safetensors import SafetensorError

from slide_train.cli import main
from slide_train.config import load_config
from slide_train.errors import CheckpointError, ConfigError, DiskFullError, ExportError, ModelError, TrainingError
from slide_train.export import export_run
from slide_train.machines import resolve_machine
from slide_train.metrics import read_metrics
from slide_train.models.build import load_model
from slide_train.trainer import Trainer


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'optimizer.lrr'.*did you mean optimizer.lr\?"):
        load_config(None, ["--optimizer.lrr=1e-4"])
    with pytest.raises(ConfigError, match=r"did you mean seq_len\?"):
        load_config(None, ["--seqlen=64"])


def test_wrong_types_and_values_name_the_key():
    with pytest.raises(ConfigError, match="steps must be an integer"):
        load_config(None, ["--steps=ten"])
    with pytest.raises(ConfigError, match="schedule.decay must be one of constant, cosine, linear"):
        load_config(None, ["--schedule.decay=exp"])
    with pytest.raises(ConfigError, match="micro_batch_size must be at least 1"):
        load_config(None, ["--micro_batch_size=0"])


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seq_len: 64\noptimizer:\n  lr: 1e-4\n  betas: [0.9, 0.99]\nengine:\n  placement:\n"
                    "    window: 3\n    resident: [edges, block.1]\n")
    cfg = load_config(path, ["--engine.placement.window=1", "--max_grad_norm=null"])
    assert (cfg.seq_len, cfg.optimizer.lr, cfg.optimizer.betas) == (64, 1e-4, (0.9, 0.99))
    assert cfg.engine.placement == {"window": 1, "resident": ["edges", "block.1"]} and cfg.max_grad_norm is None
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_unsupported_model_type_lists_supported(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ModelError, match=r"model_type 'gpt2' has no adapter yet; supported: llama .*qwen3"):
        load_model(str(tmp_path / "gpt2"))


def test_missing_or_broken_model_directory(tmp_path):
    with pytest.raises(ModelError, match="neither a built-in preset .* nor an existing directory"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        load_model(str(tmp_path / "empty"))
    save_tiny_model(tmp_path / "m", "llama")
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save({}, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ModelError, match="pickle checkpoints are not loaded"):
        load_model(str(tmp_path / "m"))


def test_truncated_weights_are_named(tmp_path):
    save_tiny_model(tmp_path / "m", "llama")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelError, match=r"model.safetensors.*(truncated|corrupt)"):
        Trainer(load_config(None, [f"--model={tmp_path / 'm'}", f"--output_dir={tmp_path / 'run'}"]),
                progress=False)


def test_seq_len_beyond_the_model(tmp_path):
    save_tiny_model(tmp_path / "m", "llama")  # max_position_embeddings = 256
    cfg = load_config(None, [f"--model={tmp_path / 'm'}", "--seq_len=512", f"--output_dir={tmp_path / 'r'}"])
    with pytest.raises(ConfigError, match="seq_len=512 is larger than the model's max_position_embeddings=256"):
        Trainer(cfg, progress=False)


def test_dataset_without_tokens(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    cfg = load_config(None, [f"--data.path={tmp_path / 'empty.txt'}", f"--output_dir={tmp_path / 'r'}"])
    with pytest.raises(Exception, match="empty.txt") as info:
        Trainer(cfg, progress=False)
    assert "token" in str(info.value)


def test_cli_prints_errors_without_traceback(tmp_path, capsys):
    assert main(["finetune", "--optimizer.lrr=1", f"--output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "did you mean optimizer.lr?" in err and "Traceback" not in err


def test_corrupted_checkpoint_is_refused_and_auto_falls_back(tmp_path):
    save_tiny_model(tmp_path / "m", "llama")
    rows = torch.randint(3, 259, (16, 16)).tolist()
    write_token_rows(tmp_path / "d.jsonl", rows)
    base = [f"--model={tmp_path / 'm'}", f"--data.path={tmp_path / 'd.jsonl'}", "--data.format=tokens",
            "--seq_len=16", "--micro_batch_size=2", "--grad_accum=1", "--engine.device=cpu",
            f"--output_dir={tmp_path / 'run'}", "--checkpoint.every=1", "--checkpoint.keep=3", "--export=false"]
    Trainer(load_config(None, base + ["--steps=2"]), progress=False).fit()
    newest = tmp_path / "run" / "checkpoints" / "step-2" / "block-001.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the tensor data
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"block-001.safetensors does not match its checksum"):
        Trainer(load_config(None, base + ["--steps=3", f"--resume={newest.parent}"]), progress=False)
    with pytest.warns(UserWarning, match="skipping damaged checkpoint.*step-2"):
        trainer = Trainer(load_config(None, base + ["--steps=3", "--resume=auto"]), progress=False)
    assert trainer.step_index == 1
    manifest = json.loads((newest.parent / "manifest.json").read_text())
    assert "block-001.safetensors" in manifest["files"]


def test_a_resume_with_another_model_of_the_same_shapes_says_whose_weights_train(tmp_path, monkeypatch):
    """The checkpoint holds every weight, so a resume given another model of the same shapes continues the
    checkpoint's weights; it says so, naming both models, and stays silent when the model is the same, however
    its path is written."""
    for name, seed in (("m", 0), ("other", 1)):
        torch.manual_seed(seed)
        save_tiny_model(tmp_path / name, "llama")
    write_token_rows(tmp_path / "d.jsonl", torch.randint(3, 259, (16, 16)).tolist())
    base = [f"--data.path={tmp_path / 'd.jsonl'}", "--data.format=tokens", "--seq_len=16", "--micro_batch_size=2",
            "--grad_accum=1", "--engine.device=cpu", f"--output_dir={tmp_path / 'run'}", "--checkpoint.every=1",
            "--export=false", "--steps=2"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    first = Trainer(load_config(None, [*base, "--model=m"]), progress=False)
    first.fit()
    saved = {k: v.clone() for k, v in first.engine.named_masters()["block.0"].items()}
    for model, warned in (("m", False), ("./m/", False), (str(tmp_path / "m"), False), ("~/m", False),
                          ("other", True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = Trainer(load_config(None, [*base, f"--model={model}", "--resume=auto"]), progress=False)
        said = [str(w.message) for w in caught if "started from model" in str(w.message)]
        assert bool(said) == warned, (model, said)
        if warned:
            assert str(tmp_path / "m") in said[0] and str(tmp_path / "other") in said[0]
        masters = resumed.engine.named_masters()["block.0"]
        assert all(masters[k].equal(v) for k, v in saved.items())  # the checkpoint's weights either way
        resumed.close()


def test_an_earlier_run_is_never_silently_mixed_with_a_new_one(tmp_path):
    base = ["--steps=2", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false",
            f"--output_dir={tmp_path / 'run'}"]
    Trainer(load_config(None, base), progress=False).fit()
    with pytest.raises(CheckpointError, match=r"holds an earlier run .*step-2.*--resume=auto.*--overwrite=true"):
        Trainer(load_config(None, base), progress=False)
    fresh = Trainer(load_config(None, [*base, "--overwrite=true"]), progress=False)
    assert fresh.step_index == 0 and not (tmp_path / "run" / "checkpoints" / "step-2").exists()
    fresh.close()


@pytest.mark.parametrize("override, message", [
    ("--optimizer.lr=nan", "optimizer.lr must be a finite number"),
    ("--max_grad_norm=inf", "max_grad_norm must be a finite number"),
    ("--steps=nan", "steps must be a finite number"),
    ("--seq_len=.inf", "seq_len must be a finite number"),
    ("--optimizer.betas=[0.9,nan]", "optimizer.betas must be a finite number"),
    ("--engine.placement.resident=-1", "engine.placement.resident must be a count of at least 0 or a list"),
    ("--engine.placement.resident=[edges,blocks.2]", "engine.placement.resident must be a count .* or a list"),
    ("--engine.placement.device_update_share=1.5", r"engine.placement.device_update_share must be in \[0, 1\]"),
    ("--engine.states_dtype=bf16 --engine.placement.device_update_share=0.5",
     "set it to 0 with engine.states_dtype=bf16"),
    ("--engine.placement.window=0", "engine.placement.window must be an integer of at least 1"),
    ("--engine.placement.synchronous=maybe", "engine.placement.synchronous must be true or false"),
    ("--engine.placement.speculation_pause=1", "engine.placement.speculation_pause must be true or false"),
    ("--engine.placement.held_grads=2", "unknown key engine.placement.held_grads; the expert overrides are window"),
    ("--engine.device=gpu", "engine.device must be auto, cpu, cuda or cuda:N"),
    ("--engine.nvme.fraction=1.5", r"engine.nvme.fraction is the share .* in \[0, 1\], or auto, got 1.5"),
    ("--engine.nvme.fraction=most", r"engine.nvme.fraction is the share .* in \[0, 1\], or auto, got most"),
    ("--engine.window=3", r"'engine.window' was replaced by engine.placement.window"),
    ("--engine.resident=2", r"'engine.resident' was replaced by engine.placement.resident"),
    ("--engine.pipeline=false", r"'engine.pipeline' was replaced by engine.placement.synchronous"),
    ("--engine.optimizer_offload.nvme_fraction=0.5", r"'engine.optimizer_offload' was replaced by engine.nvme"),
    ("--engine.activation_dir=/tmp/x", r"'engine.activation_dir' was replaced by engine.nvme.dir"),
    ("--engine.grads_share_activations=true", r"'engine.grads_share_activations' was replaced by nothing: the "
                                              "placement shares"),
    ("--engine.activation_offload=ram", r"engine.activation_offload must be one of auto, gpu, host, disk"),
    ("--checkpoint.every=-2", "checkpoint.every must be 0 or more"),
    ("--schedule.min_lr_ratio=3", r"schedule.min_lr_ratio must be in \[0, 1\]"),
    ("--optimizer.eps=0", "optimizer.eps must be positive"),
    ("--resume=true", "resume must be 'auto' or the path"),
    ("--checkpoint.keep=0 --resume=auto", "checkpoint.keep=0 writes no checkpoint.*keep at least 1 to resume"),
    ("--checkpoint.keep=0 --checkpoint.every=5", "checkpoint.every=5 with checkpoint.keep=0"),
    ("--checkpoint.keep=-1", "checkpoint.keep must be 0 or more"),
])
def test_impossible_values_are_refused_up_front(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split())


def test_a_full_disk_skips_a_periodic_checkpoint_refuses_the_last_and_leaves_nothing_half_written(
        tmp_path, monkeypatch):
    import errno

    import slide_train.checkpoint as ckpt
    import slide_train.space as space

    base = ["--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false", "--checkpoint.every=2",
            "--checkpoint.keep=3", f"--output_dir={tmp_path / 'run'}"]
    root = tmp_path / "run" / "checkpoints"
    trainer = Trainer(load_config(None, [*base, "--steps=6"]), progress=False)
    trainer.step(), trainer.step()
    needed = ckpt.engine_checkpoint_bytes(trainer.engine)
    written = ckpt.save_checkpoint(tmp_path / "probe", 0, trainer.engine, {})
    assert needed >= sum(p.stat().st_size for p in written.iterdir()) > needed - (1 << 20)  # a fair estimate
    free = {"bytes": 10 * needed}
    monkeypatch.setattr(space, "free_bytes", lambda root: free["bytes"])
    assert trainer.save_checkpoint(required=False) == root / "step-2"
    free["bytes"] = needed // 2
    trainer.step(), trainer.step()
    with pytest.warns(UserWarning, match=r"step-4 needs about .* MB .* free.*Training goes on"):
        assert trainer.save_checkpoint(required=False) is None
    with pytest.raises(ckpt.DiskFullError, match=r"step-4 needs .*checkpoint.keep.*latest checkpoint \(step-2\) is "
                                                 r"intact"):
        trainer.save_checkpoint()
    # The disk fills while writing: the partial files go, the error is the same.
    free["bytes"] = 10 * needed
    save_file = ckpt.save_file
    calls = []

    def fill_up(tensors, path):
        calls.append(path)
        if len(calls) % 3 == 0:  # as the OS says it, then as safetensors says it (its own exception type)
            raise OSError(errno.ENOSPC, "No space left on device") if len(calls) == 3 else \
                SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        save_file(tensors, path)

    monkeypatch.setattr(ckpt, "save_file", fill_up)
    for attempts in (3, 6):
        with pytest.raises(ckpt.DiskFullError, match="Nothing of step-4 was left behind"):
            trainer.save_checkpoint()
        assert sorted(p.name for p in root.iterdir()) == ["step-2"] and len(calls) == attempts
    ckpt.verify(root / "step-2")
    monkeypatch.setattr(ckpt, "save_file", save_file)
    trainer.close()
    # A run whose periodic checkpoints are skipped still refuses to end without its last one.
    free["bytes"] = needed // 2
    again = Trainer(load_config(None, [*base, "--steps=2", f"--output_dir={tmp_path / 'other'}"]), progress=False)
    with pytest.raises(ckpt.DiskFullError, match="step-2 needs"):
        again.fit()
    again.close()


def test_a_process_killed_while_a_rewritten_checkpoint_replaces_the_old_keeps_a_whole_one(tmp_path, monkeypatch):
    """A step written again replaces the old copy only once the new one is in place: a process killed while the
    old copy is being deleted leaves `step-<N>` whole (it had deleted the old copy first, and a kill then left
    a damaged one). The next write of that step clears what was left aside."""
    import shutil

    import slide_train.checkpoint as ckpt

    trainer = Trainer(load_config(None, ["--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false",
                                         f"--output_dir={tmp_path / 'run'}"]), progress=False)
    trainer.step()
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, 1, trainer.engine, {"copy": 1})
    rmtree = shutil.rmtree

    def killed(path, *args, **kwargs):  # deletes one file of the tree, then the process is gone
        next(p for p in sorted(pathlib.Path(path).iterdir()) if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(root, 1, trainer.engine, {"copy": 2})
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    ckpt.verify(root / "step-1")
    assert json.loads((root / "step-1" / "trainer.json").read_text()) == {"copy": 2}
    assert ckpt.find_resumable(root) == root / "step-1"
    ckpt.save_checkpoint(root, 1, trainer.engine, {"copy": 3})
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]
    trainer.close()


def test_an_export_that_does_not_fit_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    import slide_train.export as export
    import slide_train.space as space

    trainer = Trainer(load_config(None, ["--steps=1", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1",
                                         f"--output_dir={tmp_path / 'run'}"]), progress=False)
    trainer.step()
    monkeypatch.setattr(space, "free_bytes", lambda directory: 1000)
    with pytest.raises(export.DiskFullError, match=r"export to .*out needs about .* MB.*slide-train export"):
        trainer.export(tmp_path / "out")
    monkeypatch.setattr(space, "free_bytes", lambda directory: 10**12)
    monkeypatch.setattr(export, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(export.DiskFullError, match="Nothing of the export was left behind"):
        trainer.export(tmp_path / "out")
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())
    trainer.close()


TINY = ["--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false"]


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start_and_a_refused_resume_changes_nothing(tmp_path):
    """--resume=auto over checkpoints that all fail to verify stops (starting over would lose the run), and a
    refused resume (here: another model) leaves the run's config.yaml and metrics as they were."""
    run = tmp_path / "run"
    base = [*TINY, f"--output_dir={run}", "--checkpoint.every=1"]
    Trainer(load_config(None, [*base, "--steps=2"]), progress=False).fit()
    config, metrics = (run / "config.yaml").read_text(), (run / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match="checkpoint is from another model"):
        Trainer(load_config(None, [*base, "--steps=3", "--resume=auto", "--model=tiny-qwen3"]), progress=False)
    assert (run / "config.yaml").read_text() == config and (run / "metrics.jsonl").read_text() == metrics
    for step in (1, 2):
        (run / "checkpoints" / f"step-{step}" / "edges.safetensors").write_bytes(b"torn")
    with pytest.warns(UserWarning, match="skipping damaged"), pytest.raises(CheckpointError, match="every checkpoint"):
        Trainer(load_config(None, [*base, "--steps=3", "--resume=auto"]), progress=False)
    assert (run / "metrics.jsonl").read_text() == metrics


def test_a_run_without_checkpoints_is_an_earlier_run_too_and_overwrite_clears_its_outputs(tmp_path):
    run = tmp_path / "run"
    base = [*TINY, f"--output_dir={run}", "--steps=2"]
    first = Trainer(load_config(None, base), progress=False)
    first.step()  # killed before any checkpoint: metrics.jsonl only
    first.close()
    (run / "export").mkdir()
    events = list((run / "tensorboard").iterdir())
    with pytest.raises(CheckpointError, match=r"earlier run \(metrics.jsonl, no checkpoint to continue from: "
                                              r"start afresh there with --overwrite=true"):
        Trainer(load_config(None, base), progress=False)
    fresh = Trainer(load_config(None, [*base, "--overwrite=true"]), progress=False)
    assert (run / "metrics.jsonl").read_text() == "" and not (run / "export").exists()
    assert events and not any(e.exists() for e in events)  # the old TensorBoard logs went too
    fresh.close()


def test_a_torn_last_metrics_line_does_not_block_resuming(tmp_path):
    run = tmp_path / "run"
    base = [*TINY, f"--output_dir={run}", "--checkpoint.every=1"]
    Trainer(load_config(None, [*base, "--steps=2"]), progress=False).fit()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.8')
    with pytest.warns(UserWarning, match="not a complete record"):
        trainer = Trainer(load_config(None, [*base, "--steps=3", "--resume=auto"]), progress=False)
    assert trainer.step_index == 2
    trainer.close()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_non_finite_loss_stops_the_run_before_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(load_config(None, [*TINY, f"--output_dir={run}", "--steps=3", "--checkpoint.every=1"]),
                      progress=False)
    step = trainer.engine.step
    calls = []

    def nan_on_second(*args, **kwargs):
        stats = step(*args, **kwargs)
        calls.append(stats)
        if len(calls) == 2:
            stats.loss = float("nan")
        return stats

    trainer.engine.step = nan_on_second
    with pytest.raises(TrainingError, match=r"step 2: loss nan.*the latest, step-1, is intact.*optimizer.lr"):
        trainer.fit()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-1"]


def test_a_disk_too_small_for_the_last_checkpoint_is_refused_before_training(tmp_path, monkeypatch):
    import slide_train.launch as launch_module
    import slide_train.outputs as outputs_module

    monkeypatch.setattr(outputs_module, "free_bytes", lambda path: 1 << 20)
    engine = launch_module.SlidingEngine

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded before the disk check")

    monkeypatch.setattr(launch_module, "SlidingEngine", no_loading)  # refused before the wait for the weights
    with pytest.raises(DiskFullError, match=r"1.0 MB free, but this run's checkpoint need about .* MB"):
        Trainer(load_config(None, [*TINY, f"--output_dir={tmp_path / 'run'}"]), progress=False)
    monkeypatch.setattr(launch_module, "SlidingEngine", engine)
    # checkpoint.keep=0 writes no checkpoint: only the export is counted, and without it the run goes ahead.
    monkeypatch.setattr(outputs_module, "free_bytes", lambda path: 1 << 10)
    with pytest.raises(DiskFullError, match=r"but this run's export need about"):
        Trainer(load_config(None, [*TINY, f"--output_dir={tmp_path / 'run'}", "--checkpoint.keep=0",
                                   "--export=true"]), progress=False)
    run = tmp_path / "run0"
    with pytest.warns(UserWarning, match="writes no checkpoint"):
        trainer = Trainer(load_config(None, [*TINY, f"--output_dir={run}", "--checkpoint.keep=0", "--export=false",
                                             "--steps=2"]), progress=False)
    trainer.fit()
    assert len(read_metrics(run / "metrics.jsonl")) == 2 and not any((run / "checkpoints").glob("*"))
    with pytest.raises(CheckpointError, match="checkpoint.keep=0"):
        export_run(run)


def test_a_disk_too_small_for_the_activations_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    """engine.activation_offload=disk on a disk without room for a step's boundary activations is refused up
    front, naming what needs the room and the key that moves it; on one disk with the checkpoint, the two are
    counted together (room for either alone is not enough)."""
    import slide_train.checkpoint as ckpt
    import slide_train.launch as launch_module
    import slide_train.outputs as outputs_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded before the disk check")

    monkeypatch.setattr(launch_module, "SlidingEngine", no_loading)
    args = [*TINY, f"--output_dir={tmp_path / 'run'}", "--engine.activation_offload=disk"]
    monkeypatch.setattr(outputs_module, "free_bytes", lambda path: 1000)
    with pytest.raises(DiskFullError, match=r"0.0 MB free, but this run's boundary activations "
                                            r"\(engine.nvme.dir\) need about"):
        Trainer(load_config(None, [*args, "--checkpoint.keep=0"]), progress=False)
    cfg = load_config(None, args)
    machine = resolve_machine(None)
    placement = launch_module.plan_run(cfg, launch_module.load_model(cfg.model, 0, need_tokenizer=False),
                                        machine)[0].placement
    checkpoint = ckpt.checkpoint_bytes(placement.shapes.unit_numels, placement.resident, "fp32")
    acts_on_disk = placement.tiers()["disk"]["boundary activations"]
    assert acts_on_disk > 0 and checkpoint > 0
    monkeypatch.setattr(outputs_module, "free_bytes", lambda path: int(max(acts_on_disk, checkpoint)) + 1)
    with pytest.raises(DiskFullError, match=r"this run's checkpoint and boundary activations"):
        Trainer(cfg, progress=False)
    # their own folder on the same disk: the message names both folders
    acts = tmp_path / "acts"
    acts.mkdir()  # (a folder the user names exists: the run never makes it)
    both = f"the disk of {tmp_path / 'run'} and {acts / 'activations'}"
    with pytest.raises(DiskFullError, match=rf"^{re.escape(both)} has .* free, but this run's checkpoint and "
                                            r"boundary activations"):
        Trainer(load_config(None, [*args, f"--engine.nvme.dir={acts}"]), progress=False)


def test_a_share_of_states_on_disk_that_rounds_to_no_block_is_warned_about(tmp_path):
    """engine.nvme.fraction too small for one block would silently keep every state in RAM:
    the warning says so and names a share that moves one block, which then does; with every block resident it
    says that instead."""
    import slide_train.launch as launch_module

    def plan(fraction, *extra):
        cfg = load_config(None, [*TINY, f"--output_dir={tmp_path / 'run'}",
                                 f"--engine.nvme.fraction={fraction}", *extra])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            made = launch_module.plan_run(cfg, launch_module.load_model(cfg.model, 0, need_tokenizer=False),
                                           resolve_machine(None))[0].placement
        return made, [str(w.message) for w in caught if "nvme.fraction" in str(w.message)]

    none, said = plan(0.01)
    assert not none.on_disk and len(said) == 1
    found = re.search(r"nvme.fraction=0.01 puts no master or AdamW state on disk: it is none of the (\d+) sliding "
                      r"blocks \(a share of ([0-9.]+) keeps one block's states there\)", said[0])
    assert found and int(found.group(1)) == len(none.sliding_blocks) > 1
    moved, said = plan(float(found.group(2)))
    assert len(moved.on_disk) == 1 and moved.bytes("disk") > 0 and not said
    resident, said = plan(0.5, f"--engine.placement.resident={len(none.units)}")
    assert not resident.sliding_blocks and said == ["engine.nvme.fraction=0.5 puts no master or AdamW state on disk: "
                                                    "every block is resident, its states on the device"]


def test_a_folder_for_the_nvme_tier_that_the_run_does_not_use_is_warned_about(tmp_path):
    args = [*TINY, f"--output_dir={tmp_path / 'run'}", f"--engine.nvme.dir={tmp_path / 'fast'}"]
    with pytest.warns(UserWarning, match="only used with engine.nvme.fraction > 0 or engine.activation_offload=disk"):
        Trainer(load_config(None, args), progress=False).close()
    assert not (tmp_path / "fast").exists()


def test_export_replaces_only_an_earlier_export(tmp_path, monkeypatch):
    """An export never deletes a directory it did not write: a run directory, a folder of documents, '.'."""
    run = tmp_path / "run"
    Trainer(load_config(None, [*TINY, f"--output_dir={run}", "--steps=1"]), progress=False).fit()
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text("keep me")
    for out in (docs, run, tmp_path):
        with pytest.raises(ExportError, match="is not an earlier export"):
            export_run(run, out=str(out))
    assert (docs / "notes.txt").read_text() == "keep me" and (run / "checkpoints").is_dir()
    monkeypatch.chdir(docs)
    assert main(["export", str(run), "--out", "."]) == 2  # a clean error, and nothing deleted
    assert (docs / "notes.txt").read_text() == "keep me"
    out = tmp_path / "model"
    for _ in range(2):  # an earlier export is replaced
        assert main(["export", str(run), "--out", str(out)]) == 0
    assert (out / "config.json").is_file()
    (out / ".slide-export").unlink()  # now like a model directory from elsewhere (a base model, say)
    (out / "README.md").write_text("my notes")
    with pytest.raises(ExportError, match="is not an earlier export"):
        export_run(run, out=str(out))
    assert (out / "README.md").read_text() == "my notes"


def test_config_shapes_and_values_found_late_are_clean_errors(tmp_path, monkeypatch):
    listing = tmp_path / "list.yaml"
    listing.write_text("- steps: 3\n")
    with pytest.raises(ConfigError, match="must map config keys to values"):
        load_config(listing, ["--steps=2"])
    with pytest.raises(ConfigError, match=r"engine.placement.resident=50, but this model has \d+ units"):
        Trainer(load_config(None, [*TINY, f"--output_dir={tmp_path / 'r'}", "--engine.placement.resident=50"]),
                progress=False)
    with pytest.raises(ConfigError, match=r"engine.placement.resident names block.9, but this model has blocks 0 "
                                          r"to \d"):
        Trainer(load_config(None, [*TINY, f"--output_dir={tmp_path / 'r'}",
                                   "--engine.placement.resident=[edges, block.9]"]), progress=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        Trainer(load_config(None, [*TINY, f"--output_dir={tmp_path / 'c'}", "--engine.device=cuda"]),
                progress=False)


def test_non_finite_weights_are_never_checkpointed_or_exported(tmp_path):
    """An update can overflow the weights while the loss and norm that preceded it were finite."""
    trainer = Trainer(load_config(None, [*TINY, f"--output_dir={tmp_path / 'run'}", "--steps=2"]), progress=False)
    trainer.step()
    trainer.engine.synchronize()
    trainer.engine.units[2].master[3] = float("inf")
    trainer.engine.refresh()
    with pytest.raises(TrainingError, match=r"after step 1 the weights of block.1 are not finite: no checkpoint"):
        trainer.save_checkpoint()
    with pytest.raises(TrainingError, match="no export"):
        trainer.export(tmp_path / "out")
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not (checkpoints.exists() and list(checkpoints.iterdir())) and not (tmp_path / "out").exists()
    trainer.close()


def test_a_final_checkpoint_of_non_finite_weights_deletes_no_older_one_for_room(tmp_path, monkeypatch):
    """A final checkpoint that finds the disk full deletes older checkpoints to make room, but only for weights
    worth keeping: non-finite ones stop it first, and every earlier checkpoint stays."""
    import slide_train.space as space

    trainer = Trainer(load_config(None, [*TINY, f"--output_dir={tmp_path / 'run'}", "--steps=5",
                                         "--checkpoint.keep=5"]), progress=False)
    for _ in range(2):
        trainer.step()
        trainer.save_checkpoint()
    trainer.step()
    trainer.engine.synchronize()
    trainer.engine.units[2].master[3] = float("inf")
    trainer.engine.refresh()
    real, calls = space.free_bytes, []
    monkeypatch.setattr(space, "free_bytes", lambda where: (calls.append(where), 0 if len(calls) == 1
                                                            else real(where))[1])
    with pytest.raises(TrainingError, match="not finite: no checkpoint"):
        trainer.save_checkpoint(required=True)
    assert sorted(p.name for p in trainer.checkpoints.iterdir()) == ["step-1", "step-2"]
    trainer.close()


def test_a_checkpoint_reads_each_master_once_to_check_and_write_it(tmp_path):
    """The check for non-finite weights runs on each master as the checkpoint writes it: one read of a master
    (on disk, a whole tier's worth), not a pass to check and another to write. An export of the same step
    checks nothing again."""
    trainer = Trainer(load_config(None, [*TINY, f"--output_dir={tmp_path / 'run'}", "--steps=2",
                                         "--engine.nvme.fraction=1"]), progress=False)
    trainer.step()
    reads = []
    master = trainer.engine.master

    def counted(k):
        reads.append(k)
        return master(k)

    trainer.engine.master = counted
    trainer.save_checkpoint()
    assert sorted(reads) == list(range(len(trainer.engine.units)))
    before = len(reads)
    trainer._check_weights("export")  # (what export runs first)
    assert len(reads) == before
    trainer.close()


def test_overwrite_counts_the_space_it_frees(tmp_path, monkeypatch):
    import slide_train.outputs as outputs_module

    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    with open(run / "export" / "old.safetensors", "wb") as f:
        f.truncate(200 << 20)  # an earlier run's 200 MB (sparse: takes no real space here)
    (run / "export" / ".slide-export").write_text("")
    (run / "metrics.jsonl").write_text("")
    monkeypatch.setattr(outputs_module, "free_bytes", lambda path: 1 << 20)
    fresh = Trainer(load_config(None, [*TINY, f"--output_dir={run}", "--overwrite=true"]), progress=False)
    assert not (run / "export").exists()
    fresh.close()


def test_prune_keeps_the_newest(tmp_path):
    from slide_train.checkpoint import list_checkpoints, prune
    for step in (9, 10, 2):
        (tmp_path / f"step-{step}").mkdir()
    prune(tmp_path, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-9", "step-10"]  # by step, not by name
    prune(tmp_path, 0)  # [:-0] would have kept them all
    assert list_checkpoints(tmp_path) == []


def test_a_resume_from_an_older_checkpoint_replaces_the_later_ones(tmp_path, monkeypatch):
    """Resumed from step-2 of a run that reached step-4, the first new checkpoint deletes step-3 and step-4:
    resume=auto or `export --step=4` would take the replaced course. Short of disk, the last checkpoint deletes
    those first and never the one resumed from (it once deleted that and kept a damaged step-4). Found by two
    reviews."""
    import slide_train.checkpoint as ckpt
    import slide_train.space as space

    run = tmp_path / "run"
    base = [*TINY, f"--output_dir={run}", "--checkpoint.keep=3"]
    Trainer(load_config(None, [*base, "--steps=4", "--checkpoint.every=1"]), progress=False).fit()
    with pytest.warns(UserWarning, match="deleted step-3, step-4: checkpoints of the course this run replaced"):
        Trainer(load_config(None, [*base, "--steps=6", f"--resume={run / 'checkpoints' / 'step-2'}"]),
                progress=False).fit()
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step-2", "step-6"]

    other = tmp_path / "other"
    base = [*TINY, f"--output_dir={other}", "--checkpoint.keep=3"]
    trainer = Trainer(load_config(None, [*base, "--steps=4", "--checkpoint.every=2"]), progress=False)
    size = ckpt.engine_checkpoint_bytes(trainer.engine)
    trainer.fit()
    damaged = other / "checkpoints" / "step-4" / "manifest.json"
    damaged.write_text("[]")
    used = lambda: sum(f.stat().st_size for f in (other / "checkpoints").rglob("*") if f.is_file())  # noqa: E731
    monkeypatch.setattr(space, "free_bytes", lambda root: int(2.5 * size) - used())
    with pytest.warns(UserWarning, match="skipping damaged checkpoint"):
        resumed = Trainer(load_config(None, [*base, "--steps=6", "--resume=auto"]), progress=False)
    assert resumed.step_index == 2
    with pytest.warns(UserWarning, match="Deleting step-4 to make room"):
        resumed.fit()
    assert [p.name for p in ckpt.list_checkpoints(other / "checkpoints")] == ["step-2", "step-6"]


def test_overwrite_deletes_only_what_a_run_wrote(tmp_path):
    run = tmp_path / "run"
    Trainer(load_config(None, [*TINY, f"--output_dir={run}", "--steps=1"]), progress=False).fit()
    (run / "checkpoints" / "mine").mkdir()
    (run / "checkpoints" / "mine" / "model.bin").write_text("keep")
    (run / "tensorboard" / "notes.txt").write_text("keep")
    fresh = Trainer(load_config(None, [*TINY, f"--output_dir={run}", "--steps=1", "--overwrite=true"]),
                    progress=False)
    fresh.close()
    assert (run / "checkpoints" / "mine" / "model.bin").read_text() == "keep"
    assert (run / "tensorboard" / "notes.txt").read_text() == "keep"
    assert not list((run / "checkpoints").glob("step-*")) and (run / "metrics.jsonl").read_text() == ""
    (run / "export").mkdir()
    (run / "export" / "notes.txt").write_text("keep")  # not an export of ours: refused, nothing deleted
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"export was not written by slide-train.*move it away"):
        Trainer(load_config(None, [*TINY, f"--output_dir={run}", "--overwrite=true"]), progress=False)
    assert (run / "export" / "notes.txt").read_text() == "keep" and (run / "metrics.jsonl").read_text() == "{}\n"


def test_the_last_checkpoint_makes_room_by_deleting_older_ones(tmp_path, monkeypatch):
    """On a disk that holds two checkpoints, keep=3 with a checkpoint every step: the last one (the run's final
    weights) deletes the oldest rather than fail after all the training. Found by a review."""
    import slide_train.checkpoint as ckpt
    import slide_train.space as space

    run = tmp_path / "run"
    trainer = Trainer(load_config(None, [*TINY, f"--output_dir={run}", "--steps=3", "--checkpoint.every=1",
                                         "--checkpoint.keep=3"]), progress=False)
    size = ckpt.engine_checkpoint_bytes(trainer.engine)
    used = lambda: sum(f.stat().st_size for f in (run / "checkpoints").rglob("*") if f.is_file())  # noqa: E731
    monkeypatch.setattr(space, "free_bytes", lambda root: int(2.5 * size) - used())
    with pytest.warns(UserWarning, match="Deleting step-1 to make room"):
        trainer.fit()
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step-2", "step-3"]


def test_string_keys_keep_their_text_and_odd_yaml_is_refused_clearly(tmp_path):
    """An override of a string key is taken as typed (YAML read `007` as 7, `yes` as true, `12:30` as 750);
    in a config file such a value is refused with the fix (quote it). Found by running them."""
    cfg = load_config(None, ["--output_dir=007", "--data.text_key=yes", "--resume=2024-01-01", "--model=12:30"])
    assert (cfg.output_dir, cfg.data.text_key, cfg.resume, cfg.model) == ("007", "yes", "2024-01-01", "12:30")
    assert load_config(None, ["--resume=null"]).resume is None
    assert load_config(None, ["--engine.kernels=off", "--seq_len=64"]).engine.kernels == "off"
    f = tmp_path / "run.yaml"
    f.write_text("output_dir: 007\n")
    with pytest.raises(ConfigError, match=r"output_dir must be a string, but the YAML read it as int 7: put it in "
                                          r"quotes"):
        load_config(f)
    f.write_text("engine:\n  kernels: off\n")  # the one key whose values YAML 1.1 reads as booleans
    assert load_config(f).engine.kernels == "off"
    f.write_text("1: 2\n")
    with pytest.raises(ConfigError, match="config key 1 is not a name"):
        load_config(f)
    f.write_bytes("model: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(f)
    f.write_text("data:\nseq_len: 64\n")  # an empty section still takes overrides
    assert load_config(f, ["--data.path=x.txt"]).data.path == "x.txt"
    with pytest.raises(ConfigError, match="resume must be 'auto' or the path"):
        load_config(None, ["--resume=yes"])
    assert load_config(None, ["--resume=NULL"]).resume is None
    cfg = load_config(None, ["--data={path: x.jsonl}", "--data.format=jsonl"])  # a section, then one of its keys
    assert (cfg.data.path, cfg.data.format) == ("x.jsonl", "jsonl")


def test_jsonl_without_a_path_asks_for_a_file():
    from slide_train.data.config import DataConfig, DataError, check_config

    with pytest.raises(DataError, match="format 'jsonl' needs a file"):
        check_config(DataConfig(format="jsonl"), seq_len=64, micro_batch_size=2)


def test_paths_expand_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["--output_dir=~/runs/a", "--data.path=~/d.txt", "--resume=~/runs/a/checkpoints/step-2"])
    assert (cfg.output_dir, cfg.data.path, cfg.resume) == (
        f"{tmp_path}/runs/a", f"{tmp_path}/d.txt", f"{tmp_path}/runs/a/checkpoints/step-2")
    assert load_config(None, ["--resume=auto"]).resume == "auto"
    assert load_config(None, ["--output_dir=~"]).output_dir == str(tmp_path)


@pytest.mark.parametrize("manifest", ["[]", '{"files": []}', '{"files": {"a.safetensors": {"sha256": "0"}}}'])
def test_a_manifest_of_the_wrong_shape_is_a_damaged_checkpoint(tmp_path, manifest):
    """Valid JSON of another shape raised TypeError / AttributeError / KeyError, which resume=auto did not
    treat as damage (no fallback to the previous checkpoint). Found by a review."""
    from slide_train.checkpoint import verify

    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / "manifest.json").write_text(manifest)
    with pytest.raises(CheckpointError, match="manifest.json is corrupt"):
        verify(tmp_path / "step-1")


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    """Resumed from step-2 of a run that logged 4 steps, steps 3-4 are redone: TensorBoard shows them once (it
    showed both courses). Found by a review."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    base = [*TINY, f"--output_dir={run}", "--steps=4", "--checkpoint.every=2", "--checkpoint.keep=3"]
    Trainer(load_config(None, base), progress=False).fit()
    Trainer(load_config(None, [*base, f"--resume={run / 'checkpoints' / 'step-2'}"]), progress=False).fit()
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]


def test_export_after_the_base_model_moved_or_changed(tmp_path):
    """The run keeps its base model's config and tokenizer: `slide-train export` works after the base model
    directory moved, and does not take a different model later put at that path. Found by a review (export
    said the model directory does not exist, with no way to give it)."""
    save_tiny_model(tmp_path / "m", "llama")
    run = tmp_path / "run"
    Trainer(load_config(None, [*TINY, f"--model={tmp_path / 'm'}", f"--output_dir={run}", "--steps=1"]),
            progress=False).fit()
    (tmp_path / "m").rename(tmp_path / "moved")
    out = export_run(run, out=str(tmp_path / "e1"))
    assert transformers.AutoConfig.from_pretrained(out).rms_norm_eps == \
        transformers.AutoConfig.from_pretrained(tmp_path / "moved").rms_norm_eps == 1e-5
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    other = transformers.AutoConfig.from_pretrained(tmp_path / "moved")
    other.rms_norm_eps = 1e-3  # another model of the same shapes at the old path
    save_tiny_model(tmp_path / "m", "llama")
    other.save_pretrained(tmp_path / "m")
    out = export_run(run, out=str(tmp_path / "e2"))
    assert transformers.AutoConfig.from_pretrained(out).rms_norm_eps == 1e-5
    # A refused resume with another model leaves the run's copy as it was (it was overwritten before the check).
    save_tiny_model(tmp_path / "q", "qwen2")
    with pytest.raises(CheckpointError, match="the checkpoint is from another model"):
        Trainer(load_config(None, [*TINY, f"--model={tmp_path / 'q'}", f"--output_dir={run}", "--steps=2",
                                   "--resume=auto"]), progress=False)
    assert transformers.AutoConfig.from_pretrained(run / "base-model").model_type == "llama"


def test_jsonl_of_empty_texts_has_no_tokens(tmp_path):
    """Empty texts were kept as [bos, eos] examples: a file of only those trained on nothing but eos."""
    (tmp_path / "e.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    cfg = load_config(None, [f"--data.path={tmp_path / 'e.jsonl'}", "--data.format=jsonl",
                             f"--output_dir={tmp_path / 'r'}"])
    with pytest.raises(Exception, match=r"e.jsonl.*token|token.*e.jsonl"):
        Trainer(cfg, progress=False)


def test_the_nvme_tier_filling_up_mid_step_stops_the_run_and_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    """The disk under engine.nvme.dir fills while a step writes its states back: the run stops with an error
    naming the folder and the bytes, the checkpoint before it passes its checksums, and a resume continues from
    it."""
    import errno

    import slide_io
    import slide_train.checkpoint as ckpt

    base = ["--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false", "--checkpoint.every=2",
            "--checkpoint.keep=3", f"--output_dir={tmp_path / 'run'}", "--engine.nvme.fraction=1",
            f"--engine.nvme.dir={tmp_path / 'tier'}"]
    (tmp_path / "tier").mkdir()
    root = tmp_path / "run" / "checkpoints"
    trainer = Trainer(load_config(None, [*base, "--steps=6"]), progress=False)
    assert trainer.engine.disk_stores(), "the run keeps states on disk"
    trainer.step(), trainer.step()
    assert trainer.save_checkpoint() == root / "step-2"
    write = slide_io.posix.PosixFile.pwrite  # (the CPU's path: no kvikio without a CUDA driver)

    def full(self, tensor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(slide_io.posix.PosixFile, "pwrite", full)
    with pytest.raises(RuntimeError) as error:
        trainer.step()
        trainer.engine.synchronize()
    chain, cause = [], error.value
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__
    full_error = next((e for e in chain if isinstance(e, slide_io.StoreFullError)), chain)
    assert str(tmp_path / "tier") in str(full_error) and "bytes" in str(full_error)
    with contextlib.suppress(RuntimeError):
        trainer.close()  # (it raises the failure again, and stops every thread all the same)
    monkeypatch.setattr(slide_io.posix.PosixFile, "pwrite", write)
    ckpt.verify(root / "step-2")
    again = Trainer(load_config(None, [*base, "--steps=6", "--resume=auto"]), progress=False)
    assert again.step_index == 2
    record = again.step()
    assert record["step"] == 3 and math.isfinite(record["loss"])
    again.close()


def test_a_disk_slower_than_the_machine_file_says_is_warned_of_once_with_folder_bytes_and_rate(tmp_path, monkeypatch):
    """Each write to the tier takes 0.3 s more than the machine file's rates allow: after a step the run warns,
    naming the tier's folder, the bytes it moved, the rate it reached and the file's; only once."""
    import time

    import slide_io

    write = slide_io.posix.PosixFile.pwrite

    def slow(self, tensor):
        time.sleep(0.3)
        write(self, tensor)

    monkeypatch.setattr(slide_io.posix.PosixFile, "pwrite", slow)
    tier = tmp_path / "tier"
    tier.mkdir()
    cfg = load_config(None, ["--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false",
                             "--checkpoint.keep=0", f"--output_dir={tmp_path / 'run'}", "--engine.nvme.fraction=1",
                             f"--engine.nvme.dir={tier}", "--steps=4"])
    with pytest.warns(UserWarning, match="checkpoint.keep=0"):
        trainer = Trainer(cfg, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = [trainer.step() for _ in range(4)]
    trainer.close()
    slow_disk = [w for w in caught if "NVMe tier" in str(w.message)]
    assert len(slow_disk) == 1, [str(w.message) for w in caught]
    text = str(slow_disk[0].message)
    step = int(re.match(r"step (\d+):", text).group(1))
    r = records[step - 1]
    assert str(tier) in text and f"{r['disk_written_gb']:.2f} GB out" in text and "GB/s read" in text
    assert r["disk_busy_s"] > 0.5 and "slide-train probe --disk" in text
