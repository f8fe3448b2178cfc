"""Lanes: the places work is queued (compute, host-to-device, land, device-to-host, store) and the signals that
order them.

On CUDA a lane is a stream and a signal is an event: queuing never blocks the Python thread, and the GPU runs
copies and compute side by side. On the CPU every other lane is a single worker thread and a signal is a future, so
the CPU run of the engine has the same concurrency, the same ordering rules and the same races to get right;
that is what lets CI test the pipeline. The compute lane on the CPU is the calling thread itself.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .timeline import Timeline


class Signal:
    """Something that becomes true once: a CUDA event, a future, or already done."""

    def wait_host(self) -> None:  # block the calling thread until it holds
        pass


class Done(Signal):
    pass


DONE = Done()


class CudaSignal(Signal):
    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait_host(self) -> None:
        self.event.synchronize()


class FutureSignal(Signal):
    def __init__(self, future: Future):
        self.future = future

    def wait_host(self) -> None:
        self.future.result()


class HostSignal(Signal):
    """Set by a host thread (the optimizer worker) when its work on a unit is done."""

    def __init__(self):
        self._event = threading.Event()
        self._event.set()
        self.error: BaseException | None = None

    def clear(self) -> None:
        self._event.clear()

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._event.set()

    def is_set(self) -> bool:  # (a failed update is set too: its wait raises)
        return self._event.is_set()

    def wait_host(self) -> None:
        self._event.wait()
        if self.error is not None:
            raise RuntimeError("the host optimizer worker failed") from self.error


class Lane:
    """An ordered queue of device work. `run(fn)` queues fn; `record()` is a signal for everything queued so
    far; `wait(signal)` makes everything queued later wait for it."""

    def __init__(self, name: str, device: torch.device, inline: bool = False, priority: int = 0):
        self.name = name
        self.device = device
        self.delay = 0.0  # tests: seconds each queued task sleeps first, to shake out missing waits
        self.timeline = None  # a Timeline, to record when each labelled task ran
        self.error: BaseException | None = None  # the first failure of a queued task (CPU lanes)
        self.stream = None
        self._pool = None
        if device.type == "cuda":
            # priority: lower runs first when both streams have kernels waiting (torch's convention)
            self.stream = torch.cuda.current_stream(device) if inline else torch.cuda.Stream(device, priority)
        elif not inline:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"slide-{name}")

    def run(self, fn, *args, label: str | None = None) -> None:
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                if self.timeline is not None and label:
                    with self.timeline.span(self.name, label, self.stream):
                        fn(*args)
                else:
                    fn(*args)
        elif self._pool is not None:
            self._pool.submit(self._task, fn, args, label)
        else:
            self._task(fn, args, label)

    def record(self) -> Signal:
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            return CudaSignal(event)
        if self._pool is not None:
            return FutureSignal(self._pool.submit(self._check))
        return DONE

    def wait(self, signal: Signal) -> None:
        if self.stream is not None and isinstance(signal, CudaSignal):
            self.stream.wait_event(signal.event)
        elif self._pool is not None:  # a failed signal stops this lane too: later work would read bad data
            self._pool.submit(self._task, signal.wait_host, (), None)
        else:
            signal.wait_host()

    def _task(self, fn, args, label) -> None:
        if self.error is not None:  # after a failure nothing more runs: later work would read bad data
            return
        self._sleep()
        start = time.perf_counter()
        try:
            fn(*args)
        except BaseException as e:  # kept, and raised by every later signal of this lane
            if self._pool is None:
                raise
            self.error = e
            return
        if self.timeline is not None and label:
            self.timeline.add_host(self.name, label, start, time.perf_counter())

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a task on the {self.name} lane failed") from self.error

    def _sleep(self) -> None:
        if self.delay:
            time.sleep(self.delay)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class Lanes:
    """The engine's five lanes and the timeline their spans go on: compute; h2d, host-to-device copies; land, the
    kernels that turn landed bytes into slot contents; d2h, device-to-host copies; store, device updates' results
    going home. Inline (the synchronous schedule), every lane runs its work on the calling thread as it is queued.
    Iterating gives the lanes in that order."""

    def __init__(self, device: torch.device, inline: bool = False):
        self.compute = Lane("compute", device, inline=True)
        self.h2d = Lane("h2d", device, inline=inline)
        self.d2h = Lane("d2h", device, inline=inline)
        # What lands on the device is turned into slot contents (a master narrowed to bf16, a streamed AdamW
        # step) on a lane of its own: a copy queued behind such a kernel would wait with it for SMs, which the
        # forward's GEMMs hold up to a millisecond at a time. Higher priority: its kernels go first when SMs free.
        self.land = Lane("land", device, inline=inline, priority=-1)
        # Device updates' results go home on a lane of their own: on d2h their copies would queue behind the
        # forward's boundary activations, each waiting for a block's forward to end, holding both buffers.
        self.store = Lane("store", device, inline=inline)
        self.timeline = Timeline(device)
        for lane in self:
            lane.timeline = self.timeline

    def _all(self) -> tuple[Lane, ...]:
        return self.compute, self.h2d, self.land, self.d2h, self.store

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __getitem__(self, index):
        return self._all()[index]

    def landed(self) -> Signal:
        """A signal for everything queued so far on the h2d and land lanes."""
        self.land.wait(self.h2d.record())
        return self.land.record()
