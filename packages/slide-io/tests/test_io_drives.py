"""A store striped over drives: a store per folder with a reader and a writer thread each, what it refuses, and
what closing leaves behind."""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch

from slide_io import Drives, NVMeStore, StoreFullError, folders_of


def test_folders_of_takes_one_folder_or_a_list():
    assert folders_of("/mnt/a") == ["/mnt/a"]
    assert folders_of(pathlib.Path("/mnt/a")) == ["/mnt/a"]
    assert folders_of(["/mnt/a", pathlib.Path("/mnt/b")]) == ["/mnt/a", "/mnt/b"]


def test_each_drive_has_its_store_and_threads_and_moves_its_own_files(tmp_path):
    folders = [tmp_path / "a", tmp_path / "b"]
    drives = Drives(folders, used=[0, 1], what="moments", name="test")
    assert len(drives) == 2 and all(isinstance(s, NVMeStore) for s in drives.stores)
    tensors = [torch.arange(1000, dtype=torch.float32) * (d + 1) for d in range(2)]
    writes = [drives.writers[d].submit(lambda d=d: drives.stores[d].write("t", tensors[d]).result())
              for d in range(2)]
    for w in writes:
        w.result()
    names = {}
    for d in range(2):
        out = torch.empty(1000)
        got = drives.readers[d].submit(lambda d=d, out=out: (threading.current_thread().name,
                                                             drives.stores[d].read("t", out).result()))
        names[d], read = got.result()
        assert read.equal(tensors[d])
        assert any(f.is_file() for f in folders[d].rglob("*"))
    assert names == {0: "slide-test-read-0_0", 1: "slide-test-read-1_0"}
    drives.close()
    assert not [f for folder in folders for f in folder.rglob("*") if f.is_file()]


def test_a_stripe_over_more_drives_than_folders_is_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"stripes moments over 2 drives, given 1 folder\(s\): .*one"):
        Drives(tmp_path / "one", used=[0, 1], what="moments", name="test")


def test_a_drive_without_room_for_its_reserve_is_refused_before_it_starts(tmp_path):
    with pytest.raises(StoreFullError, match="preflight needs"):
        Drives([tmp_path / "a"], used=[0], what="moments", name="test", reserve=lambda drive: 1 << 62)
