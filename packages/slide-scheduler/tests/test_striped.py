"""The disk tier striped over several drives: a folder per drive holds what the placement puts on that drive,
the weights are bit for bit those of one drive, two slow drives take less of a step than one, the cost model
prices a lane per drive, and machine files list drives."""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import time

import pytest
import torch
from test_engine import DEPTH, DIM, Model, ToyStack, batches
from test_placement import FAST, LLAMA_3B  # (a Llama-3B's shapes and a fast machine)

from slide_io import NVMeStore
from slide_memory import AdamWConfig
from slide_scheduler import (
    Disk,
    EngineConfig,
    Machine,
    RunFacts,
    SlidingEngine,
    StepShape,
    arrange,
    drive_shares,
    price,
    run_facts,
    shapes_of,
    stripe,
)

MICRO, ROWS, LENGTH = 3, 3, 10  # test_engine.batches: 3 rows of 10 tokens per micro-batch
STEP = StepShape(ROWS * LENGTH, MICRO, LENGTH)
DRIVE = Disk(free_gib=100, read_gbps=1.0, write_gbps=1.0)


def drive_lanes(monkeypatch, seconds: float) -> None:
    """Each store (one drive) moves one file at a time and sleeps `seconds` per transfer; stores move at once."""
    locks: dict[int, threading.Lock] = {}
    guard = threading.Lock()

    def slow(op):
        def run(self, room, tensor):
            with guard:
                lock = locks.setdefault(id(self), threading.Lock())
            with lock:
                time.sleep(seconds)
                op(self, room, tensor)
        return run

    monkeypatch.setattr(NVMeStore, "_put", slow(NVMeStore._put))
    monkeypatch.setattr(NVMeStore, "_get", slow(NVMeStore._get))


def striped_engine(folders: list[pathlib.Path], clip: float = 0.05):
    """Every block's master, moments and clipped gradient on disk and every boundary activation too, striped over
    a drive per folder (the same speed each)."""
    torch.manual_seed(0)
    stack = ToyStack(Model(tied=True))
    shapes = dataclasses.replace(shapes_of(stack), hidden=DIM, intermediate=3 * DIM)
    p = arrange(shapes, STEP, run_facts(device="cpu", max_grad_norm=clip), resident=(), window=2, share=0.0,
                shared=False, held=0, nvme_fraction=1.0, disk_grads=True, disk_boundaries=DEPTH)
    p = stripe(p, [DRIVE] * len(folders))
    config = EngineConfig(optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1),
                          nvme_dir=[str(f / "states") for f in folders],
                          activation_dir=[str(f / "activations") for f in folders])
    return SlidingEngine(stack, p, config)


def train(engine: SlidingEngine, steps: int = 3) -> tuple[list[float], dict, list[float]]:
    losses, seconds = [], []
    for step in batches(seed=4, steps=steps, micro=MICRO):
        n = sum(int((b["targets"] != -100).sum()) for b in step)
        stats = engine.step(step, lr=1e-2, normalizer=n)
        losses.append(stats.loss)
        seconds.append(stats.seconds)
    engine.synchronize()
    masters = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}
    return losses, masters, seconds


