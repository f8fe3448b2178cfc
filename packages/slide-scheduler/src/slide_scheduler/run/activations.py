"""Boundary activations: the hidden state entering each block, per micro-batch, kept for the backward recompute.

They are the only activations kept across a step (everything inside a block is recomputed). In the host tier
each one is copied to a host buffer on the device-to-host lane as soon as it is produced, and copied back on the
host-to-device lane ahead of its block in backward, so device memory does not grow with depth. The host buffers
are the store's own, or a `SharedPool`'s (memory the held gradients of clipping share with them). The disk
tier passes them through two small rings of host buffers to files (`disk_activations.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slide_io import Folders
from slide_memory import host_empty

from ..plan.facts import DISK, GPU, HOST, TIERS
from .disk_activations import DiskActivations
from .lanes import DONE, Lane, Signal


class ActivationStore:
    """`tiers`: each boundary's tier (block input 0, 1, ...); `drives`: each boundary's drive where the disk tier
    has several (`directory` then a folder per drive)."""

    def __init__(self, tiers: Sequence[str], device: torch.device, d2h: Lane, h2d: Lane, compute: Lane,
                 pool=None, directory: Folders | None = None, drives: tuple[int, ...] = ()):
        if isinstance(tiers, str):
            raise TypeError(f"tiers: each boundary's tier, as a sequence (got the one string {tiers!r})")
        self.tiers = tuple(tiers)
        for tier in set(self.tiers):
            if tier not in TIERS:
                raise ValueError(f"activation tier must be {GPU!r} (keep on the device), {HOST!r} or {DISK!r}, got "
                                 f"{tier!r}")
        on_disk = DISK in self.tiers
        if on_disk and not directory:
            raise ValueError("activations on the disk tier go to files: set activation_dir to a directory on a fast "
                             "local disk")
        self.disk = DiskActivations(directory, d2h, h2d, drives) if on_disk else None
        self.device, self.d2h, self.h2d, self.compute = device, d2h, h2d, compute
        self.pool = pool  # when set, the host buffers are its (`SharedPool.activation`)
        self._saved: dict[tuple[int, int], tuple[torch.Tensor, Signal]] = {}
        self._landing: dict[tuple[object, int], torch.Tensor] = {}  # (owner, micro-batch) -> device buffer
        # Device tensors whose copy out is queued, held until `release`, so their memory goes back to the
        # allocator only after compute is ordered behind the copies; the d2h lane copies in order, so the
        # latest copy's signal covers them all.
        self._leaving: list[torch.Tensor] = []
        self._last_copy: Signal = DONE

    def tier(self, boundary: int) -> str:
        return self.tiers[boundary]

    def put(self, boundary: int, micro: int, hidden: torch.Tensor, produced: Signal) -> None:
        """Keep `hidden` (made on the compute lane; `produced` holds once it is written)."""
        tier = self.tier(boundary)
        if tier == GPU:
            self._saved[boundary, micro] = (hidden, DONE)
            return
        self.d2h.wait(produced)
        if tier == DISK:
            self._leave(hidden, self.disk.put((boundary, micro), hidden))
            return
        if self.pool is not None:
            buf = self.pool.activation(boundary, micro, hidden)
        else:
            old = self._saved.get((boundary, micro))
            buf = old[0] if old is not None and old[0].shape == hidden.shape and old[0].dtype == hidden.dtype else None
            if buf is None:  # first step (or a new shape): kept and reused by every later step
                buf = host_empty(hidden.numel(), hidden.dtype).view(hidden.shape)
        self.d2h.run(buf.copy_, hidden, True, label=f"acts out {boundary}")
        copied = self.d2h.record()
        self._leave(hidden, copied)
        self._saved[boundary, micro] = (buf, copied)

    def _leave(self, hidden: torch.Tensor, copied: Signal) -> None:
        if self.d2h.stream is not None:  # (a CPU lane's task holds its own reference)
            self._leaving.append(hidden)
            self._last_copy = copied

    def release(self) -> None:
        """Let go of the device tensors put so far, once compute has queued its last read of them. Compute first
        waits for their copies out, so later compute allocations cannot reuse memory a copy still reads. (Not
        `record_stream`: its frees wait on events the allocator polls only when it allocates, and under a tight
        memory cap that polling happens inside an allocation retry.)"""
        if self._leaving:
            self.compute.wait(self._last_copy)
            self._leaving.clear()

    def trim(self, micro_batches: int) -> None:
        """Let go of landing buffers (and pool views) for micro-batches beyond `micro_batches` (a step with fewer
        of them), and of any device tensors a failed forward left unreleased."""
        for key in [k for k in self._landing if k[1] >= micro_batches]:
            del self._landing[key]
        if self.disk is not None and micro_batches:
            self.disk.begin(micro_batches)
        if self.pool is not None:  # pool views left over would keep an allocation the pool has replaced alive
            for key in [k for k in self._saved if k[1] >= micro_batches]:
                del self._saved[key]
        self.release()

    def fetch(self, boundary: int, micro: int, owner: object) -> torch.Tensor:
        """The saved activation as a device tensor, queued on the host-to-device lane.

        It lands in a device buffer kept for `owner` (what it is fetched for) and the micro-batch, reused by the
        owner's next fetch, so the steady state allocates nothing; the caller orders that next fetch after
        compute is done with this one (the owner's `free` signal)."""
        tier = self.tier(boundary)
        saved, stored = self.disk.fetch((boundary, micro)) if tier == DISK else self._saved[boundary, micro]
        if tier == GPU:
            return saved
        self.h2d.wait(stored)
        out = self._landing.get((owner, micro))
        if out is None or out.shape != saved.shape or out.dtype != saved.dtype:
            if self.h2d.stream is not None:
                with torch.cuda.stream(self.h2d.stream):  # allocated on the copy stream, used on compute
                    out = torch.empty_like(saved, device=self.device)
                out.record_stream(self.compute.stream)  # a replaced buffer is freed only after compute's use
            else:
                out = torch.empty_like(saved, device=self.device)
            self._landing[owner, micro] = out
        self.h2d.run(out.copy_, saved, True, label=f"acts in {boundary}")
        if tier == DISK:
            self.disk.consumed((boundary, micro), self.h2d.record())
        return out

    def close(self) -> None:
        """Let go of every buffer; the disk tier finishes its transfers and removes its files."""
        self.trim(0)
        if self.disk is not None:
            self.disk.close()
