"""What a run says reads right: errors keep their whole detail, counts agree with their nouns, each summary is
printed once, a resume that finds nothing says so, help describes every argument, and a plan for a GPU this
machine does not have is refused rather than priced for the CPU."""

from __future__ import annotations

import json

import pytest
from conftest import MACHINE

import slide_train.machines
from slide_train.cli import main
from slide_train.data import DataConfig, DataError, build_data, builtin_tokenizer, render_examples
from slide_train.errors import plural
from slide_train.machines import load_machine

SMALL = ["--steps=1", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false"]


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("slide-train: error: ")
    return lines[0]


def test_a_json_error_keeps_its_position(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": "cut\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON \(Unterminated string starting at column 10\)"):
        build_data(DataConfig(path=str(jsonl), format="jsonl"), builtin_tokenizer(), 32, 1, 0)
    whole = tmp_path / "d.json"
    whole.write_text('[{"text": "a"},\n {"text": "b" "c"}]\n')
    with pytest.raises(DataError, match=r"d\.json:2: not valid JSON \(Expecting ',' delimiter at line 2, column 15\)"):
        build_data(DataConfig(path=str(whole), format="jsonl"), builtin_tokenizer(), 32, 1, 0)


def test_counts_agree_with_their_nouns(tmp_path):
    assert (plural(1, "example"), plural(2, "example"), plural(0, "example")) == ("1 example", "2 examples",
                                                                                 "0 examples")
    assert plural(1, "entry", "entries") == "1 entry" and plural(3, "entry", "entries") == "3 entries"
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "a single document"}) + "\n")
    assert render_examples(DataConfig(path=str(one), format="jsonl"), builtin_tokenizer(), 64).startswith(
        f"{one} (format jsonl): 1 example from 1 record;")
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"document {i}" for i in range(4)) + "\n")
    data = build_data(DataConfig(path=str(docs), eval_fraction=0.25), builtin_tokenizer(), 64, 2, 0)
    assert "3 train examples" in data.summary() and "; 1 eval example in 1 micro-batch" in data.summary()


def test_data_prints_one_summary(capsys):
    assert main(["data", "-n", "1"]) == 0
    out = capsys.readouterr().out
    summaries = [line for line in out.splitlines() if "examples" in line]
    assert len(summaries) == 1 and summaries[0].startswith("data: "), out
    assert "has no loss (label -100)" in out  # the legend of the examples stays


def test_resume_auto_without_a_checkpoint_says_it_starts_afresh(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["finetune", *SMALL, "--resume=auto", f"--output_dir={run}", "--no-progress"]) == 0
    said = f"resume=auto: no checkpoint in {run / 'checkpoints'}, so the run starts from step 0"
    assert said in capsys.readouterr().out and said in (run / "log.txt").read_text()
    assert main(["finetune", *SMALL, "--steps=2", "--resume=auto", f"--output_dir={run}", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "no checkpoint in" not in out


def test_help_describes_tool_roles_and_the_export_run_dir(capsys):
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    roles = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("data.roles"))
    assert "tool" in roles
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    out = capsys.readouterr().out
    run_dir = next(line for line in out.splitlines() if line.strip().startswith("run_dir"))
    assert "the run's folder (its output_dir)" in run_dir and "checkpoints/" in out


def test_planning_cuda_for_a_machine_without_a_gpu_is_refused(tmp_path, capsys, monkeypatch):
    """plan_run plans a CPU run wherever the machine has no GPU, whatever engine.device says: the contradiction is
    refused instead, pointing at a machine file of a GPU machine."""
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text(MACHINE.read_text().replace("gpu: {memory_gib: 80, bf16_tflops: 400}", "gpu: {memory_gib: 0}"))
    assert not load_machine(cpu).has_gpu
    monkeypatch.delenv("SLIDE_MACHINE")
    monkeypatch.setattr(slide_train.machines, "resolve_machine", lambda path, disk_dir=None: load_machine(path or cpu))
    assert main(["plan", "--engine.device=cuda"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "engine.device=cuda, but no CUDA device is available here" in line and "plan --machine FILE" in line
    assert main(["plan", "--engine.device=cuda:1", "--machine", str(cpu)]) == 2
    assert f"the machine file {cpu} has no GPU" in one_error_line(capsys.readouterr().err)
    assert main(["plan", "--engine.device=cpu"]) == 0
    assert main(["plan", "--engine.device=cuda", "--machine", str(MACHINE)]) == 0  # a GPU machine's file
