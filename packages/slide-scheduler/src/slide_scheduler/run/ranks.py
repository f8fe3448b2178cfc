"""Data-parallel ranks: which shard of every unit's flat state a process keeps, and the collectives that make the
shards one model.

Every rank runs the same sliding schedule on its own micro-batches. A block's gradient is reduce-scattered where it
is made (each rank receives the sum over ranks of its shard), each rank's host optimizer updates its shard, and a
block's load gathers the ranks' updated shards into every rank's slot. Host memory therefore holds one copy of the
masters and AdamW moments across the ranks of a host, whatever their number.

Collectives on device tensors go through the default process group (NCCL on GPUs, gloo on CPUs), loads' gathers
through a group of their own; host tensors (checkpoints) through gloo. `Ranks()` is the default process group's
place; where torch.distributed is not initialized, one rank: one shard, the whole unit, and collectives that do
nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# (torch 2.13 names the flat collectives *_single; earlier versions *_tensor)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Ranks:
    def __init__(self, group=None):
        self.active = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0
        self.group = group
        self.host_group = self.gather_group = group
        if self.active and self.size > 1:
            # Loads gather on a lane of their own (a stream, or a thread on CPUs), gradients reduce on the
            # compute lane: each group's collectives must come in one order on every rank, so each lane has one.
            self.gather_group = dist.new_group()
            if dist.get_backend(group) != "gloo":
                self.host_group = dist.new_group(backend="gloo")  # host tensors never go through NCCL

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def shard(self, numel: int) -> tuple[int, int]:
        """[start, end) of a flat unit of `numel` elements (a multiple of the rank count) that this rank keeps."""
        if numel % self.size:
            raise ValueError(f"a unit of {numel} elements does not split into {self.size} equal shards")
        size = numel // self.size
        return self.rank * size, (self.rank + 1) * size

    # -- the engine's hooks: at the backward, the load and the readout (one rank: nothing to do) ----------------------

    def reduce_gradient(self, shard: torch.Tensor, grads: torch.Tensor) -> None:
        """Once a unit's gradient is made (on the compute lane): `shard` = this rank's shard of its sum over ranks
        (one rank's shard is the gradient itself)."""
        if self.sharded:
            self.reduce_scatter(shard, grads)

    def gather_load(self, params: torch.Tensor, h2d, land, label: str) -> None:
        """After a load has queued this rank's shard into a slot's `params`: the other ranks' shards, gathered on
        the land lane once the copies are in."""
        if self.sharded:
            land.wait(h2d.record())
            land.run(self.all_gather, params, label=f"gather {label}")

    def readout(self, compute, tensor: torch.Tensor) -> None:
        """The step's readout (its loss and squared norms) summed over ranks, on the compute lane."""
        if self.sharded:
            compute.run(self.all_reduce, tensor)

    # -- collectives -----------------------------------------------------------------------------------------------

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        """`out` = this rank's shard of the sum of `flat` over ranks."""
        _reduce_scatter(out, flat, group=self._group_of(flat))

    def all_gather(self, flat: torch.Tensor) -> None:
        """Fill `flat` with every rank's shard of it, each rank's own in place already."""
        start, end = self.shard(flat.numel())
        _all_gather(flat, flat[start:end], group=self.gather_group)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over ranks, in place."""
        if self.sharded:
            dist.all_reduce(tensor, group=self._group_of(tensor))

    @property
    def lead(self) -> bool:
        """The first rank: it writes what the run writes (checkpoints, exports, logs)."""
        return self.rank == 0

    def gather_host(self, shard: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `shard` of a host tensor, concatenated in rank order, on the first rank (None on the
        others: only the first holds a whole copy)."""
        if not self.sharded:
            return shard
        parts = [torch.empty_like(shard) for _ in range(self.size)] if self.lead else None
        dist.gather(shard.contiguous(), parts, dst=0, group=self.host_group)
        return torch.cat(parts) if self.lead else None

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (a stop one rank was asked for, a failure one rank saw)."""
        if not self.sharded:
            return flag
        t = torch.tensor([float(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host_group)
        return bool(t)

    def share(self, value: float) -> float:
        """The first rank's `value`, on every rank: a decision one rank makes (it writes the run's files) that
        all then act on alike. Every rank waits here for every other."""
        if not self.sharded:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(t, 0, group=self.host_group)
        return float(t)

    def _group_of(self, tensor: torch.Tensor):
        return self.group if tensor.device.type != "cpu" else self.host_group

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, size={self.size})"
