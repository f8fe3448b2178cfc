"""What the placement needs of a model and of a step: each unit's parameters, a block's widths (`Shapes`), the
tokens of a micro-batch and how many there are (`StepShape`)."""

from __future__ import annotations

from dataclasses import dataclass

from slide_memory import FlatLayout


@dataclass(frozen=True)
class StepShape:
    tokens_per_micro: int  # micro-batch size x sequence length
    micro_batches: int
    seq_len: int = 0  # for attention's FLOPs (0: tokens_per_micro)


@dataclass(frozen=True)
class Shapes:
    """What the placement needs of a model: parameters per unit and the widths of a block's activations."""

    unit_numels: tuple[int, ...]  # the edges, then each block
    hidden: int
    intermediate: int = 0
    vocab: int = 0  # rows of the output projection (0: half the edges, for the cost model's tail)
    # each block's parameters one token computes with (a mixture of experts' routed experts; empty: all of them)
    active_numels: tuple[int, ...] = ()
    active_block_numel: int = 0  # the same for every block alike (a mixture of experts' routed
    #                              experts; 0: all of them)
    # of those, each block's that run as a mixture's routed experts (grouped GEMMs; empty: none)
    routed_numels: tuple[int, ...] = ()
    attention_width: int = 0  # query heads x head dim (0: hidden)
    kv_width: int = 0  # key-value heads x head dim (0: attention_width)
    windows: tuple[int, ...] = ()  # each block's attention window in tokens (0: the whole causal row; empty: all)
    head_dim: int = 0  # attention's head dim (0: not given)
    # each block's attention backends that compute its layer exactly, the front end's order of preference (empty:
    # not given; attention then runs at the machine's `attention_tflops`)
    attention_backends: tuple[tuple[str, ...], ...] = ()
    # of those, each block's that also run its attention by query tiles (empty: not given, all of them)
    tile_backends: tuple[tuple[str, ...], ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.unit_numels) - 1

    @property
    def block_numel(self) -> int:
        """The largest block's parameters: what a slot holds."""
        return max(self.unit_numels[1:], default=0)

    def active(self, unit: int) -> int:
        """The parameters of unit `unit` (1 + block) one token computes with."""
        if self.active_numels:
            return self.active_numels[unit - 1]
        return self.active_block_numel or self.unit_numels[unit]

    def routed(self, unit: int) -> int:
        """Of unit `unit`'s (1 + block) active parameters, those of the routed experts a token runs."""
        return self.routed_numels[unit - 1] if self.routed_numels else 0

    def window(self, unit: int) -> int:
        """The attention window of unit `unit` (1 + block), in tokens; 0 for the whole causal row."""
        return self.windows[unit - 1] if self.windows else 0

    def backends(self, unit: int) -> tuple[str, ...]:
        """The attention backends that can run unit `unit`'s (1 + block) layer, in order of preference."""
        return self.attention_backends[unit - 1] if self.attention_backends else ()

    def backends_tiled(self, unit: int) -> tuple[str, ...]:
        """Those of unit `unit`'s (1 + block) backends that run its attention by query tiles."""
        return self.tile_backends[unit - 1] if self.tile_backends else self.backends(unit)

    @property
    def tileable(self) -> bool:
        """Whether every block has a backend that runs its attention by query tiles (or none is named)."""
        return not self.attention_backends or all(self.backends_tiled(u) for u in range(1, len(self.unit_numels)))

    @property
    def queries(self) -> int:
        """A token's query width (heads x head dim)."""
        return self.attention_width or self.hidden

    @property
    def kv(self) -> int:
        """A token's key (or value) width after grouping (key-value heads x head dim)."""
        return self.kv_width or self.queries

    @property
    def mixed(self) -> bool:
        """Whether the blocks come in more than one size."""
        return len(set(self.unit_numels[1:])) > 1


def shapes_of(stack, hidden: int = 0, intermediate: int = 0, vocab: int = 0, ranks: int = 1) -> Shapes:
    """A stack's shapes (its edges' and each block's parameter counts, padded to split into `ranks` shards;
    widths as given). A stack whose blocks come in several shapes says which block has which with
    `block_shape(index)` and makes each with `make_block(shape)`; one whose tokens compute with only part of a
    block (a mixture of experts) says how much with `active_numel(block)`, given a block module, and how much of
    that its routed experts are with `routed_numel(block)`."""
    edges = FlatLayout(stack.make_edges(), shards=ranks).numel
    shapes = block_shapes(stack)
    made = {k: make_block(stack, k) for k in dict.fromkeys(shapes)}
    numel = {k: FlatLayout(m, shards=ranks).numel for k, m in made.items()}
    active = getattr(stack, "active_numel", None)
    actives = tuple(numel[k] - made_numel(made[k]) + active(made[k]) for k in shapes) if active else ()
    routed = getattr(stack, "routed_numel", None)
    routes = tuple(routed(made[k]) for k in shapes) if routed else ()
    return Shapes((edges,) + tuple(numel[k] for k in shapes), hidden, intermediate, vocab, active_numels=actives,
                  routed_numels=routes if any(routes) else ())


@dataclass(frozen=True)
class Layouts:
    """How a stack's units lie in flat buffers: the edges', one layout per block shape, and each block's shape."""

    edges: FlatLayout
    blocks: dict
    shapes: list

    def units(self) -> dict[str, FlatLayout]:
        """Unit name ('edges', 'block.<i>') -> its layout."""
        return {"edges": self.edges, **{f"block.{i}": self.blocks[k] for i, k in enumerate(self.shapes)}}


def layouts_of(stack, shards: int = 1, edges=None) -> Layouts:
    """The stack's units laid out as the engine lays them, each padded to split into `shards` (`edges`: the edges
    module the caller already made, else one is made)."""
    shapes = block_shapes(stack)
    blocks = {k: FlatLayout(make_block(stack, k), shards=shards) for k in dict.fromkeys(shapes)}
    return Layouts(FlatLayout(edges if edges is not None else stack.make_edges(), shards=shards), blocks, shapes)


def block_shapes(stack) -> list:
    """Each block's shape, as the stack names it (None for all where its blocks have one shape)."""
    shape_of = getattr(stack, "block_shape", None)
    return [shape_of(i) if shape_of else None for i in range(stack.num_blocks)]


def make_block(stack, shape=None):
    """A block module of `shape` (a stack of one shape makes its only one)."""
    return stack.make_block(shape) if getattr(stack, "block_shape", None) else stack.make_block()


def made_numel(module) -> int:
    """A module's parameters, each tensor once (tied ones too)."""
    return sum(p.numel() for p in module.parameters())
