"""Training progress on a terminal: a bar, with the step lines kept in the run's log.txt; on a terminal that
reports no width, where no bar can be drawn, the plain step lines a pipe gets."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SMALL = ["--steps=3", "--seq_len=32", "--micro_batch_size=2", "--grad_accum=1", "--export=false",
         "--checkpoint.keep=0"]


def run_on_terminal(columns: int, run: pathlib.Path) -> str:
    """`slide-train finetune` on a pseudo-terminal of `columns` columns: what the terminal received."""
    pty = pytest.importorskip("pty")
    import fcntl
    import select
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    child = subprocess.Popen([sys.executable, "-m", "slide_train.cli", "finetune", *SMALL,
                              f"--output_dir={run}"],
                             stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    received = b""
    while select.select([leader], [], [], 120)[0]:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # (Linux: EIO once the child has exited and closed its end)
            break
        if not chunk:
            break
        received += chunk
    os.close(leader)
    assert child.wait(timeout=60) == 0, received.decode(errors="replace")
    return received.decode(errors="replace")


def test_on_a_terminal_the_bar_shows_and_log_txt_keeps_the_step_lines(tmp_path):
    shown = run_on_terminal(100, tmp_path / "run")
    assert "3/3 [" in shown  # the bar
    assert "step 1/3:" not in shown  # (no plain lines under it)
    logged = [line.split(" info: ")[1] for line in (tmp_path / "run" / "log.txt").read_text().splitlines()
              if " info: step " in line]
    assert [line.split(":")[0] for line in logged] == ["step 1/3", "step 2/3", "step 3/3"]
    assert all("loss " in line for line in logged)


def test_a_terminal_of_no_width_gets_plain_step_lines(tmp_path):
    shown = run_on_terminal(0, tmp_path / "run")
    assert "%|" not in shown  # no bar, which no width can hold
    assert [line.split(":")[0] for line in shown.splitlines() if line.startswith("step ")] == [
        "step 1/3", "step 2/3", "step 3/3"]
    assert "step 3/3:" in (tmp_path / "run" / "log.txt").read_text()
