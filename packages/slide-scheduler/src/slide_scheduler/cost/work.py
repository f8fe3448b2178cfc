"""A step's work, phase by phase and lane by lane (the bytes and seconds each lane's terms add), and the facts of
a step and a unit those terms share."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..placement import Placement, UnitPlacement, kind_of


@dataclass
class PhaseWork:
    """Bytes and seconds of one phase, lane by lane."""

    h2d: float = 0.0
    d2h: float = 0.0
    host_bytes: float = 0.0
    adamw: float = 0.0
    disk: float = 0.0
    gpu: float = 0.0
    link: float = 0.0  # collectives with the other ranks' GPUs

    def __add__(self, other: PhaseWork) -> PhaseWork:
        return PhaseWork(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))


@dataclass
class Work:
    """A step's work: its forward's, its backward's, and host work nothing within the step waits for (updates
    behind held speculation)."""

    forward: PhaseWork = field(default_factory=PhaseWork)
    backward: PhaseWork = field(default_factory=PhaseWork)
    anywhere: PhaseWork = field(default_factory=PhaseWork)

    def __add__(self, other: Work) -> Work:
        return Work(self.forward + other.forward, self.backward + other.backward, self.anywhere + other.anywhere)

    def update_phase(self, deferred: bool) -> PhaseWork:
        """Where the host updates run: under the next forward where they wait for the step's end, else under
        the backward."""
        return self.forward if deferred else self.backward


def step_tokens(p: Placement) -> int:
    return p.step.tokens_per_micro * p.step.micro_batches


def boundary_bytes(p: Placement) -> int:
    """One block's input boundary activations, every micro-batch."""
    return p.step.tokens_per_micro * p.shapes.hidden * p.compute_bytes * p.step.micro_batches


def speculation_holds(p: Placement, unit: UnitPlacement, clipping_acts: bool) -> bool:
    """Whether `unit`'s speculated update stands (clipping on and not acting): its loads take the speculated
    parameters, and nothing waits for its update proper, which runs whole under the next forward."""
    return p.clip and unit.speculate and not clipping_acts


def master_on_disk(unit: UnitPlacement) -> bool:
    return kind_of(unit.master) == "files"


def loads_from_disk(unit: UnitPlacement) -> bool:
    """Whether a load reads the master from its files (no copy of the parameters in host memory)."""
    return kind_of(unit.loads) == "files"


def loads_compact(p: Placement, unit: UnitPlacement, clipping_acts: bool) -> bool:
    """Whether `unit`'s loads take parameters in the compute dtype: where those are kept (held speculation, a
    master on disk with its copy in host memory). A master read from disk for each load crosses as fp32."""
    return (speculation_holds(p, unit, clipping_acts)
            or (master_on_disk(unit) and not loads_from_disk(unit)))
