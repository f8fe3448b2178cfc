"""The host optimizer worker's threads: its AdamW runs on the placement's count of torch threads, and the training
thread keeps its own."""

from __future__ import annotations

import threading

import torch

from slide_memory import AdamWConfig, HostAdamW, optimizer_threads
from slide_scheduler import HOST, RunFacts, arrange
from slide_scheduler.plan.placement import Shapes, StepShape
from slide_scheduler.run.lanes import HostSignal
from slide_scheduler.run.updater import HostUpdater


class Recorded(HostAdamW):
    """A host AdamW that notes the thread and torch's thread count each step ran on."""

    def __init__(self, masters, threads):
        super().__init__(masters, AdamWConfig(lr=1e-2), threads=threads)
        self.seen: list[tuple[str, int]] = []

    def step_unit(self, unit, grad, lr, grad_scale=1.0, before_chunk=None, part="all", into=None):
        self.seen.append((threading.current_thread().name, torch.get_num_threads()))
        super().step_unit(unit, grad, lr, grad_scale, before_chunk, part, into)


def test_the_worker_steps_on_its_own_thread_count_and_the_training_thread_keeps_its():
    ours = torch.get_num_threads()
    master = torch.full((1000,), 0.5)
    optimizer = Recorded([master], threads=1)
    updater = HostUpdater(optimizer, threads=1)
    try:
        arrived = [HostSignal()]
        updater.submit(0, torch.full((1000,), 0.1), arrived, lr=1e-2, grad_scale=1.0)
        updater.wait(0)
    finally:
        updater.close()
    assert optimizer.seen == [("slide-updater", 1)]
    assert torch.get_num_threads() == ours
    # and the step is AdamW's: every parameter moved by lr against its gradient's sign on the first step
    assert torch.allclose(master, torch.full((1000,), 0.5 - 1e-2))


def test_the_optimizer_leaves_the_training_thread_a_core_where_there_are_more_than_two():
    assert [optimizer_threads(n) for n in (1, 2, 3, 16)] == [1, 2, 2, 15]
    shapes = Shapes((1_000, 10_000, 10_000), hidden=100)
    step = StepShape(tokens_per_micro=100, micro_batches=1, seq_len=100)
    p = arrange(shapes, step, RunFacts(clip=None, activations=HOST), resident=[0], window=2)
    assert p.threads == optimizer_threads()
