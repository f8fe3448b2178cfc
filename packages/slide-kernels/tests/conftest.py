"""Test setup: without CUDA, the Triton kernels run in Triton's interpreter (set before slide_kernels loads)."""

import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The interpreted tests' time on CI's 2 cores, at most: their shapes stay tiny (about 70 s there)
INTERPRETER_BUDGET_S = 180.0
_spent = [0.0]
HERE = pathlib.Path(__file__).resolve().parent
_root: list[pathlib.Path] = []


def pytest_configure(config):
    _root.append(config.rootpath)


def pytest_runtest_logreport(report):
    # (this folder's tests only: a pytest run over several packages calls these hooks for all of them)
    if os.environ.get("TRITON_INTERPRET") == "1" and HERE in (_root[0] / report.location[0]).resolve().parents:
        _spent[0] += report.duration


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("TRITON_INTERPRET") == "1" and _spent[0] > INTERPRETER_BUDGET_S and exitstatus == 0:
        session.config.get_terminal_writer().line(
            f"slide-kernels' tests took {_spent[0]:.0f} s in Triton's interpreter, over their budget of "
            f"{INTERPRETER_BUDGET_S:.0f} s: keep the interpreted shapes tiny", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """Run a CPU test through the Triton kernels (interpreter, or CUDA when present) and the torch fallback."""
    if request.param == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device = "cpu"
    else:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton path is covered by the gpu tests on this machine")
        device = "cpu"
    return request.param, device
