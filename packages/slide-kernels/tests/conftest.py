"""Test setup: without CUDA, the Triton kernels run in Triton's interpreter (set before slide_kernels loads)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
