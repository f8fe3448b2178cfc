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
    gpu: float = 0.0
    link: float = 0.0  # collectives with the other ranks' GPUs
    # each drive's busy seconds (the disk tier's drives, in the machine's order): they move at once, so the disk
    # lane is the slowest drive's
    drives: tuple[float, ...] = ()

    @property
    def disk(self) -> float:
        return max(self.drives, default=0.0)

    def on_drive(self, drive: int, seconds: float) -> None:
        drives = list(self.drives) + [0.0] * (drive + 1 - len(self.drives))
        drives[drive] += seconds
        self.drives = tuple(drives)

    def __add__(self, other: PhaseWork) -> PhaseWork:
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)
                  if f.name != "drives"}
        mine, theirs = self.drives, other.drives  # (drive by drive; a drive one side lacks adds nothing)
        drives = tuple((mine[d] if d < len(mine) else 0.0) + (theirs[d] if d < len(theirs) else 0.0)
                       for d in range(max(len(mine), len(theirs))))
        return PhaseWork(**summed, drives=drives)


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


def speculation_holds(p: Placement, unit: UnitPlacement, clipping_acts: bool) -> bool:
    """Whether `unit`'s speculated update stands (clipping on and not acting): its loads take the speculated
    parameters, and nothing waits for its update proper, which runs whole under the next forward."""
    return p.clips and unit.speculate and not clipping_acts


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
