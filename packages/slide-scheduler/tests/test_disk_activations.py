"""Boundary activations on the NVMe tier (`activation_offload="disk"`) against the same run with them in memory."""

from __future__ import annotations

import contextlib
import errno
import time

import pytest
import torch
from test_engine import DEPTH, Model, ToyStack, batches, make_engine, random_steps, run_engine

from slide_io import NVMeStore, StoreFullError
from slide_scheduler.run.disk_activations import SLOTS_PER_MICRO, DiskActivations


def causes(error: BaseException) -> list[BaseException]:
    chain = []
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def same(a, b) -> bool:
    return all(a[u][n].equal(t) for u, params in b.items() for n, t in params.items())


@pytest.fixture
def slow_disk(monkeypatch):
    """Every file write and read of the NVMe store sleeps first: the disk falls behind the lanes."""
    put, get = NVMeStore._put, NVMeStore._get

    def slow(op):
        def run(self, room, tensor):
            time.sleep(0.003)
            op(self, room, tensor)
        return run

    monkeypatch.setattr(NVMeStore, "_put", slow(put))
    monkeypatch.setattr(NVMeStore, "_get", slow(get))


@pytest.mark.parametrize("slow", ["h2d", "d2h", "land", "updater", "disk"])
@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("clip", [0.05, None])
def test_activations_on_disk_give_the_in_memory_result(tmp_path, request, slow, window, clip):
    """Bit for bit the synchronous engine with activations in host memory, whichever worker (or the disk) is
    slow: each step's 4 boundaries x 3 micro-batches pass through rings of 6 buffers each way, so every buffer
    is reused within a step."""
    ref_losses, ref = run_engine(pipeline=False, window=window, clip=clip)
    if slow == "disk":
        request.getfixturevalue("slow_disk")
    losses, got = run_engine(pipeline=True, window=window, clip=clip, acts_dir=tmp_path,
                             delays=None if slow == "disk" else {slow: 0.004})
    assert losses == ref_losses and same(got, ref)
    assert not list(tmp_path.iterdir()), "closing the engine removes the activations' files"


@pytest.mark.parametrize("resident", [1, 3])
def test_activations_on_disk_beside_resident_blocks_and_the_synchronous_schedule(tmp_path, resident):
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=0.05, resident=resident)
    for pipeline in (False, True):
        losses, got = run_engine(pipeline=pipeline, window=2, clip=0.05, resident=resident, acts_dir=tmp_path,
                                 delays={"h2d": 0.003} if pipeline else None)
        assert losses == ref_losses and same(got, ref)


def test_host_memory_holds_the_rings_and_the_disk_every_boundary(tmp_path):
    """Host buffers: SLOTS_PER_MICRO per micro-batch each way, whatever the depth; the store holds every boundary
    of every micro-batch, and a later step with as many allocates no file and no buffer."""
    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)),
        device="cpu", window=2, activation_offload="nvme", activation_dir=str(tmp_path))
    disk = engine.activations.disk
    steps = batches(seed=4, steps=3, micro=3)
    engine.step(steps[0], lr=1e-2, normalizer=50)
    files, buffers = disk.store.allocations, [id(b.data) for b in disk._out + disk._in]
    assert disk.buffers == 2 * SLOTS_PER_MICRO * 3 < 2 * DEPTH * 3
    assert sorted(disk.store.keys()) == sorted(f"acts.{b}.{j}" for b in range(DEPTH) for j in range(3))
    for step in steps[1:]:
        engine.step(step, lr=1e-2, normalizer=50)
    assert disk.store.allocations == files and [id(b.data) for b in disk._out + disk._in] == buffers
    engine.close()


@pytest.mark.parametrize("pool, drop, slow", [("readers", 0, "h2d"), ("readers", 1, "d2h"), ("writers", 0, "d2h")])
def test_each_wait_of_the_disk_tier_matters(tmp_path, monkeypatch, pool, drop, slow):
    """The equality above can fail: a read that does not wait for the copy out of its buffer (a slow h2d lane)
    or for its key's write (a slow d2h lane holds the write back), or a write that does not wait for its copy off
    the device, moves the wrong bytes."""
    _, ref = run_engine(pipeline=False, window=2, clip=0.05)
    when = DiskActivations._when

    def impatient(self, on, after, op, label):
        return when(self, on, tuple(a for k, a in enumerate(after) if k != drop) if on in getattr(self.tier, pool)
                    else after, op, label)

    monkeypatch.setattr(DiskActivations, "_when", impatient)
    try:
        _, got = run_engine(pipeline=True, window=2, clip=0.05, acts_dir=tmp_path, delays={slow: 0.004})
    except (KeyError, RuntimeError) as error:  # a read before the first write of its key finds nothing
        assert any(isinstance(e, KeyError) and "no key" in str(e) for e in causes(error)), error
        return
    assert not same(got, ref)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_activation_leaves_only_once_it_is_made(tmp_path, tier):
    """The copy off the device waits for the compute that makes the activation (on a GPU, an event; here a
    future set late, on CPU worker lanes): what backward gets back is what was made, not the buffer's earlier
    contents. (The engine's CPU compute lane is its own thread, so only this test can see that wait missing.)"""
    from concurrent.futures import Future

    from slide_scheduler.run.activations import ActivationStore
    from slide_scheduler.run.lanes import FutureSignal, Lane

    cpu = torch.device("cpu")
    d2h, h2d, compute = Lane("d2h", cpu), Lane("h2d", cpu), Lane("compute", cpu, inline=True)
    store = ActivationStore((tier,), cpu, d2h, h2d, compute, directory=str(tmp_path))
    store.trim(1)
    hidden, made = torch.zeros(1024), Future()
    store.put(0, 0, hidden, FutureSignal(made))
    time.sleep(0.05)  # the d2h lane would have copied the zeros by now
    hidden.fill_(7.0)
    made.set_result(None)
    out = store.fetch(0, 0, owner="backward")
    h2d.record().wait_host()
    assert out.equal(torch.full((1024,), 7.0))
    store.close()
    for lane in (d2h, h2d):
        lane.close()


