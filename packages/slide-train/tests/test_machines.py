"""Machine files (reading, writing, errors that name the file and key) and the cached probe of this machine."""

import dataclasses

import pytest
import yaml

import slide_train.machines as machines
from slide_scheduler import Disk, Gpu, Host, Machine, Pcie
from slide_train.errors import ConfigError
from slide_train.machines import cache_dir, fingerprint, load_machine, resolve_machine, save_machine, this_machine

RTX4090_PC = """\
gpu: {memory_gib: 24, bf16_tflops: 165}
host: {memory_gib: 256, cores: 16, memory_gbps: 80, adamw_gparams: 1.5}
pcie: {h2d_gbps: 25, d2h_gbps: 25, duplex_gbps: 45}
disk: {free_gib: 3600, read_gbps: 7.0, write_gbps: 6.0}
"""

MEASURED = Machine(gpu=Gpu(memory_gib=79.2, bf16_tflops=612.0),
                   host=Host(memory_gib=125.0, cores=16, memory_gbps=131.0, adamw_gparams=3.21),
                   pcie=Pcie(h2d_gbps=55.5, d2h_gbps=55.3, duplex_gbps=101.7),
                   disk=Disk(free_gib=812.0, read_gbps=1.6, write_gbps=1.4, path="posix",
                             path_reason="posix moved 1.28x kvikio-compat's rate here (written then read: 2.38 "
                                         "against 1.87 GB/s; posix is taken above 1.10x)",
                             posix_read_gbps=1.6, posix_write_gbps=1.4, kvikio_read_gbps=1.2, kvikio_write_gbps=1.1))


def test_round_trip(tmp_path):
    path = tmp_path / "sub" / "machine.yaml"
    save_machine(MEASURED, path)
    assert load_machine(path) == MEASURED
    text = path.read_text()
    assert text.startswith("# Slide machine file: measured by slide-scheduler")
    assert "UTC" in text.splitlines()[0]
    assert [p.name for p in path.parent.iterdir()] == ["machine.yaml"]  # no temporary file left beside it


def test_the_attention_and_experts_rates_are_kept(tmp_path):
    machine = Machine(gpu=Gpu(memory_gib=79.2, bf16_tflops=612.0, attention_tflops=301.0, experts_tflops=122.5))
    save_machine(machine, tmp_path / "m.yaml")
    text = (tmp_path / "m.yaml").read_text()
    assert "attention_tflops: 301.0" in text and "experts_tflops: 122.5" in text
    assert load_machine(tmp_path / "m.yaml") == machine


def test_the_disk_path_and_its_reason_are_kept(tmp_path):
    save_machine(MEASURED, tmp_path / "m.yaml")
    disk = load_machine(tmp_path / "m.yaml").disk
    assert (disk.path, disk.path_reason) == ("posix", MEASURED.disk.path_reason)
    assert (disk.kvikio_read_gbps, disk.kvikio_write_gbps) == (1.2, 1.1)
    # A file written before the disk's path was measured names none: the store keeps its default.
    (tmp_path / "old.yaml").write_text("disk: {free_gib: 10, read_gbps: 2.0, write_gbps: 1.5}\n")
    assert load_machine(tmp_path / "old.yaml").disk == Disk(free_gib=10.0, read_gbps=2.0, write_gbps=1.5, path="")


def test_header_names_what_measured(tmp_path):
    save_machine(MEASURED, tmp_path / "m.yaml", measured_by="hand, from the vendor's sheet")
    assert "measured by hand, from the vendor's sheet" in (tmp_path / "m.yaml").read_text()


def test_reads_a_hand_written_file(tmp_path):
    (tmp_path / "pc.yaml").write_text(RTX4090_PC)
    machine = load_machine(tmp_path / "pc.yaml")
    assert machine.gpu == Gpu(memory_gib=24.0, bf16_tflops=165.0)
    assert machine.host.cores == 16 and isinstance(machine.host.cores, int)
    assert machine.disk.read_gbps == 7.0


