"""Every refusal before the first step, each in the situation a user met it: what the run would write is checked
at launch, before the model loads, and a refused run leaves its folders as they were."""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest
from conftest import save_tiny_model, write_token_rows
from test_machines import MEASURED

from slide_train import launch, machines
from slide_train.cli import main
from slide_train.config import load_config
from slide_train.errors import ConfigError
from slide_train.export import MARKER
from slide_train.trainer import Trainer

SMALL = ["--steps=1", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--engine.device=cpu"]


def state(folder: pathlib.Path) -> dict[str, str]:
    """Every file and folder under `folder`, each file with the hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(folder.rglob("*"))}


def one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("slide-train: error:")]
    assert len(lines) == 1, err
    return lines[0]


def no_model(*args, **kwargs):
    raise AssertionError("the model was loaded for a run refused at launch")


def test_a_copied_export_as_the_base_model_with_output_dir_its_parent_is_refused_and_its_weights_stay(
        tmp_path, capsys):
    """A copied export keeps its marker; a run from it into its parent once replaced its weights after training."""
    base = tmp_path / "copied"
    save_tiny_model(base / "export", "llama")
    (base / "export" / MARKER).write_text("written by slide-train export\n")
    before = state(tmp_path)
    assert main(["finetune", *SMALL, f"--model={base / 'export'}", f"--output_dir={base}", "--export=true",
                 "--no-progress"]) == 2
    line = one_error(capsys.readouterr().err)
    assert f"model: {base / 'export'} is the folder this run would write into" in line
    assert "the run's export folder" in line and "set output_dir (and engine.nvme.dir) outside it" in line
    assert state(tmp_path) == before
    # A disk tier's folder inside the model's folder, or the run's folder inside it, likewise
    for args in ([f"--output_dir={tmp_path / 'run'}", f"--engine.nvme.dir={base / 'export'}"],
                 [f"--output_dir={base / 'export' / 'run'}"]):
        assert main(["finetune", *SMALL, f"--model={base / 'export'}", *args, "--no-progress"]) == 2
        line = one_error(capsys.readouterr().err)
        assert "is the folder this run would write into" in line
        assert ("engine.nvme.dir" if "nvme" in args[-1] else f"output_dir ({base / 'export' / 'run'})") in line
        assert state(tmp_path) == before


def test_an_export_folder_holding_a_users_files_is_refused_at_launch_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "load_model", no_model)
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "notes.txt").write_text("mine")
    before = state(tmp_path)
    cfg = load_config(None, [*SMALL, "--model=tiny-llama", f"--output_dir={run}", "--export=true"])
    with pytest.raises(ConfigError) as caught:
        Trainer(cfg, progress=False)
    message = str(caught.value)
    assert message.startswith(f"output_dir: {run / 'export'} holds files slide-train did not write (notes.txt;")
    assert "set export=false" in message and "choose another output_dir" in message and "--out" not in message
    assert state(tmp_path) == before
    # Without an export, the folder is the user's business
    monkeypatch.undo()
    Trainer(load_config(None, [*SMALL, "--model=tiny-llama", f"--output_dir={run}", "--export=false"]),
            progress=False).close()
    assert (run / "export" / "notes.txt").read_text() == "mine"


def test_a_missing_nvme_dir_is_refused_naming_the_key_and_is_not_made(tmp_path, capsys, monkeypatch):
    """A disk tier's folder the user named is never made by the run: on a drive that is not mounted it would fill
    the disk above it. The run's own folder under output_dir is the run's to make."""
    missing = tmp_path / "mnt" / "nvme"
    before = state(tmp_path)
    for tier in ("--engine.nvme.fraction=1", "--engine.activation_offload=disk"):
        assert main(["finetune", *SMALL, f"--engine.nvme.dir={missing}", tier, f"--output_dir={tmp_path / 'run'}",
                     "--no-progress"]) == 2
        line = one_error(capsys.readouterr().err)
        assert f"engine.nvme.dir: {missing} does not exist" in line and "create it on the drive you mean" in line
        assert state(tmp_path) == before
    monkeypatch.setattr(launch, "load_model", no_model)  # (a Trainer made in Python: the same check, first)
    cfg = load_config(None, [*SMALL, f"--engine.nvme.dir={missing}", "--engine.nvme.fraction=1",
                             f"--output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="engine.nvme.dir: .* does not exist"):
        Trainer(cfg, progress=False)
    assert state(tmp_path) == before


def test_a_run_refused_for_host_memory_leaves_no_folder_behind(tmp_path, monkeypatch):
    """This machine resolved without a machine file: the plan does not fit RAM, so the disk tier's default folder
    (<output_dir>/nvme) is measured, by the real disk probe, before the refusal. Nothing is left of it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SLIDE_MACHINE")
    monkeypatch.setattr(machines, "probe", lambda disk_dir=None, device=None, quick=False: MEASURED)
    measured = []
    probe_disk = machines.probe_disk
    monkeypatch.setattr(machines, "probe_disk", lambda d, quick=False: measured.append(d) or probe_disk(d, quick))
    work = tmp_path / "work"
    work.mkdir()
    cfg = load_config(None, [*SMALL, "--model=tiny-llama", "--engine.host_memory_limit_gb=0.001",
                             f"--output_dir={work / 'run'}"])
    with pytest.raises(ConfigError, match="this run cannot fit: host"):
        Trainer(cfg, progress=False)
    assert measured and state(work) == {}


def test_an_unknown_model_type_gets_our_message_not_transformers(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "frobnicator", "hidden_size": 64,
                                                   "num_hidden_layers": 2, "vocab_size": 128}))
    write_token_rows(tmp_path / "rows.jsonl", [[1, 2, 3, 4]] * 8)
    for command in (["plan"], ["finetune", f"--data.path={tmp_path / 'rows.jsonl'}", "--data.format=tokens",
                               f"--output_dir={tmp_path / 'run'}"]):
        assert main([*command, f"--model={model}"]) == 2
        line = one_error(capsys.readouterr().err)
        assert f"{model / 'config.json'}: model_type 'frobnicator' has no adapter yet; supported: llama " in line
        assert "qwen3_moe" in line and "To ask for this family, open an issue" in line
        assert "pip install" not in line and "Transformers" not in line
