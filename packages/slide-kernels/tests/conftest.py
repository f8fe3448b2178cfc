"""Test setup: without CUDA, the Triton kernels run in Triton's interpreter (set before slide_kernels loads)."""

import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The interpreted tests' seconds, printed in the summary. Their pace is a benchmark's business: it never fails a run.
_spent = [0.0]
HERE = pathlib.Path(__file__).resolve().parent
_root: list[pathlib.Path] = []


def pytest_configure(config):
    _root.append(config.rootpath)


def pytest_runtest_logreport(report):
    # (this folder's tests only: a pytest run over several packages calls these hooks for all of them)
    if os.environ.get("TRITON_INTERPRET") == "1" and HERE in (_root[0] / report.location[0]).resolve().parents:
        _spent[0] += report.duration


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("TRITON_INTERPRET") == "1" and _spent[0] > 0:
        terminalreporter.write_line(f"slide-kernels' tests: {_spent[0]:.0f} s in Triton's interpreter")


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