@pytest.mark.parametrize("text, key", [
    ("gpu: {memory_gb: 24}\n", "gpu.memory_gb"),
    ("host: {cores: -2}\n", "host.cores"),
    ("disk: {read_gbps: fast}\n", "disk.read_gbps"),
    ("pcie: {h2d_gbps: .nan}\n", "pcie.h2d_gbps"),
    ("host: {memory_gib: true}\n", "host.memory_gib"),
    ("disk: {path: 3}\n", "disk.path"),
    ("disk: {path_reason: [fast]}\n", "disk.path_reason"),
    ("gpus: {memory_gib: 24}\n", "gpus"),
])
def test_errors_name_the_file_and_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_machine(path)
    assert str(path) in str(caught.value) and key in str(caught.value)


@pytest.mark.parametrize("text, words", [
    ("gpu: {memory_gib: 24\n", "not valid YAML"),
    ("", "empty"),
    ("- 1\n- 2\n", "mapping"),
    ("gpu: 24\n", "mapping"),
])
def test_errors_for_files_that_are_not_machine_files(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as caught:
        load_machine(path)
    assert str(path) in str(caught.value)


def test_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ConfigError, match="does not exist.*slide-train probe") as caught:
        load_machine(tmp_path / "nowhere.yaml")
    assert str(tmp_path / "nowhere.yaml") in str(caught.value)


def test_fingerprint_is_short_and_stable():
    key = fingerprint()
    assert key == fingerprint() and len(key) == 12 and int(key, 16) >= 0


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder under XDG_CACHE_HOME, and counting stand-ins for the probes (no measuring)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SLIDE_MACHINE")  # (the tests' fixed machine file)
    calls = {"probe": [], "probe_disk": []}

    def fake_probe(disk_dir=None, device=None, quick=False):
        calls["probe"].append((disk_dir, quick))
        return MEASURED

    def fake_probe_disk(disk_dir=None, quick=False):
        calls["probe_disk"].append((disk_dir, quick))
        return Disk(free_gib=10.0, read_gbps=2.0, write_gbps=1.0)

    monkeypatch.setattr(machines, "probe", fake_probe)
    monkeypatch.setattr(machines, "probe_disk", fake_probe_disk)
    return calls


def test_cache_folder_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "slide"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "slide"


def test_this_machine_is_measured_once_then_read_from_the_cache(cache, tmp_path):
    first = this_machine()
    assert len(cache["probe"]) == 1 and cache["probe"][0][1] is True  # a quick probe
    assert (tmp_path / "xdg" / "slide" / f"machine-{fingerprint()}.yaml").is_file()
    second = this_machine()
    assert len(cache["probe"]) == 1
    assert first == second
    assert (first.gpu, first.host, first.pcie) == (MEASURED.gpu, MEASURED.host, MEASURED.pcie)
    assert first.disk.free_gib == 0  # no disk folder named: no disk tier


def test_a_cache_entry_without_a_figure_measured_since_is_measured_again(cache, tmp_path):
    """A cached probe an earlier version wrote (here without gpu.experts_tflops) is measured again, once."""
    this_machine()
    path = tmp_path / "xdg" / "slide" / f"machine-{fingerprint()}.yaml"
    written = yaml.safe_load(path.read_text())
    del written["gpu"]["experts_tflops"]
    path.write_text(yaml.safe_dump(written))
    assert load_machine(path).gpu.experts_tflops == 0.0  # (a valid file: read as not measured)
    this_machine()
    assert len(cache["probe"]) == 2 and "experts_tflops" in path.read_text()
    this_machine()
    assert len(cache["probe"]) == 2


