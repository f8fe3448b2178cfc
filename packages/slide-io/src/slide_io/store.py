"""The store interface, and the bookkeeping every tier shares: worker pool, per-key ordering, catalog.

A tier (host memory, NVMe) supplies four hooks: allocate room for a key, put bytes, get bytes, release
room. Everything else (futures, ordering, what a failed write leaves behind) lives here once, so the
CPU-only tests of one tier exercise the logic of all of them.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from slide_io.tensors import nbytes_of, ready_event, require_contiguous


@dataclass(frozen=True)
class Entry:
    """What the store knows about one key: the layout of the last write and the tier's room for it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    room: Any


class TensorStore(ABC):
    """A keyed store of tensors whose writes and reads run on a small thread pool and return futures.

    Operations on one key run in the order they were submitted (a read issued right after a write sees
    that write); operations on different keys run concurrently. The caller must not change a tensor
    handed to `write`, nor use an `out` handed to `read`, until the future is done.
    """

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"slide-io: a store needs at least one worker, got {workers}")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"slide-io-{name}")
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._last: dict[str, Future] = {}  # the newest operation submitted per key, until it is done
        self._closed = False
        self.allocations = 0  # rooms made so far: it stays put in the steady state
        self.bytes_written = 0  # bytes moved into the tier by finished writes, and out of it by finished reads
        self.bytes_read = 0

    # -- the interface ------------------------------------------------------------------------------

    def write(self, key: str, tensor: torch.Tensor) -> Future[None]:
        """Store a copy of `tensor` under `key`, replacing what was there; the future is done when it is."""
        self._check_key(key)
        require_contiguous(tensor, "a tensor to write")
        self._check_tensor(tensor)
        return self._submit(key, self._write, key, tensor, ready_event(tensor))

    def read(self, key: str, out: torch.Tensor) -> Future[torch.Tensor]:
        """Copy the tensor under `key` into `out` (same dtype and element count); the future yields `out`."""
        self._check_key(key)
        require_contiguous(out, "read's out")
        self._check_tensor(out)
        return self._submit(key, self._read, key, out, ready_event(out))

    def delete(self, key: str) -> None:
        """Drop `key` and release its room, after the operations already submitted on it finish."""
        with self._lock:
            last = self._last.get(key)
        if last is not None:
            wait([last])
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            raise KeyError(f"slide-io: no key {key!r} in this store")
        self._release(entry.room)

    def close(self) -> None:
        """Finish every submitted operation, then release all rooms; a second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        for entry in self._entries.values():
            self._release(entry.room)
        self._entries.clear()
        self._close_tier()

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    @property
    def nbytes(self) -> int:
        """Bytes held for all keys now."""
        with self._lock:
            return sum(entry.nbytes for entry in self._entries.values())

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what a tier supplies -----------------------------------------------------------------------

    @abstractmethod
    def _allocate(self, key: str, nbytes: int) -> Any:
        """Make room for `nbytes` under `key` (raise StoreFullError when there is none)."""

    @abstractmethod
    def _put(self, room: Any, tensor: torch.Tensor) -> None:
        """Copy the bytes of `tensor` into `room`."""

    @abstractmethod
    def _get(self, room: Any, out: torch.Tensor) -> None:
        """Copy the bytes in `room` into `out`."""

    @abstractmethod
    def _release(self, room: Any) -> None:
        """Give `room` back."""

    def _check_tensor(self, tensor: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Refuse, at submit time, a tensor this tier cannot move (e.g. device memory on the POSIX path)."""

    def _close_tier(self) -> None:  # noqa: B027 (optional hook)
        """Release what the tier holds beyond its rooms."""

    # -- shared bookkeeping -------------------------------------------------------------------------

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key:
            raise TypeError(f"slide-io: keys are non-empty strings, got {key!r}")

    def _submit(self, key: str, fn: Any, *args: Any) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("slide-io: the store is closed")
            before = self._last.get(key)
            future = self._pool.submit(self._after, before, fn, *args)
            self._last[key] = future
        # Outside the lock: a callback on a finished future runs at once, and it takes the lock.
        future.add_done_callback(lambda done: self._forget(key, done))
        return future

    @staticmethod
    def _after(before: Future | None, fn: Any, *args: Any) -> Any:
        # The pool takes work in FIFO order, so `before` is already running or done: waiting cannot deadlock.
        # Its error, if any, was reported through its own future.
        if before is not None:
            wait([before])
        return fn(*args)

    def _forget(self, key: str, future: Future) -> None:
        with self._lock:
            if self._last.get(key) is future:
                del self._last[key]

    def _write(self, key: str, tensor: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            ready.synchronize()
        nbytes = nbytes_of(tensor)
        with self._lock:
            old = self._entries.get(key)
        if old is not None and old.nbytes == nbytes:
            # Same size: reuse the room, so the steady state allocates nothing.
            try:
                self._put(old.room, tensor)
            except BaseException:
                # The old bytes may be half overwritten: drop the key rather than ever read back a torn mix.
                with self._lock:
                    self._entries.pop(key, None)
                self._release(old.room)
                raise
            room = old.room
        else:
            # New key or new size: fill a fresh room first, so a failure (a full disk) leaves the old
            # value and every other key as they were.
            room = self._allocate(key, nbytes)
            with self._lock:
                self.allocations += 1
            try:
                self._put(room, tensor)
            except BaseException:
                self._release(room)
                raise
            if old is not None:
                self._release(old.room)
        with self._lock:
            self._entries[key] = Entry(tensor.dtype, tuple(tensor.shape), nbytes, room)
            self.bytes_written += nbytes

    def _read(self, key: str, out: torch.Tensor, ready: torch.cuda.Event | None) -> torch.Tensor:
        if ready is not None:
            ready.synchronize()  # the caller's stream may still be using `out`
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"slide-io: no key {key!r} in this store")
        if out.dtype != entry.dtype or out.numel() != math.prod(entry.shape):
            raise ValueError(
                f"slide-io: key {key!r} holds {entry.dtype} of shape {entry.shape}; "
                f"out is {out.dtype} of shape {tuple(out.shape)}"
            )
        self._get(entry.room, out)
        with self._lock:
            self.bytes_read += entry.nbytes
        return out
