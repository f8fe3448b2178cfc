"""What a person reads: help that explains each key, warnings as one line each, contradictory flags refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slide_train.config import CHOICES, KEY_HELP, describe_keys, load_config
from slide_train.data import FORMATS
from slide_train.errors import ConfigError

SMALL = ["--steps=2", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false"]


def test_help_gives_every_key_a_line_and_its_allowed_values():
    rows = describe_keys()
    assert {key for key, _, _ in rows} == set(KEY_HELP)  # no key without a line, no line for a key that went
    out = subprocess.run([sys.executable, "-m", "slide_train.cli", "finetune", "--help"], capture_output=True,
                         text=True, check=True).stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()}
    for key, _, text in rows:
        assert text and KEY_HELP[key] in lines[key], key
    for key, allowed in CHOICES.items():
        assert f"one of: {', '.join(allowed)}" in lines[key]
    assert all(name in lines["data.format"] for name in FORMATS)
    top = subprocess.run([sys.executable, "-m", "slide_train.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("finetune", "data", "plan", "probe", "export", "presets"):
        assert any(line.split()[:1] == [command] and len(line.split()) > 1 for line in top.splitlines()), command


def test_warnings_on_the_command_line_are_one_line_each(tmp_path, capsys):
    from slide_train.cli import main

    assert main(["finetune", *SMALL, "--checkpoint.keep=0", f"--output_dir={tmp_path / 'run'}"]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("slide-train: warning:")]
    assert said and "checkpoint.keep=0: this run writes no checkpoint" in said[0]
    assert "UserWarning" not in err and ".py:" not in err and "warnings.warn" not in err


def test_overwrite_and_resume_together_are_refused():
    with pytest.raises(ConfigError, match="overwrite=true deletes the run that resume=auto would continue"):
        load_config(None, ["--overwrite=true", "--resume=auto"])


def test_without_a_terminal_progress_is_plain_lines_and_the_run_keeps_a_log(tmp_path):
    """Piped into a file: no bar and no carriage return, a step line now and then; the warning and what the run
    printed are in the run's log.txt, the warning with its category."""
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "slide_train.cli", "finetune", *SMALL, "--steps=4",
                           "--checkpoint.keep=0", f"--output_dir={run}"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == [f"step {i}/4" for i in (1, 2, 3, 4)]
    assert all("loss " in line and "tok/s" in line for line in lines if line.startswith("step "))
    log = (run / "log.txt").read_text()
    assert "warning: checkpoint.keep=0: this run writes no checkpoint" in log and "[UserWarning at " in log
    assert "info: plan: " in log or "plan: " in log
    assert "step 4/4: loss" in log and "done: 4 steps" in log


def test_no_progress_keeps_the_step_lines_in_log_txt_and_a_cpu_run_shows_no_gpu_memory(tmp_path, capsys):
    """--no-progress drops the bars and the step lines on the terminal, not those of log.txt, which the README
    says holds them. A run on the CPU has no GPU memory to show (it printed `gpu 0.0 GiB`): its lines give the
    host's, each figure that of the step's metrics.jsonl record."""
    from slide_train.cli import main
    from slide_train.metrics import read_metrics

    run = tmp_path / "run"
    assert main(["finetune", *SMALL, "--steps=4", "--engine.device=cpu", "--checkpoint.keep=0",
                 f"--output_dir={run}", "--no-progress"]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    logged = [line.split(" info: ")[1] for line in (run / "log.txt").read_text().splitlines()
              if " info: step " in line]
    assert [line.split(":")[0] for line in logged] == [f"step {i}/4" for i in (1, 2, 3, 4)]
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 4
    for line, row in zip(logged, rows, strict=True):
        assert f"loss {row['loss']:.3f} | " in line and line.endswith(f"| host {row['host_rss_gib']:.1f} GiB")
        assert "gpu" not in line.lower() and row["gpu_peak_gib"] == 0.0


def test_a_gpu_runs_step_line_shows_its_peak_gpu_memory():
    from slide_train.metrics import step_figures

    record = {"loss": 2.5, "tokens_per_s": 12345.6, "tflops": 312.5, "gpu_peak_gib": 21.94, "host_rss_gib": 97.2}
    assert step_figures(record, on_gpu=True) == ("loss 2.500 | 12,346 tok/s | 312.50 TFLOP/s | gpu 21.9 GiB | "
                                                 "host 97.2 GiB")
    assert step_figures(record, on_gpu=False) == "loss 2.500 | 12,346 tok/s | 312.50 TFLOP/s | host 97.2 GiB"


def test_scratch_a_stopped_run_left_in_the_users_own_folder_is_named_and_kept(tmp_path):
    """engine.nvme.dir of the user's choosing is never cleared: what a killed run left there is said, not
    removed (the run's own default folder is cleared at its start)."""
    from slide_train.trainer import Trainer

    own = tmp_path / "fast"
    stale = own / "states" / "slide-io-x1y2"
    stale.mkdir(parents=True)
    (stale / "block.3").write_bytes(b"\0" * 4096)
    cfg = load_config(None, [*SMALL, "--engine.device=cpu", "--engine.nvme.fraction=0.5",
                             f"--engine.nvme.dir={own}", f"--output_dir={tmp_path / 'run'}"])
    with pytest.warns(UserWarning, match=rf"{own} holds 1 scratch folder\(s\) an earlier run left when it was "
                                         r"stopped \(0\.0 MB: slide-io-x1y2\); this run leaves them alone"):
        trainer = Trainer(cfg, progress=False)
    trainer.step()
    trainer.close()
    assert (stale / "block.3").stat().st_size == 4096 and [p.name for p in (own / "states").iterdir()] == [stale.name]


def test_speculation_asked_for_where_none_can_run_is_said(tmp_path):
    from slide_train.trainer import Trainer

    cfg = load_config(None, [*SMALL, "--engine.device=cpu", "--max_grad_norm=null", "--engine.placement.speculate=true",
                             f"--output_dir={tmp_path / 'run'}"])
    with pytest.warns(UserWarning, match="engine.placement.speculate=true, but no block speculates: without clipping"):
        trainer = Trainer(cfg, progress=False)
    assert trainer.step()["speculation"] == "off"
    trainer.close()
