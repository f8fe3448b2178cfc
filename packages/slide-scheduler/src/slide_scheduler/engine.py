"""The layer-sliding engine: trains a `Stack` whose blocks live on the host and visit the device in slots.

One optimizer step over a list of micro-batches (DESIGN.md section 3):
  forward   head, then block by block: load block i into a slot, run every micro-batch through it (no grad),
            save each output boundary activation
  tail      loss and the gradient w.r.t. the last boundary activation, per micro-batch
  backward  block by block in reverse: load, recompute + backward per micro-batch (grads accumulate in the
            slot), gradient to the host
  head      embedding backward
  update    exact global grad-norm clipping, then AdamW on the host over fp32 masters, one unit at a time,
            and fresh compute-dtype copies for the next step

This engine is synchronous: each copy and update runs in order on the calling thread. It runs unchanged with
device = cpu, which is how CI checks it against plain PyTorch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from slide_memory import AdamWConfig, FlatLayout, HostAdamW, SlotQueue, host_empty, host_zeros

from .activations import ActivationStore
from .stack import Batch, Stack

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    compute_dtype: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32
    window: int = 2  # GPU slots for sliding blocks
    activation_offload: str = "cpu"  # none | cpu
    max_grad_norm: float | None = 1.0
    optimizer: AdamWConfig = field(default_factory=AdamWConfig)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("engine.device is 'cuda' but no CUDA device is available; use engine.device=cpu")
        return dev

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.compute_dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype must be one of auto, {', '.join(DTYPES)}; got {self.compute_dtype!r}")
        return DTYPES[self.compute_dtype]


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    seconds: float
    phases: dict[str, float]


class Unit:
    """One trainable unit (the edges, or one block): fp32 master, its compute-dtype copy and host gradient."""

    def __init__(self, layout: FlatLayout, compute_dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.master = torch.zeros(layout.numel, dtype=torch.float32)
        # On an fp32 CPU run the master is what the device reads; otherwise a (pinned) copy in compute dtype.
        same = compute_dtype == torch.float32 and device.type == "cpu"
        self.compute = self.master if same else host_empty(layout.numel, compute_dtype)
        self.grad = host_zeros(layout.numel, compute_dtype)

    def refresh(self) -> None:
        if self.compute is not self.master:
            self.compute.copy_(self.master)


class SlidingEngine:
    def __init__(self, stack: Stack, config: EngineConfig):
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.num_blocks = stack.num_blocks

        # Edges: head + tail parameters, resident on the device in one flat buffer for the whole run.
        self.edges = stack.make_edges()
        edge_layout = FlatLayout(self.edges)
        self.edge_params = torch.zeros(edge_layout.numel, dtype=self.dtype, device=self.device)
        self.edge_grads = torch.zeros_like(self.edge_params)
        edge_layout.bind(self.edges, self.edge_params, self.edge_grads)
        for module in self.edges.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(self.device)

        # Blocks: fp32 masters on the host, a window of device slots to run them in.
        block_layout = FlatLayout(stack.make_block())
        self.units = [Unit(edge_layout, self.dtype, self.device)]
        self.units += [Unit(block_layout, self.dtype, self.device) for _ in range(self.num_blocks)]
        with torch.no_grad():
            stack.load_edges(edge_layout.views(self.units[0].master))
            for i in range(self.num_blocks):
                stack.load_block(i, block_layout.views(self.units[i + 1].master))
        self.slots = SlotQueue(block_layout, stack.make_block, config.window, self.device, self.dtype)

        self.optimizer = HostAdamW([u.master for u in self.units], config.optimizer)
        self._grad32 = torch.empty(max(u.layout.numel for u in self.units), dtype=torch.float32)
        self.activations = ActivationStore(config.activation_offload, self.device)
        self.refresh()

    # -- parameters ---------------------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Bring compute copies and the resident edge parameters up to date with the fp32 masters."""
        for unit in self.units:
            unit.refresh()
        self.edge_params.copy_(self.units[0].compute)

    def unit_names(self) -> list[str]:
        return ["edges"] + [f"block.{i}" for i in range(self.num_blocks)]

    def named_masters(self) -> dict[str, dict[str, torch.Tensor]]:
        """Unit name ('edges', 'block.<i>') -> parameter name -> fp32 master view."""
        return {name: u.layout.views(u.master) for name, u in zip(self.unit_names(), self.units)}

    def _load(self, block: int):
        slot = self.slots.next()
        slot.load(self.units[block + 1].compute, block)
        return slot

    # -- one optimizer step -------------------------------------------------------------------------------------

    def step(self, micro_batches: list[Batch], *, lr: float, normalizer: float) -> StepStats:
        """Forward, backward and AdamW update over `micro_batches`; the loss is normalized by `normalizer`."""
        clock = _Clock(self.device)
        n, acts = self.num_blocks, self.activations
        batches = self._to_device(micro_batches)
        contexts = self._forward(batches)
        clock.lap("forward")

        self.edge_grads.zero_()
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        grads = []
        for j, batch in enumerate(batches):
            hidden = acts.get(n, j)
            share = self.edges.tail(hidden, batch, normalizer)
            share.backward()
            loss += share.detach().float()
            grads.append(hidden.grad)
        clock.lap("tail")

        for i in reversed(range(n)):
            slot = self._load(i)
            slot.grads.zero_()
            for j, ctx in enumerate(contexts):
                hidden = acts.get(i, j)
                slot.module(hidden, ctx).backward(grads[j])
                grads[j] = hidden.grad
            self.units[i + 1].grad.copy_(slot.grads)
        for j, batch in enumerate(batches):
            hidden, _ = self.edges.head(batch)
            hidden.backward(grads[j])
        self.units[0].grad.copy_(self.edge_grads)
        clock.lap("backward")

        grad_norm = self._update(lr)
        clock.lap("update")
        return StepStats(loss=loss.item(), grad_norm=grad_norm, seconds=clock.total, phases=clock.laps)

    def evaluate(self, micro_batches: list[Batch], *, normalizer: float) -> float:
        """The loss over `micro_batches` (normalized by `normalizer`) with no gradient and no update."""
        batches = self._to_device(micro_batches)
        with torch.no_grad():
            contexts = self._forward(batches)
            del contexts
            loss = sum(float(self.edges.tail(self.activations.get(self.num_blocks, j), batch, normalizer))
                       for j, batch in enumerate(batches))
        return loss

    def _to_device(self, micro_batches: list[Batch]) -> list[Batch]:
        return [{k: v.to(self.device, non_blocking=True) for k, v in mb.items()} for mb in micro_batches]

    @torch.no_grad()
    def _forward(self, batches: list[Batch]) -> list:
        """Head and blocks, layer-major: each block visits a slot once and sees every micro-batch there."""
        acts, contexts = self.activations, []
        for j, batch in enumerate(batches):
            hidden, ctx = self.edges.head(batch)
            contexts.append(ctx)
            acts.put(0, j, hidden)
        for i in range(self.num_blocks):
            slot = self._load(i)
            for j, ctx in enumerate(contexts):
                acts.put(i + 1, j, slot.module(acts.get(i, j), ctx))
        return contexts

    def _update(self, lr: float) -> float:
        # Exact global clipping needs every gradient first: the norm is taken over all units before any update.
        sq = sum(float(torch.linalg.vector_norm(u.grad, dtype=torch.float32)) ** 2 for u in self.units)
        grad_norm = math.sqrt(sq)
        max_norm = self.config.max_grad_norm
        scale = min(1.0, max_norm / (grad_norm + 1e-6)) if max_norm else 1.0
        for index, unit in enumerate(self.units):
            grad32 = self._grad32[: unit.layout.numel]
            grad32.copy_(unit.grad)
            self.optimizer.step_unit(index, grad32, lr, scale)
        self.refresh()
        return grad_norm


class _Clock:
    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.laps[name] = now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
