"""HostStore: exact round trips, buffer reuse, per-key ordering, concurrency and errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from io_helpers import DTYPES, random_tensor

from slide_io import HostStore


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 5, 7), (1031,)])
def test_round_trip_is_exact(dtype, shape):
    t = random_tensor(shape, dtype)
    expected = t.clone()
    with HostStore() as store:
        store.write("t", t).result()
        t.zero_() if dtype != torch.bool else t.logical_not_()  # the store must hold a copy, not a view
        out = torch.empty(shape, dtype=dtype)
        assert store.read("t", out).result() is out
        assert torch.equal(out, expected)


def test_same_size_rewrite_reuses_the_buffer():
    with HostStore() as store:
        store.write("k", random_tensor((64, 64), torch.bfloat16, seed=1)).result()
        buffer = store._entries["k"].room
        for seed in range(2, 6):
            t = random_tensor((64, 64), torch.bfloat16, seed=seed)
            store.write("k", t).result()
            assert store._entries["k"].room.data_ptr() == buffer.data_ptr()
            out = torch.empty_like(t)
            store.read("k", out).result()
            assert torch.equal(out, t)
        # Another dtype of the same byte size also reuses the buffer; its layout is recorded anew.
        f32 = random_tensor((32, 64), torch.float32, seed=9)
        store.write("k", f32).result()
        assert store.allocations == 1
        with pytest.raises(ValueError, match="holds torch.float32"):
            store.read("k", torch.empty((64, 64), dtype=torch.bfloat16)).result()


def test_resize_allocates_once_more_and_keeps_the_new_value():
    with HostStore() as store:
        store.write("k", torch.ones(10)).result()
        store.write("k", torch.arange(20.0)).result()
        assert store.allocations == 2
        out = torch.empty(20)
        store.read("k", out).result()
        assert torch.equal(out, torch.arange(20.0))
        assert store.nbytes == 80


def test_read_into_another_shape_of_the_same_count():
    with HostStore() as store:
        t = random_tensor((4, 6), torch.float16)
        store.write("k", t).result()
        out = torch.empty(24, dtype=torch.float16)
        store.read("k", out).result()
        assert torch.equal(out, t.reshape(-1))


def test_operations_on_one_key_run_in_submit_order(monkeypatch):
    # Slow writes: without ordering, a read on the second worker would overtake them.
    put = HostStore._put

    def slow_put(self, room, tensor):
        time.sleep(0.05)
        put(self, room, tensor)

    monkeypatch.setattr(HostStore, "_put", slow_put)
    a, b = torch.full((100,), 1.0), torch.full((100,), 2.0)
    out_a, out_b = torch.empty(100), torch.empty(100)
    with HostStore(workers=4) as store:
        futures = [store.write("k", a), store.read("k", out_a), store.write("k", b), store.read("k", out_b)]
        for f in futures:
            f.result(timeout=10)
    assert torch.equal(out_a, a) and torch.equal(out_b, b)


def test_different_keys_run_concurrently(monkeypatch):
    # Both writes must be inside _put at once to pass the barrier; a serial store times out.
    barrier = threading.Barrier(2, timeout=5)
    put = HostStore._put

    def meeting_put(self, room, tensor):
        barrier.wait()
        put(self, room, tensor)

    monkeypatch.setattr(HostStore, "_put", meeting_put)
    with HostStore(workers=2) as store:
        futures = [store.write("a", torch.ones(8)), store.write("b", torch.zeros(8))]
        for f in futures:
            f.result(timeout=10)


def test_many_threads_many_keys():
    tensors = {f"layer.{i}": random_tensor((257,), torch.bfloat16, seed=i) for i in range(32)}
    with HostStore(workers=4) as store:

        def submit(keys):
            for _ in range(3):
                for f in [store.write(k, tensors[k]) for k in keys]:
                    f.result()

        names = sorted(tensors)
        threads = [threading.Thread(target=submit, args=(names[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(store.keys()) == names and store.allocations == 32
        outs = {k: torch.empty(257, dtype=torch.bfloat16) for k in names}
        for f in [store.read(k, outs[k]) for k in names]:
            f.result()
    for k in names:
        assert torch.equal(outs[k], tensors[k])


def test_errors_are_clear():
    with HostStore() as store:
        with pytest.raises(KeyError, match="no key 'missing'"):
            store.read("missing", torch.empty(1)).result()
        store.write("k", torch.ones(4)).result()
        with pytest.raises(ValueError, match="shape"):
            store.read("k", torch.empty(5)).result()
        with pytest.raises(ValueError, match="contiguous"):
            store.write("k", torch.ones(4, 4).t())
        with pytest.raises(TypeError, match="non-empty strings"):
            store.write(3, torch.ones(4))  # type: ignore[arg-type]
        store.delete("k")
        assert "k" not in store
        with pytest.raises(KeyError):
            store.delete("k")
    with pytest.raises(RuntimeError, match="closed"):
        store.write("k", torch.ones(1))
    store.close()  # a second close is harmless


def test_pins_only_when_asked_or_cuda_is_there():
    store = HostStore()
    assert store.pinned == torch.cuda.is_available()
    store.close()
    if not torch.cuda.is_available():
        # Pinning needs a CUDA driver: asking for it here must fail loudly, not silently hand back pageable.
        store = HostStore(pin=True)
        with pytest.raises(RuntimeError):
            store.write("k", torch.ones(4)).result()
        store.close()
