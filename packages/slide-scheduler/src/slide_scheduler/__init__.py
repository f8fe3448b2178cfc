"""slide-scheduler: the layer-sliding engine (head, blocks, tail; slots, boundary activations, host updates)."""

from .__about__ import __version__
from .activations import ActivationStore
from .engine import EngineConfig, SlidingEngine, StepStats
from .stack import Batch, Context, Edges, Stack

__all__ = [
    "ActivationStore",
    "Batch",
    "Context",
    "Edges",
    "EngineConfig",
    "SlidingEngine",
    "Stack",
    "StepStats",
    "__version__",
]