def test_a_first_probe_says_so_once_and_where_it_keeps_the_result(cache, tmp_path, capsys):
    this_machine()
    err = capsys.readouterr().err.splitlines()
    machine_file = tmp_path / "xdg" / "slide" / f"machine-{fingerprint()}.yaml"
    assert len(err) == 1 and "measuring this machine" in err[0] and str(machine_file) in err[0]
    this_machine()
    assert capsys.readouterr() == ("", "")  # read from the cache: nothing to say
    disk = tmp_path / "disk"
    this_machine(disk_dir=disk)  # a folder not measured yet: its disk alone, in one line
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"measuring the disk under {disk}" in err[0] and "disk-" in err[0]
    this_machine(disk_dir=disk)
    assert capsys.readouterr().err == ""


def test_a_first_probe_with_a_disk_names_both_files_in_one_line(cache, tmp_path, capsys):
    this_machine(disk_dir=tmp_path / "disk")
    (line,) = capsys.readouterr().err.splitlines()
    folder = tmp_path / "xdg" / "slide"
    kept = sorted(p.name for p in folder.iterdir())
    assert kept == [f"disk-{fingerprint()}-{kept[0].split('-')[-1]}", f"machine-{fingerprint()}.yaml"]
    assert all(str(folder / name) in line for name in kept)


