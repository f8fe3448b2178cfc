"""AdamW states on the NVMe tier: the m and v of some host-updated blocks, and of some of them the fp32 master
too, live in files, not in host memory.

For a run whose states do not fit in RAM. A block's m and v (in the states' dtype, as in memory: 8 bytes per
parameter in fp32, 4 in bf16), and its master where it is on disk too (4 bytes), are read into one of `SLOTS`
staging slots (plain host memory: only the host optimizer touches them) ahead of its update, stepped there by the
host optimizer, and written back; the slot is reused once that write is done. Reads are queued in the order the
updates will run (`fetch`, called by the engine when it knows that order), so they run ahead of the optimizer by
as many slots as there are. (A block whose master is on disk loads for compute from a copy of its parameters in
the compute dtype, which its update writes; where host memory has no room for that copy, each load reads the
master itself, `read_master`, once the write-back of the update it waited for is on disk.)

Ordering rules, each a future a later operation waits for:
- a read of unit u waits for the write-back of u's previous update (it must see the newest moments);
- a read into a slot waits for the write-back that last used that slot (nothing overwrites moments on their way
  out);
- an update waits for its own read (`bind`), and hands its write-back over when it is done (`finish`). An update
  that failed still finishes, with its error, so nothing waits forever and later reads of the unit fail too.

Reads and writes take turns on the disk (one lock around each transfer, never held while waiting on a future), as
the cost model prices the tier: its reads, then its writes (a drive can move less in all when it mixes them).

Striped over several drives (a folder each, `Placement.drives` saying which unit's files live where), each drive
has a store, a lock, a reader and a writer of its own: the drives move at once, each in the order of its units.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future

import torch

from slide_io import Drives, Folders, NVMeStore
from slide_memory import host_zeros

from ..plan.sizes import DISK_STAGING_SLOTS as SLOTS  # (the placement's count: sizes.py)


def state_bytes(dtype: torch.dtype) -> int:
    """Bytes per parameter of m and v in `dtype`."""
    return 2 * dtype.itemsize


def done_future() -> Future:
    """A future that is already done (what a first use waits for)."""
    future: Future = Future()
    future.set_result(None)
    return future


class DiskStates:
    """m and v of `units` (flat, `numel` elements of `dtype` each), and the fp32 masters of `masters` (some of
    `units`), in an NVMe store under `directory` (or a store per drive, `directory` a list of folders and `drives`
    each unit's drive: 0 where not given), staged through `slots` host buffers: reads run that many updates
    ahead."""

    def __init__(self, units: list[int], numel: int | dict[int, int], directory: Folders,
                 dtype: torch.dtype = torch.float32, masters: list[int] = (), grads: list[int] = (),
                 grad_dtype: torch.dtype = torch.bfloat16, slots: int = SLOTS, drives: dict[int, int] | None = None):
        # (`numel`: every unit's, or each unit's where blocks come in several shapes; staging is sized for the largest)
        self.numels = numel if isinstance(numel, dict) else dict.fromkeys(units, numel)
        self.numel, self.dtype = max(self.numels.values(), default=0), dtype
        numel = self.numel
        self.masters = set(masters)
        if not self.masters <= set(units):
            raise ValueError("a unit whose master is on disk keeps its moments there too")
        # Units whose clipped gradient waits on disk: written from the backward (`put_gradient`), read back with
        # the states for the update (`gradient`)
        self.grads = set(grads)
        if not self.grads <= set(units):
            raise ValueError("a unit whose gradient waits on disk keeps its moments there")
        # (label, start, end) host times of reads and writes, for the timeline's `disk` lane: they run past the
        # step that queued them, so the engine takes them as it does the optimizer's spans
        self.spans: list[tuple[str, float, float]] = []
        self.drive = {u: (drives or {}).get(u, 0) for u in units}

        def reserve(drive: int) -> int:
            mine = {u for u in units if self.drive[u] == drive}
            return (sum(self.numels[u] * state_bytes(dtype) for u in mine)
                    + sum(4 * self.numels[u] for u in self.masters if u in mine)
                    + sum(grad_dtype.itemsize * self.numels[u] for u in self.grads if u in mine))

        # Preflight: every unit's states must fit on its drive, or the run stops now with what it needs.
        self.tier = Drives(directory, self.drive.values(), "the disk tier", "states", reserve)
        self.slots = [(host_zeros(numel, dtype, False), host_zeros(numel, dtype, False),
                       host_zeros(numel, torch.float32, False) if self.masters else None) for _ in range(slots)]
        self._grad_slots = [host_zeros(numel, grad_dtype, False) for _ in range(slots)] if self.grads else []
        self._grad_written: dict[int, Future] = {u: done_future() for u in self.grads}  # each one's latest write
        self._slot_free = [done_future() for _ in self.slots]  # the write-back that last used each slot
        self._written = {u: done_future() for u in units}  # each unit's latest write-back (or its placeholder)
        self._landed = dict(self._written)  # each unit's latest write-back of an update that has finished
        self._stored: set[int] = set()  # units with moments on disk (before a unit's first write: zeros)
        self._fetched: dict[int, tuple[int, Future, Future]] = {}  # unit -> (slot, its read, its write-back)
        self._bound: set[int] = set()  # fetched units whose update has its moments (it will finish them)
        self._closed = False
        self._next = 0
        self._lock = threading.Lock()
        self._disks = [threading.Lock() for _ in self.tier.stores]  # one transfer on each drive at a time

    def __contains__(self, unit: object) -> bool:
        return unit in self._written

    @property
    def store(self) -> NVMeStore:
        """The first drive's store (the only one where the tier has one drive)."""
        return self.tier.stores[0]

    def store_of(self, unit: int) -> NVMeStore:
        """The store on `unit`'s drive."""
        return self.tier.stores[self.drive[unit]]

    @contextlib.contextmanager
    def _turn(self, unit: int, label: str | None = None):
        """`unit`'s drive for one transfer; its time a span of the `disk` lane under `label`."""
        with self._disks[self.drive[unit]]:
            start = time.perf_counter()
            yield
            if label:
                self.spans.append((label, start, time.perf_counter()))

    def _both(self, op: str, unit: int, m: torch.Tensor, v: torch.Tensor, master: torch.Tensor | None = None,
              label: str | None = None) -> None:
        """The store's `op` (read or write) of `unit`'s m and v (and master, if given), all at once, until done."""
        with self._turn(unit, label):
            op = getattr(self.store_of(unit), op)
            futures = [op(f"m.{unit}", m), op(f"v.{unit}", v)] + ([op(f"master.{unit}", master)]
                                                                  if master is not None else [])
            for future in futures:
                future.result()

    def fetch(self, unit: int) -> None:
        """Queue the read of `unit`'s moments for its next update (called in the order updates will run; a unit
        already fetched for its next update is left as it is)."""
        with self._lock:
            if unit in self._fetched:
                return
            slot = self._next
            self._next = (slot + 1) % len(self.slots)
            written: Future = Future()  # set once this update's moments are back on disk
            # (a gradient on disk: this step's, written during the backward, which came before this fetch)
            after = (self._slot_free[slot], self._written[unit], self._grad_written.get(unit))
            self._slot_free[slot] = self._written[unit] = written
            read = self.tier.readers[self.drive[unit]].submit(self._read, unit, slot, after)
            self._fetched[unit] = (slot, read, written)

    def _staged(self, unit: int, slot: int) -> tuple:
        """A staging slot's m, v and master buffers, as long as `unit`'s."""
        n = self.numels[unit]
        return tuple(t[:n] if t is not None else None for t in self.slots[slot])

    def _read(self, unit: int, slot: int, after: tuple[Future, ...]) -> tuple:
        for future in after:
            if future is not None:
                future.result()  # (a failed write-back fails this read, and so the update that needs it)
        m, v, master = self._staged(unit, slot)
        if unit in self.grads:
            with self._turn(unit, f"read gradient {unit}"):
                self.store_of(unit).read(f"g.{unit}", self._grad_slots[slot][:self.numels[unit]]).result()
        master = master if unit in self.masters else None
        if unit in self._stored:
            self._both("read", unit, m, v, master, label=f"read states {unit}")
        else:  # moments before a first update are zeros; a master is on disk from the start (`load_master`)
            m.zero_()
            v.zero_()
            if master is not None:
                with self._turn(unit, f"read master {unit}"):
                    self.store_of(unit).read(f"master.{unit}", master).result()
        return m, v, master

    def bind(self, unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`unit`'s moments and (where on disk) master in their staging slot, once read (fetching them now if
        nobody did)."""
        self.fetch(unit)
        with self._lock:
            _, read, _ = self._fetched[unit]
            self._bound.add(unit)
        return read.result()

    def gradient(self, unit: int) -> torch.Tensor:
        """`unit`'s gradient as read back into its staging slot (for its update, once `bind` has returned)."""
        with self._lock:
            slot, _, _ = self._fetched[unit]
        return self._grad_slots[slot][:self.numels[unit]]

    def put_gradient(self, unit: int, buffer: torch.Tensor, arrived: list) -> Future:
        """Write `unit`'s gradient from the host `buffer` once every signal in `arrived` holds (its copies off the
        device); the future is done once it is on disk, and the buffer free again."""
        written: Future = Future()

        def write() -> None:
            try:
                for signal in arrived:
                    signal.wait_host()
                with self._turn(unit, f"write gradient {unit}"):
                    self.store_of(unit).write(f"g.{unit}", buffer[:self.numels[unit]]).result()
                written.set_result(None)
            except BaseException as e:  # (the read of it for its update raises it)
                written.set_exception(e)

        with self._lock:
            self._grad_written[unit] = written
        self.tier.writers[self.drive[unit]].submit(write)
        return written

    def finish(self, unit: int, error: BaseException | None = None) -> None:
        """The update of `unit` is over: write its moments back (or, after `error`, pass the error on)."""
        with self._lock:
            if unit not in self._fetched:  # (an update that failed after finishing)
                return
            slot, read, written = self._fetched.pop(unit)
            self._bound.discard(unit)
            self._landed[unit] = written
        if error is not None:
            written.set_exception(error)
            return
        m, v, master = self._staged(unit, slot)
        self.tier.writers[self.drive[unit]].submit(self._write, unit, m, v, master if unit in self.masters else None,
                                               written)

    def _write(self, unit: int, m: torch.Tensor, v: torch.Tensor, master: torch.Tensor | None,
               written: Future) -> None:
        try:
            self._both("write", unit, m, v, master, label=f"write states {unit}")
            self._stored.add(unit)
            written.set_result(None)
        except BaseException as e:  # a full disk: the next read of this unit, or of this slot, raises it
            written.set_exception(e)

    def wait(self, unit: int) -> None:
        """Until the write-back of `unit`'s last finished update is on disk (raises its error)."""
        with self._lock:
            written = self._landed[unit]
        written.result()

    def state(self, unit: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`unit`'s moments as on disk (None before its first update), memory-mapped: for checkpoints, which
        walk every unit's without holding them in RAM. Read them before the unit's next update."""
        self.wait(unit)
        if unit not in self._stored:
            return None
        return self.store_of(unit).mapped(f"m.{unit}"), self.store_of(unit).mapped(f"v.{unit}")

    def master(self, unit: int) -> torch.Tensor:
        """`unit`'s fp32 master as on disk (after its last update's write-back), memory-mapped, as `state`."""
        self.wait(unit)
        return self.store_of(unit).mapped(f"master.{unit}")

    def read_master(self, unit: int, out: torch.Tensor) -> None:
        """Read `unit`'s fp32 master into `out`, as its last finished update left it (for a load: the update
        the load waited for has handed its write-back over, which this read waits for)."""
        self.wait(unit)
        with self._turn(unit, f"read master {unit} for a load"):
            self.store_of(unit).read(f"master.{unit}", out).result()

    def load_master(self, unit: int, master: torch.Tensor) -> None:
        """Replace `unit`'s master on disk (at the start, and from a checkpoint), with no update of it pending."""
        if unit in self._fetched:
            raise RuntimeError(f"unit {unit} is staged for an update: load its master before it is queued")
        self.wait(unit)
        with self._turn(unit):
            self.store_of(unit).write(f"master.{unit}", master.to(torch.float32).contiguous()).result()

    def load(self, unit: int, m: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """Replace `unit`'s moments on disk (None: zeros, as before a first update; any dtype, stored as the
        states'); from a checkpoint, with no update of the unit pending."""
        if unit in self._fetched:
            raise RuntimeError(f"moments of unit {unit} are staged for an update: load them before it is queued")
        self.wait(unit)
        if m is None:
            self._stored.discard(unit)
            return
        self._both("write", unit, m.to(self.dtype).contiguous(), v.to(self.dtype).contiguous())
        self._stored.add(unit)

    def call_off(self) -> None:
        """Forget reads fetched for updates that have not started (a step that failed before queueing them):
        their moments on disk are as they were, so what waits for their write-back may go on, and their next
        update fetches them afresh. (Reads run one at a time in order, so slots are never written twice at once.)"""
        with self._lock:
            for unit in [u for u in self._fetched if u not in self._bound]:
                _, _, written = self._fetched.pop(unit)
                written.set_result(None)

    def close(self) -> None:
        """Finish every write, then remove the files (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        self.call_off()  # (the updater has finished every update it was given)
        self.tier.close()
