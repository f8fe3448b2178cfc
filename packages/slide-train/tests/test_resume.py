"""A run killed at any point and resumed ends bitwise equal to a run that was never interrupted."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

STEPS = 8
ARGS = ["--steps=8", "--seq_len=64", "--micro_batch_size=4", "--grad_accum=2", "--checkpoint.every=1",
        "--checkpoint.keep=2", "--export=false", "--engine.device=cpu", "--no-progress", "--seed=3",
        "--schedule.warmup_steps=2", "--data.eval_fraction=0.02", "--eval_every=3"]


def start(run_dir: pathlib.Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "slide_train.cli", "finetune", f"--output_dir={run_dir}", *ARGS, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def steps_logged(run_dir: pathlib.Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line)


def final_state(run_dir: pathlib.Path) -> dict:
    ckpt = run_dir / "checkpoints" / f"step-{STEPS}"
    return {f.name: load_file(str(f)) for f in sorted(ckpt.glob("*.safetensors")) if f.name != "rng.safetensors"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    run = tmp_path_factory.mktemp("ref") / "run"
    proc = start(run)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return final_state(run)


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            assert a[name][key].equal(b[name][key]), f"{name}:{key} differs"


# Device updates (on CPU the same AdamW arithmetic, so the reference holds) are pending across step boundaries:
# checkpoints must flush them first.
STREAMED = "--engine.placement.device_update_share=0.5"
# AdamW states of half the blocks in files: what the checkpoint holds is read from there, a resume writes it back
ON_DISK = "--engine.nvme.fraction=0.5"
# Boundary activations in files: transient, so a killed run's are cleared and the result is the same
ACTS_ON_DISK = "--engine.activation_offload=disk"


@pytest.mark.parametrize("kill_after, extra", [(1, ()), (4, ()), (6, ()), (4, (STREAMED,)), (4, (ON_DISK,)),
                                                (3, (ACTS_ON_DISK,))])
def test_sigkill_then_resume_is_bitwise_equal(tmp_path, reference, kill_after, extra):
    run = tmp_path / "run"
    proc = start(run, *extra)
    deadline = time.time() + 300
    while steps_logged(run) < kill_after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: mid-step or mid-checkpoint
    proc.communicate()
    resumed = start(run, "--resume=auto", *extra)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert_bitwise_equal(final_state(run), reference)
    logged = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(logged) == STEPS  # steps redone after the checkpoint are logged once
    if ON_DISK in extra or ACTS_ON_DISK in extra:  # the killed process's files were cleared; the finished one
        assert not (run / "nvme").exists()          # removed its own, and the folder


@pytest.mark.parametrize("extra", [(), (STREAMED,)])
def test_sigterm_checkpoints_and_stops(tmp_path, reference, extra):
    run = tmp_path / "run"
    proc = start(run, "--checkpoint.every=100", *extra)
    deadline = time.time() + 300
    while steps_logged(run) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "continue with --resume=auto" in out
    resumed = start(run, "--resume=auto", "--checkpoint.every=100", *extra)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert_bitwise_equal(final_state(run), reference)