def files_bytes(folder: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.mark.parametrize("clip", [0.05, 1e6])  # clipping that acts, and that never does
def test_two_slow_drives_give_one_drives_weights_and_hold_what_the_placement_says(tmp_path, monkeypatch, clip):
    drive_lanes(monkeypatch, 0.002)
    one = striped_engine([tmp_path / "one"], clip)
    ref_losses, ref, _ = train(one)
    one.close()
    folders = [tmp_path / "a", tmp_path / "b"]
    two = striped_engine(folders, clip)
    p = two.placement
    assert {p.drive_of(u) for u in p.on_disk} == {0, 1} and set(p.boundary_drives) == {0, 1}
    losses, got, _ = train(two)
    shares = drive_shares(p, 2)
    held = [files_bytes(f) for f in folders]
    two.close()
    assert losses == ref_losses
    for unit, params in ref.items():
        for name, t in params.items():
            assert got[unit][name].equal(t), f"{unit}.{name}"
    assert held == [s.size for s in shares] and all(held)
    assert sum(held) == p.bytes("disk")


def test_two_drives_slowed_so_they_bind_take_at_most_0_8_of_one_drives_step(tmp_path, monkeypatch):
    drive_lanes(monkeypatch, 0.01)  # far above the toy's compute: the drives set the step
    times = {}
    for n in (1, 2):
        engine = striped_engine([tmp_path / f"{n}-{d}" for d in range(n)])
        *_, seconds = train(engine, steps=4)
        engine.close()
        times[n] = sum(seconds[1:]) / len(seconds[1:])  # (the first step writes masters from nothing)
    print(f"step with one drive {times[1]:.3f} s, two {times[2]:.3f} s")
    assert times[2] <= 0.8 * times[1], times


def test_the_cost_model_prices_a_lane_per_drive_and_the_step_waits_for_the_slowest():
    """Two drives of one speed halve the disk lane of a tier with an even count of equal blocks; a placement
    striped over two drives, priced with one drive twice as fast as the other, puts twice the bytes there."""
    step = StepShape(4096, 8, 4096)
    p = arrange(LLAMA_3B, step, RunFacts(clip=1.0), nvme_fraction=0.5, resident=(),
                window=2, share=0.0, shared=False, held=0)
    slow = dataclasses.replace(FAST.disk, read_gbps=2.0, write_gbps=1.5)
    one = price(p, FAST.with_drives([slow]))
    even = stripe(p, [slow, slow])
    two = price(even, FAST.with_drives([slow, slow]))
    assert len(p.on_disk) % 2 == 0 and [s.size for s in drive_shares(even, 2)][0] == drive_shares(even, 2)[1].size
    assert two.lanes["disk"] == pytest.approx(one.lanes["disk"] / 2)
    fast = dataclasses.replace(slow, read_gbps=4.0, write_gbps=3.0)
    uneven = stripe(p, [fast, slow])
    shares = drive_shares(uneven, 2)
    assert shares[0].size == pytest.approx(2 * shares[1].size, rel=0.1)
    with pytest.raises(ValueError, match="stripes the disk tier over 2 drives"):
        price(uneven, FAST.with_drives([slow]))


def test_a_machine_file_with_drives_round_trips_and_bad_ones_say_what_is_wrong():
    values = {"gpu": {"memory_gib": 24.0}, "disks": [
        {"dir": "/mnt/nvme0", "free_gib": 3600, "read_gbps": 7.0, "write_gbps": 6.0, "tbw": 2400},
        {"dir": "/mnt/nvme1", "free_gib": 1800, "read_gbps": 5.0, "write_gbps": 4.0}]}
    machine = Machine.from_dict(values)
    assert [d.dir for d in machine.drives] == ["/mnt/nvme0", "/mnt/nvme1"] and machine.disk == machine.drives[0]
    assert machine.drives[1].read_gbps == 5.0 and machine.drives[0].tbw == 2400
    written = machine.to_dict()
    assert "disk" not in written and len(written["disks"]) == 2
    assert Machine.from_dict(written) == machine
    single = Machine.from_dict({"disk": {"free_gib": 10, "read_gbps": 2.0}})
    assert single.drives == (single.disk,) and "disks" not in single.to_dict() and "dir" not in single.to_dict()["disk"]
    assert Machine.from_dict(single.to_dict()) == single
    bad = {
        "needs dir": [{"read_gbps": 7.0}],
        r"disks\[1\].read_gbps must be a number of at least 0": [{"dir": "/a"}, {"dir": "/b", "read_gbps": -1}],
        "disks must be a list of drives": {"dir": "/a"},
        "name a folder twice": [{"dir": "/a"}, {"dir": "/a"}],
        r"unknown key disks\[0\].speed": [{"dir": "/a", "speed": 1}],
    }
    for message, drives in bad.items():
        with pytest.raises(ValueError, match=message):
            Machine.from_dict({"disks": drives})
    with pytest.raises(ValueError, match="not both"):
        Machine.from_dict({"disk": {}, "disks": [{"dir": "/a"}]})
