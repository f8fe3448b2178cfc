"""The host optimizer worker: one thread that applies AdamW to units in the order they are submitted.

A unit's update waits for its gradient to arrive on the host (a lane signal), runs AdamW over its fp32 master
and then sets the unit's signals: `params` (the master is new), which every later load of the unit waits for, and
`done` (the AdamW states too), which every later reuse of its gradient buffer waits for. A split update sets
them one part at a time (`FlatAdamW.step`'s "params", later "moments"). A speculative update ("speculate") changes
no state and sets the unit's `speculated` signal once the parameters it wrote are ready. One thread, because
torch's CPU AdamW already uses every core inside one call; jobs run in the order they were submitted.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time

import torch

from .lanes import HostSignal, Signal

# Updaters whose worker runs (a running thread holds its updater anyway, so a weak set would hold them too).
# The thread is a daemon (a script that never closes its engine still exits), and a daemon thread inside a
# torch call when the interpreter finalizes aborts the process ("terminate called without an active
# exception"): at exit each one finishes what was queued and stops first, then the disk tier it reads moments
# from (disk_states.py) finishes its writes. That runs where threading runs its exit hooks, ahead of the one that
# shuts down concurrent.futures' pools (later hooks run first), which the disk tier's reads and writes use.
_running: set[HostUpdater] = set()


def _finish_at_exit() -> None:
    for updater in list(_running):
        updater.close()
        if updater.disk is not None:
            updater.disk.close()


getattr(threading, "_register_atexit", atexit.register)(_finish_at_exit)


class HostUpdater:
    def __init__(self, optimizer, inline: bool = False, disk=None):
        self.optimizer = optimizer
        self.disk = disk  # DiskStates: units whose m and v are brought from disk for each update
        self.params = [HostSignal() for _ in optimizer.units]
        self.done = [HostSignal() for _ in optimizer.units]
        self.speculated = [HostSignal() for _ in optimizer.units]
        self.delay = 0.0  # tests: seconds each update sleeps first
        self.spans: list[tuple[str, float, float]] = []  # (label, start, end) host times, for the timeline
        self._queue: queue.Queue | None = None
        if not inline:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._loop, name="slide-updater", daemon=True)
            self._thread.start()
            _running.add(self)

    def submit(self, index: int, grad: torch.Tensor, arrived: list[Signal], lr: float, grad_scale: float,
               part: str = "all", into: torch.Tensor | None = None) -> None:
        """Update unit `index` from the host tensor `grad`; `arrived[k]` holds once the unit's optimizer chunk k
        is in it, and each chunk waits only for its own. `part` "params" leaves `done` clear until the unit's
        "moments" part (a later submit, nothing else in between may need the unit's states) is done;
        "speculate" writes the parameters `into` and touches only the `speculated` signal; a whole update may
        write them `into` too."""
        if part == "speculate":
            self.speculated[index].clear()
        else:
            if part != "moments":
                self.params[index].clear()
            self.done[index].clear()
        if self._queue is None:
            self._apply(index, grad, arrived, lr, grad_scale, part, into)
        else:
            self._queue.put((index, grad, arrived, lr, grad_scale, part, into))

    def wait(self, index: int, params_only: bool = False) -> None:
        """Until unit `index`'s last submitted update is done (`params_only`: its master is)."""
        (self.params if params_only else self.done)[index].wait_host()

    def ready(self, index: int, params_only: bool = False) -> bool:
        """Whether `wait(index, params_only)` would return at once."""
        return (self.params if params_only else self.done)[index].is_set()

    def wait_all(self) -> None:
        for signal in (*self.done, *self.speculated):
            signal.wait_host()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._apply(*item)

    def _apply(self, index: int, grad: torch.Tensor, arrived: list[Signal], lr: float, grad_scale: float,
               part: str, into: torch.Tensor | None = None) -> None:
        if part == "moments" and self.params[index].error is not None:  # its params part failed: keep the error
            self.done[index].set(error=self.params[index].error)
            return
        if part == "speculate":
            self._speculate(index, grad, arrived, lr, grad_scale, into)
            return
        on_disk = self.disk is not None and index in self.disk
        try:
            arrived[0].wait_host()
            if self.delay:
                time.sleep(self.delay)
            start = time.perf_counter()
            if on_disk:  # its moments (and master, where it is there too), read from disk into a staging slot
                self.optimizer.units[index].bind_states(*self.disk.bind(index))
                if grad is None:  # (its gradient waited on disk: read back beside them)
                    grad = self.disk.gradient(index)
            # (`into`: where a master on disk leaves its unit's parameters for the loads)
            self.optimizer.step_unit(index, grad, lr, grad_scale, before_chunk=lambda k: arrived[k].wait_host(),
                                     part=part, into=into)
            if on_disk:
                self.disk.finish(index)
            name = index - 1 if index else "edges"
            self.spans.append((f"{'moments' if part == 'moments' else 'update'} {name}", start, time.perf_counter()))
            self.params[index].set()
            if part != "params":
                self.done[index].set()
        except BaseException as e:  # surfaced in the training thread by the next wait on this unit
            if on_disk:  # (later reads of the unit, or into its slot, raise it too rather than wait)
                self.disk.finish(index, e)
            self.params[index].set(error=e)
            self.done[index].set(error=e)

    def _speculate(self, index: int, grad: torch.Tensor, arrived: list[Signal], lr: float, grad_scale: float,
                   into: torch.Tensor) -> None:
        try:
            arrived[0].wait_host()
            if self.delay:
                time.sleep(self.delay)
            start = time.perf_counter()
            self.optimizer.step_unit(index, grad, lr, grad_scale, before_chunk=lambda k: arrived[k].wait_host(),
                                     part="speculate", into=into)
            self.spans.append((f"speculate {index - 1 if index else 'edges'}", start, time.perf_counter()))
            self.speculated[index].set()
        except BaseException as e:  # (a failed speculation surfaces where its parameters are waited for)
            self.speculated[index].set(error=e)

    def close(self) -> None:
        """Finish what was submitted, then stop the worker; later submits (an engine closed after the exit
        handler closed its updater) run inline."""
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None
        _running.discard(self)


class UpdateWaits:
    """Where the engine's thread blocks for a host update: each wait's time is counted (`seconds`, this step's),
    and pipelined, put on the timeline's `waits` lane, where the GPU running out of work counts as exposed
    CPU-update time."""

    def __init__(self, updater: HostUpdater, timeline, synchronous: bool):
        self.updater = updater
        self.timeline = timeline
        self.synchronous = synchronous
        self.seconds = 0.0

    def __call__(self, unit: int, params_only: bool = False, speculated: bool = False) -> None:
        """Block until unit's last host update is done (`params_only`: its params part; `speculated`: its
        speculated parameters)."""
        start = time.perf_counter()
        if speculated:
            self.updater.speculated[unit].wait_host()
        else:
            self.updater.wait(unit, params_only)
        end = time.perf_counter()
        self.seconds += end - start
        # (most loads find their update done; inline, the updates themselves are the waits, from the engine's
        # spans, and a pause here, a GC or a thread switch, is not update work)
        if not self.synchronous and end - start > 1e-4:
            self.timeline.add_host("waits", f"waiting for update {unit - 1 if unit else 'edges'}", start, end)
