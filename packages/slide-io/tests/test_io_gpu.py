"""GPU tests (run with `nox -s gpu` on the GPU machine): CUDA tensors through both tiers, stream ordering."""

from __future__ import annotations

import pytest
import torch
from io_helpers import random_tensor

import slide_io.kvikio_path as kp
from slide_io import HostStore, NVMeStore

pytestmark = pytest.mark.gpu


def _slow_product_on_a_side_stream(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 tensor still being computed on a side stream when the caller hands it to a store."""
    a = random_tensor((2048, 2048), torch.float32, seed=seed).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(20):  # long enough that an unordered copy would read unfinished memory
            b = (a @ a).mul_(1e-3)
        result = b.to(torch.bfloat16)
    torch.cuda.current_stream().wait_stream(side)
    expected = result.cpu()  # synchronous: the reference
    return result, expected


def test_cuda_probe_sees_the_driver():
    assert kp._cuda_driver()


def test_host_store_pins_and_round_trips_cuda_tensors():
    with HostStore() as store:
        assert store.pinned
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            t = torch.randn(4096, 1024, device="cuda").to(torch.bfloat16)
            future = store.write("act", t)  # recorded on `side`: the worker waits for randn
        future.result()
        assert store._entries["act"].room.is_pinned()
        out = torch.empty_like(t)
        store.read("act", out).result()
        torch.cuda.synchronize()
        assert torch.equal(out, t)


def test_host_store_orders_against_the_producing_stream():
    result, expected = _slow_product_on_a_side_stream(0)
    with HostStore() as store:
        store.write("k", result).result()
        out = torch.empty(result.shape, dtype=torch.bfloat16)
        store.read("k", out).result()
    assert torch.equal(out, expected)


def test_nvme_store_on_this_machine(tmp_path):
    with NVMeStore(tmp_path) as store:
        print(f"slide-io NVMe path: {store.path} ({store.path_reason}); O_DIRECT={store.direct}")
        t = random_tensor((3, 1000, 999), torch.bfloat16, seed=5)
        if store.path == "posix":
            staged = torch.empty_like(t).pin_memory()
            staged.copy_(t)
            store.write("s", staged).result()
            out = torch.empty_like(t).pin_memory()
        else:
            store.write("s", t.cuda()).result()
            out = torch.empty(t.shape, dtype=t.dtype, device="cuda")
        store.read("s", out).result()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), t)
