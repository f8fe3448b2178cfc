"""A resume keeps its run: `--resume=auto` alone continues with the run's own config (its steps, batch shape,
model and data), a key given again that changes the training is named, a run's folder can stand for the config,
and a local model that moved is pointed at. Also the smaller messages around a run: the nearest key for a typo,
a damaged only checkpoint, `--model` given a file, the presets table."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import warnings

import pytest
from conftest import MACHINE, save_tiny_model
from safetensors.torch import load_file

from slide_train.checkpoint import MANIFEST, find_resumable
from slide_train.cli import main
from slide_train.config import load_config
from slide_train.errors import CheckpointError, ConfigError, ModelError
from slide_train.models.build import load_model
from slide_train.resume import resumed_config

# The run's own keys, none of them the defaults (60 steps, seq_len 128, 8 x 2 rows, seed 0, lr 1e-3): a resume
# that fell back to a default anywhere would train another course.
RUN = ["--steps=40", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--seed=5", "--optimizer.lr=3e-3",
       "--schedule.warmup_steps=4", "--checkpoint.every=20", "--checkpoint.keep=2", "--export=false",
       "--engine.device=cpu"]


def masters(checkpoint: pathlib.Path) -> dict:
    return {f.name: load_file(str(f)) for f in sorted(checkpoint.glob("*.safetensors")) if f.name != "rng.safetensors"}


def logged_steps(run: pathlib.Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def run40(tmp_path_factory) -> pathlib.Path:
    """A whole 40-step run of the tiny default model, checkpointed at steps 20 and 40."""
    run = tmp_path_factory.mktemp("run40") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLIDE_MACHINE", str(MACHINE))
        assert main(["finetune", *RUN, f"--output_dir={run}", "--no-progress"]) == 0
    assert logged_steps(run) == list(range(1, 41))
    return run


def copy_of(run: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(run, tmp_path / "run"))


def test_resume_auto_alone_keeps_the_runs_40_steps_and_its_weights(run40, tmp_path, monkeypatch, capsys):
    """Stopped after step 20's checkpoint (the later one gone), `slide-train finetune --resume=auto` with no other
    key, in the run's folder's parent (output_dir: its default), ends at step 40 with the weights the whole run
    had, and names no change."""
    whole = masters(run40 / "checkpoints" / "step-40")
    run = tmp_path / "runs" / "default"
    shutil.copytree(run40, run)
    shutil.rmtree(run / "checkpoints" / "step-40")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["finetune", "--resume=auto", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "checkpoints/step-20 at step 20" in out
    assert "replaces the run's" not in err and "schedule changes" not in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-20", "step-40"]
    assert logged_steps(run) == list(range(1, 41))
    resumed = masters(run / "checkpoints" / "step-40")
    assert resumed.keys() == whole.keys()
    for name in whole:
        for key in whole[name]:
            assert resumed[name][key].equal(whole[name][key]), f"{name}:{key}"


def test_a_key_given_at_resume_overrides_and_each_change_to_the_training_is_named(run40):
    """Keys given again with the run's values, or keys that do not change what is trained, are not named."""
    given = [f"--output_dir={run40}", "--resume=auto", "--steps=50", "--optimizer.lr=5e-4", "--seq_len=32",
             "--checkpoint.every=5", "--engine.states_dtype=bf16"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg, checkpoint = resumed_config(None, given)
    said = sorted(str(w.message) for w in caught)
    assert said == ["resume: engine.states_dtype=bf16 replaces the run's fp32 from step 40 on",
                    "resume: optimizer.lr=0.0005 replaces the run's 0.003 from step 40 on",
                    "resume: steps=50 replaces the run's 40 from step 40 on"]
    assert checkpoint == run40 / "checkpoints" / "step-40"
    assert (cfg.steps, cfg.optimizer.lr, cfg.checkpoint.every, cfg.engine.states_dtype) == (50, 5e-4, 5, "bf16")
    # the rest is the run's own, not the defaults
    assert (cfg.seq_len, cfg.micro_batch_size, cfg.grad_accum, cfg.seed, cfg.schedule.warmup_steps) == (32, 2, 1, 5, 4)
    assert cfg.export is False and cfg.resume == "auto" and cfg.overwrite is False


def test_the_older_words_for_the_activations_tier_still_load_and_resume(run40, tmp_path):
    """engine.activation_offload's older words (none, cpu, nvme) name the tiers gpu, host and disk, in a config
    file and in a checkpoint's kept config (written before the tiers had those names): the run resumes in the
    tier it named, and no change is named."""
    config = tmp_path / "old.yaml"
    for old, tier in (("none", "gpu"), ("cpu", "host"), ("nvme", "disk")):
        config.write_text(f"engine:\n  activation_offload: {old}\n")
        assert load_config(config).engine.activation_offload == tier
    run = copy_of(run40, tmp_path)
    checkpoint = run / "checkpoints" / "step-40"
    state = json.loads((checkpoint / "trainer.json").read_text())
    assert state["config"]["engine"]["activation_offload"] == "host"
    state["config"]["engine"]["activation_offload"] = "cpu"  # as an older version kept it
    (checkpoint / "trainer.json").write_text(json.dumps(state, indent=2))
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    data = (checkpoint / "trainer.json").read_bytes()
    manifest["files"]["trainer.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest, indent=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg, found = resumed_config(None, [f"--output_dir={run}", "--resume=auto"])
    assert found == checkpoint and cfg.engine.activation_offload == "host" and cfg.steps == 40


def test_a_yaml_file_given_at_resume_overrides_the_run_with_its_own_keys_only(run40, tmp_path):
    config = tmp_path / "more.yaml"
    config.write_text(f"output_dir: {run40}\nsteps: 44\n")
    with pytest.warns(UserWarning, match=r"^resume: steps=44 replaces the run's 40 from step 40 on$"):
        cfg, _ = resumed_config(str(config), ["--resume=auto"])
    assert (cfg.steps, cfg.seq_len, cfg.seed, cfg.optimizer.lr) == (44, 32, 5, 3e-3)


def test_a_runs_folder_stands_for_its_config_with_resume(run40, tmp_path, monkeypatch, capsys):
    run = copy_of(run40, tmp_path)
    monkeypatch.chdir(tmp_path.parent)  # (a relative path to the folder, from elsewhere)
    relative = os.path.relpath(run)
    cfg, checkpoint = resumed_config(relative, ["--resume=auto"])
    assert (pathlib.Path(cfg.output_dir).absolute(), checkpoint, cfg.steps, cfg.seq_len) == (
        run, pathlib.Path(relative) / "checkpoints" / "step-40", 40, 32)
    capsys.readouterr()
    assert main(["finetune", relative, "--resume=auto", "--steps=42", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "resumed from" in out and "resume: steps=42 replaces the run's 40 from step 40 on" in err
    assert logged_steps(run) == list(range(1, 43))
    with pytest.raises(ConfigError, match=r"is a run's folder: continue it with --resume=auto"):
        resumed_config(relative, [])
    with pytest.raises(ConfigError, match="is the run's folder, its output_dir: give one or the other"):
        resumed_config(relative, ["--resume=auto", f"--output_dir={tmp_path / 'elsewhere'}"])
    assert main(["finetune", str(tmp_path), "--resume=auto"]) == 2
    assert "is a folder, not a config file, and holds no run" in capsys.readouterr().err


LOCAL = ["--seq_len=16", "--micro_batch_size=2", "--grad_accum=1", "--export=false", "--engine.device=cpu",
         "--checkpoint.keep=1", "--no-progress"]


def test_a_local_model_resumes_without_model_and_its_move_is_pointed_at(tmp_path, monkeypatch, capsys):
    """The run's model comes from its checkpoint's config (not the preset default, which the checkpoint would
    refuse as another model), and so do the keys a key given needs; once the model's folder has moved, the error
    says where the run keeps its copy."""
    model = tmp_path / "models" / "mine"
    save_tiny_model(model, "llama")
    run = tmp_path / "run"
    assert main(["finetune", f"--model={model}", *LOCAL, "--steps=2", "--data.eval_fraction=0.1",
                 f"--output_dir={run}"]) == 0
    capsys.readouterr()
    # (eval_every alone is refused, "needs a validation split": here the run's data.eval_fraction gives one)
    assert main(["finetune", str(run), "--resume=auto", "--steps=3", "--eval_every=1"]) == 0
    out, err = capsys.readouterr()
    assert "resumed from" in out and "another model" not in err and "model=" not in err
    moved = tmp_path / "moved"
    model.rename(moved)
    assert main(["finetune", str(run), "--resume=auto", "--steps=4"]) == 2
    err = capsys.readouterr().err
    assert f"the run's model {model} is not there any more" in err and "--model=DIR" in err
    assert f"copy of the model's config.json and tokenizer (not its weights) in {run / 'base-model'}" in err
    assert "Traceback" not in err
    capsys.readouterr()
    assert main(["finetune", str(run), "--resume=auto", "--steps=4", f"--model={moved}"]) == 0
    assert f"resume: model={moved} replaces the run's {model} from step 3 on" in capsys.readouterr().err
    assert logged_steps(run) == [1, 2, 3, 4]


def test_a_damaged_only_checkpoint_promises_no_fallback(run40, tmp_path):
    run = copy_of(run40, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step-20")
    (run / "checkpoints" / "step-40" / "edges.safetensors").write_bytes(b"torn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match="every checkpoint in .* is damaged"):
            find_resumable(run / "checkpoints")
    assert not [w for w in caught if "falling back" in str(w.message)]


def test_a_damaged_newest_checkpoint_names_the_one_it_falls_back_to(run40, tmp_path):
    run = copy_of(run40, tmp_path)
    (run / "checkpoints" / "step-40" / "edges.safetensors").write_bytes(b"torn")
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoint: .*step-40.*; falling back to step-20$"):
        assert find_resumable(run / "checkpoints") == run / "checkpoints" / "step-20"


@pytest.mark.parametrize("typed", ["--optimizer.lerning_rate=1e-4", "--learning_rate=1e-4", "--lr=1e-4",
                                   "--optimizer.learning_rate=1e-4"])
def test_a_typo_or_another_trainers_name_gets_the_nearest_key(typed):
    key = typed[2:].split("=")[0]
    with pytest.raises(ConfigError, match=rf"^unknown config key '{key}'; did you mean optimizer\.lr\?$"):
        load_config(None, [typed])


def test_nearest_keys_across_sections(capsys):
    for typed, near in [("--warmup_steps=3", "schedule.warmup_steps"), ("--data.pth=x", "data.path"),
                        ("--checkpoint.evry=3", "checkpoint.every"), ("--gradient_accumulation_steps=2", "grad_accum"),
                        ("--max_seq_length=64", "seq_len")]:
        with pytest.raises(ConfigError, match=rf"did you mean {near}\?$"):
            load_config(None, [typed])
    with pytest.raises(ConfigError, match="; valid keys: model, data, "):  # nothing near: the section's keys
        load_config(None, ["--zzzz=1"])
    assert main(["finetune", "--learning_rate=1e-4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "slide-train: error: unknown config key 'learning_rate'; did you mean optimizer.lr?")


def test_model_given_a_file_says_a_folder_is_expected(tmp_path):
    save_tiny_model(tmp_path / "m", "llama")
    for name in ("config.json", "model.safetensors"):
        with pytest.raises(ModelError, match=rf"is a file: give the Hugging Face model directory that holds "
                                             rf"config.json.*\(perhaps {tmp_path / 'm'}\)$"):
            load_model(str(tmp_path / "m" / name))


def test_the_presets_table_is_aligned(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 10 and "llama-3.1-8b-256k" in "".join(lines)
    for word in ("hidden", "layers"):  # every column starts (the counts: ends) at one place
        assert len({line.index(word) for line in lines}) == 1, "\n".join(lines)
    assert len({line.index(line.split()[1], len(line.split()[0])) for line in lines}) == 1  # the model types
