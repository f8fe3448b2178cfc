"""Boundary activations on the NVMe tier: for a run whose activations do not fit in host memory.

Each boundary activation goes from the device into a pinned host buffer of the write ring (d2h lane), from there
to its file, and back the same way ahead of its block in backward through the read ring: host memory holds the
two rings (`SLOTS_PER_MICRO` buffers per micro-batch each), not every boundary of the step.

Ordering rules, each a signal or future a later operation waits for:
- a copy into a write buffer waits for that buffer's last write to disk (the d2h lane waits; on CUDA the calling
  thread blocks there, so a disk slower than the forward makes the forward wait for it);
- a write to disk waits for its copy off the device, and for the last read of its key (the store runs one key's
  operations in the order they are submitted, so the previous backward's read sees the older value);
- a read waits for its key's write, and for the copy to the device that last read out of its buffer;
- reads are queued in the order backward fetches (boundaries from the last down, micro-batches in order), at
  most a ring ahead: a buffer is read into again only once backward has queued the copy out of it, so no read
  ever waits for a fetch that is still to come.

Striped over several drives (a folder each), each boundary's files live on the drive `drives` names, and each
drive has a store, a writer and a reader of its own.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from slide_io import Drives, Folders, NVMeStore
from slide_memory import host_empty

from ..plan.sizes import SLOTS_PER_MICRO  # (the placement's count: sizes.py)
from .disk_states import done_future
from .lanes import FutureSignal, Lane, Signal

Key = tuple[int, int]  # (boundary, micro-batch)


def _settled(future: Future) -> Future:
    """`future` once it is over, whatever its outcome: what a new use of a buffer waits for after a failed step
    (the failure was raised in that step)."""
    if future.done() and future.exception() is None:
        return future
    out: Future = Future()
    future.add_done_callback(lambda _: out.set_result(None))
    return out


def _hold(item: Future | Signal | None) -> None:
    """Block until `item` holds (a signal, or a future, whose error is raised)."""
    if isinstance(item, Signal):
        item.wait_host()
    elif item is not None:
        item.result()


class _Buffer:
    def __init__(self):
        self.data: torch.Tensor | None = None  # flat, grown to the largest activation it has held
        self.busy: Future | Signal = done_future()  # what the next use of the buffer waits for

    def view(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        numel = shape.numel()
        if self.data is None or self.data.dtype != dtype or self.data.numel() < numel:
            # (the first step, or a larger shape): the old memory goes only once no transfer reads it
            _hold(self.busy)
            self.data = host_empty(numel, dtype)
        return self.data[:numel].view(shape)


class DiskActivations:
    """Boundary activations in an NVMe store under `directory`, moved by the engine's `d2h` and `h2d` lanes; or
    in a store per drive, `directory` a list of folders and `drives` each boundary's drive (0 where not given)."""

    def __init__(self, directory: Folders, d2h: Lane, h2d: Lane, drives: tuple[int, ...] = ()):
        self.tier = Drives(directory, drives, "boundary activations", "acts")
        self.drives = tuple(drives)
        self.d2h, self.h2d = d2h, h2d
        self._out: list[_Buffer] = []  # the write ring
        self._in: list[_Buffer] = []  # the read ring
        self._next_out = 0
        self._written: dict[Key, Future] = {}  # each key's latest write to disk
        self._layout: dict[Key, tuple[torch.Size, torch.dtype]] = {}
        self._read: dict[Key, Future] = {}  # each key's latest read from disk
        self._queued: dict[Key, tuple[_Buffer, torch.Tensor, Future]] = {}  # reads not fetched yet
        self._free: deque[_Buffer] = deque()  # read buffers with no read queued into them
        self._order: list[Key] | None = None  # this backward's fetch order, from the first fetch on
        self._cursor = 0

    @property
    def store(self) -> NVMeStore:
        """The first drive's store (the only one where the tier has one drive)."""
        return self.tier.stores[0]

    def _drive(self, key: Key) -> int:
        return self.drives[key[0]] if self.drives else 0

    @property
    def buffers(self) -> int:
        """Host staging buffers in both rings (they stay put in the steady state)."""
        return len(self._out) + len(self._in)

    def begin(self, micro_batches: int) -> None:
        """A new step of `micro_batches`: rings sized for it, and reads left over by a failed step called off."""
        size = SLOTS_PER_MICRO * micro_batches
        self._out += [_Buffer() for _ in range(size - len(self._out))]
        self._in += [_Buffer() for _ in range(size - len(self._in))]
        for buffer, _, read in self._queued.values():
            buffer.busy = _settled(read)
        self._queued.clear()
        for buffer in self._out + self._in:
            if isinstance(buffer.busy, Future):
                buffer.busy = _settled(buffer.busy)
        self._free = deque(self._in)
        self._order = None
        for key in [k for k in self._layout if k[1] >= micro_batches]:
            del self._layout[key]

    def put(self, key: Key, hidden: torch.Tensor) -> Signal:
        """Queue `hidden` (ready on the d2h lane) out to disk; the signal holds once the device copy is done."""
        buffer = self._out[self._next_out]
        self._next_out = (self._next_out + 1) % len(self._out)
        self.d2h.wait(FutureSignal(buffer.busy))
        data = buffer.view(hidden.shape, hidden.dtype)
        self.d2h.run(data.copy_, hidden, True, label=f"acts out {key[0]}")
        copied = self.d2h.record()
        last_read = self._read.get(key)  # (only its order matters: a failed one was raised in its own step)
        drive = self._drive(key)
        store = self.tier.stores[drive]
        written = self._when(self.tier.writers[drive], (copied, last_read and _settled(last_read)),
                             lambda: store.write(self._name(key), data), f"write acts {key[0]}.{key[1]}")
        buffer.busy = self._written[key] = written
        self._layout[key] = (hidden.shape, hidden.dtype)
        return copied

    def fetch(self, key: Key) -> tuple[torch.Tensor, Signal]:
        """The host buffer `key` is read into, and the signal that holds once it is there; then `consumed`."""
        if self._order is None:
            self._order = sorted(self._layout, key=lambda k: (-k[0], k[1]))
            self._cursor = 0
        self._read_ahead()
        if key not in self._queued:
            raise RuntimeError(f"activations {key} fetched out of backward order (or never put): the disk tier reads "
                               "ahead from the last boundary down, micro-batches in order")
        _, data, read = self._queued[key]
        return data, FutureSignal(read)

    def consumed(self, key: Key, copied: Signal) -> None:
        """The copy out of `key`'s buffer is queued (`copied` holds when it is done): read the next one into it."""
        buffer, _, _ = self._queued.pop(key)
        buffer.busy = copied
        self._free.append(buffer)
        self._read_ahead()

    def _read_ahead(self) -> None:
        """Queue reads, in backward's order, into every free buffer (each waits only for copies already queued)."""
        while self._free and self._cursor < len(self._order):
            key = self._order[self._cursor]
            self._cursor += 1
            buffer = self._free.popleft()
            data = buffer.view(*self._layout[key])
            drive = self._drive(key)
            store = self.tier.stores[drive]
            read = self._when(self.tier.readers[drive], (buffer.busy, self._written[key]),
                              lambda key=key, data=data, store=store: store.read(self._name(key), data),
                              f"read acts {key[0]}.{key[1]}")
            self._queued[key] = (buffer, data, read)
            self._read[key] = read

    @staticmethod
    def _name(key: Key) -> str:
        return f"acts.{key[0]}.{key[1]}"

    def _when(self, pool: ThreadPoolExecutor, after, op, label: str) -> Future:
        """A future for the store operation `op()` submitted on `pool`'s thread once everything in `after` holds
        (signals, futures or None); the thread goes on to the next without waiting for the disk. The operation
        goes on the timeline's `disk` lane."""
        out: Future = Future()
        timeline = self.d2h.timeline

        def done(f: Future, start: float) -> None:
            if timeline is not None:
                timeline.add_host("disk", label, start, time.perf_counter())
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(None)

        def submit():
            try:
                for item in after:
                    _hold(item)
                start = time.perf_counter()
                inner = op()
            except BaseException as e:  # (raised where the result is waited for)
                out.set_exception(e)
                return
            inner.add_done_callback(lambda f: done(f, start))

        pool.submit(submit)
        return out

    def close(self) -> None:
        """Finish every transfer, then remove the files."""
        self.tier.close()
