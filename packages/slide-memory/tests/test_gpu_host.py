"""Pinned host memory on a CUDA machine (marked `gpu`: run on the GPU machine)."""

from __future__ import annotations

import gc

import pytest
import torch

from slide_memory import host_empty
from slide_memory.host import EXACT_PIN_BYTES

pytestmark = pytest.mark.gpu


def test_large_pinned_buffers_are_exact_size_page_locked_and_copy_asynchronously():
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")
    numel = 218_112_000 + 3  # a Llama-8B block's parameter count, plus an odd tail
    buf = host_empty(numel, torch.float32)
    assert buf.is_pinned() and buf.numel() == numel and buf.data_ptr() % 4096 == 0
    small = host_empty(EXACT_PIN_BYTES // 8, torch.bfloat16)
    assert small.is_pinned()
    buf.copy_(torch.arange(numel, dtype=torch.float32))
    dev = torch.empty(numel, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev.copy_(buf, non_blocking=True)
        back = torch.empty_like(buf, pin_memory=False)
    stream.synchronize()
    back.copy_(dev)
    assert back.equal(buf)
    view = buf[10:20].view(2, 5)  # views keep it locked after the base tensor is gone
    del buf
    gc.collect()
    assert view.is_pinned()
    del view
    gc.collect()
    again = host_empty(numel, torch.float32)  # unlocked on release: the same pages can be locked again
    assert again.is_pinned()
