"""preflight: passes with room, fails with a message naming needed bytes, free bytes and the directory."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest

import slide_io.disk
from slide_io import NVMeStore, StoreFullError, free_bytes, preflight

Usage = namedtuple("Usage", "total used free")


def test_returns_free_bytes_when_there_is_room(tmp_path):
    free = preflight(tmp_path, 1)
    assert free > 0 and abs(free - shutil.disk_usage(tmp_path).free) < 2**30  # others may write meanwhile


def test_too_little_room_names_needed_free_and_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(slide_io.disk.shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 5000, 5000))
    with pytest.raises(StoreFullError) as info:
        preflight(tmp_path, 3 * 2**30)
    error = info.value
    assert (error.needed, error.free, error.directory) == (3 * 2**30, 5000, str(tmp_path))
    assert error.errno == errno.ENOSPC
    message = str(error)
    assert "3,221,225,472 bytes (3.00 GiB)" in message
    assert "5,000 bytes" in message and str(tmp_path) in message


def test_exactly_enough_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(slide_io.disk.shutil, "disk_usage", lambda path: Usage(100, 0, 100))
    assert preflight(tmp_path, 100) == 100
    with pytest.raises(StoreFullError):
        preflight(tmp_path, 101)


def test_a_directory_not_made_yet_is_measured_at_its_nearest_ancestor(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(slide_io.disk.shutil, "disk_usage", lambda path: seen.append(path) or Usage(1, 0, 7))
    assert free_bytes(tmp_path / "not" / "yet") == 7
    assert seen == [str(tmp_path)]


def test_negative_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError):
        preflight(tmp_path, -1)


def test_a_store_with_a_reserve_runs_preflight(tmp_path, monkeypatch):
    monkeypatch.setattr(slide_io.disk.shutil, "disk_usage", lambda path: Usage(100, 90, 10))
    with pytest.raises(StoreFullError, match="needs 11 bytes"):
        NVMeStore(tmp_path, path="posix", reserve=11)
    NVMeStore(tmp_path, path="posix", reserve=10).close()
