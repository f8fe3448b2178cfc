"""NVMeStore on the POSIX path: exact round trips (checked against the raw file bytes), reuse, O_DIRECT and
its fallbacks, short transfers, a full disk, and cleanup."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch
from io_helpers import DTYPES, aligned_tensor, random_tensor, raw_bytes

import slide_io.posix
from slide_io import NVMeStore, StoreCorruptError, StoreFullError


@pytest.fixture
def store(tmp_path):
    s = NVMeStore(tmp_path / "nvme", path="posix", workers=3)
    yield s
    s.close()


def file_of(store: NVMeStore, key: str) -> str:
    return store._entries[key].room.path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [0, 1, 1000, 2048, 4097])
def test_round_trip_matches_the_file_bytes(store, dtype, numel):
    t = random_tensor((numel,), dtype, seed=numel)
    store.write("t", t).result()
    with open(file_of(store, "t"), "rb") as f:
        assert f.read() == raw_bytes(t)  # the file holds exactly the tensor's bytes, nothing more
    out = torch.empty_like(t)
    store.read("t", out).result()
    assert torch.equal(out, t)


@pytest.mark.parametrize("numel", [2048, 2048 * 3 + 5])  # whole blocks, and blocks plus a buffered tail
def test_aligned_buffers_round_trip(store, numel):
    t = aligned_tensor(numel, torch.bfloat16)
    t.copy_(random_tensor((numel,), torch.bfloat16, seed=7))
    store.write("a", t).result()
    out = aligned_tensor(numel, torch.bfloat16)
    store.read("a", out).result()
    assert torch.equal(out, t)
    with open(file_of(store, "a"), "rb") as f:
        assert f.read() == raw_bytes(t)


def test_direct_io_is_used_where_the_filesystem_allows(tmp_path):
    # Independent probe: can this filesystem open a file with O_DIRECT at all?
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_DIRECT))
        allowed = True
    except OSError:
        allowed = False
    with NVMeStore(tmp_path, path="posix") as s:
        assert s.direct == allowed
        s.write("k", aligned_tensor(4096, torch.uint8)).result()
        assert s._entries["k"].room.direct == allowed
    with NVMeStore(tmp_path, path="posix", direct=False) as s:
        assert not s.direct


def test_without_direct_io_the_page_cache_path_works(tmp_path, monkeypatch):
    monkeypatch.setattr(slide_io.posix, "open_direct", lambda path: None)
    t = aligned_tensor(8192, torch.float32)
    t.copy_(torch.arange(8192.0))
    with NVMeStore(tmp_path, path="posix") as s:
        s.write("k", t).result()
        assert not s._entries["k"].room.direct
        out = torch.empty(8192)
        s.read("k", out).result()
        assert torch.equal(out, t)


def test_einval_from_direct_io_falls_back_to_the_page_cache(store, monkeypatch):
    if not store.direct:
        pytest.fail("this filesystem refuses O_DIRECT; the fallback test needs one that allows it")
    real = os.pwrite
    direct_fds = set()

    def picky_pwrite(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    t = aligned_tensor(4096, torch.int32)
    t.copy_(torch.arange(4096, dtype=torch.int32))
    store.write("k", torch.zeros(4096, dtype=torch.int32)).result()
    room = store._entries["k"].room
    direct_fds.add(room._direct_fd)
    monkeypatch.setattr(os, "pwrite", picky_pwrite)
    store.write("k", t).result()
    assert not room.direct
    out = torch.empty(4096, dtype=torch.int32)
    store.read("k", out).result()
    assert torch.equal(out, t)


def test_short_transfers_are_completed(store, monkeypatch):
    real_pwrite, real_preadv = os.pwrite, os.preadv
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: real_pwrite(fd, memoryview(data)[:1000], off))
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real_preadv(fd, [bufs[0][:777]], off))
    t = random_tensor((5000,), torch.bfloat16, seed=3)  # unaligned: all through the buffered descriptor
    store.write("k", t).result()
    out = torch.empty_like(t)
    store.read("k", out).result()
    assert torch.equal(out, t)


def test_a_file_cut_from_outside_is_named_not_read_as_garbage(store):
    store.write("k", torch.ones(100)).result()
    path = file_of(store, "k")
    os.truncate(path, 10)
    with pytest.raises(StoreCorruptError, match=r"holds 10 bytes, but 400 were written to it") as info:
        store.read("k", torch.empty(100)).result()
    assert (info.value.path, info.value.key, info.value.errno) == (path, "k", errno.EIO)


@pytest.mark.parametrize("how", ["written", "replaced"])
def test_a_file_written_or_replaced_from_outside_is_named_not_read(store, how):
    """Same size, other bytes: a program writing into the tier's file, or a file put in its place, is caught
    at the next read (the file's inode and modification time differ from the store's last write)."""
    t = torch.ones(100)
    store.write("k", t).result()
    path = file_of(store, "k")
    if how == "written":
        time.sleep(0.01)  # (a later modification time on any filesystem clock)
        with open(path, "r+b") as f:
            f.write(b"\x00" * 8)
    else:
        other = path + ".new"
        with open(other, "wb") as f:
            f.write(b"\x00" * 400)
        os.replace(other, path)
    with pytest.raises(StoreCorruptError, match=r"was written or replaced outside this run after it last wrote the "
                                                r"400 bytes there") as info:
        store.read("k", torch.empty(100)).result()
    assert (info.value.path, info.value.key, info.value.changed, info.value.errno) == (path, "k", True, errno.EIO)
    store.write("k", t * 3).result()  # writing the key again makes it the store's own once more
    out = torch.empty(100)
    store.read("k", out).result()
    assert torch.equal(out, t * 3)


def test_a_file_that_ends_during_a_read_is_an_error_not_garbage(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10)
    room = slide_io.posix.PosixFile(str(path), "k", direct=False)
    try:
        with pytest.raises(OSError, match="ended"):
            room.pread(torch.empty(100))
    finally:
        room.close()


def test_rewrite_reuses_the_file_and_resize_replaces_it(store):
    store.write("k", torch.ones(256)).result()
    path = file_of(store, "k")
    for i in range(3):
        store.write("k", torch.full((256,), float(i))).result()
    assert file_of(store, "k") == path and store.allocations == 1
    store.write("k", torch.arange(300.0)).result()
    assert store.allocations == 2 and not os.path.exists(path)
    out = torch.empty(300)
    store.read("k", out).result()
    assert torch.equal(out, torch.arange(300.0))


def test_delete_and_close_remove_the_files(tmp_path):
    s = NVMeStore(tmp_path, path="posix")
    s.write("a", torch.ones(10)).result()
    s.write("b", torch.ones(10)).result()
    a = file_of(s, "a")
    s.delete("a")
    assert not os.path.exists(a) and s.keys() == ["b"]
    s.close()
    assert os.listdir(tmp_path) == []


def test_two_stores_on_one_directory_do_not_collide(tmp_path):
    with NVMeStore(tmp_path, path="posix") as s1, NVMeStore(tmp_path, path="posix") as s2:
        s1.write("k", torch.ones(8)).result()
        s2.write("k", torch.zeros(8)).result()
        out = torch.empty(8)
        s1.read("k", out).result()
        assert torch.equal(out, torch.ones(8))


def test_posix_path_refuses_device_tensors_at_submit(store):
    with pytest.raises(ValueError, match="host memory only"):
        store.write("k", torch.empty(4, device="meta"))


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_enospc_on_write_raises_store_full_and_keeps_other_keys(store, monkeypatch):
    kept = {f"k{i}": random_tensor((300,), torch.bfloat16, seed=i) for i in range(3)}
    for key, t in kept.items():
        store.write(key, t).result()
    monkeypatch.setattr(os, "pwrite", _enospc)
    with pytest.raises(StoreFullError) as info:
        store.write("new", torch.ones(1000)).result()
    error = info.value
    assert error.errno == errno.ENOSPC and error.directory == store.directory and error.needed == 4000
    assert store.directory in str(error) and "4,000 bytes" in str(error) and "'new'" in str(error)
    # A resize of an existing key fails the same way and leaves its old value.
    with pytest.raises(StoreFullError):
        store.write("k0", torch.ones(1000)).result()
    monkeypatch.undo()
    assert "new" not in store and sorted(store.keys()) == sorted(kept)
    assert len(os.listdir(store._root)) == len(kept)  # the failed file was removed
    for key, t in kept.items():
        out = torch.empty_like(t)
        store.read(key, out).result()
        assert torch.equal(out, t)


def test_enospc_at_preallocation_raises_store_full(store, monkeypatch):
    store.write("old", torch.ones(5)).result()
    monkeypatch.setattr(os, "posix_fallocate", _enospc)
    with pytest.raises(StoreFullError, match="needs 80 bytes"):
        store.write("new", torch.ones(20)).result()
    monkeypatch.undo()
    out = torch.empty(5)
    store.read("old", out).result()
    assert torch.equal(out, torch.ones(5)) and "new" not in store


def test_failed_in_place_rewrite_drops_the_key_rather_than_serving_torn_bytes(store, monkeypatch):
    store.write("k", torch.ones(100)).result()
    store.write("other", torch.zeros(3)).result()
    monkeypatch.setattr(os, "pwrite", _enospc)
    with pytest.raises(StoreFullError):
        store.write("k", torch.full((100,), 2.0)).result()
    monkeypatch.undo()
    assert "k" not in store and "other" in store
    with pytest.raises(KeyError):
        store.read("k", torch.empty(100)).result()


def test_other_write_errors_are_not_reported_as_a_full_disk(store, monkeypatch):
    def eio(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwrite", eio)
    with pytest.raises(OSError) as info:
        store.write("k", torch.ones(10)).result()
    assert not isinstance(info.value, StoreFullError) and info.value.errno == errno.EIO


def test_a_full_store_error_survives_pickling_and_copying():
    """It crosses process boundaries (a worker's failure) with its fields and message intact."""
    import copy
    import errno
    import pickle

    error = StoreFullError("/mnt/nvme", 10 << 30, 1 << 30, what="optimizer states")
    for clone in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(clone) is StoreFullError and clone.errno == errno.ENOSPC
        assert (clone.directory, clone.needed, clone.free, str(clone)) == (error.directory, error.needed,
                                                                           error.free, str(error))


def test_a_mapped_key_reads_what_was_written_without_copying_it_in(tmp_path):
    """`mapped` waits for the key's last write and maps its file: the values written, nothing read into memory
    until touched; a later write of the key shows in a new mapping."""
    with NVMeStore(tmp_path, path="posix") as store:
        t = random_tensor((64, 1000), torch.float32, seed=3)
        store.write("k", t)  # (not waited for: mapped waits)
        view = store.mapped("k")
        assert view.dtype == t.dtype and view.shape == t.shape and torch.equal(view, t)
        store.write("k", t * 2).result()
        assert torch.equal(store.mapped("k"), t * 2)
        with pytest.raises(KeyError, match="no key 'other'"):
            store.mapped("other")
