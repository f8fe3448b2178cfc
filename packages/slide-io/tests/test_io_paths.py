"""Which NVMe path is taken (gds / kvikio-compat / posix), and the kvikio handle driven by a stand-in kvikio.

The stand-in implements CuFile on plain files, so CI (no CUDA driver, no kvikio) runs the kvikio path's
glue and the store's shared bookkeeping through it; the real library runs in the gpu tests.
"""

from __future__ import annotations

import errno
import os
import sys
import types

import pytest
import torch
from io_helpers import random_tensor

import slide_io.kvikio_path as kp
from slide_io import NVMeStore, StoreFullError, select_path


class _Done:
    def __init__(self, n: int) -> None:
        self._n = n

    def get(self) -> int:
        return self._n


class FakeCuFile:
    """CuFile's shape (path, flags; pwrite/pread(buf, size, file_offset) -> future.get()) on os calls."""

    full = False

    def __init__(self, path, flags="r"):
        assert flags == "r+" and os.path.exists(path)
        self._fd = os.open(path, os.O_RDWR)

    def pwrite(self, buf, size, file_offset=0):
        if FakeCuFile.full:
            raise RuntimeError("cuFile write failed: No space left on device")
        return _Done(os.pwrite(self._fd, memoryview(buf)[:size], file_offset))

    def pread(self, buf, size, file_offset=0):
        return _Done(os.preadv(self._fd, [memoryview(buf)[:size]], file_offset))

    def close(self):
        os.close(self._fd)


def fake_kvikio(compat=True, legacy=False):
    defaults = types.SimpleNamespace()
    if legacy:
        defaults.compat_mode = lambda: compat
    else:
        defaults.is_compat_mode_preferred = lambda: compat
    return types.SimpleNamespace(defaults=defaults, CuFile=FakeCuFile)


def test_no_kvikio_means_posix():
    choice = select_path(import_kvikio=lambda: None, cuda_driver=lambda: True)
    assert choice.path == "posix" and "not installed" in choice.reason


def test_kvikio_without_a_cuda_driver_means_posix():
    choice = select_path(import_kvikio=fake_kvikio, cuda_driver=lambda: False)
    assert choice.path == "posix" and "no CUDA driver" in choice.reason and choice.kvikio is None


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize(("compat", "path"), [(True, "kvikio-compat"), (False, "gds")])
def test_kvikio_with_a_driver_reports_gds_or_compat_from_its_defaults(compat, path, legacy):
    module = fake_kvikio(compat, legacy)
    choice = select_path(import_kvikio=lambda: module, cuda_driver=lambda: True)
    assert choice.path == path and choice.kvikio is module


def test_asking_for_posix_ignores_kvikio():
    assert select_path("posix", import_kvikio=fake_kvikio, cuda_driver=lambda: True).path == "posix"


def test_asking_for_kvikio_where_it_cannot_run_fails_with_the_reason():
    with pytest.raises(RuntimeError, match="no CUDA driver"):
        select_path("kvikio", import_kvikio=fake_kvikio, cuda_driver=lambda: False)
    with pytest.raises(RuntimeError, match="not installed"):
        select_path("kvikio", import_kvikio=lambda: None, cuda_driver=lambda: True)
    with pytest.raises(ValueError, match="'auto', 'kvikio' or 'posix'"):
        select_path("fast")


def test_real_probes_on_this_machine(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", None)  # None in sys.modules makes `import kvikio` fail
    assert kp._import_kvikio() is None
    # A kvikio on disk shaped like the real one: `import kvikio` leaves its `defaults` submodule unbound.
    (tmp_path / "kvikio").mkdir()
    (tmp_path / "kvikio" / "__init__.py").write_text("")
    (tmp_path / "kvikio" / "defaults.py").write_text("def is_compat_mode_preferred():\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvikio")
    # (a real kvikio imported by an earlier test left its submodule, which the import would find instead)
    monkeypatch.delitem(sys.modules, "kvikio.defaults", raising=False)
    try:
        found = kp._import_kvikio()
        assert found is not None and kp.compat_preferred(found) is True
        assert select_path(import_kvikio=lambda: found, cuda_driver=lambda: True).path == "kvikio-compat"
    finally:
        sys.modules.pop("kvikio", None)
        sys.modules.pop("kvikio.defaults", None)
    assert kp._cuda_driver() == (torch.version.cuda is not None and torch.cuda.is_available())


def test_store_without_driver_takes_posix_even_with_kvikio_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", fake_kvikio())
    monkeypatch.setattr(kp, "_cuda_driver", lambda: False)
    with NVMeStore(tmp_path) as store:
        assert store.path == "posix"


@pytest.fixture
def kvikio_store(tmp_path, monkeypatch):
    monkeypatch.setattr(kp, "_import_kvikio", lambda: fake_kvikio(compat=True))
    monkeypatch.setattr(kp, "_cuda_driver", lambda: True)
    FakeCuFile.full = False
    store = NVMeStore(tmp_path, path="kvikio")
    yield store
    store.close()


def test_kvikio_compat_path_asks_kvikio_for_direct_io(tmp_path, monkeypatch):
    kvikio = fake_kvikio(compat=True)
    settings = {"auto_direct_io_read": False, "auto_direct_io_write": False}
    kvikio.defaults.set = settings.update
    kvikio.defaults.get = settings.__getitem__
    monkeypatch.setattr(kp, "_import_kvikio", lambda: kvikio)
    monkeypatch.setattr(kp, "_cuda_driver", lambda: True)
    with NVMeStore(tmp_path, direct=False) as store:  # asked not to: kvikio's settings stay as they were
        assert store.path == "kvikio-compat" and not store.direct and not any(settings.values())
    with NVMeStore(tmp_path) as store:
        assert store.direct and settings == {"auto_direct_io_read": True, "auto_direct_io_write": True}
        t = random_tensor((4096,), torch.float32)
        store.write("k", t).result()
        out = torch.empty_like(t)
        store.read("k", out).result()
        store.read("k", out).result()
        assert torch.equal(out, t) and (store.bytes_written, store.bytes_read) == (4 * 4096, 2 * 4 * 4096)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64], ids=str)
def test_kvikio_path_round_trip_and_reuse(kvikio_store, dtype):
    assert kvikio_store.path == "kvikio-compat" and not kvikio_store.direct
    for seed in range(3):
        t = random_tensor((777,), dtype, seed=seed)
        kvikio_store.write("k", t).result()
        out = torch.empty_like(t)
        kvikio_store.read("k", out).result()
        assert torch.equal(out, t)
    assert kvikio_store.allocations == 1


def test_kvikio_path_full_disk_is_store_full_and_keeps_other_keys(kvikio_store):
    t = random_tensor((100,), torch.bfloat16)
    kvikio_store.write("old", t).result()
    FakeCuFile.full = True
    with pytest.raises(StoreFullError) as info:
        kvikio_store.write("new", torch.ones(50)).result()
    assert info.value.errno == errno.ENOSPC and kvikio_store.directory in str(info.value)
    FakeCuFile.full = False
    out = torch.empty_like(t)
    kvikio_store.read("old", out).result()
    assert torch.equal(out, t) and "new" not in kvikio_store


def test_kvikio_short_transfer_is_an_error(kvikio_store, monkeypatch):
    monkeypatch.setattr(FakeCuFile, "pread", lambda self, buf, size, file_offset=0: _Done(size - 1))
    kvikio_store.write("k", torch.ones(10)).result()
    with pytest.raises(OSError, match="moved 39 of 40 bytes"):
        kvikio_store.read("k", torch.empty(10)).result()