def test_reads_run_a_ring_ahead_and_fetching_out_of_backward_order_is_refused(tmp_path):
    d2h_h2d = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2)
    disk = DiskActivations(tmp_path, d2h_h2d.d2h, d2h_h2d.h2d)
    disk.begin(1)  # a ring of 2 buffers each way
    for b in range(4):
        disk.put((b, 0), torch.full((5,), float(b)))
    data, ready = disk.fetch((3, 0))  # the last boundary first, as backward reads them
    assert sorted(disk._queued) == [(2, 0), (3, 0)], "reads run a whole ring ahead"
    ready.wait_host()
    assert data.equal(torch.full((5,), 3.0))
    with pytest.raises(RuntimeError, match="out of backward order"):
        disk.fetch((0, 0))  # two ahead of the ring
    disk.close()
    d2h_h2d.close()


def test_activations_on_disk_need_a_directory(tmp_path):
    with pytest.raises(ValueError, match="activation_dir"):
        make_engine(ToyStack(Model(tied=True)), device="cpu", activation_offload="nvme")
    with pytest.raises(ValueError, match="activations on the host"):
        make_engine(ToyStack(Model(tied=True)),
            device="cpu", activation_offload="nvme", activation_dir=str(tmp_path), grads_share_activations=True)


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_full_disk_fails_the_step_changes_nothing_and_a_retry_gives_the_right_result(tmp_path, monkeypatch,
                                                                                         pipeline):
    """The disk fills up during step 2's forward: the step raises the store's error (what was written, how much
    room there is) and no weight or AdamW state changes. Synchronously, once there is room again, the same step
    gives the run with activations in memory, bit for bit. (A failed task stops a CPU worker lane for good, so
    a pipelined CPU engine is not retried.)"""
    steps = batches(seed=4, steps=3, micro=3)
    torch.manual_seed(0)
    ref = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2, max_grad_norm=0.05,
                                                                 pipeline=False)
    for step in steps:
        ref.step(step, lr=1e-2, normalizer=50)
    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)),
        device="cpu", window=2, max_grad_norm=0.05, pipeline=pipeline, activation_offload="nvme",
        activation_dir=str(tmp_path))
    engine.step(steps[0], lr=1e-2, normalizer=50)
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in engine.named_masters().items()}
    put, full = NVMeStore._put, {"on": True}

    def fill_up(self, room, tensor):
        if full["on"] and room.key == "acts.2.1":
            raise StoreFullError(str(tmp_path), tensor.nbytes, 0, what=f"writing key {room.key!r}")
        put(self, room, tensor)

    monkeypatch.setattr(NVMeStore, "_put", fill_up)
    with pytest.raises(BaseException) as error:
        engine.step(steps[1], lr=1e-2, normalizer=50)
    assert any(isinstance(e, StoreFullError) and "acts.2.1" in str(e) for e in causes(error.value)), error.value
    assert same(engine.named_masters(), before)
    full["on"] = False
    if not pipeline:
        engine.step(steps[1], lr=1e-2, normalizer=50)
        engine.step(steps[2], lr=1e-2, normalizer=50)
        assert same(engine.named_masters(), ref.named_masters())
    try:
        engine.close()
    except RuntimeError:  # (a failed lane raises its error again; the threads stop all the same)
        assert pipeline
    ref.close()
    assert not list(tmp_path.iterdir())


