"""The machine probe: figures the OS reports are taken as reported, measured rates are positive, and the disk
probe leaves nothing behind."""

import os
import shutil

import pytest
import torch

import slide_scheduler.probe as probe_module
from slide_scheduler.machine import Gpu, Machine, Pcie
from slide_scheduler.probe import probe, probe_disk

GIB = 1 << 30


def test_quick_probe_on_the_host(tmp_path):
    # The host's figures: the default device where there is no CUDA, the CPU asked for where there is.
    device = "cpu" if torch.cuda.is_available() else None
    machine = probe(disk_dir=tmp_path, device=device, quick=True)
    assert isinstance(machine, Machine)
    assert machine.gpu == Gpu() and machine.pcie == Pcie()
    assert not machine.has_gpu
    assert machine.host.cores == len(os.sched_getaffinity(0))
    os_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    assert machine.host.memory_gib == pytest.approx(os_gib, rel=0.01)
    assert machine.host.memory_gbps > 0 and machine.host.adamw_gparams > 0
    assert machine.disk.read_gbps > 0 and machine.disk.write_gbps > 0
    assert machine.disk.free_gib == pytest.approx(shutil.disk_usage(tmp_path).free / GIB, rel=0.03)
    assert list(tmp_path.iterdir()) == []  # the probe's file and folder are gone
    assert Machine.from_dict(machine.to_dict()) == machine  # a machine file can hold what was measured


def test_disk_probe_defaults_to_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    disk = probe_disk(quick=True)
    assert disk.read_gbps > 0 and disk.write_gbps > 0
    assert list(tmp_path.iterdir()) == []


def test_disk_probe_makes_a_missing_folder(tmp_path):
    target = tmp_path / "not" / "yet"
    assert probe_disk(target, quick=True).write_gbps > 0
    assert target.is_dir() and list(target.iterdir()) == []


def test_disk_probe_cleans_up_after_a_failure(tmp_path, monkeypatch):
    def broken(directory, sizes):
        assert os.listdir(directory) == [] and os.path.dirname(directory) == str(tmp_path)
        raise OSError("disk gone")

    monkeypatch.setattr(probe_module, "_disk_gbps", broken)
    with pytest.raises(OSError, match="disk gone"):
        probe_disk(tmp_path, quick=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_quick_probe_on_a_gpu(tmp_path):
    machine = probe(disk_dir=tmp_path, quick=True)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    assert machine.gpu.memory_gib == pytest.approx(total / GIB, rel=0.01)
    assert machine.gpu.bf16_tflops > 0
    pcie = machine.pcie
    assert pcie.h2d_gbps > 0 and pcie.d2h_gbps > 0 and pcie.duplex_gbps > 0
    # Both ways at once move at least as much as the faster single direction, up to measurement noise.
    assert pcie.duplex_gbps >= 0.8 * max(pcie.h2d_gbps, pcie.d2h_gbps)
    assert list(tmp_path.iterdir()) == []
