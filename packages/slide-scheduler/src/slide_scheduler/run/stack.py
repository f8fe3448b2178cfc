"""What the engine trains: a head, a stack of blocks (of one shape, or of a few) and a tail.

The engine never sees a model library. An adapter (slide-train's, or your own) describes the model through this
protocol; the parameters of the head and the tail form one "edge" unit, so weights tied between the embedding and
the output projection stay one tensor.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
from torch import nn

Batch = dict[str, torch.Tensor]
Context = dict[str, Any]


class Edges(Protocol):
    """The head and tail parameters as one module (stays on the device for the whole step).

    Optionally `tail_only`: names of parameters that only `tail` reads (final norm, an untied output
    projection). The engine may then update them as soon as their gradient is final, apart from the rest.
    """

    def parameters(self, recurse: bool = True): ...

    def head(self, batch: Batch) -> tuple[torch.Tensor, Context]:
        """Token ids -> first boundary activation, plus what every block needs (positions, masks).

        Optionally the edges have `head_activation(batch)`: `head`'s activation alone, which the head's backward
        recomputes (without it, the engine calls `head` and drops the context)."""

    def tail(self, hidden: torch.Tensor, batch: Batch, normalizer: float) -> torch.Tensor:
        """Last boundary activation -> this micro-batch's share of the step loss: sum of token losses / normalizer.

        A tail with a `ctx` keyword parameter is also given the micro-batch's context from `head` (the same
        object the blocks' contexts came from), after every block's forward and before any backward. Blocks may
        record statistics there in their forward for a loss term the tail computes over all of them (a mixture of
        experts' load-balancing loss), and read what the tail derived from them in their backward's recompute.
        """


class Stack(Protocol):
    """Blocks come in one shape, or in a few (dense and mixture-of-experts layers): optionally a stack has
    `block_shape(index) -> a hashable name`, and then `make_block(shape)` makes a block of that shape; a slot holds
    one template module per shape over buffers sized for the largest, and the placement counts each block's own
    parameters. Optionally `active_numel(block)`: the parameters of a block module one token computes with (a
    mixture of experts' routed experts).

    Beyond its shape a block may depend on its index through what it is given: optionally a stack has
    `block_context(index, ctx) -> ctx`, and the engine then calls block `index` with `block_context(index, ctx)`
    instead of the head's `ctx` (a model whose layers alternate sliding-window and global attention passes each
    layer its own mask and rotary tables). It is
    called for every block and micro-batch, in the forward and again in the backward's recompute, and must give
    the same context for the same arguments (cheap: a lookup, not a computation).

    Optionally `tile_sequence(tile, queries)`: the engine calls it with its placement's `sequence_tile` (positions
    per tile of each block's per-token work; 0: none) and `query_tiles` (its attention by query tiles of that many
    positions too) before it makes any block or the edges.
    """

    num_blocks: int

    def make_edges(self) -> nn.Module:
        """An `Edges` module; its parameters may be on the meta device, its buffers must be real."""

    def make_block(self) -> nn.Module:
        """One block with `forward(hidden, ctx) -> hidden`; parameters may be on the meta device, no buffers.
        (With `block_shape`: `make_block(shape)`.)"""

    def load_edges(self, params: dict[str, torch.Tensor]) -> None:
        """Fill the given views (edge parameter name -> fp32 host tensor) with the initial weights."""

    def load_block(self, index: int, params: dict[str, torch.Tensor]) -> None:
        """Fill block `index`'s views (block parameter name -> fp32 host tensor) with its initial weights."""


class StackCalls:
    """How the engine calls a stack's edges and blocks, with the hooks a stack may have: what each block sees of
    the head's context (`block_context`; the whole of it without), a tail that takes its micro-batch's head context
    (`ctx`: what the blocks recorded there), and what the head's backward recomputes (`head_activation`: its
    activation alone, without the context)."""

    def __init__(self, stack: Stack, edges: Edges):
        self.edges = edges  # (not the engine: the calls keep no engine alive)
        self._block_context = getattr(stack, "block_context", None)
        self._tail_ctx = "ctx" in inspect.signature(edges.tail).parameters
        self.head_activation = getattr(edges, "head_activation", None) or (lambda b: edges.head(b)[0])

    def context(self, index: int, ctx):
        """The context block `index` runs with."""
        return ctx if self._block_context is None else self._block_context(index, ctx)

    def loss(self, hidden, batch: Batch, normalizer: float, ctx):
        if self._tail_ctx:
            return self.edges.tail(hidden, batch, normalizer, ctx=ctx)
        return self.edges.tail(hidden, batch, normalizer)