def test_a_disk_error_on_read_surfaces(tmp_path, monkeypatch):
    get = NVMeStore._get

    def broken(self, room, out):
        if room.key == "acts.1.0":
            raise OSError(errno.EIO, "input/output error")
        get(self, room, out)

    monkeypatch.setattr(NVMeStore, "_get", broken)
    engine = make_engine(ToyStack(Model(tied=True)),
        device="cpu", window=2, activation_offload="nvme", activation_dir=str(tmp_path))
    with pytest.raises(BaseException) as error:
        engine.step(batches(seed=4, steps=1, micro=2)[0], lr=1e-2, normalizer=50)
        engine.synchronize()
    assert any(isinstance(e, OSError) and e.errno == errno.EIO for e in causes(error.value)), error.value
    with contextlib.suppress(RuntimeError):  # (a failed lane raises its error again; the threads stop all the same)
        engine.close()
    disk = engine.activations.disk
    assert not any(t.is_alive() for pool in disk.tier.writers + disk.tier.readers for t in pool._threads)
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.parametrize("stall", [None, "compute", "d2h", "h2d"])
def test_activations_on_disk_on_cuda_give_the_in_memory_result(tmp_path, slow_disk, stall):
    """On a GPU (CUDA streams and events, pinned rings, the engine's thread blocking on the disk), steps of other
    shapes (3 and 2 micro-batches of 800 and 1600 tokens), with a slow disk and GPU sleeps holding back the
    compute that makes the activations, or the copies off or onto the device: bit for bit the run with
    activations in host memory."""
    if not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA device: run it on the GPU machine (it is marked `gpu`)")

    data = random_steps(0, [(3, 800), (2, 800), (3, 1600), (3, 1600)], "cuda")
    results = {}
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for tier in ("host", "disk"):
            torch.manual_seed(0)
            engine = make_engine(ToyStack(Model(tied=True)),
                device="cuda", compute_dtype="fp32", window=2, max_grad_norm=0.05, activation_offload=tier,
                activation_dir=str(tmp_path))
            losses = []
            for batch in data:
                if stall:  # ~50 ms of GPU sleep ahead of the step's work on that lane
                    with torch.cuda.stream(getattr(engine, stall).stream):
                        torch.cuda._sleep(100_000_000)
                losses.append(engine.step(batch, lr=1e-2, normalizer=10).loss)
            results[tier] = losses, {k: {n: t.clone() for n, t in v.items()}
                                     for k, v in engine.named_masters().items()}
            engine.close()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    (ref_losses, ref), (losses, got) = results["host"], results["disk"]
    assert losses == ref_losses and same(got, ref)
    assert not list(tmp_path.iterdir())


def test_steps_of_other_micro_batch_counts_and_lengths(tmp_path):
    """Steps of 3, 2 and 4 micro-batches, of 10 and 25 tokens: the rings grow to the largest step (buffers
    re-made only once nothing reads them), keys of micro-batches a step does not have are not read, and the
    result is the in-memory run's."""
    data = random_steps(7, [(3, 10), (2, 25), (4, 10), (2, 10)])
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=0.05, steps_data=data)
    losses, got = run_engine(pipeline=True, window=2, clip=0.05, steps_data=data, acts_dir=tmp_path,
                             delays={"h2d": 0.002})
    assert losses == ref_losses and same(got, ref)


@pytest.mark.parametrize("clip", [0.05, None])
def test_activations_and_adamw_states_on_disk_together(tmp_path, clip):
    """Both NVMe tiers in one run (their own stores and threads): the in-memory result, bit for bit."""
    ref_losses, ref = run_engine(pipeline=False, window=2, clip=clip)
    losses, got = run_engine(pipeline=True, window=2, clip=clip, acts_dir=tmp_path / "acts",
                             nvme=(0.5, tmp_path / "states"), delays={"updater": 0.003})
    assert losses == ref_losses and same(got, ref)


def test_the_disk_tiers_reads_and_writes_are_on_the_timeline(tmp_path):
    """Every boundary of every micro-batch is written and read once per step, and the moments of the blocks on
    disk read and written once, each a span of the `disk` lane; their union is the step's `disk_busy_s`."""
    torch.manual_seed(0)
    engine = make_engine(ToyStack(Model(tied=True)),
        device="cpu", window=2, max_grad_norm=None, activation_offload="nvme", activation_dir=str(tmp_path / "a"),
        nvme_fraction=0.5, nvme_dir=str(tmp_path / "s"))
    steps = batches(seed=4, steps=2, micro=3)
    engine.step(steps[0], lr=1e-2, normalizer=50)
    stats = engine.step(steps[1], lr=1e-2, normalizer=50)
    labels = [s.label for s in stats.spans if s.lane == "disk"]
    for kind in ("write acts", "read acts"):
        assert sorted(x for x in labels if x.startswith(kind)) == sorted(
            f"{kind} {b}.{j}" for b in range(DEPTH) for j in range(3))
    assert 0 < stats.timeline["disk_busy_s"] <= stats.seconds  # (only what falls within the step)
    engine.synchronize()  # the moments' reads and write-backs may run past the step's end (no clipping)
    for u in engine.on_disk:
        engine.disk.wait(u)
    # they are kept until the engine reads them, as the optimizer's updates are: none is lost between steps
    late = set(labels) | {label for label, *_ in engine.disk.spans}
    assert late >= {f"{kind} states {u}" for u in engine.on_disk for kind in ("read", "write")}
    engine.close()
    memory = make_engine(ToyStack(Model(tied=True)), device="cpu", window=2)
    assert memory.step(steps[0], lr=1e-2, normalizer=50).timeline["disk_busy_s"] == 0
    memory.close()
