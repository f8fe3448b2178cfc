"""What cannot work is refused in one line before the model loads or the data is tokenized: a model folder
without a usable tokenizer for a text format, a folder the run cannot write, data it cannot read, a config file
that is not YAML."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
import transformers
from conftest import tiny_config, write_token_rows

import slide_train.trainer
from slide_train.cli import main
from slide_train.data import DataConfig, DataError, build_data, builtin_tokenizer
from slide_train.errors import ModelError
from slide_train.preflight import check_tokenizer_files

SMALL = ["--steps=1", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false"]


class Reached(Exception):
    """Raised by a stand-in for the work a refusal must come before."""


@pytest.fixture
def no_training(monkeypatch):
    """finetune's Trainer (which loads the model and tokenizes) replaced by one that says it was reached."""
    def trainer(*args, **kwargs):
        raise Reached("the Trainer was built")

    monkeypatch.setattr(slide_train.trainer, "Trainer", trainer)


@pytest.fixture(scope="module")
def bare_models(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Tiny Gemma 2 and Qwen2 model folders as save_pretrained writes them: config and weights, no tokenizer."""
    root = tmp_path_factory.mktemp("bare")
    folders = {}
    for model_type in ("gemma2", "qwen2"):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(root / model_type)
        folders[model_type] = root / model_type
    return folders


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("slide-train: error: ")
    return lines[0]


# -- tokenizers -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["gemma2", "qwen2"])
@pytest.mark.parametrize("command", ["finetune", "data"])
def test_a_model_folder_without_tokenizer_files_is_refused_first(model_type, command, bare_models, tmp_path, capsys,
                                                                 monkeypatch, no_training):
    """transformers builds an empty tokenizer for these folders (Gemma 2's encodes every document as <unk>,
    Qwen2's as nothing): the folder is refused, naming the files looked for, before the model loads."""
    import slide_train.models.build

    def load_model(*args, **kwargs):
        raise Reached("the model was loaded")

    monkeypatch.setattr(slide_train.models.build, "load_model", load_model)
    text = tmp_path / "docs.txt"
    text.write_text("one document\n\nanother one\n")
    code = main([command, f"--model={bare_models[model_type]}", f"--data.path={text}",
                 f"--output_dir={tmp_path / 'run'}", *SMALL])
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"model {bare_models[model_type]} has no tokenizer files" in line
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json"):
        assert name in line
    assert "data.format=text" in line and "data.format=tokens" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("fmt", ["jsonl", "alpaca", "chat", "sharegpt"])
def test_every_text_format_needs_the_tokenizer_files(fmt, bare_models):
    with pytest.raises(ModelError, match=f"no tokenizer files .*data.format={fmt} needs"):
        check_tokenizer_files(str(bare_models["gemma2"]), fmt)
    check_tokenizer_files(str(bare_models["gemma2"]), "tokens")  # ids need no tokenizer
    check_tokenizer_files("tiny-llama", fmt)  # a preset brings its own


def test_a_tokenizer_without_a_vocabulary_is_refused(bare_models, tmp_path, capsys):
    """A tokenizer_config.json alone is a tokenizer file, but transformers builds a tokenizer of special tokens
    only from it: the data pipeline refuses it before tokenizing, rather than training on <unk>."""
    folder = tmp_path / "gemma2"
    folder.mkdir()
    for path in bare_models["gemma2"].iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "tokenizer_config.json").write_text("{}")
    text = tmp_path / "docs.txt"
    text.write_text("one document\n")
    assert main(["data", f"--model={folder}", f"--data.path={text}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"the tokenizer of {folder} has no vocabulary" in line and "all special: <pad> <eos> <bos> <unk>" in line


def test_text_and_alpaca_need_an_eos_token_and_tokens_rows_do_not(tmp_path):
    tokenizer = builtin_tokenizer()
    tokenizer.eos_token = None
    text = tmp_path / "docs.txt"
    text.write_text("one document\n\nanother one\n")
    with pytest.raises(DataError, match="has no EOS token, which data.format=text puts at the end of each example"):
        build_data(DataConfig(path=str(text)), tokenizer, 32, 1, 0)
    alpaca = tmp_path / "a.jsonl"
    alpaca.write_text(json.dumps({"instruction": "say hi", "output": "hi"}) + "\n")
    with pytest.raises(DataError, match="data.format=alpaca"):
        build_data(DataConfig(path=str(alpaca), format="alpaca"), tokenizer, 32, 1, 0)
    rows = tmp_path / "t.jsonl"
    write_token_rows(rows, [[5, 6, 7, 8]])
    assert build_data(DataConfig(path=str(rows), format="tokens"), tokenizer, 32, 1, 0).stats["train_tokens"] == 4


def test_token_rows_train_from_a_folder_without_a_tokenizer(bare_models, tmp_path, capsys):
    """Format `tokens` needs no tokenizer: `data` shows the rows and `finetune` trains and exports, and the export
    holds no tokenizer (none was made up for the folder)."""
    rows = tmp_path / "t.jsonl"
    write_token_rows(rows, [[(7 * i + j) % 300 + 1 for j in range(20)] for i in range(8)])
    run = tmp_path / "run"
    args = [f"--model={bare_models['gemma2']}", f"--data.path={rows}", "--data.format=tokens"]
    assert main(["data", *args, "-n", "1"]) == 0
    assert "8 train examples, 160 tokens" in capsys.readouterr().out
    assert main(["finetune", *args, *SMALL, "--seq_len=16", "--export=true", f"--output_dir={run}",
                 "--no-progress"]) == 0
    assert (run / "export" / "model.safetensors").is_file()
    assert not [p.name for p in (run / "export").iterdir() if p.name.startswith(("tokenizer", "vocab", "special"))]


# -- paths ----------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/sys"), reason="needs Linux's /proc")
@pytest.mark.parametrize("tier", ["--engine.nvme.fraction=1", "--engine.activation_offload=disk"])
def test_an_nvme_dir_that_takes_no_files_is_refused_before_any_work(tier, tmp_path, capsys, no_training):
    code = main(["finetune", *SMALL, "--engine.nvme.dir=/proc/sys", tier, f"--output_dir={tmp_path / 'run'}"])
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert "engine.nvme.dir: cannot create files in /proc/sys" in line and "set engine.nvme.dir to" in line


@pytest.mark.skipif(not os.path.isdir("/proc/sys"), reason="needs Linux's /proc")
def test_an_nvme_dir_the_run_does_not_use_is_not_checked(tmp_path, no_training):
    with pytest.raises(Reached):
        main(["finetune", *SMALL, "--engine.nvme.dir=/proc/sys", f"--output_dir={tmp_path / 'run'}"])


def test_output_dir_and_data_path_are_checked_before_any_work(tmp_path, capsys, no_training):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["finetune", *SMALL, f"--output_dir={blocker / 'run'}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"output_dir: {blocker} is a file" in line
    assert main(["finetune", *SMALL, f"--data.path={tmp_path / 'missing.jsonl'}",
                 f"--output_dir={tmp_path / 'run'}"]) == 2
    assert "data.path: file not found" in one_error_line(capsys.readouterr().err)
    with pytest.raises(Reached):  # a writable output_dir that does not exist yet passes, and is not made
        main(["finetune", *SMALL, f"--output_dir={tmp_path / 'new' / 'run'}"])
    assert not (tmp_path / "new").exists()


# -- the config file ------------------------------------------------------------------------------------------------


def test_a_yaml_error_names_the_file_and_line(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("seq_len: 64\n  steps: [1\n")
    assert main(["data", str(config)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{config}:2:" in line and "not valid YAML" in line and "<unicode string>" not in line
