"""The disk path chosen by measurement: the pure choice from two paths' rates, and the preference a store asked
for "auto" follows ($SLIDE_IO_PATH first, then prefer_path, then kvikio wherever it runs)."""

from __future__ import annotations

import types

import pytest

import slide_io.kvikio_path as kp
from slide_io import MARGIN, PATH_ENV, NVMeStore, PathRates, choose_path, prefer_path, select_path

KVIKIO = PathRates(read_gbps=1.74, write_gbps=2.01)


def faster(rates: PathRates, by: float) -> PathRates:
    return PathRates(rates.read_gbps * by, rates.write_gbps * by)


@pytest.fixture(autouse=True)
def no_preference(monkeypatch):
    monkeypatch.delenv(PATH_ENV, raising=False)
    prefer_path(None)
    yield
    prefer_path(None)


@pytest.fixture
def kvikio_runs(monkeypatch):
    """A machine where kvikio imports and has a driver (compat mode), as a GPU host without GDS."""
    defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: True)
    monkeypatch.setattr(kp, "_import_kvikio", lambda: types.SimpleNamespace(defaults=defaults))
    monkeypatch.setattr(kp, "_cuda_driver", lambda: True)


def test_round_trip_rate_is_bytes_over_a_write_and_a_read():
    # 1 GB written at 2 GB/s (0.5 s) and read at 1 GB/s (1 s): 2 GB in 1.5 s
    assert PathRates(read_gbps=1.0, write_gbps=2.0).round_trip_gbps == pytest.approx(2 / 1.5)
    assert PathRates(read_gbps=0.0, write_gbps=2.0).round_trip_gbps == 0.0


def test_posix_15_percent_faster_is_taken():
    choice = choose_path(faster(KVIKIO, 1.15), KVIKIO)
    assert choice.path == "posix"
    assert "1.15x kvikio-compat" in choice.reason and "above 1.10x" in choice.reason


def test_posix_5_percent_faster_leaves_kvikio():
    choice = choose_path(faster(KVIKIO, 1.05), KVIKIO, kvikio_path="gds")
    assert choice.path == "gds" and "1.05x gds" in choice.reason


def test_the_margin_is_strict():
    assert choose_path(faster(KVIKIO, 1 + MARGIN), KVIKIO).path == "kvikio-compat"
    assert choose_path(faster(KVIKIO, 1 + MARGIN + 1e-3), KVIKIO).path == "posix"


def test_posix_slower_leaves_kvikio():
    assert choose_path(faster(KVIKIO, 0.7), KVIKIO).path == "kvikio-compat"


def test_a_fast_write_does_not_hide_a_slow_read():
    # Posix writes 50% faster but reads 25% slower: per byte written and read back it is slower than kvikio.
    posix = PathRates(read_gbps=KVIKIO.read_gbps * 0.75, write_gbps=KVIKIO.write_gbps * 1.5)
    assert posix.round_trip_gbps < KVIKIO.round_trip_gbps
    assert choose_path(posix, KVIKIO).path == "kvikio-compat"


def test_kvikio_unavailable_is_posix_with_the_reason():
    choice = choose_path(PathRates(1.0, 1.0), None, unavailable="kvikio is not installed")
    assert choice.path == "posix" and choice.reason.startswith("kvikio is not installed")


def test_the_h200_hosts_rates_choose_posix():
    # posix with O_DIRECT against kvikio-compat, 1 GiB transfers on one drive (the figures)
    choice = choose_path(PathRates(read_gbps=2.16, write_gbps=2.65), KVIKIO)
    assert choice.path == "posix" and "1.28x" in choice.reason


def test_a_posix_preference_reaches_a_store(tmp_path, kvikio_runs):
    assert select_path().path == "kvikio-compat"  # nothing said: kvikio where it runs
    prefer_path("posix", "posix moved 1.27x kvikio-compat's rate here")
    with NVMeStore(tmp_path) as store:
        assert store.path == "posix" and store.path_reason == "posix moved 1.27x kvikio-compat's rate here"
    with NVMeStore(tmp_path, path="kvikio") as store:  # a store told its path keeps it
        assert store.path == "kvikio-compat"
    prefer_path("kvikio-compat", "posix moved 1.05x kvikio-compat's rate here")  # a machine file's path name
    with NVMeStore(tmp_path) as store:
        assert store.path == "kvikio-compat" and store.path_reason.endswith("posix moved 1.05x kvikio-compat's "
                                                                             "rate here")
    prefer_path("")  # a machine file that names no path: the default again
    assert select_path().reason == "kvikio in compat mode (no GPUDirect Storage here)"


def test_a_kvikio_preference_where_kvikio_cannot_run_is_posix(monkeypatch):
    monkeypatch.setattr(kp, "_import_kvikio", lambda: None)
    prefer_path("gds")
    choice = select_path()
    assert choice.path == "posix" and "not installed" in choice.reason


def test_the_environment_comes_before_the_preference(tmp_path, kvikio_runs, monkeypatch):
    prefer_path("posix", "measured")
    monkeypatch.setenv(PATH_ENV, "kvikio")
    assert select_path().path == "kvikio-compat"
    monkeypatch.setenv(PATH_ENV, "auto")  # the same as unset: the preference holds
    assert select_path().path == "posix"
    prefer_path(None)
    monkeypatch.setenv(PATH_ENV, "posix")
    with NVMeStore(tmp_path) as store:
        assert store.path == "posix" and store.path_reason == f"asked for by ${PATH_ENV}"


def test_the_environment_asking_for_kvikio_where_it_cannot_run_fails(monkeypatch):
    monkeypatch.setattr(kp, "_import_kvikio", lambda: None)
    monkeypatch.setenv(PATH_ENV, "kvikio")
    with pytest.raises(RuntimeError, match=rf"asked for by \${PATH_ENV}, but kvikio is not installed"):
        select_path()


def test_unknown_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="preferred path"):
        prefer_path("fast")
    monkeypatch.setenv(PATH_ENV, "fast")
    with pytest.raises(ValueError, match=PATH_ENV):
        select_path()