def test_only_the_first_rank_says_it_measures(cache, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    this_machine()
    assert len(cache["probe"]) == 1 and capsys.readouterr().err == ""


def test_this_machine_is_measured_again_when_the_hardware_changes(cache, monkeypatch):
    monkeypatch.setattr(machines, "fingerprint", lambda: "aaaaaaaaaaaa")
    this_machine()
    this_machine()
    monkeypatch.setattr(machines, "fingerprint", lambda: "bbbbbbbbbbbb")
    this_machine()
    assert len(cache["probe"]) == 2
    monkeypatch.setattr(machines, "fingerprint", lambda: "aaaaaaaaaaaa")
    this_machine()
    assert len(cache["probe"]) == 2  # the first machine's probe is still there


def test_refresh_measures_again(cache):
    this_machine()
    this_machine(refresh=True)
    assert len(cache["probe"]) == 2


def test_a_damaged_cache_entry_is_measured_again(cache, tmp_path):
    this_machine()
    (tmp_path / "xdg" / "slide" / f"machine-{fingerprint()}.yaml").write_text("gpu: [")
    assert this_machine().gpu == MEASURED.gpu
    assert len(cache["probe"]) == 2


def test_disk_rates_are_cached_per_folder(cache, tmp_path, monkeypatch):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    fast.mkdir()
    slow.mkdir()
    first = this_machine(disk_dir=fast)  # a first probe measures the disk it is given
    assert cache["probe"] == [(fast, True)] and cache["probe_disk"] == []
    assert first.disk == MEASURED.disk
    monkeypatch.setattr(machines, "free_bytes", lambda directory: 5 * 2**30)
    again = this_machine(disk_dir=fast)
    assert cache["probe_disk"] == []
    # Rates from the cache; free space as it is now.
    assert (again.disk.read_gbps, again.disk.write_gbps, again.disk.free_gib) == (1.6, 1.4, 5.0)
    assert (again.disk.path, again.disk.path_reason) == (MEASURED.disk.path, MEASURED.disk.path_reason)
    other = this_machine(disk_dir=slow)
    assert cache["probe_disk"] == [(slow, True)] and other.disk.read_gbps == 2.0
    this_machine(disk_dir=slow)
    assert len(cache["probe"]) == 1 and len(cache["probe_disk"]) == 1


def test_resolve_machine_prefers_the_file(cache, tmp_path, monkeypatch):
    (tmp_path / "pc.yaml").write_text(RTX4090_PC)
    assert resolve_machine(str(tmp_path / "pc.yaml")).gpu.memory_gib == 24
    assert cache["probe"] == []
    assert resolve_machine(None).gpu == MEASURED.gpu
    assert len(cache["probe"]) == 1
    (tmp_path / "other.yaml").write_text(RTX4090_PC.replace("memory_gib: 24", "memory_gib: 48"))
    monkeypatch.setenv("SLIDE_MACHINE", str(tmp_path / "other.yaml"))  # the file $SLIDE_MACHINE names, then
    assert resolve_machine(None).gpu.memory_gib == 48
    assert resolve_machine(str(tmp_path / "pc.yaml")).gpu.memory_gib == 24  # --machine before it
    assert len(cache["probe"]) == 1


def test_this_machine_measures_for_real(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    disk = tmp_path / "disk"
    machine = this_machine(disk_dir=disk)
    assert machine.host.cores >= 1 and machine.disk.read_gbps > 0
    assert list(disk.iterdir()) == []
    assert load_machine(tmp_path / "xdg" / "slide" / f"machine-{fingerprint()}.yaml").host == machine.host


def test_probe_keeps_what_it_measured_as_the_last_probe_that_a_later_plan_reads(cache, tmp_path, monkeypatch,
                                                                                capsys):
    """`slide-train probe` without --out replaces the cache file that runs without --machine read (it kept its
    old contents before), says where in a line on stderr, and prints the machine file on stdout; a later `plan`
    reads it and measures nothing."""
    from slide_train.cli import main

    this_machine()  # an earlier quick probe, cached
    assert len(cache["probe"]) == 1
    newer = dataclasses.replace(MEASURED, gpu=dataclasses.replace(MEASURED.gpu, memory_gib=40.0),
                                host=dataclasses.replace(MEASURED.host, memory_gib=100.0))
    probed = []
    monkeypatch.setattr(machines, "probe", lambda disk_dir=None, quick=False: probed.append(disk_dir) or newer)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["probe"]) == 0
    out, err = capsys.readouterr()
    folder = tmp_path / "xdg" / "slide"
    machine_file = folder / f"machine-{fingerprint()}.yaml"
    assert probed == [str(tmp_path)]  # the disk of the current folder, as --disk says
    (line,) = err.splitlines()
    assert "last probe of this machine" in line and str(machine_file) in line and str(folder / "disk-") in line
    assert Machine.from_dict(yaml.safe_load(out)) == newer
    assert load_machine(machine_file).gpu == newer.gpu and load_machine(machine_file).host == newer.host
    assert this_machine(disk_dir=tmp_path).disk.read_gbps == newer.disk.read_gbps  # the folder's rates, cached
    assert main(["plan", "--model=tiny-llama", "--seq_len=128"]) == 0
    text = capsys.readouterr().out
    assert "machine: this one (last probe)" in text
    assert "GPU ~" in text and f" of {0.92 * 40:.1f} usable" in text  # (the budgets of the newer figures)
    assert "host memory ~" in text and f" of {0.95 * 100:.1f} usable" in text
    assert len(cache["probe"]) == 1 and len(probed) == 1 and cache["probe_disk"] == []


def test_probe_with_out_writes_the_file_and_the_cache(cache, tmp_path, capsys):
    """With --out the file is written where asked, and this machine's cache too: it always holds the last probe
    of this machine, whatever else the probe wrote."""
    from slide_train.cli import main

    disk = tmp_path / "disk"
    disk.mkdir()
    assert main(["probe", "--quick", "--out", str(tmp_path / "box.yaml"), "--disk", str(disk)]) == 0
    _, err = capsys.readouterr()
    assert cache["probe"] == [(str(disk), True)]
    first, second = err.splitlines()
    assert first == f"slide-train: wrote {tmp_path / 'box.yaml'}" and "last probe of this machine" in second
    assert load_machine(tmp_path / "box.yaml") == MEASURED
    assert "quick" in (tmp_path / "box.yaml").read_text().splitlines()[0]
    cached = tmp_path / "xdg" / "slide" / f"machine-{fingerprint()}.yaml"
    assert str(cached) in second and load_machine(cached).host == MEASURED.host
    assert this_machine(disk_dir=disk).disk.write_gbps == MEASURED.disk.write_gbps
    assert len(cache["probe"]) == 1 and cache["probe_disk"] == []
